"""flash_attention.cu's entry points against attention_flash.VARIANTS, without a GPU: every
(head_dim, warps, stages) the Python side may ask for is instantiated in the source, as a
walk and as a split, with a combine for every head_dim; every warps count has its default
ring depth; and every variant's walk fits the shared memory of a CTA (a missing entry or an
oversized CTA fails only on a GPU, at compile or launch)."""

from __future__ import annotations

import re

import pytest

from executor.numba_cuda import attention_flash

ENTRIES = re.compile(r"^FLASH_ENTRIES\((\d+), (\d+), (\d+), (\d+)\)$", re.M)
COMBINES = re.compile(r"^COMBINE_ENTRY\((\d+), (\d+)\)$", re.M)
SEG_BLOCKS = re.compile(r"^#define SEG_BLOCKS (\d+)$", re.M)


def test_the_source_instantiates_exactly_the_variants():
    source = attention_flash.SOURCE.read_text()
    entries = {tuple(int(x) for x in m) for m in ENTRIES.findall(source)}
    assert {(d, w, s) for d, w, bn, s in entries} == attention_flash.VARIANTS
    assert {bn for _, _, bn, _ in entries} == {attention_flash.BLOCK_KEYS}
    combines = {tuple(int(x) for x in m) for m in COMBINES.findall(source)}
    assert combines == {(d, attention_flash.BLOCK_KEYS) for d in attention_flash.WARPS}
    assert [int(x) for x in SEG_BLOCKS.findall(source)] == [attention_flash.SEGMENT_BLOCKS]
    assert attention_flash.SEGMENT_KEYS == 512


def test_every_warps_count_runs_at_its_default_ring_depth_and_fits():
    for head_dim, warps, stages in attention_flash.VARIANTS:
        assert (head_dim, warps, attention_flash.default_stages(head_dim, warps)) in attention_flash.VARIANTS
        assert attention_flash.shared_bytes(head_dim, stages, warps, split=False) <= attention_flash.MAX_SHARED_BYTES
    for head_dim, warps in attention_flash.WARPS.items():
        assert (head_dim, warps, attention_flash.default_stages(head_dim, warps)) in attention_flash.VARIANTS
    assert attention_flash.default_stages(256, 4) == 3
    assert attention_flash.default_stages(256, 8) == 3  # 101,376 + 131,072: exactly the 227 KB of a CTA
    assert attention_flash.shared_bytes(256, 4, 8, split=False) > attention_flash.MAX_SHARED_BYTES


def test_shared_bytes_of_the_ring_and_the_running_outputs():
    assert attention_flash.shared_bytes(256, 3) == 3 * 2 * 32 * 264 * 2 == 101_376
    assert attention_flash.shared_bytes(256, 3, 4, split=False) == 101_376 + 4 * 16 * 256 * 4 == 166_912
    assert attention_flash.shared_bytes(256, 2, 8, split=False) == 67_584 + 131_072


def test_split_segments_follows_rows_keys_and_scratch():
    seg = attention_flash.split_segments
    assert seg(51, 24, 4, 256, 2035) == 4  # the 27B's off-grid continuation: 306 virtual rows
    assert seg(64, 24, 4, 256, 32768) == 64  # its captured bucket, sized for the capacity: 101 MB
    assert seg(86, 24, 4, 256, 2035) == 0  # 516 virtual rows: walk
    assert seg(51, 24, 4, 256, 512) == 0  # one segment: nothing to split
    assert seg(51, 24, 4, 256, 513) == 2
    assert seg(128, 16, 4, 256, 262144) == 0  # 512 segments of partials: 1.1 GB, walk


def test_rms_norm_source_instantiates_exactly_the_fused_variants():
    """rms_norm.cu's entry points are (threads, vec) for every vec up to norms.FUSED_VEC[threads]."""
    from executor.numba_cuda import norms

    found = {tuple(int(x) for x in m) for m in re.findall(r"^NORM_ENTRY\((\d+), (\d+)\)$",
                                                           norms.FUSED_SOURCE.read_text(), re.M)}
    assert found == {(t, v) for t, most in norms.FUSED_VEC.items() for v in range(1, most + 1)}
    assert norms.FUSED_VEC == {256: 8, 1024: 2}


def test_the_wgmma_walk_source_appends_its_kernel_and_functions_to_the_mma_sync_source():
    """attention_wgmma's cubin source: flash_attention.cu's text (the helpers it calls), then
    flash_wgmma.cu's with the two wgmma functions generated at the marker."""
    from executor.numba_cuda import attention_wgmma

    text = attention_wgmma.source()
    assert text.startswith(attention_flash.SOURCE.read_text())
    assert "@WGMMA_FUNCTIONS@" not in text
    assert len(re.findall(r"void wgmma_s\(float \(&d\)\[16\], const u32\* a", text)) == 1
    assert len(re.findall(r"void wgmma_o\(float \(&d\)\[128\], const u32\* a", text)) == 1
    assert "m64n256k16.f32.bf16.bf16" in text and "m64n32k16.f32.bf16.bf16" in text
    assert f"void __launch_bounds__({attention_wgmma.THREADS}, 1)\n    {attention_wgmma.KERNEL}(" in text
    assert attention_wgmma.FLASH_SOURCE == attention_flash.SOURCE


