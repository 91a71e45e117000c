"""The CPU side of the wgmma benchmarks (executor/numba_cuda/nvrtc.py, bench/flash_wgmma.py): the
generated wgmma functions' operand numbering and the case parser. The kernels run on the H200
only (bench/RESULTS.md, session 26)."""

import re

import pytest

from bench.flash_wgmma import parse_cases, source
from executor.numba_cuda.nvrtc import wgmma_function
from bench.wgmma_probe import source as probe_source


def test_a_register_a_wgmma_numbers_its_operands_after_the_accumulators():
    text = wgmma_function("wgmma_s", 32, a_registers=True, transpose_b=False)
    assert "void wgmma_s(float (&d)[16], const u32* a, unsigned long long b_desc)" in text
    assert "m64n32k16.f32.bf16.bf16 {" + ", ".join(f"%{i}" for i in range(16)) + "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;" in text
    assert text.count('"+f"(d[') == 16 and '"+f"(d[15])' in text and '"l"(b_desc)' in text


def test_a_shared_a_wgmma_has_both_descriptors_and_both_transpose_flags():
    text = wgmma_function("w", 256, a_registers=False, transpose_b=True)
    assert "float (&d)[128], unsigned long long a_desc, unsigned long long b_desc" in text
    assert "%127}, %128, %129, p, 1, 1, 0, 1;" in text and text.count('"+f"(d[') == 128


def test_a_tf32_wgmma_is_k8_with_no_transpose_immediates():
    """The delta walk's products (delta_wgmma.py): m64nNk8 tf32, A's four registers, scale-d, scale-a
    and scale-b only (tf32 has no transpose), operands numbered after the accumulators."""
    text = wgmma_function("wgmma_tf32_n64", 64, a_registers=True, transpose_b=False, dtype="tf32")
    assert "void wgmma_tf32_n64(float (&d)[32], const u32* a, unsigned long long b_desc)" in text
    assert "m64n64k8.f32.tf32.tf32 {" + ", ".join(f"%{i}" for i in range(32)) + "}, {%32, %33, %34, %35}, %36, p, 1, 1;" in text
    with pytest.raises(ValueError, match="K-major"):
        wgmma_function("w", 32, True, True, dtype="tf32")
    with pytest.raises(ValueError, match="dtype"):
        wgmma_function("w", 32, True, False, dtype="fp16")


def test_the_delta_walk_source_has_its_functions_and_both_launchable_walks():
    from executor.numba_cuda import delta_wgmma

    text = delta_wgmma.source()
    assert "@WGMMA_FUNCTIONS@" not in text and text.index("namespace delta") < text.index("walk_wgmma")
    assert len(re.findall(r"void wgmma_tf32_n(32|64)\(", text)) == 2
    assert all(f"DELTA_WALK_WGMMA(128, {bv})" in text for bv in delta_wgmma.COLUMNS)
    assert delta_wgmma.shared_bytes(32) == 175_616 and delta_wgmma.shared_bytes(64) == 230_912  # under 232,448


@pytest.mark.parametrize("n", [0, 4, 12, 264])
def test_an_n_wgmma_lacks_is_refused(n):
    with pytest.raises(ValueError, match="multiple of 8"):
        wgmma_function("w", n, True, False)


def test_the_walk_source_is_the_production_kernel_then_the_experiment_with_its_functions():
    text = source()
    assert text.index("COMBINE_ENTRY(256, 32)") < text.index("flash_wgmma_walk_256")
    assert "@WGMMA_FUNCTIONS@" not in text
    assert len(re.findall(r"void wgmma_[so]\(", text)) == 2


def test_cases_parse_and_bad_ones_name_the_item():
    assert parse_cases("27b:51@1984,9b:8192@24576") == [("27b", 51, 1984), ("9b", 8192, 24576)]
    with pytest.raises(ValueError, match="'2b:1@0'"):
        parse_cases("2b:1@0")
    with pytest.raises(ValueError, match="'9b:8192'"):
        parse_cases("9b:8192")


def test_the_probe_source_appends_its_kernels_and_functions_to_the_walks():
    text = probe_source()
    assert text.index("flash_wgmma_walk_256") < text.index("gemm_ss(")
    assert "@WGMMA_FUNCTIONS@" not in text
    assert len(re.findall(r"void wgmma_(ss|rs)_n\d+_t[01]\(", text)) == 10


def test_without_cuda_bindings_the_benches_say_what_to_install(monkeypatch, capsys):
    """A fresh-user review: on a machine without cuda-bindings both benches died in a
    ModuleNotFoundError traceback."""
    import builtins

    from bench import flash_wgmma, wgmma_probe

    real_import = builtins.__import__

    def no_cuda(name, *args, **kwargs):
        if name.startswith("cuda"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cuda)
    for bench_main in (flash_wgmma.main, wgmma_probe.main):
        with pytest.raises(SystemExit) as exit_info:
            bench_main(["--compile-only"])
        assert exit_info.value.code == 2
        assert "NVRTC needs cuda-bindings" in capsys.readouterr().err


def test_unknown_kernels_are_refused_before_any_compile(capsys):
    from bench import flash_wgmma

    with pytest.raises(SystemExit) as exit_info:
        flash_wgmma.main(["--kernels", "walk,nope"])
    assert exit_info.value.code == 2 and "--kernels 'walk,nope'" in capsys.readouterr().err
    assert set(flash_wgmma.DEFAULT_KERNELS.split(",")) < set(flash_wgmma.KERNELS)


def test_no_layouts_alone_is_refused(capsys):
    """A review found it: `--no-layouts` without --loops or --chains compiled and ran nothing."""
    from bench import wgmma_probe

    with pytest.raises(SystemExit) as exit_info:
        wgmma_probe.main(["--no-layouts"])
    assert exit_info.value.code == 2
    assert "--no-layouts leaves nothing to run" in capsys.readouterr().err
