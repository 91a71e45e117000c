"""Kernel cases (embedding, norms, SwiGLU, GEMV, QK-norm + RoPE + K/V store) against the
NumPy twins in executor/reference/ops.py. Run by test_kernels_simulated.py under the CUDA
simulator, or directly with pytest on a GPU. Outputs are poisoned before launch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from numba import cuda

from executor.numba_cuda import attention_prep, elementwise, gemv, norms
from executor.numba_cuda.device import IS_SIMULATOR, empty, poisoned, to_device
from executor.reference import ops
from tests.executor.numba_cuda.kernel_support import as_f32, bf16, host, rng
from tests.helpers import assert_close

BF16_TOL = 8e-3  # relative to max |ref|: bf16 output rounding plus fp32 math


@pytest.mark.parametrize("rows", [1, 5])
def test_embed(rows):
    r = rng()
    table = bf16(r.normal(size=(50, 40)))
    ids = r.integers(0, 50, rows).astype(np.int32)
    with poisoned():
        out = host(elementwise.embed(to_device(ids), to_device(table)))
    np.testing.assert_array_equal(out, ops.embed(ids, as_f32(table)))


@pytest.mark.parametrize("threads", [norms.NORM_THREADS, norms.PREFILL_NORM_THREADS], ids=["decode", "prefill"])
@pytest.mark.parametrize("with_delta", [False, True], ids=["plain", "residual"])
def test_add_rms_norm(with_delta, threads):
    r = rng()
    x = r.normal(size=(3, 200)).astype(np.float32)
    delta = r.normal(size=(3, 200)).astype(np.float32)
    weight = r.normal(0, 0.1, 200).astype(np.float32)
    dx = to_device(x)
    with poisoned():
        out = host(norms.add_rms_norm(dx, to_device(weight), 1e-6, delta=to_device(delta) if with_delta else None,
                                      threads=threads))
    summed = x + delta if with_delta else x
    np.testing.assert_array_equal(dx.copy_to_host(), summed)
    assert_close("add_rms_norm", ops.rms_norm(summed, weight, 1e-6), as_f32(out), BF16_TOL, rel=True)


@pytest.mark.parametrize("with_delta", [False, True], ids=["plain", "residual"])
def test_add_rms_norm_unroll_changes_no_bit(with_delta):
    """32 threads, dim 328: a thread has 10 or 11 elements (328 = 10 x 32 + 8), loaded 1, 3 or
    4 at a time (the last group partly past the row; 4 is the default) or all at once.
    Every output bit and the updated residual equal unroll 1's (and the twin)."""
    r = rng()
    x = r.normal(size=(4, 328)).astype(np.float32)
    delta = r.normal(size=(4, 328)).astype(np.float32)
    weight = r.normal(0, 0.1, 328).astype(np.float32)
    outs, residuals = [], []
    for unroll in (1, 3, 4, 11):
        dx = to_device(x)
        with poisoned():
            out = host(norms.add_rms_norm(dx, to_device(weight), 1e-6, delta=to_device(delta) if with_delta else None,
                                          threads=32, unroll=unroll))
        outs.append(out)
        residuals.append(dx.copy_to_host())
    summed = x + delta if with_delta else x
    for out, residual in zip(outs, residuals):
        np.testing.assert_array_equal(out, outs[0])
        np.testing.assert_array_equal(residual, summed)
    assert_close("add_rms_norm", ops.rms_norm(summed, weight, 1e-6), as_f32(outs[0]), BF16_TOL, rel=True)


def test_add_rms_norm_rejects_unroll_0():
    with pytest.raises(ValueError, match="unroll"):
        norms.add_rms_norm(to_device(np.zeros((1, 32), np.float32)), to_device(np.zeros(32, np.float32)), 1e-6,
                           threads=32, unroll=0)
    with pytest.raises(ValueError, match=r"out \(2, 32\) must be \[1, 32\]"):
        norms.add_rms_norm(to_device(np.zeros((1, 32), np.float32)), to_device(np.zeros(32, np.float32)), 1e-6,
                           out=to_device(np.zeros((2, 32), np.uint16)), threads=32)


