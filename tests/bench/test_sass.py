"""The attention walks as ptxas builds them, checked on the CPU (bench/sass.py: NVRTC's ptxas report
and cuobjdump's SASS; no GPU). The backend's walks keep every register in registers (no spill)
and no wgmma of any walk is serialized; the lookahead walk (attention_wgmma.LOOKAHEAD_KERNEL)
works out the softmax while a wgmma group is still in flight, which a plainly written wait
loses (planted below: ptxas moves it up, session 33), and its loop top keeps the order its
shared-memory ring needs (planted races below: only now-and-then wrong bits on a GPU). Skips
where NVRTC or the SASS tools are missing (the `sass` extra installs them). Not caught here, only
by the GPU bit tests: a copy into the wrong slot, a wrong segment end, a dropped rescale."""

import pytest

from bench.sass import (
    LOOKAHEAD_LOOP_TOP as LOOP_TOP,
    KernelReport,
    hgmma_gaps,
    loop_top,
    overlap_windows,
    ptxas_report,
    summary,
)

LOG = """ptxas info    : 0 bytes gmem
ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma \
instructions reading accumulator registers of  a wgmma between start and end of the pipeline stage in the function 'b' in line 0
ptxas info    : Compiling entry function 'a' for 'sm_90a'
ptxas info    : Function properties for a
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 252 registers, used 1 barriers
ptxas info    : Compiling entry function 'b' for 'sm_90a'
ptxas info    : Function properties for b
ptxas         .     48 bytes stack frame, 60 bytes spill stores, 56 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 48 bytes cumulative stack size
"""


def test_the_report_gives_each_entry_its_registers_spills_and_notes():
    reports = ptxas_report(LOG)
    assert reports["a"] == KernelReport(252, 0, 0, 0, ())
    b = reports["b"]
    assert (b.registers, b.stack_bytes, b.spill_stores, b.spill_loads) == (255, 48, 60, 56)
    assert len(b.notes) == 1 and b.notes[0].startswith("(C7514)")


def test_an_entry_without_its_register_count_is_refused():
    with pytest.raises(ValueError, match="'c'"):
        ptxas_report("ptxas info    : Compiling entry function 'c' for 'sm_90a'\n")


def test_a_note_that_names_no_function_is_kept():
    """A review found such a note dropped, so a check for "no notes" would have passed over it."""
    reports = ptxas_report("ptxas info    : (C7599) Some note with no function\n" + LOG)
    assert reports[""].notes == ("(C7599) Some note with no function",) and set(reports) == {"", "a", "b"}


