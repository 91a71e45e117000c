"""The numba-cuda backend on a real GPU: logits against the reference backend, and the
bit-exact contracts (resumed == fresh, concurrent == solo, tail == full, chunk
invariance on the 64-row grid, CUDA-graph decode == eager decode), each with a planted
break that must turn it red. Marked `cuda`; skips cleanly without an NVIDIA GPU and
numba-cuda + nvmath-python.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from executor.numba_cuda.device import is_gpu_available

pytestmark = pytest.mark.cuda
if not is_gpu_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("nvmath")

from executor.config import FULL, LINEAR  # noqa: E402
from executor.model import random_checkpoint  # noqa: E402
from executor.numba_cuda import backend as nb_backend  # noqa: E402
from executor.numba_cuda.backend import INVARIANT_ROWS, NumbaCudaBackend  # noqa: E402
from executor.numba_cuda.graphs import DecodeGraphs  # noqa: E402
from executor.reference.backend import ReferenceBackend  # noqa: E402
from executor.weights import load_weights  # noqa: E402
from policy.shape import ModelShape, state_bytes  # noqa: E402
from policy.usable import BackendFacts  # noqa: E402
from tests.executor.qwen_support import gpu_test_configs, small_config  # noqa: E402

CONFIGS = gpu_test_configs()


@pytest.fixture(scope="module", params=list(CONFIGS))
def models(request, tmp_path_factory):
    config = CONFIGS[request.param]
    path = random_checkpoint(config, seed=3, out_dir=tmp_path_factory.mktemp(request.param))
    weights = load_weights(path)
    return ReferenceBackend(weights), NumbaCudaBackend(weights, slots=48, capacity_rows=1024)


def _prompt(config, rows, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, config.vocab_size, rows)]


def _rel(ref, out):
    return float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref))


LOGITS_TOL = 5e-2
"""Median relative logits error allowed against the float32 reference. The serving format rounds
every GEMM input, the conv tail and K/V to bf16; rounding only the GEMM inputs inside the
reference itself already moves these random models' logits by up to 2.9% (gva-untied) and
8.3% (tied-deep; median 2.9%), measured on the CPU, so the
issue's 1e-2 is out of reach for bf16 activations (see test_logits_within_1e-2)."""


def _teacher_forced(ref, gpu, steps=32, steps_out=None):
    """Relative logits errors over a prefill and `steps` decode steps that feed both
    backends the reference's greedy tokens; and the two greedy token lists. `steps_out`,
    when a list, gets per step (the reference's margin between its pick and the GPU's pick,
    the largest |logit deviation| of the step)."""
    ids = _prompt(gpu.config, 57, 1)
    rs, gs = ref.new_state(), gpu.new_state()
    rl, gl = ref.prefill(rs, ids, (0, 57)), gpu.prefill(gs, ids, (0, 57))
    errors, rt, gt = [_rel(rl, gl)], [], []
    for _ in range(steps):
        rt.append(int(np.argmax(rl)))
        gt.append(int(np.argmax(gl)))
        if steps_out is not None:
            steps_out.append((float(rl[rt[-1]] - rl[gt[-1]]), float(np.abs(gl - rl).max())))
        rl, gl = ref.decode([rs], [rt[-1]])[0], gpu.decode([gs], [rt[-1]])[0]
        errors.append(_rel(rl, gl))
    gpu.release(gs)
    return errors, rt, gt


def test_logits_match_reference(models):
    errors, rt, gt = _teacher_forced(*models)
    agree = sum(a == b for a, b in zip(rt, gt))
    print(f"relative logits error max {max(errors):.2e} median {np.median(errors):.2e}; greedy agree {agree}/32")
    assert np.median(errors) < LOGITS_TOL
    assert agree >= 28


