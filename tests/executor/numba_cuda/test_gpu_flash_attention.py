"""The fused tensor-core prefill attention (attention_flash.py, flash_attention.cu) on a
real GPU: values against the float64 twin and the serving roundings, against the matrix
path, and a row's bits independent of the chunk it sits in, the cut (on or off the
64-row grid), a tail, and the other rows of its warp; the walk on wgmma (attention_wgmma.py,
flash_wgmma.cu: the default walk at head_dim 256 on the H200, its K/V blocks by cp.async and by
TMA) bit for bit against the mma.sync walk. Marked `cuda`: the CUDA simulator
cannot run a linked CUDA C++ device function (no NVRTC, no mma), so these skip without a
GPU; the backend then uses the matrix path, whose cases run under the simulator.
"""

from __future__ import annotations

import numpy as np
import pytest

from executor.numba_cuda.device import is_gpu_available

pytestmark = pytest.mark.cuda
if not is_gpu_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("nvmath")

from executor.numba_cuda import attention_flash  # noqa: E402
from executor.numba_cuda.attention_mm import MatrixAttention  # noqa: E402
from executor.numba_cuda.device import poisoned, to_device  # noqa: E402
from tests.executor.numba_cuda.cases_attention_mm import _emulated, _ref, _setup  # noqa: E402
from tests.executor.numba_cuda.kernel_support import as_f32, bf16, host, rng, walk_statuses  # noqa: E402
from tests.helpers import assert_close  # noqa: E402

TOL = 8e-3


def _run(q, qg, kc, vc, slot, start):
    with poisoned():
        out = attention_flash.prefill(to_device(q), to_device(qg), kc, vc, slot, start)
    return host(out)


def _inputs(r, rows, heads, head_dim):
    q = r.normal(size=(rows, heads, head_dim)).astype(np.float32)
    qg = r.normal(size=(rows, heads * 2 * head_dim)).astype(np.float32)
    return q, qg


def _wide_inputs(r, rows, heads, head_dim):
    """`_inputs` with q 4x: scores wide enough that the lazy max moves partway through a segment
    (~2% of blocks, ~20% of a warp's blocks at head_dim 256; with q 1x it never does), so the bit
    tests run O's rescale in some warps and not in others."""
    q, qg = _inputs(r, rows, heads, head_dim)
    return q * np.float32(4), qg


@pytest.mark.parametrize("heads,kv_heads,head_dim,start,rows", [
    (4, 2, 16, 9, 13), (6, 2, 32, 0, 70), (3, 3, 64, 31, 40), (8, 2, 128, 5, 100), (16, 4, 256, 100, 150),
    (24, 4, 256, 0, 33),
])
def test_flash_matches_twins(heads, kv_heads, head_dim, start, rows):
    r = rng()
    kh, vh, kc, vc = _setup(r, heads, kv_heads, head_dim, capacity=512)
    q, qg = _inputs(r, rows, heads, head_dim)
    out = as_f32(_run(q, qg, kc, vc, 1, start))
    k, v = as_f32(kh[1]), as_f32(vh[1])
    assert_close("vs float64 twin", _ref(q, qg, k, v, start), out, TOL, rel=True)
    assert_close("vs emulated roundings", _emulated(q, qg, k, v, start).astype(np.float32), out, TOL, rel=True)
    matrix = MatrixAttention()
    if matrix.ready(head_dim):
        with poisoned():
            mm = host(matrix.prefill(to_device(q), to_device(qg), kc, vc, 1, start))
        assert_close("vs the matrix path", as_f32(mm), out, TOL, rel=True)