def test_a_log_that_names_no_entry_function_stops_the_table(monkeypatch, capsys):
    """Session 35's call A printed a table with no rows on the GPU machine; now it says why."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC needs cuda-bindings (the sass extra)")
    from bench import sass

    monkeypatch.setattr(sass, "build", lambda which="attention", replace=(): (b"", "ptxas info    : 0 bytes gmem"))
    with pytest.raises(SystemExit) as stop:
        sass.main([])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "log names no entry function" in err and "0 bytes gmem" in err and "NVRTC 13." in err


def test_a_window_counts_the_exponentials_between_a_wait_for_one_and_the_next_wait():
    sass = ["HGMMA.64x32x16.F32.BF16 R1, R2, gdesc[UR4], R1, gsb0 ;", "WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
            "MUFU.EX2 R3, R3 ;", "FMUL R4, R4, R5 ;", "MUFU.EX2 R6, R6 ;", "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
            "MUFU.EX2 R7, R7 ;", "WARPGROUP.DEPBAR.LE gsb0, 0x1 ;", "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
            "STL [R1+0x8], R6 ;", "BAR.SYNC.DEFER_BLOCKING 0x0 ;"]
    assert overlap_windows(sass) == [2, 0]
    assert summary(sass) == {"hgmma": {"64x32x16": 1}, "waits": {0: 2, 1: 2}, "stl": 1, "ldl": 0, "bar_sync": 1,
                             "overlap_windows": [2, 0], "loop_top": []}
    assert overlap_windows([ins for ins in sass if "0x1" not in ins]) == []


def test_gaps_count_the_instructions_between_products_of_one_shape():
    code = ["HGMMA.64x32x16.F32.BF16 R152, R168, gdesc[UR4], RZ, !UPT ;", "IADD3 R1, R2, 0x2, RZ ;",
            "R2UR UR4, R1 ;", "HGMMA.64x32x16.F32.BF16 R152, R172, gdesc[UR4], R152 ;", "MOV R3, R4 ;",
            "HGMMA.64x256x16.F32.BF16 R24, R232, gdesc[UR4].tnspB, R24 ;",
            "HGMMA.64x32x16.F32.BF16 R152, R176, gdesc[UR4], R152, gsb0 ;"]
    assert hgmma_gaps(code, "64x32x16") == [2, 2]
    assert hgmma_gaps(code, "64x256x16") == []


def test_the_loop_top_names_each_step_where_it_first_comes():
    sass = ["DEPBAR.LE SB0, 0x2 ;", "DEPBAR.LE SB0, 0x1 ;", "FENCE.VIEW.ASYNC.S ;", "BAR.SYNC.DEFER_BLOCKING 0x0 ;",
            "@!P0 LDGSTS.E.BYPASS.128 [R17], desc[UR32][R14.64] ;", "BAR.SYNC.DEFER_BLOCKING 0x0 ;",
            "LDGSTS.E.BYPASS.128 [R7], desc[UR32][R4.64] ;", "HGMMA.64x32x16.F32.BF16 R24, R168, gdesc[UR4], RZ, !UPT ;",
            "LDGSTS.E.BYPASS.128 [R7], desc[UR32][R4.64] ;"]
    assert loop_top(sass) == ["cp.async wait 1", "proxy fence", "barrier", "copy", "wgmma"]
    assert loop_top(sass[:1] + sass[3:]) == []
    assert loop_top(sass[1:7] + ["WARPGROUP.DEPBAR.LE gsb0, 0x1 ;"] + sass[7:]) == LOOP_TOP[:3] + ["copy"]


def test_a_tool_is_found_in_a_target_folder_on_the_path(tmp_path, monkeypatch):
    """On the GPU machine the wheels go to `pip install --target /tmp/site` (on PYTHONPATH), whose
    `nvidia` folder another site's regular `nvidia` package shadows for imports: `tool` looks in
    every sys.path entry."""
    from bench import sass

    binary = tmp_path / "nvidia" / "cu13" / "bin" / "cuobjdump-test"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setattr(sass.shutil, "which", lambda name: None)
    monkeypatch.setattr(sass.sys, "path", ["/nonexistent", str(tmp_path)])
    assert sass.tool("cuobjdump-test") == str(binary)
    binary.chmod(0o644)
    assert sass.tool("cuobjdump-test") is None


@pytest.fixture(scope="module")
def built():
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC needs cuda-bindings (the sass extra)")
    from bench.sass import build

    try:
        return build()
    except RuntimeError as exc:  # cuda-bindings without the NVRTC library
        pytest.skip(f"NVRTC cannot compile here: {str(exc)[:200]}")


def test_the_backend_walks_spill_nothing_and_no_wgmma_is_serialized(built):
    from executor.numba_cuda import attention_wgmma

    reports = ptxas_report(built[1])
    assert set(reports) == {attention_wgmma.KERNEL, attention_wgmma.TMA_KERNEL, attention_wgmma.LOOKAHEAD_KERNEL}
    for name in (attention_wgmma.KERNEL, attention_wgmma.TMA_KERNEL):
        assert (reports[name].spill_stores, reports[name].spill_loads) == (0, 0), name
        assert reports[name].registers <= 255
    for name, report in reports.items():
        assert not report.notes, (name, report.notes)


def _sass(cubin, kernel):
    from bench.sass import sass, sass_unavailable

    why = sass_unavailable()
    if why is not None:
        pytest.skip(why)
    return sass(cubin, kernel)


def test_the_backend_walks_issue_s_products_four_instructions_apart(built):
    """S = Q K^T is 16 wgmmas a block; each block's descriptors are worked out once, so between two
    products a warpgroup issues an offset add and the descriptor's move to uniform registers: 4
    instructions in the typical (median) gap; ptxas may schedule other work into one or two. Built
    from its address each time (wg_desc_128b per product), the median gap was 7 (session 36)."""
    from executor.numba_cuda import attention_wgmma

    for name in (attention_wgmma.KERNEL, attention_wgmma.TMA_KERNEL):
        gaps = hgmma_gaps(_sass(built[0], name), "64x32x16")
        assert len(gaps) == 15, (name, gaps)
        assert sorted(gaps)[7] == 4, (name, gaps)


def test_the_lookahead_walk_works_out_a_softmax_while_its_p_v_runs(built):
    """Between its wait for S (one group, P V, left in flight) and its wait for P V: the whole
    softmax of a block, 2 rows x 4 column tiles x 2 elements + 2 alphas = 18 exponentials a thread.
    The backend's walk has no such wait: it drains the pipe before every softmax."""
    from executor.numba_cuda import attention_wgmma

    instructions = _sass(built[0], attention_wgmma.LOOKAHEAD_KERNEL)
    lookahead = summary(instructions)
    assert lookahead["overlap_windows"] == [18]
    assert lookahead["hgmma"] == {"64x32x16": 32, "64x256x16": 2}  # S in the prologue and the loop, one P V
    assert lookahead["loop_top"] == LOOP_TOP
    window = instructions[instructions.index("WARPGROUP.DEPBAR.LE gsb0, 0x1 ;") + 1:]
    window = window[:next(i for i, ins in enumerate(window) if ins.startswith("WARPGROUP.DEPBAR"))]
    assert not [ins for ins in window if ins.startswith(("STL", "LDL"))]  # no spill under the overlap
    report = ptxas_report(built[1])[attention_wgmma.LOOKAHEAD_KERNEL]
    assert report.spill_stores <= 80 and report.spill_loads <= 80, report  # 76 / 72 B with NVRTC 13.0 and 13.5
    plain = summary(_sass(built[0], attention_wgmma.KERNEL))
    assert plain["overlap_windows"] == [] and plain["waits"] == {0: 2}