def _matrix_attention_roundings(q, k, v, start):
    """ops.attention with the tensor-core prefill's roundings (attention_mm.py): q and the
    unnormalised probabilities in bf16, divided by the sum of the rounded ones."""
    from executor.safetensors_file import bf16_to_f32, f32_to_bf16

    r = lambda a: bf16_to_f32(f32_to_bf16(np.asarray(a, np.float32)))  # noqa: E731
    rows, heads, head_dim = q.shape
    group = heads // k.shape[1]
    out = np.empty((rows, heads, head_dim), np.float32)
    qb = r(q).astype(np.float64)
    for h in range(heads):
        kh, vh = k[:, h // group].astype(np.float64), v[:, h // group].astype(np.float64)
        s = ((qb[:, h] @ kh[: start + rows].T).astype(np.float32) * np.float32(head_dim**-0.5)).astype(np.float64)
        s[np.arange(start + rows)[None, :] > (start + np.arange(rows))[:, None]] = -np.inf
        p = r(np.exp(s - s.max(axis=1, keepdims=True))).astype(np.float64)
        out[:, h] = (p @ vh[: start + rows]) / p.sum(axis=1, keepdims=True)
    return out


def _flash_attention_roundings(q, k, v, start, block=32, segment=512, lazy=8.0):
    """ops.attention with the fused prefill's roundings (attention_flash.py, flash_attention.cu):
    q in bf16; key segments of `segment` keys from key 0, each an online softmax over blocks of
    `block` keys with the lazy max (m moves to a block's top only when that passes it by more
    than `lazy` in log2 units), each block's probabilities rounded to bf16 against m, the sum
    over the rounded ones; the segments folded in ascending order."""
    from executor.safetensors_file import bf16_to_f32, f32_to_bf16

    r = lambda a: bf16_to_f32(f32_to_bf16(np.asarray(a, np.float32)))  # noqa: E731
    rows, heads, head_dim = q.shape
    group, keys = heads // k.shape[1], start + rows
    margin = lazy * np.log(2.0)
    out = np.empty((rows, heads, head_dim), np.float32)
    qb = r(q).astype(np.float64)
    with np.errstate(invalid="ignore"):  # exp(-inf - -inf) for rows a segment does not reach: masked below
        for h in range(heads):
            kh, vh = k[:keys, h // group].astype(np.float64), v[:keys, h // group].astype(np.float64)
            s = ((qb[:, h] @ kh.T).astype(np.float32) * np.float32(head_dim**-0.5)).astype(np.float64)
            s[np.arange(keys)[None, :] > (start + np.arange(rows))[:, None]] = -np.inf
            big_m, big_l, big_o = np.full(rows, -np.inf), np.zeros(rows), np.zeros((rows, head_dim))
            for s0 in range(0, keys, segment):
                m, total, o = np.full(rows, -np.inf), np.zeros(rows), np.zeros((rows, head_dim))
                for b in range(s0, min(s0 + segment, keys), block):
                    top = s[:, b:b + block].max(axis=1)
                    fresh = np.where((m == -np.inf) | (top > m + margin), top, m)
                    alpha = np.where(m == -np.inf, 0.0, np.exp(m - fresh))
                    p = r(np.exp(s[:, b:b + block] - np.where(fresh == -np.inf, 0.0, fresh)[:, None])).astype(np.float64)
                    total, o, m = total * alpha + p.sum(axis=1), o * alpha[:, None] + p @ vh[b:b + block], fresh
                reached = m > -np.inf
                new_m = np.where(reached, np.maximum(big_m, m), big_m)
                c1 = np.where(big_m == -np.inf, 0.0, np.exp(big_m - new_m))
                c2 = np.where(reached, np.exp(m - new_m), 0.0)
                big_l, big_o, big_m = big_l * c1 + total * c2, big_o * c1[:, None] + o * c2[:, None], new_m
            out[:, h] = big_o / big_l[:, None]
    return out


def test_logits_match_reference_with_the_serving_roundings(models, monkeypatch):
    """The reference with the serving format's bf16 roundings (GEMM inputs, gate and up, conv
    input and tail, z, a and b, K/V; for prefill rows also q and the attention probabilities, as the tensor-core
    prefill rounds them) emulated: what remains is fp32-vs-float64 math and summation
    order, so this checks the wiring far tighter than the plain comparison."""
    from executor.reference import ops
    from executor.safetensors_file import bf16_to_f32, f32_to_bf16

    r = lambda a: bf16_to_f32(f32_to_bf16(np.asarray(a, np.float32)))  # noqa: E731
    linear, conv1d, attend = ops.linear, ops.causal_conv1d, ops.attention
    emulate = {"flash": _flash_attention_roundings, "matrix": _matrix_attention_roundings}[models[1].prefill_attention]
    monkeypatch.setattr(ops, "linear", lambda x, w: linear(r(x), w))
    monkeypatch.setattr(ops, "swiglu_mlp", lambda x, wg, wu, wd: ops.linear(
        ops.silu(r(ops.linear(x, wg))) * r(ops.linear(x, wu)), wd))
    monkeypatch.setattr(ops, "causal_conv1d", lambda x, tail, w: conv1d(r(x), r(tail), w))
    gated, gates = ops.gated_rms_norm, ops.delta_gates
    monkeypatch.setattr(ops, "gated_rms_norm", lambda x, z, w, eps: gated(x, r(z), w, eps))
    monkeypatch.setattr(ops, "delta_gates", lambda a, b, a_log, dt_bias: gates(r(a), r(b), a_log, dt_bias))
    monkeypatch.setattr(ops, "attention", lambda q, k, v, start: (
        emulate(q, r(k), r(v), start) if len(q) > 1 else attend(q, r(k), r(v), start)))
    steps = []
    errors, rt, gt = _teacher_forced(*models, steps_out=steps)
    print(f"vs bf16-emulating reference: max {max(errors):.2e} median {np.median(errors):.2e}")
    # Measured on the H200: gva-untied max 2.3e-3, tied-deep max 1.1e-2 / median 3.0e-3 (a
    # bf16 probability that rounds the other way, carried through eight layers). Session 38's
    # lazy max with the old emulator (the exact max, no segments): tied-deep max 5.5e-2.
    # Session 39 rounds z, a and b to bf16 too (on the GPU and here): tied-deep max 2.67e-2 /
    # median 5.48e-3 on an H100. Each rounding is a new place where the GPU's fp32 value and
    # this float64 one fall either side of a bf16 tie; in the reference alone, noise of 2^-20
    # before every rounding moved tied-deep's logits by max 2.5-4.0e-2 / median 1.1-1.2e-2
    # without the z, a, b roundings and 0.9-1.2e-1 / 1.6-1.8e-2 with them (bench/RESULTS.md,
    # session 39), so the bound follows (a wiring error moves logits by O(1)).
    assert max(errors) < 4e-2 and np.median(errors) < 8e-3
    # greedy equal, except where the reference's two picks are closer than the run's measured
    # logit error (the median over steps of the largest |deviation|: the exception)
    typical = float(np.median([deviation for _, deviation in steps]))
    flips = [(i, margin) for i, (margin, _) in enumerate(steps) if rt[i] != gt[i]]
    print(f"greedy differs at (step, reference margin): {flips}; measured logit error {typical:.3e}")
    assert all(margin < typical for _, margin in flips)
    assert sum(a == b for a, b in zip(rt, gt)) >= 30


def test_column_slicer_builds_numba_s_view_in_constant_time():
    from numba import cuda

    from executor.numba_cuda.device import ColumnSlicer, device_pointer

    host = np.arange(7 * 40, dtype=np.float32).reshape(7, 40)
    array = cuda.to_device(host)  # a numba array (the backend's own arrays are LeanArrays)
    slicer = ColumnSlicer()
    first = slicer(array, 3, 17)  # checked against numba's slice, which it returns
    assert slicer.fast is True
    for lo, hi in ((0, 40), (3, 17), (39, 40), (12, 13)):
        view = slicer(array, lo, hi)
        want = array[:, lo:hi].__cuda_array_interface__
        assert {k: view.__cuda_array_interface__[k] for k in ("shape", "strides", "data")} == {
            k: want[k] for k in ("shape", "strides", "data")}
        np.testing.assert_array_equal(view.copy_to_host(), host[:, lo:hi])
        assert device_pointer(view) == want["data"][0]  # the fast pointer read GEMMs use
    np.testing.assert_array_equal(first.copy_to_host(), host[:, 3:17])


def test_lean_array_views_equal_numba_s_and_copy_the_same_bytes():
    from numba import cuda

    from executor.numba_cuda.device import POOL, LeanArray, empty, to_device

    host = np.arange(5 * 6 * 8, dtype=np.float32).reshape(5, 6, 8)
    numba_array = cuda.to_device(host)
    lean = to_device(host)
    assert isinstance(lean, LeanArray)
    assert isinstance(empty((3, 4), np.float32), LeanArray) == (POOL is not None)
    for key in ((slice(1, 4),), (2,), (slice(None), slice(2, 5)), (slice(None), 3, slice(1, 7)), (4, slice(0, 6), 0)):
        view, want = lean[key], numba_array[key]
        got_cai, want_cai = view.__cuda_array_interface__, want.__cuda_array_interface__
        assert got_cai["shape"] == want_cai["shape"] and got_cai["typestr"] == want_cai["typestr"]
        base = numba_array.__cuda_array_interface__["data"][0]  # two allocations: compare byte offsets
        assert got_cai["data"][0] - lean.ptr == want_cai["data"][0] - base
        assert tuple(view.strides) == tuple(want.strides)
        np.testing.assert_array_equal(view.copy_to_host(), host[key])
    flat = lean.reshape(lean.size)
    np.testing.assert_array_equal(flat.view(np.uint32).copy_to_host(), host.reshape(-1).view(np.uint32))
    other = empty((5, 6, 8), np.float32)
    other.copy_to_device(lean)  # device to device, LeanArray source
    np.testing.assert_array_equal(other.copy_to_host(), host)

    @cuda.jit
    def double(x):  # a plain numba kernel (no fast launch) takes a LeanArray through its CUDA array interface
        i = cuda.grid(1)
        if i < x.size:
            x[i] *= 2

    double[1, 256](flat)
    np.testing.assert_array_equal(lean.copy_to_host(), 2 * host)


def test_device_pool_reuses_a_block_only_after_every_view_is_gone():
    import gc

    from executor.numba_cuda import device

    if device.POOL is None:
        pytest.skip("WARMSTATE_DEVICE_POOL=0")
    a = device.empty((1000,), np.float32)
    first = device.device_pointer(a)
    view = a[10:]
    del a
    gc.collect()
    b = device.empty((1000,), np.float32)
    assert device.device_pointer(b) != first  # the view still holds the first block
    second = device.device_pointer(b)
    del view, b
    gc.collect()
    c, d = device.empty((1000,), np.float32), device.empty((1000,), np.float32)
    assert {device.device_pointer(c), device.device_pointer(d)} == {first, second}


@pytest.mark.xfail(reason="bf16 GEMM inputs alone move logits 0.4-2.9% on these models (LOGITS_TOL)", strict=False)
def test_logits_within_1e_2_and_greedy_equal_32_steps(models):
    errors, rt, gt = _teacher_forced(*models)
    assert max(errors) < 1e-2
    assert rt == gt


def _chunked(gpu, ids, cuts, tail_from=None):
    state = gpu.new_state()
    logits = None
    for a, b in zip(cuts, cuts[1:]):
        last = b == cuts[-1]
        logits = gpu.prefill(state, ids, (a, b), want_logits=last, tail_from=tail_from if last else None)
    packed = gpu.pool.pack(state.slot, state.rows).copy_to_host()
    gpu.release(state)
    return logits, packed


def _same(x, y):
    return all(np.array_equal(a, b) for a, b in zip(x, y))


def test_chunk_invariance_on_the_64_row_grid(models):
    _, gpu = models
    ids = _prompt(gpu.config, 300, 2)
    whole = _chunked(gpu, ids, [0, 300])
    for cuts in ([0, 64, 128, 300], [0, 256, 300], [0, 64, 192, 256, 300]):
        assert _same(whole, _chunked(gpu, ids, cuts)), cuts
    off_grid = _chunked(gpu, ids, [0, 100, 300])
    assert _same(off_grid, _chunked(gpu, ids, [0, 100, 128, 300]))


REAL_HEADS = small_config(
    hidden_size=256, intermediate_size=512, num_hidden_layers=2, layer_types=(LINEAR, FULL), num_attention_heads=16,
    num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, partial_rotary_factor=0.25,
)
"""The 9B's attention and linear-attention head shapes (16 q / 4 K/V heads of 256; 16 key /
32 value heads of 128) on a narrow two-layer model, for long-prompt invariance."""


@pytest.fixture(scope="module")
def real_heads(tmp_path_factory):
    path = random_checkpoint(REAL_HEADS, seed=11, out_dir=tmp_path_factory.mktemp("real-heads"))
    return NumbaCudaBackend(load_weights(path), slots=2, capacity_rows=20480)


def test_prefill_attention_runs_on_the_tensor_cores(models, real_heads):
    for gpu in (models[1], real_heads):
        assert gpu.prefill_attention == "flash", gpu.attention_failures
        assert gpu.matrix_attention.ready(gpu.config.head_dim), gpu.matrix_attention.failure  # the fallback
    print(f"pinned attention algorithms: {real_heads.matrix_attention.pinned}")


def test_prefill_delta_runs_on_the_tensor_cores(models, real_heads):
    for gpu in (models[1], real_heads):
        assert gpu.prefill_delta == "mma", gpu.delta_failures


def test_chunk_invariance_on_the_64_row_grid_with_the_cuda_core_delta_rule(monkeypatch, tmp_path):
    """The fallback delta rule (delta_chunked.py) keeps the grid invariance the backend claims."""
    monkeypatch.setenv(nb_backend.PREFILL_DELTA_ENV, "cuda-core")
    path = random_checkpoint(CONFIGS["tied-deep"], seed=3, out_dir=tmp_path)
    gpu = NumbaCudaBackend(load_weights(path), slots=4, capacity_rows=512)
    assert gpu.prefill_delta == "cuda-core"
    ids = _prompt(gpu.config, 300, 2)
    whole = _chunked(gpu, ids, [0, 300])
    for cuts in ([0, 64, 128, 300], [0, 256, 300]):
        assert _same(whole, _chunked(gpu, ids, cuts)), cuts


def test_chunk_invariance_long_prompts_at_real_head_shapes(real_heads):
    """Prompts up to 20K rows: one chunk vs three random plans with cuts on the 64-row grid
    (chunks up to 4096 rows, as the policy plans): the last row's logits and every state
    byte (K/V rows, recurrent matrix, conv tail) identical."""
    gpu = real_heads
    rng = np.random.default_rng(12)
    for rows in (20000, 7001):
        ids = _prompt(gpu.config, rows, rows)
        whole = _chunked(gpu, ids, [0, rows])
        last = (rows - 1) // 64 * 64
        for _ in range(3):
            cuts = [0]
            while cuts[-1] < last:
                cuts.append(min(cuts[-1] + 64 * int(rng.integers(1, 65)), last))
            cuts.append(rows)
            assert _same(whole, _chunked(gpu, ids, cuts)), cuts


def test_chunk_invariance_catches_a_planted_break(models, monkeypatch):
    _, gpu = models
    ids = _prompt(gpu.config, 200, 4)
    whole = _chunked(gpu, ids, [0, 200])
    real = nb_backend.conv.causal_conv1d_qkv
    planted = []

    def forgets_the_tail(x, row_start, slots, weight, tails, key_heads, key_dim, stream=0):
        tails.copy_to_device(np.zeros(tails.shape, tails.dtype))  # planted: the conv tail is not carried
        planted.append(x.shape[0])
        return real(x, row_start, slots, weight, tails, key_heads, key_dim, stream)

    monkeypatch.setattr(nb_backend.conv, "causal_conv1d_qkv", forgets_the_tail)
    assert not _same(whole, _chunked(gpu, ids, [0, 64, 200]))
    assert planted  # the break was in the path the backend runs


def test_tail_equals_full(models):
    _, gpu = models
    ids = _prompt(gpu.config, 300, 5)
    full = _chunked(gpu, ids, [0, 300])
    assert _same(full, _chunked(gpu, ids, [0, 300], tail_from=172))
    assert _same(full, _chunked(gpu, ids, [0, 256, 300], tail_from=299))


def test_tail_catches_a_planted_break(models, monkeypatch):
    _, gpu = models
    ids = _prompt(gpu.config, 300, 6)
    full = _chunked(gpu, ids, [0, 300])
    real = nb_backend.attention_prep.q_norm_rope

    def shifted(qg, weight, freqs, positions, *args, **kwargs):
        if qg.shape[0] < 300:  # planted: the tail's queries are rotated one row late
            positions = nb_backend.to_device(positions.copy_to_host() + 1)
        return real(qg, weight, freqs, positions, *args, **kwargs)

    monkeypatch.setattr(nb_backend.attention_prep, "q_norm_rope", shifted)
    assert not _same(full, _chunked(gpu, ids, [0, 300], tail_from=172))


def test_residual_accumulate_gives_the_separate_add_s_bits(models, monkeypatch):
    """Prefill's projections added into the residual stream by cuBLASLt's epilogue
    (`residual_accumulate`, on by default) give the last-row logits and every state byte of the
    product handed to the norm, over chunks, a tail from an off-grid row and one chunk of 16
    rows (a bucket's algorithm); every projection shape accumulated and none was refused."""
    _, gpu = models
    ids = _prompt(gpu.config, 300, 9)
    calls = []
    real = gpu.gemm.matmul

    def counted(*args, accumulate=False, **kwargs):
        calls.append(accumulate)
        return real(*args, accumulate=accumulate, **kwargs)

    plans = ([0, 300], [0, 64, 80, 300], [0, 256, 300])
    assert gpu.residual_accumulate
    monkeypatch.setattr(gpu.gemm, "matmul", counted)
    tails = [(cuts, tail) for cuts in plans for tail in (None, (cuts[-2] + cuts[-1]) // 2 + 1)]
    on = [_chunked(gpu, ids, cuts, tail_from=tail) for cuts, tail in tails]
    assert gpu.accumulate_refused == {} and calls.count(True) >= 3 * len(gpu.config.layer_types)
    monkeypatch.setattr(gpu, "residual_accumulate", False)
    calls.clear()
    off = [_chunked(gpu, ids, cuts, tail_from=tail) for cuts, tail in tails]
    assert True not in calls
    for a, b in zip(on, off):
        assert _same(a, b)


def test_bf16_products_give_the_f32_path_s_bits(real_heads, monkeypatch):
    """Prefill chunks of more than 1,024 rows take in_proj and gate|up in bf16 from cuBLASLt's
    epilogue (`bf16_products`, on by default): the last-row logits and every state byte equal
    the f32 products', which the conv, gates, gated norm and SwiGLU round themselves, over one
    chunk, a cut leaving a 1,236-row chunk and a 1,024-row chunk (f32 either way), with and
    without a tail."""
    gpu = real_heads
    ids = _prompt(gpu.config, 1300, 21)
    calls = []
    real = gpu.gemm.matmul
    in_proj_n = gpu.w.layers[0]["in_proj"].shape[0]

    def counted(x, w, *args, bf16=False, **kwargs):
        calls.append((bf16, "in_proj" if w.shape[0] == in_proj_n else "other"))
        return real(x, w, *args, bf16=bf16, **kwargs)

    plans = ([0, 1300], [0, 64, 1300], [0, 1024, 1300])
    assert gpu.bf16_products
    monkeypatch.setattr(gpu.gemm, "matmul", counted)
    tails = [(cuts, tail) for cuts in plans for tail in (None, 1290)]
    on = [_chunked(gpu, ids, cuts, tail_from=tail) for cuts, tail in tails]
    # the first two plans' long chunks: both layers' MLPs without a tail, the first layer's with one (the
    # last layer's MLP then runs the 10 tail rows, in f32); the linear layer's in_proj over every row. A
    # shape keeps a bf16 algorithm only if it timed no slower than f32 (tiny here: noise may decide)
    layer = gpu.w.layers[0]
    kept = {name: gpu.gemm.bf16_algo(*layer[name].shape) is not None for name in ("in_proj", "gate_up")}
    assert calls.count((True, "in_proj")) == 4 * kept["in_proj"], gpu.gemm.pinned
    assert calls.count((True, "other")) == (2 * 2 + 2 * 1) * kept["gate_up"], gpu.gemm.pinned
    if not any(kept.values()):
        print(f"no bf16 algorithm kept at these shapes, both runs f32: {gpu.gemm.pinned}")
    monkeypatch.setattr(gpu, "bf16_products", False)
    calls.clear()
    off = [_chunked(gpu, ids, cuts, tail_from=tail) for cuts, tail in tails]
    assert not any(bf16 for bf16, _ in calls)
    for a, b in zip(on, off):
        assert _same(a, b)


def _resumed_matches_fresh(gpu, ids, cut, steps=4):
    fresh = gpu.new_state()
    gpu.prefill(fresh, ids, (0, cut), want_logits=False)
    kept = gpu.snapshot(fresh)
    shape = ModelShape(
        linear_layers=len(gpu.config.linear_layers), attention_layers=len(gpu.config.full_layers),
        linear_num_key_heads=gpu.config.linear_num_key_heads, linear_key_head_dim=gpu.config.linear_key_head_dim,
        linear_num_value_heads=gpu.config.linear_num_value_heads, linear_value_head_dim=gpu.config.linear_value_head_dim,
        linear_conv_kernel_dim=gpu.config.linear_conv_kernel_dim, num_key_value_heads=gpu.config.num_key_value_heads,
        head_dim=gpu.config.head_dim,
    )
    assert gpu.payload_bytes(kept) == state_bytes(shape, cut) == gpu.config.state_bytes(cut)
    resumed = gpu.restore(kept)
    a = [gpu.prefill(fresh, ids, (cut, len(ids)))]
    b = [gpu.prefill(resumed, ids, (cut, len(ids)))]
    for _ in range(steps):
        a.append(gpu.decode([fresh], [int(np.argmax(a[-1]))])[0])
        b.append(gpu.decode([resumed], [int(np.argmax(b[-1]))])[0])
    gpu.release(fresh)
    gpu.release(resumed)
    return _same(a, b)


def test_resumed_equals_fresh(models):
    _, gpu = models
    ids = _prompt(gpu.config, 150, 7)
    assert _resumed_matches_fresh(gpu, ids, 100)
    assert _resumed_matches_fresh(gpu, ids, 128)


def test_resumed_catches_a_planted_break(models, monkeypatch):
    _, gpu = models
    ids = _prompt(gpu.config, 150, 8)
    real = gpu.pool.unpack_fixed

    def drops_recurrent(data, slot):
        real(data, slot)
        gpu.pool.recurrent[0, slot].copy_to_device(np.zeros(gpu.pool.recurrent[0, slot].shape, np.float32))

    monkeypatch.setattr(gpu.pool, "unpack_fixed", drops_recurrent)
    assert not _resumed_matches_fresh(gpu, ids, 100)


def _chain_resumes_exactly(gpu, ids, cuts, skip_segment=None):
    """Keeps at each cut, each built on the one below; the middle one made a ghost; the top
    one restored and continued, against the state that never stopped (logits of the rest of
    the prompt and 4 greedy steps). skip_segment: a planted break (restore drops it)."""
    c = gpu.config
    fresh = gpu.new_state()
    chain = []
    for a, b in zip([0, *cuts], cuts):
        gpu.prefill(fresh, ids, (a, b), want_logits=False)
        chain.append(gpu.snapshot(fresh, chain[-1] if chain else None))
    assert [(p.rows, p.kv_from) for p in chain] == [(b, a) for a, b in zip([0, *cuts], cuts)]
    assert [gpu.payload_bytes(p) for p in chain] == [c.state_bytes(b - a) for a, b in zip([0, *cuts], cuts)]
    ghost = gpu.ghost(chain[1])
    assert gpu.payload_bytes(ghost) == (cuts[1] - cuts[0]) * c.kv_bytes_per_row
    top = chain[-1]
    assert top.segments[1] is ghost.segments[1]  # shared, not copied
    chain = [chain[0], ghost, top]
    if skip_segment is not None:
        top = attrs.evolve(top, segments=top.segments[:skip_segment] + top.segments[skip_segment + 1:])
    resumed = gpu.restore(top)
    a = [gpu.prefill(fresh, ids, (cuts[-1], len(ids)))]
    b = [gpu.prefill(resumed, ids, (cuts[-1], len(ids)))]
    for _ in range(4):
        a.append(gpu.decode([fresh], [int(np.argmax(a[-1]))])[0])
        b.append(gpu.decode([resumed], [int(np.argmax(b[-1]))])[0])
    gpu.release(fresh)
    gpu.release(resumed)
    return _same(a, b)


def test_a_chain_of_keeps_resumes_exactly_through_a_ghost(models):
    """DESIGN rule 3 on the device: each payload holds its fixed part and the K/V rows above
    its base; restoring through a ghost equals never stopping, bit for bit."""
    _, gpu = models
    ids = _prompt(gpu.config, 300, 9)
    assert _chain_resumes_exactly(gpu, ids, [64, 150, 256])
    other = _prompt(gpu.config, 300, 10)  # the restored slot may hold rows of `ids` from the first run
    assert not _chain_resumes_exactly(gpu, other, [64, 150, 256], skip_segment=1)


def _decode_lanes(gpu, prompts, lanes_at_once, decode=None, with_states=False):
    """Logits [3 steps, lanes, vocab] of 3 decode rounds after prefilling each prompt (and,
    with_states, every lane's packed state bytes after them)."""
    decode = decode or gpu.decode
    states = []
    for ids in prompts:
        s = gpu.new_state()
        gpu.prefill(s, ids, (0, len(ids)), want_logits=False)
        states.append(s)
    out = []
    for step in range(3):
        tokens = [(7 * lane + step) % gpu.config.vocab_size for lane in range(len(states))]
        rows = []
        for g in range(0, len(states), lanes_at_once):
            rows.append(decode(states[g : g + lanes_at_once], tokens[g : g + lanes_at_once]))
            # the device's greedy pick of each lane (greedy.argmax_rows) is the host's argmax
            assert [s.greedy for s in states[g : g + lanes_at_once]] == np.argmax(rows[-1], axis=1).tolist()
        out.append(np.concatenate(rows))
    packed = [gpu.pool.pack(s.slot, s.rows).copy_to_host() for s in states] if with_states else None
    for s in states:
        gpu.release(s)
    return (np.stack(out), packed) if with_states else np.stack(out)


@pytest.mark.parametrize("lanes", [1, 2, 7, 16])
def test_concurrent_equals_solo(models, lanes):
    _, gpu = models
    prompts = [_prompt(gpu.config, 20 + 37 * i, 100 + i) for i in range(lanes)]
    together = _decode_lanes(gpu, prompts, lanes)
    solo = _decode_lanes(gpu, prompts, 1)
    np.testing.assert_array_equal(together, solo)


def test_concurrent_catches_a_planted_break(models, monkeypatch):
    _, gpu = models
    prompts = [_prompt(gpu.config, 60 + 37 * i, 200 + i) for i in range(4)]
    solo = _decode_lanes(gpu, prompts, 1)
    real = nb_backend.gemv

    def batched_to_cublas(x, weight, out=None, stream=0):
        if x.shape[0] > 1:  # planted: a batch of lanes goes to cuBLAS, a solo lane to the GEMV
            return gpu.gemm.matmul(x, weight, out, stream)
        return real(x, weight, out, stream)

    monkeypatch.setattr(nb_backend, "gemv", batched_to_cublas)
    assert not np.array_equal(_decode_lanes(gpu, prompts, 4), solo)


@pytest.mark.parametrize("lanes", [1, 3, 16])
def test_decode_graphs_equal_eager(models, lanes):
    """Replayed CUDA graphs give the eager decode's logits and states bit for bit."""
    _, gpu = models
    prompts = [_prompt(gpu.config, 20 + 37 * i, 300 + i) for i in range(lanes)]
    eager, eager_states = _decode_lanes(gpu, prompts, lanes, with_states=True)
    graphs = DecodeGraphs(gpu)
    try:
        replayed, replayed_states = _decode_lanes(gpu, prompts, lanes, decode=graphs.decode, with_states=True)
    finally:
        graphs.close()
    np.testing.assert_array_equal(eager, replayed)
    assert _same(eager_states, replayed_states)


def test_decode_graphs_of_two_lane_counts_share_a_pool_and_stay_exact(models):
    """Seven lanes in rounds of 3, 3 and 1: graphs of two lane counts replayed in turn, their
    buffers from one private pool (blocks one graph's capture gave back, the other's took),
    give the eager rounds' logits and states bit for bit."""
    _, gpu = models
    prompts = [_prompt(gpu.config, 25 + 19 * i, 700 + i) for i in range(7)]
    eager, eager_states = _decode_lanes(gpu, prompts, 3, with_states=True)
    graphs = DecodeGraphs(gpu)
    try:
        replayed, replayed_states = _decode_lanes(gpu, prompts, 3, decode=graphs.decode, with_states=True)
        assert set(graphs._graphs) == {1, 3}
        assert graphs.pool.hits > 0 and graphs.pool.cached_bytes > 0  # blocks given back and taken again
    finally:
        graphs.close()
    np.testing.assert_array_equal(eager, replayed)
    assert _same(eager_states, replayed_states)


def test_prefill_logits_are_read_only_and_keeps_and_restores_share_them(models):
    """A prefill's logits come back read-only, the state's own; a snapshot and its restore
    share that array instead of copying it (executor.backend.frozen_logits)."""
    _, gpu = models
    state = gpu.new_state()
    try:
        logits = gpu.prefill(state, _prompt(gpu.config, 40, 900), (0, 40))
        assert not logits.flags.writeable and np.shares_memory(logits, state.logits)
        kept = gpu.snapshot(state)
        assert kept.logits is state.logits
        restored = gpu.restore(kept)
        assert restored.logits is kept.logits
        assert state.greedy == int(np.argmax(logits)) and restored.greedy is None  # restored: the host picks
        gpu.release(restored)
    finally:
        gpu.release(state)


@pytest.mark.parametrize("graphs", [False, True])
def test_decode_logits_are_one_read_only_copy(models, graphs):
    """A round's host logits come back read-only and each state keeps a view of its row
    (`advance`: no second copy), equal to the returned row; a snapshot copies it."""
    _, gpu = models
    states = [gpu.new_state() for _ in range(3)]
    replay = DecodeGraphs(gpu) if graphs else None
    try:
        for i, state in enumerate(states):
            gpu.prefill(state, _prompt(gpu.config, 20 + i, 500 + i), (0, 20 + i))
        logits = (replay.decode if graphs else gpu.decode)(states, [1, 2, 3])
        assert not logits.flags.writeable
        for lane, state in enumerate(states):
            assert np.shares_memory(state.logits, logits)
            np.testing.assert_array_equal(state.logits, logits[lane])
        kept = gpu.snapshot(states[1]).logits
        assert not np.shares_memory(kept, logits) and np.array_equal(kept, logits[1])
    finally:
        if replay is not None:
            replay.close()
        for state in states:
            gpu.release(state)


def test_decode_graphs_catch_a_planted_break(models, monkeypatch):
    """Planted: the capture's recording run is not undone, so the first round is applied twice."""
    _, gpu = models
    prompts = [_prompt(gpu.config, 30 + 11 * i, 400 + i) for i in range(2)]
    eager = _decode_lanes(gpu, prompts, 2)
    monkeypatch.setattr(gpu.pool, "unpack", lambda data, slot, rows: None)
    graphs = DecodeGraphs(gpu)
    try:
        assert not np.array_equal(eager, _decode_lanes(gpu, prompts, 2, decode=graphs.decode))
    finally:
        graphs.close()


def test_facts_claim_the_grid_these_tests_prove(models):
    _, gpu = models
    assert INVARIANT_ROWS == 64
    assert gpu.facts == BackendFacts(invariant_rows=64)
    assert "test_chunk_invariance_on_the_64_row_grid" in NumbaCudaBackend.facts.__doc__


def test_fast_launches_give_numba_s_bits(models):
    """Every kernel of a prefill (two chunks, the second reading logits) and of decode rounds
    takes the fast launch path (launch.py: no signature rejected by its byte check against
    numba's own `_prepare_args`), and the logits and states equal those of numba's launches."""
    from executor.numba_cuda import launch

    if not launch.ENABLED:
        pytest.skip("WARMSTATE_FAST_LAUNCH=0")
    _, gpu = models
    prompts = [_prompt(gpu.config, 70 + 45 * i, 500 + i) for i in range(3)]
    before = {id(k): k.fast_launches for k in launch.KERNELS}
    fast, fast_states = _decode_lanes(gpu, prompts, 3, with_states=True)
    # kernels made during this call (factories compile on first use) count from zero
    used = [k.name for k in launch.KERNELS if k.fast_launches > before.get(id(k), 0)]
    rejected = {k.name: k.rejected for k in launch.KERNELS if k.rejected}
    assert not rejected
    from executor.numba_cuda import norms

    fused_norm = norms.fused_unavailable(gpu.config.hidden_size, norms.PREFILL_NORM_THREADS) is None
    expected = ["_embed_kernel", "fused_add_rms_norm" if fused_norm else "_add_rms_norm_kernel", "_conv_kernel",
                "_swiglu4_kernel", "_kv_kernel", "kernel", "_gated_rms_norm_kernel", "_gates_kernel"]
    if gpu.prefill_attention == "flash" and FULL in gpu.config.layer_types[:-1]:  # the last layer's q is skipped here
        expected.append("flash_kernel")
    if gpu.prefill_delta == "mma":
        expected += ["delta_prepare", "delta_walk"]
    for name in expected:
        assert name in used, f"{name} never launched fast: {sorted(set(used))}"
    with launch.numba_launches():
        slow, slow_states = _decode_lanes(gpu, prompts, 3, with_states=True)
    np.testing.assert_array_equal(fast, slow)
    assert _same(fast_states, slow_states)


@pytest.mark.parametrize(("preset_name", "matrix"), [("qwen3.5-27b", "down"), ("qwen3.5-2b", "in_proj"),
                                                   ("qwen3.5-27b", "kv_proj"), ("qwen3.5-2b", "down")])
def test_gemm_rows_are_the_reference_algorithm_s_at_every_row_count(preset_name, matrix):
    """The per-range algorithms (gemm.RANGES: short buckets from the wide pool, and the range
    past them, timed at LARGE_ROWS) give every row the bits of the reference algorithm's M = 4100
    product, at every row count of the short-chunk buckets, at row counts inside, between and at
    the larger buckets' edges, and past them. (27B down and kv_proj, 2B down: the shapes whose
    wide-pool algorithm at 51 rows was 1.6-2.6x faster than the heuristic's own in session 17.)"""
    from executor.numba_cuda.device import empty, to_device
    from executor.numba_cuda.device_weights import matrix_shapes
    from executor.numba_cuda.gemm import BUCKET_CANDIDATES, LARGE_ROWS, RANGES, Gemm
    from executor.presets import preset

    n, k = (matrix_shapes(preset(preset_name), LINEAR) | matrix_shapes(preset(preset_name), FULL))[matrix]
    rng = np.random.default_rng(7)
    bits = lambda shape: (rng.standard_normal(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
    x, w = bits((4100, k)), to_device(bits((n, k)))
    gemm = Gemm()
    gemm.large = True  # the search runs whatever WARMSTATE_GEMM_LARGE says
    reference = empty((4100, n), np.float32)
    gemm._run(gemm.pin(n, k), to_device(x), w, reference)
    full = reference.copy_to_host()
    buckets = gemm.pinned[(n, k)]["buckets"]
    assert len(buckets) == len(RANGES) and buckets[-1]["rows"] == [RANGES[-1][0], None], buckets[-1]
    assert buckets[-1]["timed_at"] == LARGE_ROWS and buckets[-1]["candidates"] >= 1, buckets[-1]  # it searched
    assert buckets[1]["candidates"] > BUCKET_CANDIDATES, buckets[1]  # the wide pool asked more than one shape
    for m in (*range(1, 65), 65, 100, 255, 256, 257, 500, 1023, 1024, 1025, 1100, 2048, 4099, 4100):
        part = gemm.matmul(to_device(x[-m:]), w).copy_to_host()
        assert np.array_equal(part, full[-m:]), f"rows differ at M={m}"


def test_payloads_from_reserved_cache_memory_resume_exactly_and_free(models):
    """reserve_cache: payload buffers come from the stream-ordered pool (exact sizes, counted
    in held_bytes), restores stay exact, and a dropped payload's memory goes back."""
    _, gpu = models
    got = gpu.reserve_cache(256 << 20, headroom_bytes=0)
    memory = gpu.pool.memory
    assert got == 256 << 20 and memory is not None and memory.reserved_bytes == 256 << 20
    ids = _prompt(gpu.config, 300, 11)
    assert _chain_resumes_exactly(gpu, ids, [64, 150, 256])
    state = gpu.new_state()
    gpu.prefill(state, ids, (0, 200), want_logits=False)
    before = memory.held_bytes
    kept = gpu.snapshot(state)
    assert memory.held_bytes - before == gpu.payload_bytes(kept) == gpu.config.state_bytes(200)
    resumed = gpu.restore(kept)
    np.testing.assert_array_equal(gpu.pool.pack(resumed.slot, 200).copy_to_host(),
                                  gpu.pool.pack(state.slot, 200).copy_to_host())
    del kept
    assert memory.held_bytes == before
    gpu.release(state)
    gpu.release(resumed)
    memory.trim()  # unused memory back to the device; the module's later tests use device.POOL
    gpu.pool.memory = None