@pytest.mark.parametrize("heads,kv_heads,head_dim,q_scale,planted", [
    (4, 2, 64, 4.0, False), (16, 4, 256, 4.0, False), (16, 4, 256, 1.0, True), (8, 2, 128, 1.0, True),
])
def test_flash_lazy_max_matches_the_twin_when_scores_jump(heads, kv_heads, head_dim, q_scale, planted):
    """The lazy max (flash_attention.cu, LAZY_LOG2 = 8): a row's m moves only when a block's top
    passes it by more than 8 in log2 units. Scores 4x wider than the other cases' move m on some
    blocks and not on others; a planted key (row 300, inside the first 512-key segment's second half) scores
    ~270 log2 units (at head_dim 256; ~380 at 128) over every other key of K/V head 0, so a walk
    that kept a stale m there would give 2^270 = inf. Both against the float64 twin and the emulated roundings."""
    r = rng()
    kh, vh, _, _ = _setup(r, heads, kv_heads, head_dim, capacity=1024, slots=1)
    start, rows = 0, 600
    q, qg = _inputs(r, rows, heads, head_dim)
    q *= np.float32(q_scale)
    if planted:
        q[:, :, 0] = 10.0
        kh[0, 300, 0, 0] = bf16(np.array([300.0]))[0]  # exactly 300 in bf16
    out = as_f32(_run(q, qg, to_device(kh), to_device(vh), 0, start))
    assert np.isfinite(out).all()
    k, v = as_f32(kh[0]), as_f32(vh[0])
    # The twin gets q as the kernel reads it (bf16): at q 4x a score's own rounding error is 4x
    # that of the other cases (|s| ~16 at head_dim 64, so ~2% in p), which failed TOL on one draw
    # in session 39 (2.63e-2 against a bound of 2.53e-2) with nothing wrong in the walk. The
    # emulated comparison below keeps q's rounding in.
    assert_close("vs float64 twin", _ref(as_f32(bf16(q)), qg, k, v, start), out, TOL, rel=True)
    assert_close("vs emulated roundings", _emulated(q, qg, k, v, start).astype(np.float32), out, TOL, rel=True)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 2, 32), (3, 3, 64), (8, 2, 128), (16, 4, 256),
                                                    (24, 4, 256)])
def test_flash_rows_invariant_across_chunks_cuts_and_tails(heads, kv_heads, head_dim):
    """A row's bits do not depend on its chunk: cuts on the 64-row grid, off it (37, 101),
    a one-row chunk and a tail give every row the bits of the one-chunk run."""
    r = rng()
    _, _, kc, vc = _setup(r, heads, kv_heads, head_dim, capacity=1024, slots=1)
    rows = 700
    q, qg = _wide_inputs(r, rows, heads, head_dim)
    whole = _run(q, qg, kc, vc, 0, 0)
    for cuts in ([0, 64, 448, 700], [0, 37, 101, 102, 700], [0, 699, 700]):
        pieces = np.concatenate([_run(q[a:b], qg[a:b], kc, vc, 0, a) for a, b in zip(cuts, cuts[1:])])
        assert np.array_equal(pieces, whole), cuts
    np.testing.assert_array_equal(_run(q[513:], qg[513:], kc, vc, 0, 513), whole[513:])


@pytest.mark.parametrize("heads,kv_heads", [(16, 4), (24, 4)])
def test_flash_bits_do_not_depend_on_warps_per_cta(heads, kv_heads):
    """prefill picks 4 or 8 warps a CTA by the chunk's size (SHORT_VIRTUAL_ROWS): every
    variant gives every row the same bits."""
    r = rng()
    _, _, kc, vc = _setup(r, heads, kv_heads, 256, capacity=1024, slots=1)
    q, qg = _wide_inputs(r, 301, heads, 256)
    with poisoned():
        runs = [host(attention_flash.prefill(to_device(q), to_device(qg), kc, vc, 0, 100, warps=w, wgmma=False))
                for w in (1, 2, 4, 8)]
    for w, run in zip((1, 2, 4), runs):
        assert np.array_equal(run, runs[-1]), f"{w} warps"
    assert 301 * heads // kv_heads <= attention_flash.SHORT_VIRTUAL_ROWS
    np.testing.assert_array_equal(_run(q, qg, kc, vc, 0, 100), runs[-1])


