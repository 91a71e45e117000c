"""NumPy reference ops of the Qwen3.5 text forward: one function per op.

These are the twins the GPU kernels in `executor/numba_cuda/` are tested against, so
their names, argument order and shapes are a contract: do not change them. Inputs and
outputs are float32; reductions, softmax and the gated delta rule run in float64 where
it matters. Model wiring (which op feeds which) lives in `executor/reference/backend.py`.

Source for every op: transformers 5.x `models/qwen3_5/modeling_qwen3_5.py`
(Qwen3_5RMSNorm, Qwen3_5RMSNormGated, causal_conv1d_fn/update, l2norm,
torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule, Qwen3_5GatedDeltaNet,
apply_rotary_pos_emb, eager_attention_forward, Qwen3_5Attention, Qwen3_5MLP).
"""

from __future__ import annotations

import numpy as np

DELTA_SUBCHUNK_ROWS = 64
"""Sub-chunk length of the chunked gated delta rule; sub-chunks start at absolute rows
that are multiples of this (see `gated_delta_rule_chunked`)."""

_F32 = np.float32
_F64 = np.float64


def _sigmoid64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=_F64)
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU x * sigmoid(x), elementwise; float32 out (computed in float64)."""
    x64 = np.asarray(x, dtype=_F64)
    return (x64 * _sigmoid64(x64)).astype(_F32)


def softplus(x: np.ndarray) -> np.ndarray:
    """torch.nn.functional.softplus with beta=1, threshold=20: x where x > 20, else
    log(1 + exp(x)); float32 out (computed in float64)."""
    x64 = np.asarray(x, dtype=_F64)
    return np.where(x64 > 20.0, x64, np.log1p(np.exp(np.minimum(x64, 20.0)))).astype(_F32)


def embed(token_ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Token embedding lookup.

    token_ids: int  # [rows]
    table: float32  # [vocab, hidden]
    returns: float32  # [rows, hidden]
    """
    return np.ascontiguousarray(table[np.asarray(token_ids, dtype=np.int64)], dtype=_F32)


def linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """y = x @ weight.T (no bias: Qwen3.5 text layers have none). float32 GEMM.

    x: float32  # [rows, in_features]
    weight: float32  # [out_features, in_features]  (the checkpoint layout)
    returns: float32  # [rows, out_features]
    """
    return np.matmul(np.asarray(x, dtype=_F32), np.asarray(weight, dtype=_F32).T)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Zero-centred RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + weight).

    Used for input_layernorm, post_attention_layernorm, the final norm and QK-norm
    (over the last axis). Source: Qwen3_5RMSNorm (weight initialised to 0).
    x: float32  # [..., dim]
    weight: float32  # [dim]
    returns: float32  # [..., dim]
    """
    x64 = np.asarray(x, dtype=_F64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    normed = (x64 * inv).astype(_F32)
    return (normed * (_F32(1.0) + np.asarray(weight, dtype=_F32))).astype(_F32)


def gated_rms_norm(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Gated RMSNorm of the linear-attention output: norm(x) * weight * silu(gate).

    Plain weight (not 1 + weight; initialised to 1). Source: Qwen3_5RMSNormGated.
    x: float32  # [rows, value_heads, value_dim]
    gate: float32  # [rows, value_heads, value_dim]  (in_proj_z output)
    weight: float32  # [value_dim]
    returns: float32  # [rows, value_heads, value_dim]
    """
    x64 = np.asarray(x, dtype=_F64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    normed = (x64 * inv).astype(_F32) * np.asarray(weight, dtype=_F32)
    return (normed.astype(_F64) * np.asarray(gate, dtype=_F64) * _sigmoid64(gate)).astype(_F32)


def causal_conv1d(x: np.ndarray, tail: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv over rows followed by SiLU, with a carried tail.

    out[t, c] = silu(sum_j weight[c, j] * xp[t + j, c]) where xp = concat(tail, x) and
    j runs over the kernel. The tail holds the previous kernel - 1 input rows (zeros
    before row 0), so conv over chunks equals conv over the whole prompt. Decode is the
    same call with one row. Source: causal_conv1d_fn / causal_conv1d_update.
    x: float32  # [rows, channels]  (in_proj_qkv output, channels = 2 * key_dim + value_dim)
    tail: float32  # [kernel - 1, channels]
    weight: float32  # [channels, kernel]  (conv1d.weight squeezed from [channels, 1, kernel])
    returns: (out float32  # [rows, channels],
              new_tail float32  # [kernel - 1, channels]: the last kernel - 1 rows of xp)
    """
    x = np.asarray(x, dtype=_F32)
    kernel = weight.shape[1]
    xp = np.concatenate([np.asarray(tail, dtype=_F32), x], axis=0).astype(_F64)
    rows = x.shape[0]
    acc = np.zeros((rows, x.shape[1]), dtype=_F64)
    w64 = np.asarray(weight, dtype=_F64)
    for j in range(kernel):
        acc += xp[j : j + rows] * w64[:, j]
    out = (acc * _sigmoid64(acc)).astype(_F32)
    new_tail = xp[xp.shape[0] - (kernel - 1) :].astype(_F32)
    return out, np.ascontiguousarray(new_tail)


def l2_normalize(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis (FLA / transformers `l2norm`).

    x: float32  # [rows, heads, dim]
    returns: float32  # [rows, heads, dim]
    """
    x64 = np.asarray(x, dtype=_F64)
    return (x64 / np.sqrt(np.sum(x64 * x64, axis=-1, keepdims=True) + eps)).astype(_F32)


def delta_gates(a: np.ndarray, b: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decay and write strength of the gated delta rule.

    g = -exp(A_log) * softplus(a + dt_bias)   (log decay, <= 0)
    beta = sigmoid(b)
    a: float32  # [rows, value_heads]  (in_proj_a output)
    b: float32  # [rows, value_heads]  (in_proj_b output)
    a_log, dt_bias: float32  # [value_heads]
    returns: (g float32  # [rows, value_heads], beta float32  # [rows, value_heads])
    """
    sp = softplus(np.asarray(a, dtype=_F32) + np.asarray(dt_bias, dtype=_F32)).astype(_F64)
    g = (-np.exp(np.asarray(a_log, dtype=_F64)) * sp).astype(_F32)
    beta = _sigmoid64(b).astype(_F32)
    return g, beta


def random_delta_inputs(r: np.random.Generator, rows: int, key_heads: int, value_heads: int, key_dim: int,
                        value_dim: int) -> tuple[np.ndarray, ...]:
    """Random inputs of a prefill delta rule as `gated_delta_rule_chunked` takes them, drawn from `r` in
    a fixed order (tests and bench/delta_walk.py share it, so a seed names the same inputs and digests
    in both): q, k (L2-normalised, unscaled) f32 [rows, key_heads, key_dim], v f32 [rows, value_heads,
    value_dim], g and beta f32 [rows, value_heads] (`delta_gates` of random a, b, a_log, dt_bias)."""
    q = l2_normalize(r.normal(size=(rows, key_heads, key_dim)).astype(np.float32))
    k = l2_normalize(r.normal(size=(rows, key_heads, key_dim)).astype(np.float32))
    v = r.normal(size=(rows, value_heads, value_dim)).astype(np.float32)
    a, b = r.normal(size=(2, rows, value_heads)).astype(np.float32)
    a_log = np.log(r.uniform(0.05, 1.5, value_heads)).astype(np.float32)
    dt_bias = r.normal(0, 0.5, value_heads).astype(np.float32)
    g, beta = delta_gates(a, b, a_log, dt_bias)
    return q, k, v, g.astype(np.float32), beta.astype(np.float32)


def _repeat_key_heads(x64: np.ndarray, value_heads: int) -> np.ndarray:
    """Value head h reads key head h // (value_heads // key_heads) (repeat_interleave)."""
    key_heads = x64.shape[-2]
    if value_heads % key_heads:
        raise ValueError(f"value_heads {value_heads} is not a multiple of key_heads {key_heads}")
    return np.repeat(x64, value_heads // key_heads, axis=-2)


def _delta_subchunk(q, k, v, g, beta, state):
    """One sub-chunk of the chunked gated delta rule, float64 inside.

    q, k: [C, H, K] (q already scaled), v: [C, H, V], g, beta: [C, H], state: [H, K, V].
    Returns out [C, H, V] float64 and the new state [H, K, V] float64.
    """
    q, k, v = (np.transpose(t, (1, 0, 2)) for t in (q, k, v))  # [H, C, *]
    g, beta = g.T, beta.T  # [H, C]
    rows = q.shape[1]
    cum = np.cumsum(g, axis=1)  # [H, C]
    diff = cum[:, :, None] - cum[:, None, :]  # [H, C, C]: cum_i - cum_j
    lower_incl = np.tril(np.ones((rows, rows), dtype=bool))
    decay = np.where(lower_incl, np.exp(np.where(lower_incl, diff, 0.0)), 0.0)
    k_beta = k * beta[:, :, None]
    v_beta = v * beta[:, :, None]
    strict = np.tril(np.ones((rows, rows), dtype=bool), -1)
    lower = np.where(strict, (k_beta @ np.transpose(k, (0, 2, 1))) * decay, 0.0)
    system = np.eye(rows) + lower  # unit lower triangular
    u = np.linalg.solve(system, v_beta)  # [H, C, V]
    w = np.linalg.solve(system, k_beta * np.exp(cum)[:, :, None])  # [H, C, K]
    v_new = u - w @ state  # [H, C, V]
    inter = (q * np.exp(cum)[:, :, None]) @ state  # [H, C, V]
    intra = (q @ np.transpose(k, (0, 2, 1))) * decay  # [H, C, C], diagonal included
    out = inter + intra @ v_new
    last = cum[:, -1]  # [H]
    k_decayed = k * np.exp(last[:, None] - cum)[:, :, None]  # [H, C, K]
    new_state = state * np.exp(last)[:, None, None] + np.transpose(k_decayed, (0, 2, 1)) @ v_new
    return np.transpose(out, (1, 0, 2)), new_state


def gated_delta_rule_chunked(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray,
    start_row: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Gated delta rule over a prefill chunk of rows [start_row, start_row + rows).

    Recurrence (per value head h, state S of shape [key_dim, value_dim]):
        S_t = exp(g_t) * S_{t-1}
        S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T
        o_t = S_t^T (q_t / sqrt(key_dim))
    q and k must already be L2-normalised (`l2_normalize`); the 1/sqrt(key_dim) query
    scale is applied here. Value head h reads key head h // (value_heads // key_heads).

    Chunked form (the UT transform of DeltaNet, as in transformers'
    torch_chunk_gated_delta_rule / FLA chunk_gated_delta_rule): within a sub-chunk with
    cumulative log decay c_i, L = strict_lower((beta_i k_i . k_j) exp(c_i - c_j)),
    u = (I + L)^-1 (beta v), w = (I + L)^-1 (beta k exp(c)), v' = u - w S,
    o = (q exp(c)) S + (lower_incl((q_i . k_j) exp(c_i - c_j))) v',
    S' = exp(c_last) S + (k exp(c_last - c))^T v'.
    Sub-chunks are anchored at absolute rows that are multiples of 64
    (DELTA_SUBCHUNK_ROWS): a chunk starting at row 100 runs [100, 128), [128, 192), ...
    Each sub-chunk is computed in float64 and the state is rounded to float32 at every
    sub-chunk end, exactly as at a chunk end, so any two chunkings whose cuts lie on
    multiples of 64 give bit-identical outputs and states.

    q, k: float32  # [rows, key_heads, key_dim]
    v: float32  # [rows, value_heads, value_dim]
    g, beta: float32  # [rows, value_heads]  (see `delta_gates`)
    state: float32  # [value_heads, key_dim, value_dim]  (state at start_row; zeros at 0)
    start_row: int  # absolute row of the first input row
    returns: (out float32  # [rows, value_heads, value_dim],
              new_state float32  # [value_heads, key_dim, value_dim])
    """
    value_heads = v.shape[1]
    key_dim = q.shape[2]
    q64 = _repeat_key_heads(np.asarray(q, dtype=_F64), value_heads) * (key_dim**-0.5)
    k64 = _repeat_key_heads(np.asarray(k, dtype=_F64), value_heads)
    v64 = np.asarray(v, dtype=_F64)
    g64 = np.asarray(g, dtype=_F64)
    b64 = np.asarray(beta, dtype=_F64)
    rows = v.shape[0]
    out = np.empty((rows, value_heads, v.shape[2]), dtype=_F32)
    s = np.asarray(state, dtype=_F32)
    lo = 0
    while lo < rows:
        absolute = start_row + lo
        hi = min(rows, lo + DELTA_SUBCHUNK_ROWS - absolute % DELTA_SUBCHUNK_ROWS)
        o, s64 = _delta_subchunk(q64[lo:hi], k64[lo:hi], v64[lo:hi], g64[lo:hi], b64[lo:hi], s.astype(_F64))
        out[lo:hi] = o
        s = s64.astype(_F32)
        lo = hi
    return out, s


def gated_delta_rule_step(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """One decode row of the gated delta rule per lane (the recurrent form).

    Same recurrence and conventions as `gated_delta_rule_chunked` (q, k L2-normalised,
    query scale applied here), computed in float64, state rounded to float32.
    Source: torch_recurrent_gated_delta_rule.
    q, k: float32  # [lanes, key_heads, key_dim]
    v: float32  # [lanes, value_heads, value_dim]
    g, beta: float32  # [lanes, value_heads]
    state: float32  # [lanes, value_heads, key_dim, value_dim]
    returns: (out float32  # [lanes, value_heads, value_dim],
              new_state float32  # [lanes, value_heads, key_dim, value_dim])
    """
    value_heads = v.shape[1]
    key_dim = q.shape[2]
    q64 = _repeat_key_heads(np.asarray(q, dtype=_F64), value_heads) * (key_dim**-0.5)
    k64 = _repeat_key_heads(np.asarray(k, dtype=_F64), value_heads)
    v64 = np.asarray(v, dtype=_F64)
    s = np.asarray(state, dtype=_F64) * np.exp(np.asarray(g, dtype=_F64))[:, :, None, None]
    kv_mem = np.einsum("lhkv,lhk->lhv", s, k64)
    delta = (v64 - kv_mem) * np.asarray(beta, dtype=_F64)[:, :, None]
    s = s + k64[:, :, :, None] * delta[:, :, None, :]
    out = np.einsum("lhkv,lhk->lhv", s, q64)
    return out.astype(_F32), s.astype(_F32)


def split_query_gate(q_proj_out: np.ndarray, heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Split q_proj output per head into the query and the output gate.

    q_proj's rows are laid out per head as [query (head_dim), gate (head_dim)].
    q_proj_out: float32  # [rows, heads * 2 * head_dim]
    returns: (query float32  # [rows, heads, head_dim], gate float32  # [rows, heads * head_dim])
    """
    rows = q_proj_out.shape[0]
    per_head = np.asarray(q_proj_out, dtype=_F32).reshape(rows, heads, 2 * head_dim)
    query = np.ascontiguousarray(per_head[:, :, :head_dim])
    gate = np.ascontiguousarray(per_head[:, :, head_dim:]).reshape(rows, heads * head_dim)
    return query, gate


def rope(x: np.ndarray, positions: np.ndarray, theta: float, rotary_dim: int) -> np.ndarray:
    """Partial rotary embedding on the first rotary_dim dims of each head (rotate-half).

    With r = rotary_dim / 2 and inv_freq[i] = theta^(-2i / rotary_dim), angle = pos * inv_freq:
        out[:r]  = x[:r] cos - x[r:2r] sin
        out[r:2r] = x[r:2r] cos + x[:r] sin
        out[2r:] = x[2r:]
    Angles in float64. For text-only input Qwen3.5's interleaved M-RoPE reduces to this
    (all three position grids are equal). Source: Qwen3_5TextRotaryEmbedding,
    apply_rotary_pos_emb (rotary_dim = head_dim * partial_rotary_factor, 64 of 256).
    x: float32  # [rows, heads, head_dim]
    positions: int  # [rows]  (absolute row numbers)
    returns: float32  # [rows, heads, head_dim]
    """
    half = rotary_dim // 2
    inv_freq = 1.0 / (float(theta) ** (np.arange(0, rotary_dim, 2, dtype=_F64) / rotary_dim))
    angles = np.asarray(positions, dtype=_F64)[:, None] * inv_freq[None, :]  # [rows, half]
    cos = np.cos(angles)[:, None, :]
    sin = np.sin(angles)[:, None, :]
    x64 = np.asarray(x, dtype=_F64)
    x1 = x64[..., :half]
    x2 = x64[..., half:rotary_dim]
    out = np.array(x, dtype=_F32, copy=True)
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rotary_dim] = x2 * cos + x1 * sin
    return out


ATTENTION_SCORE_BYTES = 256 << 20
"""Most bytes of float64 scores `attention` holds at once. Past it, the query rows run in blocks of
ATTENTION_BLOCK_ROWS (absolute rows, from row 0); at or under it the whole chunk runs at once, as
before blocks existed (the bits of every such call are unchanged). A 32K-row prompt on the tiny
model would otherwise ask 2 x 2 x 32768^2 float64 = 16 GiB at once."""
ATTENTION_BLOCK_ROWS = 512
"""Query rows a block of `attention` over a long chunk (see ATTENTION_SCORE_BYTES)."""


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start_row: int) -> np.ndarray:
    """Causal grouped-query softmax attention of rows [start_row, start_row + rows).

    Query row i (absolute row start_row + i) attends to key rows [0, start_row + i].
    Query head h reads KV head h // (q_heads // kv_heads). Scale head_dim^-0.5;
    scores and softmax in float64. Source: eager_attention_forward.
    When the chunk's scores (q_heads x rows x (start_row + rows) float64) pass
    ATTENTION_SCORE_BYTES, query rows run in blocks on absolute multiples of
    ATTENTION_BLOCK_ROWS, each against its causal prefix of keys only.
    q: float32  # [rows, q_heads, head_dim]  (after QK-norm and RoPE)
    k, v: float32  # [kv_rows, kv_heads, head_dim]  (kv_rows >= start_row + rows)
    returns: float32  # [rows, q_heads, head_dim]
    """
    rows, q_heads = q.shape[:2]
    end = start_row + rows
    if q_heads * rows * end * 8 <= ATTENTION_SCORE_BYTES:
        return _attention_block(q, k, v, start_row)
    out = np.empty(q.shape, dtype=_F32)
    at = start_row
    while at < end:
        stop = min(end, (at // ATTENTION_BLOCK_ROWS + 1) * ATTENTION_BLOCK_ROWS)
        out[at - start_row:stop - start_row] = _attention_block(q[at - start_row:stop - start_row], k, v, at)
        at = stop
    return out


def _attention_block(q: np.ndarray, k: np.ndarray, v: np.ndarray, start_row: int) -> np.ndarray:
    """`attention` of rows [start_row, start_row + len(q)) in one pass (shapes as there)."""
    rows, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    end = start_row + rows
    q64 = np.asarray(q, dtype=_F64).reshape(rows, kv_heads, group, head_dim)
    k64 = np.asarray(k[:end], dtype=_F64)  # [end, kv_heads, head_dim]
    v64 = np.asarray(v[:end], dtype=_F64)
    scores = np.einsum("rkgd,tkd->kgrt", q64, k64) * (head_dim**-0.5)  # [kv, group, rows, end]
    allowed = np.arange(end)[None, :] <= (start_row + np.arange(rows))[:, None]  # [rows, end]
    scores = np.where(allowed, scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.einsum("kgrt,tkd->rkgd", probs, v64)
    return out.reshape(rows, q_heads, head_dim).astype(_F32)


def sigmoid_gate(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """Attention output gate x * sigmoid(gate) (Qwen3_5Attention, before o_proj).

    x, gate: float32  # [rows, q_heads * head_dim]
    returns: float32  # [rows, q_heads * head_dim]
    """
    return (np.asarray(x, dtype=_F64) * _sigmoid64(gate)).astype(_F32)


def swiglu_mlp(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """SwiGLU MLP: down(silu(gate(x)) * up(x)). Source: Qwen3_5MLP.

    x: float32  # [rows, hidden]
    w_gate, w_up: float32  # [intermediate, hidden]
    w_down: float32  # [hidden, intermediate]
    returns: float32  # [rows, hidden]
    """
    h = silu(linear(x, w_gate)) * linear(x, w_up)
    return linear(h, w_down)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Natural-log softmax over the last axis, in float64.

    logits: float32  # [..., vocab]
    returns: float64  # [..., vocab]
    """
    x = np.asarray(logits, dtype=_F64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.sum(np.exp(x), axis=-1, keepdims=True))