@pytest.mark.parametrize("rows,heads,dim", [(2, 3, 16), (5, 3, 128), (2, 9, 40)])
def test_gated_rms_norm_reads_a_column_slice(rows, heads, dim):
    """One warp per (row, head): dims below and above the 32 lanes, a block with idle warps (3
    heads of a row in a block of GATED_WARPS), and a row's heads over two blocks (9 heads)."""
    r = rng()
    x = r.normal(size=(rows, heads, dim)).astype(np.float32)
    wide = r.normal(size=(rows, 5 + heads * dim)).astype(np.float32)
    weight = (1 + r.normal(0, 0.1, dim)).astype(np.float32)
    with poisoned():
        out = host(norms.gated_rms_norm(to_device(x), to_device(wide)[:, 5:], to_device(weight), 1e-6))
    ref = ops.gated_rms_norm(x, as_f32(bf16(wide[:, 5:])).reshape(rows, heads, dim), weight, 1e-6).reshape(rows, -1)
    assert_close("gated_rms_norm", ref, as_f32(out), BF16_TOL, rel=True)
    with poisoned():  # a bf16 gate (in_proj from cuBLASLt's bf16 epilogue): the bits of the f32 one it rounds
        from_bf16 = host(norms.gated_rms_norm(to_device(x), to_device(bf16(wide))[:, 5:], to_device(weight), 1e-6))
    np.testing.assert_array_equal(from_bf16, out)


def test_gated_rms_norm_rounds_the_gate_first():
    """Gates one f32 ulp over a bf16 tie give the bits of their bf16 rounding (up), not of the
    rounding down a kernel that skips the rounding would be nearer to: 32 heads of x, so some
    outputs tell the two apart."""
    r = rng()
    rows, heads, dim = 1, 32, 32
    x = r.normal(size=(rows, heads, dim)).astype(np.float32)
    weight = np.ones(dim, np.float32)
    over = np.full((rows, heads * dim), np.uint32(0x3F808001).view(np.float32))  # rounds up to 0x3F81
    up, down = (np.full_like(over, np.uint32(b).view(np.float32)) for b in (0x3F810000, 0x3F800000))
    run = [host(norms.gated_rms_norm(to_device(x), to_device(g), to_device(weight), 1e-6)) for g in (over, up, down)]
    np.testing.assert_array_equal(run[0], run[1])
    assert not np.array_equal(run[1], run[2])


def _warp_sum_rows_kernel(count):
    @cuda.jit
    def kernel(values, out, ref):
        # values: [count, 32] f32, a row per v entry; out[lane]: warp_sum_rows' result of the lane;
        # ref[i]: warp_sum of row i (every lane gets it; lane 0 stores)
        lane = cuda.threadIdx.x
        scratch = cuda.shared.array((1, 32), np.float32)
        v = cuda.local.array(count, np.float32)
        for i in range(count):
            total = norms.warp_sum(values[i, lane], scratch)
            if lane == 0:
                ref[i] = total
            v[i] = values[i, lane]
        out[lane] = norms.warp_sum_rows(v, count, scratch)

    return kernel


@pytest.mark.parametrize("count", [1, 2, 4, 8, 16, 32])
def test_warp_sum_rows_is_warp_sum_of_each_row(count):
    """Lane l gets row l >> (5 - log2 count)'s sum, bit for bit `warp_sum`'s (values over 30
    binary orders, so another pairing of the adds would change low bits)."""
    r = rng()
    values = (np.exp2(r.uniform(-15, 15, (count, 32))) * r.choice([-1, 1], (count, 32))).astype(np.float32)
    out, ref = empty(32, np.float32), empty(count, np.float32)
    _warp_sum_rows_kernel(count)[1, 32](to_device(values), out, ref)
    rows = np.arange(32) >> (5 - int(math.log2(count)))
    np.testing.assert_array_equal(host(out).view(np.uint32), host(ref)[rows].view(np.uint32))