@pytest.mark.parametrize("heads,kv_heads,head_dim,start,rows", [(24, 4, 256, 1984, 51), (16, 4, 256, 100, 301),
                                                               (8, 2, 128, 37, 200), (4, 2, 16, 0, 70)])
def test_flash_bits_do_not_depend_on_the_ring_depth(heads, kv_heads, head_dim, start, rows):
    """Every (warps, stages) variant at head_dim, walking or split, gives every row the same
    bits; the 27B's off-grid continuation chunk (51 rows at 1984: 64 blocks, more than any
    ring) among them, and blocks fewer than a ring's depth (70 rows at 0)."""
    r = rng()
    _, _, kc, vc = _setup(r, heads, kv_heads, head_dim, capacity=2048, slots=1)
    q, qg = _wide_inputs(r, rows, heads, head_dim)
    variants = sorted((w, st, sp) for d, w, st in attention_flash.VARIANTS if d == head_dim for sp in (False, True))
    assert len({st for _, st, _ in variants}) > 1 or head_dim != 256
    with poisoned():
        runs = {(w, st, sp): host(attention_flash.prefill(to_device(q), to_device(qg), kc, vc, 0, start, warps=w,
                                                          stages=st, split=sp, wgmma=False))
                for w, st, sp in variants}
        runs["default"] = host(attention_flash.prefill(to_device(q), to_device(qg), kc, vc, 0, start, split=False))
    first = runs[variants[0]]
    for key, run in runs.items():
        assert np.array_equal(run, first), f"warps, stages, split = {key}"


@pytest.mark.parametrize("heads,kv_heads,head_dim,start,rows", [
    (24, 4, 256, 1984, 51), (24, 4, 256, 4000, 16), (16, 4, 256, 250, 300), (8, 2, 128, 511, 90), (4, 2, 16, 500, 70),
    (6, 2, 32, 0, 600),
])
def test_a_split_gives_the_walk_s_bits(heads, kv_heads, head_dim, start, rows):
    """Key segments spread over CTAs and folded by flash_combine give every row the bits of
    one CTA walking them all (the chunk sizes at which prefill switches, and rows that start,
    end and straddle 512-key segments)."""
    r = rng()
    _, _, kc, vc = _setup(r, heads, kv_heads, head_dim, capacity=4096, slots=1)
    q, qg = _wide_inputs(r, rows, heads, head_dim)
    with poisoned():
        walk = host(attention_flash.prefill(to_device(q), to_device(qg), kc, vc, 0, start, split=False))
        split = host(attention_flash.prefill(to_device(q), to_device(qg), kc, vc, 0, start, split=True))
    np.testing.assert_array_equal(split, walk)
    np.testing.assert_array_equal(_run(q, qg, kc, vc, 0, start), walk)


@pytest.mark.parametrize("start,used", [(1984, 51), (4500, 64), (0, 1), (300, 7), (12000, 64)])
def test_a_captured_split_reads_rows_and_start_from_meta(start, used):
    """A chunk launched for a graph (meta on the device, 64 padded rows, partials for the
    capacity's segments, 16 CTAs a tile taking segments z, z + 16, ...) gives its rows in use
    the bits of an eager call, and leaves the padded rows' output alone; so does a chunk
    launched with meta and its own keys (the backend's eager chunks)."""
    from executor.numba_cuda.device import chunk_meta
    r = rng()
    heads, kv_heads, head_dim, padded = 24, 4, 256, 64
    _, _, kc, vc = _setup(r, heads, kv_heads, head_dim, capacity=16384, slots=2)
    q, qg = _inputs(r, padded, heads, head_dim)
    assert attention_flash.split_segments(padded, heads, kv_heads, head_dim, 16384) == 32
    # at 12,000 from the start the tile's 24 segments go two to CTAs 0-7: the z + 16 loop runs
    meta = chunk_meta(None, used, start, 1)
    out = to_device(np.full((padded, heads * head_dim), 0x7FC1, np.uint16))
    with poisoned():
        attention_flash.prefill(to_device(q), to_device(qg), kc, vc, 1, 0, out=out, meta=meta)
    got = out.copy_to_host()  # not `host`: the padded rows keep their NaN on purpose
    alone = _run(q[:used], qg[:used], kc, vc, 1, start)
    np.testing.assert_array_equal(got[:used], alone)
    assert (got[used:] == 0x7FC1).all()
    # an eager chunk the backend launches with meta and its own keys: one CTA a segment
    with poisoned():
        eager = host(attention_flash.prefill(to_device(q[:used]), to_device(qg[:used]), kc, vc, 1, start,
                                             meta=chunk_meta(None, used, start, 1), keys=start + used))
    np.testing.assert_array_equal(eager, alone)