def test_the_wgmma_walk_fits_a_cta_with_its_alignment():
    from executor.numba_cuda import attention_wgmma

    ring = attention_wgmma.STAGES * 2 * attention_flash.BLOCK_KEYS * 256 * 2
    assert attention_wgmma.SHARED_BYTES == ring + 8 * 16 * 256 * 4 + 1024 <= attention_flash.MAX_SHARED_BYTES
    assert attention_wgmma.TILE_ROWS == attention_wgmma.THREADS // 32 * 16


def test_without_a_gpu_the_walk_stays_on_mma_sync_and_says_why():
    from executor.numba_cuda import attention_wgmma
    from executor.numba_cuda.device import is_gpu_available

    if is_gpu_available():
        pytest.skip("a GPU is here")
    why = attention_flash.wgmma_status()
    assert why in ("no CUDA GPU", "cuda-bindings is not installed") or "simulator" in why
    assert attention_wgmma.unavailable() == why


def test_a_check_that_raises_leaves_the_walk_on_mma_sync_and_is_decided_once(monkeypatch):
    """A review found it: an exception from the bit check (a launch or copy error) escaped
    wgmma_status, which functools.cache does not keep, so every later walking prefill re-ran the
    check and raised instead of falling back to the mma.sync walk."""
    from executor.numba_cuda import attention_wgmma

    calls = []

    def check():
        calls.append(1)
        raise RuntimeError("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")

    monkeypatch.delenv("WARMSTATE_FLASH_WGMMA", raising=False)
    monkeypatch.setattr(attention_wgmma, "unavailable", lambda: None)
    monkeypatch.setattr(attention_wgmma, "module", lambda: None)
    monkeypatch.setattr(attention_flash, "_wgmma_check", check)
    attention_flash.wgmma_status.cache_clear()
    try:
        assert attention_flash.wgmma_status() == "RuntimeError: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"
        assert attention_flash.wgmma_status() == "RuntimeError: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"
        assert calls == [1]
        monkeypatch.setattr(attention_flash, "_wgmma_check", lambda: None)
        attention_flash.wgmma_status.cache_clear()
        assert attention_flash.wgmma_status() is None
        monkeypatch.setenv("WARMSTATE_FLASH_WGMMA", " 0 ")
        attention_flash.wgmma_status.cache_clear()
        assert attention_flash.wgmma_status() == "turned off by WARMSTATE_FLASH_WGMMA=0"
    finally:
        attention_flash.wgmma_status.cache_clear()


def test_the_tma_walk_is_opt_in_and_says_why_not(monkeypatch):
    """Without WARMSTATE_FLASH_TMA=1 the wgmma walk copies by cp.async (TMA_OFF); asked for where
    no wgmma walk runs (here: no GPU or the simulator), the status names why."""
    from executor.numba_cuda.device import is_gpu_available

    from tests.executor.numba_cuda.kernel_support import walk_statuses

    if is_gpu_available():
        pytest.skip("a GPU is here")
    assert walk_statuses(monkeypatch) == (attention_flash.TMA_OFF, f"no wgmma walk: {attention_flash.wgmma_status()}")


def test_the_lookahead_walk_is_opt_in_and_says_why_not(monkeypatch):
    """Without WARMSTATE_FLASH_LOOKAHEAD=1 the backend's walk runs (LOOKAHEAD_OFF); asked for where no
    wgmma walk runs (here: no GPU or the simulator), the status names why."""
    from executor.numba_cuda.device import is_gpu_available

    from tests.executor.numba_cuda.kernel_support import walk_statuses

    if is_gpu_available():
        pytest.skip("a GPU is here")
    assert walk_statuses(monkeypatch, "lookahead") == (attention_flash.LOOKAHEAD_OFF,
                                                      f"no wgmma walk: {attention_flash.wgmma_status()}")


def test_the_lookahead_walk_is_in_the_cubin_source_with_its_own_shared_memory():
    from executor.numba_cuda import attention_wgmma

    text = attention_wgmma.source()
    assert f"void __launch_bounds__(256, 1)\n    {attention_wgmma.LOOKAHEAD_KERNEL}(" in text
    assert attention_wgmma.LOOKAHEAD_SHARED_BYTES == attention_wgmma.SHARED_BYTES + 1024 <= 232448