def _lane_sum(squares, order):
    """A lane's float32 sum of its squares: "kernel" from 0 in order, "reverse" from 0 the other
    way round, "pairs" a pairwise tree ((s0 + s1) + (s2 + s3) ...)."""
    f = np.float32
    if order == "pairs":
        while len(squares) > 1:
            squares = [f(squares[j] + squares[j + 1]) if j + 1 < len(squares) else squares[j]
                       for j in range(0, len(squares), 2)]
        return squares[0] if squares else f(0.0)
    s = f(0.0)
    for v in squares[:: -1 if order == "reverse" else 1]:
        s = f(s + v)
    return s


def _gated_inv(x, eps, order="kernel"):
    """float32 1 / rms of one head as gated_rms_norm computes it under the simulator (order
    "kernel"): lane l sums x_i^2 for i = l, l + 32, ... from 0, then the 32 lanes' sums fold
    in a tree (16, 8, ..., 1); other orders change the lane's sum only (`_lane_sum`)."""
    f = np.float32
    lanes = [_lane_sum([f(x[i] * x[i]) for i in range(lane, x.shape[0], 32)], order) for lane in range(32)]
    step = 16
    while step:
        lanes[:step] = [f(lanes[j] + lanes[j + step]) for j in range(step)]
        step //= 2
    return f(1.0) / f(math.sqrt(f(lanes[0] / f(x.shape[0])) + f(eps)))


def _gated_emulation(x, silu, weight, inv):
    """bf16 bits of x * inv * weight * silu, in float32 in the kernel's order."""
    return bf16(((x * inv) * weight) * silu)