def test_flash_at_a_capacity_of_exactly_the_blocks_it_reads():
    """Keys [0, start + rows) in a cache of ceil32(start + rows) rows, the next slot NaN:
    nothing past the slot is read (the bits equal those in a roomier cache)."""
    r = rng()
    start, rows, heads, kv_heads, head_dim = 20, 44, 16, 4, 256  # 64 rows: two 32-key blocks
    kh, vh, _, _ = _setup(r, heads, kv_heads, head_dim, capacity=64, slots=2)
    kh[1], vh[1] = 0x7FC0, 0x7FC0  # NaN in the slot after the one read
    q, qg = _inputs(r, rows, heads, head_dim)
    tight = _run(q, qg, to_device(kh), to_device(vh), 0, start)
    roomy_k = np.zeros((1, 256, kv_heads, head_dim), np.uint16)
    roomy_v = np.zeros_like(roomy_k)
    roomy_k[0, :64], roomy_v[0, :64] = kh[0], vh[0]
    np.testing.assert_array_equal(tight, _run(q, qg, to_device(roomy_k), to_device(roomy_v), 0, start))


def test_flash_depends_on_the_key_blocks_it_reads():
    """The planted break for the invariance test above: a key past a row's position must
    not matter, a key before it must (changing key 5 moves row 300; key 301 does not)."""
    r = rng()
    kh, vh, kc, vc = _setup(r, 16, 4, 256, capacity=512, slots=1)
    q, qg = _inputs(r, 1, 16, 256)
    base = _run(q, qg, kc, vc, 0, 300)
    for key, moves in ((301, False), (5, True)):
        vh2 = vh.copy()
        vh2[0, key] ^= 0x0100
        got = _run(q, qg, kc, to_device(vh2), 0, 300)
        assert (not np.array_equal(got, base)) == moves, key


def test_flash_rejects_bad_shapes_and_leaves_other_slots():
    r = rng()
    kh, vh, kc, vc = _setup(r, 4, 2, 16, capacity=256)
    q, qg = _inputs(r, 5, 4, 16)
    _run(q, qg, kc, vc, 1, 3)
    np.testing.assert_array_equal(kc.copy_to_host(), kh)
    np.testing.assert_array_equal(vc.copy_to_host(), vh)
    with pytest.raises(ValueError, match="qg"):
        attention_flash.prefill(to_device(q), to_device(qg[:, :-1].copy()), kc, vc, 1, 3)
    with pytest.raises(ValueError, match="capacity"):
        attention_flash.prefill(to_device(q), to_device(qg), kc, vc, 1, 252)
    with pytest.raises(ValueError, match="head_dim"):
        attention_flash.kernel(24)
    with pytest.raises(ValueError, match="stages"):
        attention_flash.kernel(256, 4, 5)
    with pytest.raises(ValueError, match="stages"):
        attention_flash.kernel(256, 8, 4)
    assert attention_flash.unavailable(256) is None and "head_dim 48" in attention_flash.unavailable(48)


def test_probe_passes():
    for head_dim in attention_flash.WARPS:
        attention_flash.probe(head_dim)


@pytest.fixture
def wgmma():
    """Skips where the backend does not walk on wgmma (its status, decided on first use)."""
    why = attention_flash.wgmma_status()
    if why is not None:
        pytest.skip(f"no wgmma walk here: {why}")


