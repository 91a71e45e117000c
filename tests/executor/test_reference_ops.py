"""Each reference op against its transformers twin (torch float32) and against itself
(chunked vs whole, chunked vs recurrent)."""

from __future__ import annotations

import numpy as np
import pytest

from executor.reference import ops
from tests.helpers import assert_close

torch = pytest.importorskip("torch")
qm = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

T = torch.from_numpy


def _rng(seed=0):
    return np.random.default_rng(seed)


def _delta_inputs(rows, key_heads=2, value_heads=4, key_dim=16, value_dim=8, seed=0, strong_memory=True):
    rng = _rng(seed)
    q = ops.l2_normalize(rng.standard_normal((rows, key_heads, key_dim)).astype(np.float32))
    k = ops.l2_normalize(rng.standard_normal((rows, key_heads, key_dim)).astype(np.float32))
    v = rng.standard_normal((rows, value_heads, value_dim)).astype(np.float32)
    a = rng.standard_normal((rows, value_heads)).astype(np.float32)
    b = rng.standard_normal((rows, value_heads)).astype(np.float32)
    a_log = np.log(rng.uniform(0.01, 0.2 if strong_memory else 8.0, value_heads)).astype(np.float32)
    dt_bias = rng.standard_normal(value_heads).astype(np.float32)
    g, beta = ops.delta_gates(a, b, a_log, dt_bias)
    state = (0.1 * rng.standard_normal((value_heads, key_dim, value_dim))).astype(np.float32)
    return q, k, v, g, beta, state, (a, b, a_log, dt_bias)


def test_delta_gates_match_transformers():
    *_, (a, b, a_log, dt_bias) = _delta_inputs(37)
    g, beta = ops.delta_gates(a, b, a_log, dt_bias)
    g_ref = -T(a_log).float().exp() * torch.nn.functional.softplus(T(a).float() + T(dt_bias))
    assert_close("g", g_ref.numpy(), g, 1e-6, rel=True)
    assert_close("beta", T(b).sigmoid().numpy(), beta, 1e-6)
    big = np.array([[25.0, -30.0, 0.0, 19.9]], np.float32)
    assert_close("softplus", torch.nn.functional.softplus(T(big)).numpy(), ops.softplus(big), 1e-6)


@pytest.mark.parametrize("rows", [1, 63, 64, 65, 130], ids=lambda r: f"rows{r}")
def test_gated_delta_rule_chunked_matches_transformers(rows):
    q, k, v, g, beta, state, _ = _delta_inputs(rows, seed=rows)
    out, new_state = ops.gated_delta_rule_chunked(q, k, v, g, beta, state, 0)
    args = [T(x)[None] for x in (q, k, v, g, beta)]
    ref_out, ref_state = qm.torch_chunk_gated_delta_rule(
        *args[:3], g=args[3], beta=args[4], initial_state=T(state)[None], output_final_state=True
    )
    assert_close("out", ref_out[0].numpy(), out, 1e-5, rel=True)
    assert_close("state", ref_state[0].numpy(), new_state, 1e-5, rel=True)
    rec_out, rec_state = qm.torch_recurrent_gated_delta_rule(
        *args[:3], g=args[3], beta=args[4], initial_state=T(state)[None], output_final_state=True
    )
    assert_close("out vs recurrent", rec_out[0].numpy(), out, 1e-5, rel=True)
    assert_close("state vs recurrent", rec_state[0].numpy(), new_state, 1e-5, rel=True)


def test_gated_delta_rule_step_equals_chunked():
    q, k, v, g, beta, state, _ = _delta_inputs(70, seed=3)
    out, final = ops.gated_delta_rule_chunked(q, k, v, g, beta, state, 0)
    s = state[None]
    steps = []
    for t in range(70):
        o, s = ops.gated_delta_rule_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)
        steps.append(o[0])
    assert_close("outputs", out, np.stack(steps), 1e-5, rel=True)
    assert_close("state", final, s[0], 1e-5, rel=True)