@pytest.mark.parametrize("other", ["reverse", "pairs"])
def test_gated_rms_norm_sums_in_its_order(other):
    """A head whose squares span 40 binary orders, so summing a lane's dims in another order
    (`other`) changes inv, and one weight set so that change flips that output's bf16
    rounding: the kernel's bits are the emulation's in its order and not in the other one (its
    bf16 output hides a reordered sum on ordinary data). About 6% of random heads qualify."""
    if not IS_SIMULATOR:
        pytest.skip("the emulation is the simulator's float32 arithmetic (a GPU may fuse the squares' adds)")
    r = rng()
    dim, eps = 128, 1e-6
    f = np.float32
    for _ in range(2000):
        x = (np.exp2(r.uniform(-20, 0, dim)) * r.choice([-1, 1], dim)).astype(np.float32)
        ours, theirs = _gated_inv(x, eps), _gated_inv(x, eps, other)
        if ours == theirs:
            continue
        gate = as_f32(bf16(r.normal(1.0, 0.5, dim).astype(np.float32)))  # bf16 values: the kernel's rounding keeps them
        silu = np.array([g / (f(1.0) + f(math.exp(-g))) for g in gate], np.float32)
        i = int(np.argmax(np.abs(x)))  # weight i puts output i at a bf16 rounding tie, give or take ulps
        value = f(f(x[i] * ours) * silu[i])
        tie = (np.array([value], np.float32).view(np.uint32) & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
        weight = np.ones(dim, np.float32)
        w = f(tie.view(np.float32)[0] / value)
        for toward in (np.inf, -np.inf):
            weight[i] = w
            for _ in range(64):
                if _gated_emulation(x[i], silu[i], weight[i], ours) != _gated_emulation(x[i], silu[i], weight[i],
                                                                                        theirs):
                    break
                weight[i] = np.nextafter(weight[i], f(toward))
            else:
                continue
            break
        else:
            continue
        break
    else:
        pytest.fail("no order-sensitive input in 2000 random heads")
    expected = _gated_emulation(x, silu, weight, ours)
    assert not np.array_equal(expected, _gated_emulation(x, silu, weight, theirs))
    with poisoned():
        out = host(norms.gated_rms_norm(to_device(x.reshape(1, 1, dim)), to_device(gate.reshape(1, dim)),
                                        to_device(weight), eps))
    np.testing.assert_array_equal(out[0], expected)


@pytest.mark.parametrize("inter", [70, 72, 1032])
def test_swiglu(inter):
    """out = bf16(silu(bf16(gate)) * bf16(up)). inter 70: one column a thread; 72 and 1032: four
    (16-byte loads), the same bits as one a thread; 72 and 1032 from bf16 gate_up too (eight a
    thread), the same bits as from the f32 values they round."""
    r = rng()
    rows = 3
    gate_up = r.normal(size=(rows, 2 * inter)).astype(np.float32) * 4
    with poisoned():
        out = host(elementwise.swiglu(to_device(gate_up)))
    rounded = as_f32(bf16(gate_up))
    ref = ops.silu(rounded[:, :inter]) * rounded[:, inter:]
    assert_close("swiglu", ref, as_f32(out), BF16_TOL, rel=True)
    if inter % 4 == 0:
        with poisoned():
            one = elementwise.empty((rows, inter), np.uint16)
            elementwise._swiglu_kernel[(elementwise.blocks(inter), rows), elementwise.THREADS](to_device(gate_up), one)
        np.testing.assert_array_equal(host(one), out)
    if inter % 8 == 0:
        with poisoned():
            from_bf16 = host(elementwise.swiglu(to_device(bf16(gate_up))))
        np.testing.assert_array_equal(from_bf16, out)


def test_swiglu_rounds_gate_and_up_before_the_product():
    """A gate and an up value one f32 ulp over a bf16 tie give the bits of both their bf16
    roundings (up), and not those of rounding only the gate, only the up or neither: the four
    give 0x4002, 0x4001, 0x4001 and 0x4000, each product at least 256 f32 ulps from a bf16 tie
    (so an exp one ulp off cannot move it)."""
    inter = 8
    f = np.float32
    g0, u0 = np.uint32(0x40058001).view(f), np.uint32(0x3F8A8001).view(f)  # round up to 0x4006, 0x3F8B
    gate_up = np.concatenate([np.full((1, inter), g0), np.full((1, inter), u0)], axis=1)
    with poisoned():
        out = host(elementwise.swiglu(to_device(gate_up)))
    gr, ur = np.uint32(0x40060000).view(f), np.uint32(0x3F8B0000).view(f)

    def swiglu1(g, u):
        return bf16(np.array([f(g / (f(1) + np.exp(f(-g)))) * u], f))[0]

    expected = swiglu1(gr, ur)
    assert expected == 0x4002
    assert expected not in (swiglu1(gr, u0), swiglu1(g0, ur), swiglu1(g0, u0))
    assert (out == expected).all()


def test_swiglu_refuses_a_bf16_gate_up_it_cannot_load():
    with pytest.raises(ValueError, match="inter a multiple of 8"):
        elementwise.swiglu(to_device(np.zeros((2, 2 * 12), np.uint16)))


@pytest.mark.parametrize("k", [64, 1600], ids=["k64", "k1600-unrolled"])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_gemv_matches_linear_and_is_row_invariant(rows, k):
    """Each row's bits equal its bits computed alone (another row group and slot)."""
    r = rng()
    x = bf16(r.normal(size=(rows, k)))
    w = bf16(r.normal(size=(5, k)) / 8)
    dw = to_device(w)
    with poisoned():
        out = host(gemv.gemv(to_device(x), dw))
        for row in sorted({0, rows // 2, rows - 1}):
            alone = host(gemv.gemv(to_device(x[row : row + 1]), dw))
            np.testing.assert_array_equal(alone[0], out[row])
    assert_close("gemv", ops.linear(as_f32(x), as_f32(w)), out, 1e-5, rel=True)


def test_gemv_rejects_k_off_the_16_byte_chunk():
    with pytest.raises(ValueError, match="multiple of 8"):
        gemv.gemv(to_device(bf16(np.ones((1, 12)))), to_device(bf16(np.ones((3, 12)))))


@pytest.mark.parametrize(("heads", "head_dim", "rotary"), [(2, 16, 4), (5, 160, 8)],
                         ids=["small", "heads-past-a-block-dims-past-a-thread"])
def test_q_norm_rope(heads, head_dim, rotary):
    """Against the twins; 5 heads leave a block with 3 idle head groups (Q_HEADS_PER_BLOCK 4)
    that must store nothing, and head_dim 160 gives a thread two dims, one of them past the
    head for most threads."""
    r = rng()
    rows = 3
    qg = r.normal(size=(rows, heads * 2 * head_dim)).astype(np.float32)
    weight = r.normal(0, 0.1, head_dim).astype(np.float32)
    positions = np.arange(5, 5 + rows, dtype=np.int32)
    freqs = attention_prep.inv_freq(1e6, rotary)
    with poisoned():
        out = host(
            attention_prep.q_norm_rope(
                to_device(qg), to_device(weight), to_device(freqs), to_device(positions), 1e-6, heads, head_dim
            )
        )
    query, _ = ops.split_query_gate(qg, heads, head_dim)
    ref = ops.rope(ops.rms_norm(query, weight, 1e-6), positions, 1e6, rotary)
    assert_close("q_norm_rope", ref, out, 1e-5, rel=True)


@pytest.mark.parametrize("per_block", [3, 8])
def test_q_norm_rope_rows_per_block_changes_no_bit(monkeypatch, per_block):
    """A block that takes ROWS_PER_BLOCK rows (loading each row's dims while the row before it
    is worked) gives every bit that one row a block gives: 11 rows (3: blocks of 3, 3, 3, 2;
    8: of 8, 3), heads past a block, dims past a thread. A prefetch of the wrong row, a block's
    first row off, or a row left out, fails."""
    monkeypatch.setattr(attention_prep, "ROWS_PER_BLOCK", per_block)
    r = rng()
    rows, heads, head_dim, rotary = 11, 5, 160, 8
    qg = r.normal(size=(rows, heads * 2 * head_dim)).astype(np.float32)
    weight = r.normal(0, 0.1, head_dim).astype(np.float32)
    positions = np.arange(40, 40 + rows, dtype=np.int32)
    freqs = attention_prep.inv_freq(1e6, rotary)
    outs = []
    for few in (attention_prep.FEW_ROWS, 0):
        monkeypatch.setattr(attention_prep, "FEW_ROWS", few)
        with poisoned():
            outs.append(host(attention_prep.q_norm_rope(to_device(qg), to_device(weight), to_device(freqs),
                                                        to_device(positions), 1e-6, heads, head_dim)))
    assert attention_prep.rows_per_block(rows) == attention_prep.ROWS_PER_BLOCK > 1
    np.testing.assert_array_equal(outs[1], outs[0])
    query, _ = ops.split_query_gate(qg, heads, head_dim)
    assert_close("q_norm_rope", ops.rope(ops.rms_norm(query, weight, 1e-6), positions, 1e6, rotary), outs[1], 1e-5,
                 rel=True)


def test_q_norm_rope_refuses_an_out_that_does_not_fit():
    """The kernel stores the heads of `out`: an out with more heads than qg would make it read
    past qg's rows (found in review), so it is refused."""
    qg = to_device(np.zeros((2, 3 * 2 * 16), np.float32))
    args = (to_device(np.zeros(16, np.float32)), to_device(attention_prep.inv_freq(1e6, 4)),
            to_device(np.arange(2, dtype=np.int32)), 1e-6, 3, 16)
    with pytest.raises(ValueError, match=r"out \(2, 4, 16\) must be \[2, 3, 16\]"):
        attention_prep.q_norm_rope(qg, *args, out=empty((2, 4, 16), np.float32))
    with pytest.raises(ValueError, match="out"):
        attention_prep.q_norm_rope(qg, *args, out=empty((2, 3, 16), np.uint16))


def test_kv_norm_rope_store_writes_its_rows_only():
    r = rng()
    rows, kv_heads, head_dim, rotary, slots, capacity = 3, 2, 16, 8, 2, 12
    kv = r.normal(size=(rows, 2 * kv_heads * head_dim)).astype(np.float32)
    weight = r.normal(0, 0.1, head_dim).astype(np.float32)
    positions = np.arange(7, 7 + rows, dtype=np.int32)
    slot = np.full(rows, 1, np.int32)
    freqs = attention_prep.inv_freq(1e4, rotary)
    with poisoned():
        kcache = empty((slots, capacity, kv_heads, head_dim), np.uint16)
        vcache = empty((slots, capacity, kv_heads, head_dim), np.uint16)
        attention_prep.kv_norm_rope_store(
            to_device(kv), to_device(weight), to_device(freqs), to_device(positions), to_device(slot), 1e-6,
            kcache, vcache,
        )
    k_host = kcache.copy_to_host()[1, 7:10]
    v_host = vcache.copy_to_host()[1, 7:10]
    k = kv[:, : kv_heads * head_dim].reshape(rows, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim :].reshape(rows, kv_heads, head_dim)
    ref = ops.rope(ops.rms_norm(k, weight, 1e-6), positions, 1e4, rotary)
    assert_close("k cache", ref, as_f32(k_host), BF16_TOL, rel=True)
    np.testing.assert_array_equal(v_host, bf16(v))
    untouched = as_f32(kcache.copy_to_host()[0])
    assert np.isnan(untouched).all(), "kv_norm_rope_store wrote outside its slot"


def test_kv_norm_rope_store_skips_padding_rows():
    """A row whose slot is -1 (a padding row of a captured prefill) writes no cache row: the
    caches stay poisoned everywhere but the real rows, and those equal a run without padding."""
    r = rng()
    rows, kv_heads, head_dim, rotary, slots, capacity = 5, 2, 16, 8, 2, 12
    kv = r.normal(size=(rows, 2 * kv_heads * head_dim)).astype(np.float32)
    weight = r.normal(0, 0.1, head_dim).astype(np.float32)
    positions = np.asarray([3, 4, 5, 6, 7], np.int32)
    slot = np.asarray([1, 1, 1, -1, -1], np.int32)
    freqs = attention_prep.inv_freq(1e4, rotary)
    caches = []
    for n in (rows, 3):
        with poisoned():
            kcache = empty((slots, capacity, kv_heads, head_dim), np.uint16)
            vcache = empty((slots, capacity, kv_heads, head_dim), np.uint16)
            attention_prep.kv_norm_rope_store(
                to_device(kv[:n].copy()), to_device(weight), to_device(freqs), to_device(positions[:n].copy()),
                to_device(slot[:n].copy()), 1e-6, kcache, vcache,
            )
        caches.append((kcache.copy_to_host(), vcache.copy_to_host()))
    (k, v), (k3, v3) = caches
    for cache, alone in ((k, k3), (v, v3)):
        np.testing.assert_array_equal(cache, alone)  # same bits (poison is one NaN pattern)
        written = np.zeros(cache.shape[:2], bool)
        written[1, 3:6] = True
        assert not np.isnan(as_f32(cache[written])).any()
        assert np.isnan(as_f32(cache[~written])).all(), "a padding row wrote a cache row"


@pytest.mark.parametrize("n", [1, 4, 6])
def test_last_row_reads_its_row_on_the_device(n):
    r = rng()
    x = r.normal(size=(6, 40)).astype(np.float32)
    delta = r.normal(size=(6, 40)).astype(np.float32)
    with poisoned():
        x1, d1 = elementwise.last_row(to_device(x), to_device(delta), to_device(np.asarray([n, 9, 9], np.int32)))
    np.testing.assert_array_equal(host(x1), x[n - 1 : n])
    np.testing.assert_array_equal(host(d1), delta[n - 1 : n])
    with poisoned():  # the last projection was added into x: x's row alone
        x2, d2 = elementwise.last_row(to_device(x), None, to_device(np.asarray([n, 9, 9], np.int32)))
    np.testing.assert_array_equal(host(x2), x[n - 1 : n])
    assert d2 is None


def test_last_row_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="delta"):
        elementwise.last_row(to_device(np.zeros((3, 4), np.float32)), to_device(np.zeros((2, 4), np.float32)),
                             to_device(np.ones(1, np.int32)))
    with pytest.raises(ValueError, match="meta"):
        elementwise.last_row(to_device(np.zeros((3, 4), np.float32)), to_device(np.zeros((3, 4), np.float32)),
                             to_device(np.ones(1, np.float32)))


@pytest.mark.parametrize(("per_block", "kv_heads"), [(3, 2), (8, 5)])
def test_kv_norm_rope_store_rows_per_block_changes_no_bit(monkeypatch, per_block, kv_heads):
    """Blocks of ROWS_PER_BLOCK rows write the same cache bits as one row a block, padding
    rows (slot -1) inside a block included: 11 rows (3: blocks of 3, 3, 3, 2; 8: of 8, 3), dims
    past a thread, and 5 K/V heads: a second block of heads with 3 idle groups that store
    nothing."""
    monkeypatch.setattr(attention_prep, "ROWS_PER_BLOCK", per_block)
    r = rng()
    rows, head_dim, rotary, slots, capacity = 11, 160, 8, 2, 12
    kv = r.normal(size=(rows, 2 * kv_heads * head_dim)).astype(np.float32)
    weight = r.normal(0, 0.1, head_dim).astype(np.float32)
    positions = np.asarray([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], np.int32)
    slot = np.asarray([1, 1, -1, 1, 0, 0, -1, 0, 1, -1, 0], np.int32)
    freqs = attention_prep.inv_freq(1e4, rotary)
    caches = []
    for few in (attention_prep.FEW_ROWS, 0):
        monkeypatch.setattr(attention_prep, "FEW_ROWS", few)
        with poisoned():
            kcache = empty((slots, capacity, kv_heads, head_dim), np.uint16)
            vcache = empty((slots, capacity, kv_heads, head_dim), np.uint16)
            attention_prep.kv_norm_rope_store(to_device(kv), to_device(weight), to_device(freqs),
                                              to_device(positions), to_device(slot), 1e-6, kcache, vcache)
        caches.append((kcache.copy_to_host(), vcache.copy_to_host()))
    assert attention_prep.rows_per_block(rows) == attention_prep.ROWS_PER_BLOCK > 1
    for one, blocked in zip(*caches):
        np.testing.assert_array_equal(blocked, one)
    k, v = caches[1]
    live = slot >= 0
    written = np.zeros((slots, capacity), bool)
    written[slot[live], positions[live]] = True
    for cache in (k, v):
        assert not np.isnan(as_f32(cache[written])).any()
        assert np.isnan(as_f32(cache[~written])).all(), "a padding row wrote a cache row"
    kk = kv[:, : kv_heads * head_dim].reshape(rows, kv_heads, head_dim)
    ref = ops.rope(ops.rms_norm(kk, weight, 1e-6), positions, 1e4, rotary)
    assert_close("k cache", ref[live], as_f32(k[slot[live], positions[live]]), BF16_TOL, rel=True)
    np.testing.assert_array_equal(v[slot[live], positions[live]],
                                  bf16(kv[live, kv_heads * head_dim :].reshape(-1, kv_heads, head_dim)))