def _skip_without(tma: bool) -> None:
    from executor.numba_cuda import attention_wgmma

    why = attention_wgmma.tma_unavailable() if tma else None
    if why is not None:
        pytest.skip(f"no TMA walk here: {why}")


TMA = pytest.mark.parametrize("tma,lookahead", [(False, False), (True, False), (False, True)],
                              ids=["cp.async", "tma", "lookahead"])
"""The three wgmma walks, asked for by name: K/V blocks by cp.async (the default), by TMA (opt-in;
skipped where it cannot run), and the cp.async walk in FlashAttention-3's order (opt-in)."""


def test_the_wgmma_walk_runs_on_the_h200(monkeypatch):
    """Where the GPU is an H100/H200 (sm_90) the backend walks on wgmma (its K/V blocks by cp.async
    unless WARMSTATE_FLASH_TMA=1 asks for TMA): the statuses are None (built, and their checks
    against the mma.sync walk passed)."""
    from numba import cuda

    if tuple(cuda.get_current_device().compute_capability) == (9, 0):
        assert attention_flash.wgmma_status() is None
        assert walk_statuses(monkeypatch) == (attention_flash.TMA_OFF, None)
        assert walk_statuses(monkeypatch, "lookahead") == (attention_flash.LOOKAHEAD_OFF, None)


@pytest.mark.usefixtures("wgmma")
@TMA
@pytest.mark.parametrize("heads,kv_heads,start,rows,slot", [
    (24, 4, 1984, 51, 1), (24, 4, 0, 2000, 0), (16, 4, 300, 700, 1), (16, 4, 1000, 1500, 0), (8, 2, 31, 33, 1),
    (16, 4, 0, 1, 0), (24, 4, 4000, 16, 1), (16, 4, 2043, 5, 1),
])
def test_the_wgmma_walk_gives_the_mma_sync_walk_s_bits(heads, kv_heads, start, rows, slot, tma, lookahead):
    """Every output bit of the wgmma walk equals the mma.sync walk's: the 27B's off-grid
    chunk and a long one from 0, the 9B's heads, a 2B-like 8 on 2, one row, a short chunk deep
    in the cache, rows straddling 512-key segments and partial 128-row tiles, slot 0 and 1 (q
    scaled so the lazy max moves on some blocks)."""
    _skip_without(tma)
    r = rng()
    _, _, kc, vc = _setup(r, heads, kv_heads, 256, capacity=4096, slots=2)
    q, qg = _inputs(r, rows, heads, 256)
    q *= 4
    with poisoned():
        mma = host(attention_flash.prefill(to_device(q), to_device(qg), kc, vc, slot, start, split=False,
                                           wgmma=False))
        wgmma = host(attention_flash.prefill(to_device(q), to_device(qg), kc, vc, slot, start, split=False,
                                             wgmma=True, tma=tma, lookahead=lookahead))
    np.testing.assert_array_equal(wgmma, mma)


@pytest.mark.usefixtures("wgmma")
@TMA
@pytest.mark.parametrize("start,used", [(1984, 300), (0, 640), (4500, 1)])
def test_a_captured_wgmma_walk_reads_rows_start_and_slot_from_meta(start, used, tma, lookahead):
    """A walk launched for a graph (meta on the device, 640 padded rows: a grid of their
    tiles) gives its rows in use the bits of an eager call and leaves the padded rows alone."""
    _skip_without(tma)
    from executor.numba_cuda.device import chunk_meta
    r = rng()
    heads, kv_heads, padded = 16, 4, 640
    _, _, kc, vc = _setup(r, heads, kv_heads, 256, capacity=8192, slots=2)
    q, qg = _inputs(r, padded, heads, 256)
    out = to_device(np.full((padded, heads * 256), 0x7FC1, np.uint16))
    with poisoned():
        attention_flash.prefill(to_device(q), to_device(qg), kc, vc, 1, 0, out=out, meta=chunk_meta(None, used, start, 1),
                                split=False, wgmma=True, tma=tma, lookahead=lookahead)
    got = out.copy_to_host()
    with poisoned():
        alone = host(attention_flash.prefill(to_device(q[:used]), to_device(qg[:used]), kc, vc, 1, start,
                                             split=False, wgmma=False))
    np.testing.assert_array_equal(got[:used], alone)
    assert (got[used:] == 0x7FC1).all()