def test_gated_delta_rule_lanes_are_independent():
    q, k, v, g, beta, state, _ = _delta_inputs(3, seed=4)
    lanes = np.stack([state, 2 * state, -state])
    out, new = ops.gated_delta_rule_step(q, k, v, g, beta, lanes)
    for lane in range(3):
        o, s = ops.gated_delta_rule_step(
            q[lane : lane + 1],
            k[lane : lane + 1],
            v[lane : lane + 1],
            g[lane : lane + 1],
            beta[lane : lane + 1],
            lanes[lane : lane + 1],
        )
        assert np.array_equal(o[0], out[lane]) and np.array_equal(s[0], new[lane])


def test_gated_delta_rule_subchunks_anchor_on_absolute_rows():
    """Cuts on multiples of 64 give identical bits; other cuts agree to tolerance."""
    q, k, v, g, beta, state, _ = _delta_inputs(200, seed=5)
    whole, whole_state = ops.gated_delta_rule_chunked(q, k, v, g, beta, state, 0)

    def run(cuts):
        s, outs = state, []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            o, s = ops.gated_delta_rule_chunked(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], s, lo)
            outs.append(o)
        return np.concatenate(outs), s

    grid_out, grid_state = run([0, 64, 192, 200])
    assert np.array_equal(grid_out, whole) and np.array_equal(grid_state, whole_state)
    odd_out, odd_state = run([0, 1, 100, 129, 200])
    assert_close("odd cuts", whole, odd_out, 1e-5, rel=True)
    assert_close("odd cuts state", whole_state, odd_state, 1e-5, rel=True)


def test_causal_conv1d_matches_transformers_and_chunks():
    rng = _rng(1)
    x = rng.standard_normal((40, 12)).astype(np.float32)
    w = rng.standard_normal((12, 4)).astype(np.float32)
    tail0 = np.zeros((3, 12), np.float32)
    out, tail = ops.causal_conv1d(x, tail0, w)
    ref = qm.causal_conv1d_fn(T(x.T.copy())[None], T(w), None, activation="silu")[0].numpy().T
    assert_close("conv", ref, out, 1e-5, rel=True)
    assert np.array_equal(tail, x[-3:])
    parts, t = [], tail0
    for lo, hi in [(0, 1), (1, 2), (2, 17), (17, 40)]:
        o, t = ops.causal_conv1d(x[lo:hi], t, w)
        parts.append(o)
    assert_close("chunked conv", out, np.concatenate(parts), 1e-6, rel=True)
    assert np.array_equal(t, tail)


def test_norms_match_transformers():
    rng = _rng(2)
    x = (3 * rng.standard_normal((5, 3, 16))).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)
    norm = qm.Qwen3_5RMSNorm(16, eps=1e-6)
    norm.weight.data = T(w)
    with torch.no_grad():
        assert_close("rms_norm", norm(T(x)).numpy(), ops.rms_norm(x, w, 1e-6), 1e-6, rel=True)
        gate = rng.standard_normal((5, 3, 16)).astype(np.float32)
        gated = qm.Qwen3_5RMSNormGated(16, eps=1e-6)
        gated.weight.data = T(w)
        ref = gated(T(x.reshape(-1, 16)), T(gate.reshape(-1, 16))).numpy().reshape(5, 3, 16)
    assert_close("gated_rms_norm", ref, ops.gated_rms_norm(x, gate, w, 1e-6), 1e-6, rel=True)
    assert_close("l2", qm.l2norm(T(x)).numpy(), ops.l2_normalize(x), 1e-6)


@pytest.mark.parametrize("rotary_dim", [8, 64, 32])
def test_rope_matches_transformers(rotary_dim):
    rng = _rng(3)
    head_dim = 64
    x = rng.standard_normal((9, 2, head_dim)).astype(np.float32)
    positions = np.arange(100, 109)
    theta = 10_000_000.0
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    ang = torch.tensor(positions, dtype=torch.float64)[:, None] * inv
    emb = torch.cat([ang, ang], dim=-1)
    q_ref, _ = qm.apply_rotary_pos_emb(
        T(x).double().transpose(0, 1)[None], T(x).double().transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
    )
    out = ops.rope(x, positions, theta, rotary_dim)
    assert_close("rope", q_ref[0].transpose(0, 1).numpy(), out, 1e-6, rel=True)
    assert np.array_equal(out[..., rotary_dim:], x[..., rotary_dim:])