def _planted(replace):
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC needs cuda-bindings (the sass extra)")
    from bench.sass import build

    try:
        return build(replace=replace)
    except RuntimeError as exc:
        pytest.skip(f"NVRTC cannot compile here: {str(exc)[:200]}")


@pytest.mark.parametrize("old,new", [
    ("wait_groups<1>();  // G_b in", "wait_groups<2>();  // G_b in"),
    ("""wg_proxy_fence();  // cp.async writes, then wgmma reads
        __syncthreads();
        u32 pf""", """__syncthreads();
        u32 pf"""),
    ("""        __syncthreads();
        u32 pf""", """        load_group(b + 2);
        __syncthreads();
        u32 pf"""),
], ids=["copy-wait", "no-fence", "copy-before-barrier"])
def test_a_loop_top_out_of_order_is_caught(old, new):
    """Planted races that give wrong bits only now and then on a GPU: waiting for one copy group too
    few (block b's blocks may not be in), no proxy fence (wgmma may read stale shared memory), the
    next copies before the barrier (they may overwrite a slot the other warpgroup still reads)."""
    from executor.numba_cuda import attention_wgmma

    cubin, _ = _planted(((old, new),))
    assert summary(_sass(cubin, attention_wgmma.LOOKAHEAD_KERNEL))["loop_top"] != LOOP_TOP


def test_a_plain_wait_after_the_softmax_is_moved_before_it_and_caught():
    """The plant: wg_wait0_after's branch replaced by the plain wait. The PTX keeps the softmax
    between the two waits; ptxas' SASS does not, and the window the test above asks for is empty."""
    from executor.numba_cuda import attention_wgmma

    cubin, log = _planted((("wg_wait0_after(w.l[0]);  // P_b V_b", "wg_wait0();  // P_b V_b"),))
    assert not ptxas_report(log)[attention_wgmma.LOOKAHEAD_KERNEL].notes
    assert summary(_sass(cubin, attention_wgmma.LOOKAHEAD_KERNEL))["overlap_windows"] == [0]