@pytest.mark.usefixtures("wgmma")
@TMA
def test_the_wgmma_walk_depends_on_the_keys_it_reads(tma, lookahead):
    """The planted break: a key past a row's position does not move the wgmma walk's row, a
    key before it does (a walk that read the wrong layout would fail the bit tests above)."""
    _skip_without(tma)
    r = rng()
    kh, vh, kc, vc = _setup(r, 16, 4, 256, capacity=512, slots=1)
    q, qg = _inputs(r, 1, 16, 256)

    def walk(values):
        with poisoned():
            return host(attention_flash.prefill(to_device(q), to_device(qg), kc, values, 0, 300, split=False,
                                                wgmma=True, tma=tma, lookahead=lookahead))

    base = walk(vc)
    for key, moves in ((301, False), (5, True), (299, True)):
        vh2 = vh.copy()
        vh2[0, key] ^= 0x0100
        assert (not np.array_equal(walk(to_device(vh2)), base)) == moves, key


def test_this_machine_s_build_of_the_lookahead_walk_overlaps():
    """The GPU machine's own NVRTC build (what attention_wgmma.module runs), read as tests/bench/
    test_sass.py reads the CPU's: the softmax's 18 exponentials between the wait for S and the wait
    for P V, and the loop top in its order. A ptxas that moves the wait up again keeps the bits and
    loses the speed; this says so. Needs cuobjdump and nvdisasm (the nvidia-cuda-cuobjdump and
    nvidia-cuda-nvdisasm wheels), else skips."""
    from bench.sass import LOOKAHEAD_LOOP_TOP, sass, sass_unavailable, summary
    from executor.numba_cuda import attention_wgmma
    from executor.numba_cuda.nvrtc import compile_cubin

    if attention_wgmma.unavailable() is not None or sass_unavailable() is not None:
        pytest.skip(attention_wgmma.unavailable() or sass_unavailable())
    cubin, _ = compile_cubin(attention_wgmma.source(), "flash_wgmma.cu")
    got = summary(sass(cubin, attention_wgmma.LOOKAHEAD_KERNEL))
    assert got["overlap_windows"] == [18]
    assert got["loop_top"] == LOOKAHEAD_LOOP_TOP


def test_wgmma_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("WARMSTATE_FLASH_WGMMA", "0")
    attention_flash.wgmma_status.cache_clear()
    try:
        assert attention_flash.wgmma_status() == "turned off by WARMSTATE_FLASH_WGMMA=0"
    finally:
        monkeypatch.delenv("WARMSTATE_FLASH_WGMMA")
        attention_flash.wgmma_status.cache_clear()


def test_tma_is_opt_in(monkeypatch):
    for value in (None, "0", "yes"):
        if value is None:
            monkeypatch.delenv("WARMSTATE_FLASH_TMA", raising=False)
        else:
            monkeypatch.setenv("WARMSTATE_FLASH_TMA", value)
        attention_flash.tma_status.cache_clear()
        try:
            assert attention_flash.tma_status() == attention_flash.TMA_OFF
        finally:
            attention_flash.tma_status.cache_clear()


def test_tensor_maps_refuse_what_does_not_fit():
    from executor.numba_cuda import attention_wgmma

    with pytest.raises(ValueError, match="uint16"):
        attention_wgmma.tensor_map(to_device(np.zeros((1, 32, 1, 128), np.uint16)))
    with pytest.raises(ValueError, match="C-contiguous"):
        attention_wgmma.tensor_map(to_device(np.zeros((1, 32, 2, 256), np.uint16))[:, :, :1])