def _attention_inputs(rng, total, start, heads, kv_heads, d):
    """Random f32 q [total - start, heads, d] and k, v [total, kv_heads, d] (drawn in that order)."""
    q = rng.standard_normal((total - start, heads, d)).astype(np.float32)
    k = rng.standard_normal((total, kv_heads, d)).astype(np.float32)
    v = rng.standard_normal((total, kv_heads, d)).astype(np.float32)
    return q, k, v


def test_attention_matches_eager_with_offset():
    rng = _rng(4)
    total, start, heads, kv_heads, d = 20, 12, 6, 2, 8
    q, k, v = _attention_inputs(rng, total, start, heads, kv_heads, d)
    out = ops.attention(q, k, v, start)

    class M:
        num_key_value_groups = heads // kv_heads
        training = False

    mask = torch.full((total - start, total), float("-inf"))
    for i in range(total - start):
        mask[i, : start + i + 1] = 0.0
    ref, _ = qm.eager_attention_forward(
        M(),
        T(q).transpose(0, 1)[None],
        T(k).transpose(0, 1)[None],
        T(v).transpose(0, 1)[None],
        mask[None, None],
        scaling=d**-0.5,
    )
    assert_close("attention", ref[0].numpy(), out, 1e-5, rel=True)


def test_attention_past_the_score_budget_runs_in_absolute_row_blocks(monkeypatch):
    """A chunk whose scores pass ATTENTION_SCORE_BYTES runs its query rows in blocks on absolute
    multiples of ATTENTION_BLOCK_ROWS: each block's rows are exactly that block run alone, and the
    whole agrees with the one-pass softmax to float32 rounding. (A 32K-row prompt on the tiny
    server asked 16 GiB of scores at once and failed with MemoryError.)"""
    rng = _rng(11)
    total, start, heads, kv_heads, d = 150, 37, 4, 2, 8
    q, k, v = _attention_inputs(rng, total, start, heads, kv_heads, d)
    whole = ops.attention(q, k, v, start)
    monkeypatch.setattr(ops, "ATTENTION_SCORE_BYTES", 0)
    monkeypatch.setattr(ops, "ATTENTION_BLOCK_ROWS", 32)
    blocked = ops.attention(q, k, v, start)
    assert blocked.dtype == np.float32 and blocked.shape == whole.shape
    for a, b in ((37, 64), (64, 96), (96, 128), (128, 150)):  # the blocks: cut at rows 64, 96, 128
        assert np.array_equal(blocked[a - start:b - start], ops._attention_block(q[a - start:b - start], k, v, a))
    np.testing.assert_allclose(blocked, whole, rtol=1e-6, atol=1e-6)
    assert np.array_equal(whole, ops._attention_block(q, k, v, start))  # under the budget: one pass, as before

def test_split_query_gate_and_output_gate():
    rng = _rng(5)
    heads, d = 3, 4
    x = rng.standard_normal((2, heads * 2 * d)).astype(np.float32)
    q, gate = ops.split_query_gate(x, heads, d)
    q_ref, g_ref = torch.chunk(T(x).view(2, -1, d * 2), 2, dim=-1)
    assert np.array_equal(q, q_ref.numpy()) and np.array_equal(gate, g_ref.reshape(2, -1).numpy())
    o = rng.standard_normal((2, heads * d)).astype(np.float32)
    assert_close("gate", (T(o) * torch.sigmoid(T(gate))).numpy(), ops.sigmoid_gate(o, gate), 1e-6)


def test_swiglu_and_log_softmax():
    rng = _rng(6)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    wg, wu = rng.standard_normal((2, 16, 8)).astype(np.float32)
    wd = rng.standard_normal((8, 16)).astype(np.float32)
    ref = (torch.nn.functional.silu(T(x) @ T(wg).T) * (T(x) @ T(wu).T)) @ T(wd).T
    assert_close("mlp", ref.numpy(), ops.swiglu_mlp(x, wg, wu, wd), 1e-5, rel=True)
    logits = (10 * rng.standard_normal(50)).astype(np.float32)
    assert_close("log_softmax", torch.log_softmax(T(logits).double(), -1).numpy(), ops.log_softmax(logits), 1e-12)
