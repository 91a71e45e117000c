"""End-to-end decode and prefill speed of the numba-cuda backend at real Qwen3.5 shapes,
against rooflines measured on the same GPU and against transformers' Qwen3_5ForCausalLM
(torch bf16, sdpa) holding the very same weights.

Weights are random (seeded) and made on the GPU at each preset's shapes; the transformers
model gets zero-copy views of them, so both run the same numbers and their last-row
logits are compared. Decode: `lanes` streams at a context of `ctx` rows (K/V rows and
recurrent states filled with random values: no prefill needed), eager and replayed as
CUDA graphs; tokens/s against the roofline lanes / (weight bytes per step / copy
bandwidth), and against a fuller floor that adds the K/V rows and recurrent states a step
must read. Prefill: one chunk of `rows` rows from an empty state (or the policy's chunks of
`--chunk-rows`), its last layer's tail as the server passes it (DESIGN rule 8; `--tail on,off`
times it against the whole last layer, and a preset reports an error if the two give other
logits bits); TTFT (wall, logits on the host; the median of `--ttft-repeats` prefills, 3 by
default, each listed in the JSON's `ttft_runs_s`, with `logits_sha256` of the last row's logits,
the same in every run or the bench stops; the peer's is one prefill, its whole last layer) and
rows/s against the bf16 matrix roofline (the matrix and attention FLOPs the prefill does, over
the measured GEMM rate). Per-kernel device times (launches queued behind a spin kernel, events
around each call) say where the time goes. One file with the peer: the two
sides share the weights, the rooflines and the table.
Usage (GPU machine): python -m bench.decode_prefill [--presets a,b] [--out DIR] [--no-peer]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import itertools
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import attrs
import numpy as np

from executor.config import FULL, Qwen35Config, to_hf_dict
from executor.numba_cuda import attention_flash, delta_mma
from executor.numba_cuda import backend as nb_backend
from executor.numba_cuda import device_weights
from executor.numba_cuda.backend import NumbaCudaBackend
from executor.numba_cuda.device import (CallTimer, deferred_frees, device_name, elapsed_seconds, new_event,
                                        release_memory, spin, to_device)
from executor.numba_cuda.graphs import DecodeGraphs
from executor.presets import preset
from policy.config import PolicyConfig
from policy.plan import Chunk, plan_chunks
from policy.tail import TailFacts, tail_from


@attrs.frozen
class BenchConfig:
    """What to measure. long_prefill / profile entries are 'preset:rows' / 'preset'."""

    presets: tuple[str, ...] = ("qwen3.5-2b", "qwen3.5-9b", "qwen3.5-27b")
    lanes: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (4096, 32768)
    prefill_rows: tuple[int, ...] = (8192,)
    long_prefill: tuple[str, ...] = ("qwen3.5-9b:32768",)
    profile: tuple[str, ...] = ("qwen3.5-27b", "qwen3.5-9b")
    eager_steps: int = 4
    graph_steps: int = 8
    peer_steps: int = 5
    check_rows: int = 512
    seed: int = 0
    peer: bool = True
    commit: str = ""
    prefill_attention: tuple[str, ...] = ()
    """Prefill attention paths to time side by side (empty: the backend's own choice)."""
    prefill_delta: tuple[str, ...] = ()
    """Prefill delta-rule paths to time side by side (empty: the backend's own choice)."""
    residual_accumulate: tuple[bool, ...] = ()
    """NumbaCudaBackend.residual_accumulate settings to time side by side (empty: the backend's
    own, on unless WARMSTATE_RESIDUAL_ACCUMULATE=0)."""
    gemm_large: tuple[bool, ...] = ()
    """Gemm.large settings (rows > 1024 on the fastest bit-equal cuBLASLt algorithm, or on the
    reference) to time side by side (empty: the backend's own, on unless WARMSTATE_GEMM_LARGE=0)."""
    flash_lookahead: tuple[bool, ...] = ()
    """NumbaCudaBackend.flash_lookahead settings (prefill attention's wgmma walk in FlashAttention-3's
    order, or the backend's walk) to time side by side (empty: the backend's own, off unless
    WARMSTATE_FLASH_LOOKAHEAD=1). "on" needs `attention_flash.lookahead_status()` None (its bit
    check passed): `run` sets WARMSTATE_FLASH_LOOKAHEAD=1 first, and a preset whose check fails stops
    with the reason in its "error". Paths other than flash are timed once (no walk to switch)."""
    bf16_products: tuple[bool, ...] = ()
    """NumbaCudaBackend.bf16_products settings (in_proj and gate|up from cuBLASLt's bf16 epilogue
    for chunks past 1,024 rows, or in f32 for their consumers to round: the same bits) to time side
    by side (empty: the backend's own, on unless WARMSTATE_BF16_PRODUCTS=0)."""
    ttft_repeats: int = 3
    """Prefills a TTFT is the median of (each from an empty state; `ttft_runs_s` keeps them all)."""
    tail: tuple[bool, ...] = ()
    """Last-layer tail settings to time side by side (empty: on, as the server runs a cold pass). On:
    the prompt's last chunk passes `tail_from` from `policy.tail.tail_from` with the scheduler's
    default `TailFacts` (DESIGN rule 8: the last layer's q, attention, gate, o_proj and MLP over the
    last `tail_rows` rows only, K/V over every row; the kept row's logits are the same bits), and a
    chunk before it skips the last layer's q/o/MLP and the LM head; off: every row runs the whole
    last layer (what the bench timed before session 41)."""
    chunk_rows: tuple[int | None, ...] = ()
    """Plans to time side by side, as the largest chunk in rows (empty: one chunk of the whole
    prompt). N runs the prompt in the chunks `policy.plan.plan_chunks` cuts with grid_rows =
    max_chunk_rows = N (the server's defaults are 4096 and 4096), one `prefill` call a chunk, no
    state kept between them (the server would also snapshot a state at each mark)."""


# rooflines --------------------------------------------------------------------------------


def ceilings() -> dict:
    """Copy bandwidth (bytes read + written, GB/s) and bf16 GEMM rate (8192^3, TFLOP/s) on
    random data, through torch: means of 10 timed runs after warm-up."""
    import torch

    def timed(fn, repeat=10):
        fn()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3 / repeat

    def copy_seconds(n):
        src = torch.empty(n, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
        dst = torch.empty_like(src)
        return timed(lambda: dst.copy_(src))

    def matmul_seconds(n):
        x = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        y = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        return timed(lambda: x @ y)

    n = 1 << 31
    copy = 2 * 2 * n / copy_seconds(n) / 1e9
    mm = 2 * 8192**3 / matmul_seconds(8192) / 1e12
    torch.cuda.empty_cache()
    return {"copy_gbps": round(copy, 1), "bf16_tflops": round(mm, 1)}


def _matrices(c: Qwen35Config) -> list[tuple[int, int]]:
    return [nk for kind in c.layer_types for nk in device_weights.matrix_shapes(c, kind).values()]


def weight_bytes(c: Qwen35Config) -> int:
    """Weight bytes one decode step reads: every layer matrix and the LM head, bf16."""
    return 2 * (sum(n * k for n, k in _matrices(c)) + c.vocab_size * c.hidden_size)


def step_bytes(c: Qwen35Config, ctx: int, lanes: int) -> int:
    """Weight bytes plus each lane's K/V rows [0, ctx) and recurrent state (read and written)."""
    per_lane = ctx * c.kv_bytes_per_row + 2 * len(c.linear_layers) * c.recurrent_bytes_per_layer
    return weight_bytes(c) + lanes * per_lane


def prefill_flops(c: Qwen35Config, rows: int, last_rows: int | None = None) -> float:
    """Matrix FLOPs of a prefill of `rows` rows: the layer GEMMs, causal attention (QK and
    PV over rows^2 / 2 pairs), the LM head of the last row. last_rows (DESIGN rule 8; None:
    rows, the whole last layer): the last layer runs kv_proj over every row and its other
    matrices and its attention over the prompt's last `last_rows` rows only (those see
    rows - last_rows / 2 keys on average): the work a tailed prefill does, which its roofline
    is then taken on."""
    gemm = 2.0 * rows * sum(n * k for n, k in _matrices(c))
    pairs = [rows * rows / 2.0] * len(c.full_layers)
    if last_rows is not None and last_rows != rows:
        if c.layer_types[-1] != FULL:
            raise ValueError("a tail needs a full-attention last layer")
        if not 0 <= last_rows <= rows:
            raise ValueError(f"last_rows {last_rows} is outside [0, {rows}]")
        skipped = rows - last_rows
        gemm -= 2.0 * skipped * sum(n * k for name, (n, k) in device_weights.matrix_shapes(c, FULL).items()
                                    if name != "kv_proj")
        pairs[-1] = last_rows * (rows - last_rows / 2.0)
    attn = 4.0 * sum(pairs) * c.num_attention_heads * c.head_dim
    return gemm + attn + 2.0 * c.hidden_size * c.vocab_size


def served_tail_from(c: Qwen35Config, chunk: Chunk) -> int | None:
    """The tail_from the server passes for `chunk` (DESIGN rule 8): `policy.tail.tail_from` with the
    scheduler's default TailFacts (PolicyConfig's tail_rows, no reader: `executor.runtime.Runtime`
    builds its scheduler so), and None where the model's last layer is not full attention (the
    stepper passes no tail then: `executor.stepper.Stepper`)."""
    if c.layer_types[-1] != FULL:
        return None
    return tail_from(chunk, TailFacts(tail_rows=PolicyConfig().tail_rows))


def prompt_chunks(rows: int, chunk_rows: int | None) -> tuple[Chunk, ...]:
    """The cold pass's chunks of a `rows`-row prompt (no request starts): one chunk when
    chunk_rows is None, else `plan_chunks` with grid_rows = max_chunk_rows = chunk_rows; the last
    one reads its logits."""
    if chunk_rows is None:
        return (Chunk(0, rows, True),)
    return plan_chunks(rows, (), 0, PolicyConfig(grid_rows=chunk_rows, max_chunk_rows=chunk_rows))


# ours -----------------------------------------------------------------------------------


def _fresh_states(backend: NumbaCudaBackend, lanes: int, ctx: int, seed: int) -> list:
    """`lanes` states standing at row `ctx`, their recurrent and conv state random (K/V
    rows were filled once for the whole pool)."""
    states = []
    for lane in range(lanes):
        state = backend.new_state()
        for i in range(backend.pool.recurrent.shape[0]):
            device_weights.fill_uniform(backend.pool.recurrent[i, state.slot], seed + 2 * lane + 7 * i, 0.02)
            device_weights.fill_uniform(backend.pool.conv[i, state.slot], seed + 2 * lane + 7 * i + 1, 1.0)
        state.rows = ctx
        states.append(state)
    return states


KERNELS = ("elementwise.embed", "elementwise.swiglu", "norms.add_rms_norm", "norms.gated_rms_norm",
           "conv.causal_conv1d_qkv", "delta_rule.delta_gates", "delta_rule.delta_recurrence", "delta_chunked.delta_chunked",
           "delta_mma.delta_mma",
           "attention_prep.kv_norm_rope_store", "attention_prep.q_norm_rope", "attention.attention",
           "attention_flash.prefill")


@contextlib.contextmanager
def _timed_kernels(backend: NumbaCudaBackend, timer: CallTimer):
    """Wrap every kernel function the backend calls (and its GEMV / GEMM) in `timer`."""
    saved = []
    for path in KERNELS:
        module_name, name = path.split(".")
        module = getattr(nb_backend, module_name)
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, timer.wrap(name, getattr(module, name)))
    real_gemv, real_matmul = nb_backend.gemv, backend.gemm.matmul
    gemv_labels = {id(backend.w.lm_head): "lm_head gemv"}
    nb_backend.gemv = lambda x, w, *a, **k: timer.wrap(gemv_labels.get(id(w), "gemv"), real_gemv)(x, w, *a, **k)
    backend.gemm.matmul = timer.wrap("gemm (cuBLASLt)", real_matmul)
    mat = backend.matrix_attention
    real_mat_prefill, real_mat_gemm = mat.prefill, mat._gemm
    mat.prefill = timer.wrap("matrix attention (all)", real_mat_prefill)
    mat._gemm = timer.wrap("matrix attention: QK/PV gemms", real_mat_gemm)
    try:
        yield
    finally:
        del mat.prefill, mat._gemm
        for module, name, fn in saved:
            setattr(module, name, fn)
        nb_backend.gemv = real_gemv
        del backend.gemm.matmul


def _profile(backend: NumbaCudaBackend, launch, spin_ms: float, defer: bool) -> dict:
    """Per-kernel device ms of one `launch()` queued behind a spin kernel (with `defer`, no
    buffer is freed meanwhile, since a free waits for the device: decode steps only, a
    prefill's buffers would not fit)."""
    timer = CallTimer()
    with _timed_kernels(backend, timer), deferred_frees() if defer else contextlib.nullcontext():
        spin(spin_ms)
        start, stop = new_event(), new_event()
        start.record()
        launch()
        stop.record()
    step_s = elapsed_seconds(start, stop)
    totals = sorted(timer.totals().items(), key=lambda kv: -kv[1][0])
    return {"step_ms": round(step_s * 1e3, 3),
            "kernels": {label: {"ms": round(s * 1e3, 3), "calls": n} for label, (s, n) in totals}}


def decode_ours(backend: NumbaCudaBackend, ctx: int, lanes: int, cfg: BenchConfig, profile: bool) -> dict:
    rng = np.random.default_rng(cfg.seed + ctx + lanes)
    states = _fresh_states(backend, lanes, ctx, cfg.seed + 1000 * lanes)
    tokens = [int(t) for t in rng.integers(0, backend.config.vocab_size, lanes)]
    backend.decode(states, tokens)
    eager = []
    for _ in range(cfg.eager_steps):
        t0 = time.perf_counter()
        logits = backend.decode(states, tokens)
        eager.append(time.perf_counter() - t0)
    assert np.isfinite(logits).all(), "non-finite decode logits"
    out = {"ctx": ctx, "lanes": lanes, "eager_s": float(np.median(eager))}
    if profile:
        ids, positions, slots = backend.decode_inputs(states, tokens)
        args = [to_device(a) for a in (ids, positions, slots, np.arange(lanes + 1, dtype=np.int32))]
        out["profile"] = _profile(backend, lambda: backend.decode_step(*args, int(positions.max())), 500.0, True)
    graphs = DecodeGraphs(backend)
    try:
        t0 = time.perf_counter()
        graphs.decode(states, tokens)
        out["capture_s"] = time.perf_counter() - t0
        replayed = []
        for _ in range(cfg.graph_steps):
            t0 = time.perf_counter()
            graphs.decode(states, tokens)
            replayed.append(time.perf_counter() - t0)
        out["graph_s"] = float(np.median(replayed))
        out["graph_device_s"] = graphs.replay_seconds(lanes, 5)
    finally:
        graphs.close()
        for state in states:
            backend.release(state)
    return out


def prefill_settings(cfg: BenchConfig, chosen: tuple) -> list[tuple]:
    """The prefill settings to time, in order: every (attention path, delta-rule path, residual
    accumulate, large-M GEMM, lookahead, bf16 products, tail, chunk rows) of cfg's lists, each empty
    list standing for the backend's own choice in `chosen` (the same eight, in that order; the
    tail's own is on, the chunk rows' None: one chunk). Lookahead only switches the flash path's
    walk, so another path is timed once, with the first lookahead setting."""
    lists = (cfg.prefill_attention, cfg.prefill_delta, cfg.residual_accumulate, cfg.gemm_large, cfg.flash_lookahead,
             cfg.bf16_products, cfg.tail, cfg.chunk_rows)
    lists = [given or (own,) for given, own in zip(lists, chosen)]
    return [s for s in itertools.product(*lists) if s[0] == "flash" or s[4] == lists[4][0]]


def logits_digest(logits: np.ndarray) -> str:
    """sha256 (hex, first 16 digits) of a prefill's last-row logits as float32 bytes: the same
    seeded weights and prompt give the same digest on any build that keeps every bit, so two
    builds timed in one run show whether a change kept the bits end to end."""
    return hashlib.sha256(np.ascontiguousarray(logits, np.float32).tobytes()).hexdigest()[:16]


def prefill_ours(backend: NumbaCudaBackend, rows: int, cfg: BenchConfig, profile: bool, tail: bool = False,
                 chunk_rows: int | None = None) -> dict:
    """TTFT of a `rows`-row prompt from an empty state: the median of cfg.ttft_repeats cold passes,
    each the chunks of `prompt_chunks(rows, chunk_rows)` (wall time from the first call to the
    last row's logits on the host). tail: each chunk passes the server's tail_from
    (`served_tail_from`); off, every chunk runs the whole last layer (tail_from = its start). The
    profile (per-kernel device ms) times a one-chunk prompt's single launch, with its tail."""
    c = backend.config
    rng = np.random.default_rng(cfg.seed + rows)
    ids = [int(t) for t in rng.integers(0, c.vocab_size, rows)]
    chunks = prompt_chunks(rows, chunk_rows)
    tails = [served_tail_from(c, chunk) if tail else chunk.start for chunk in chunks]
    runs, digests = [], set()
    for _ in range(max(1, cfg.ttft_repeats)):
        state = backend.new_state()
        t0 = time.perf_counter()
        for chunk, first in zip(chunks, tails):
            kwargs = {} if first is None else {"tail_from": first}
            logits = backend.prefill(state, ids, (chunk.start, chunk.end), want_logits=chunk.reads_logits, **kwargs)
        runs.append(time.perf_counter() - t0)
        backend.release(state)
        assert np.isfinite(logits).all(), "non-finite prefill logits"
        digests.add(logits_digest(logits))
    if len(digests) != 1:
        raise AssertionError(
            f"prefill of {rows} rows gave {len(digests)} different last-row logits over {len(runs)} runs")
    firsts = [chunk.start if first is None else first for chunk, first in zip(chunks, tails)]
    # rows that ran the last layer's q, attention, o_proj and MLP: the last chunk's tail (the chunks before it
    # skip them when the tail is on), or every row
    last_rows = sum(chunk.end - first for chunk, first in zip(chunks, firsts))
    out = {"rows": rows, "ttft_s": float(np.median(runs)), "ttft_runs_s": [round(t, 4) for t in runs],
           "logits_sha256": digests.pop(), "chunks": len(chunks), "last_layer_rows": last_rows,
           "tail_rows": last_rows if tail else None}
    last_tail = firsts[-1]
    if profile and len(chunks) == 1:
        state = backend.new_state()
        s = state.slot
        args = [to_device(np.asarray(a, np.int32)) for a in (ids, np.arange(rows), np.full(rows, s), [s], [0, rows])]
        first = last_tail - chunks[0].start
        out["profile"] = _profile(backend, lambda: backend.prefill_step(*args, rows - 1, slot=s, first_tail=first),
                                  100.0, False)
        backend.release(state)
    return out


# the peer: transformers on the same weights ---------------------------------------------


def hf_model(config: Qwen35Config, w: device_weights.DeviceWeights, device: str = "cuda"):
    """transformers' Qwen3_5ForCausalLM (bf16, sdpa) whose matrices are zero-copy views of
    `w`'s bf16 arrays and whose vectors are bf16 copies of `w`'s (bf16-representable) ones."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    drop = ("model_type", "dtype", "attn_output_gate", "mtp_num_hidden_layers", "architectures")
    hf_config = Qwen3_5TextConfig(**{k: v for k, v in to_hf_dict(attrs.evolve(config, nested=False)).items()
                                     if k not in drop})
    hf_config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(hf_config)
    view = lambda a: torch.as_tensor(a.view(np.int16), device=device).view(torch.bfloat16)  # noqa: E731
    vec = lambda a: torch.as_tensor(a, device=device).to(torch.bfloat16)  # noqa: E731
    c = config
    state = {"model.embed_tokens.weight": view(w.embed), "lm_head.weight": view(w.lm_head), "model.norm.weight": vec(w.norm)}
    for i, (kind, lw) in enumerate(zip(c.layer_types, w.layers)):
        p = f"model.layers.{i}."
        inter = c.intermediate_size
        gate_up = view(lw["gate_up"])
        state |= {p + "input_layernorm.weight": vec(lw["in_norm"]), p + "post_attention_layernorm.weight": vec(lw["post_norm"]),
                  p + "mlp.gate_proj.weight": gate_up[:inter], p + "mlp.up_proj.weight": gate_up[inter:],
                  p + "mlp.down_proj.weight": view(lw["down"])}
        if kind == FULL:
            a, kv, half = p + "self_attn.", view(lw["kv_proj"]), c.num_key_value_heads * c.head_dim
            state |= {a + "q_proj.weight": view(lw["q_proj"]), a + "k_proj.weight": kv[:half], a + "v_proj.weight": kv[half:],
                      a + "o_proj.weight": view(lw["o_proj"]), a + "q_norm.weight": vec(lw["q_norm"]),
                      a + "k_norm.weight": vec(lw["k_norm"])}
        else:
            a, proj = p + "linear_attn.", view(lw["in_proj"])
            ch, vd, vh = c.conv_channels, c.linear_value_dim, c.linear_num_value_heads
            state |= {a + "in_proj_qkv.weight": proj[:ch], a + "in_proj_z.weight": proj[ch : ch + vd],
                      a + "in_proj_b.weight": proj[ch + vd : ch + vd + vh], a + "in_proj_a.weight": proj[ch + vd + vh :],
                      a + "out_proj.weight": view(lw["out_proj"]), a + "conv1d.weight": vec(lw["conv"]).unsqueeze(1),
                      a + "A_log": vec(lw["a_log"]), a + "dt_bias": vec(lw["dt_bias"]), a + "norm.weight": vec(lw["norm"])}
    expected = set(model.state_dict())
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=True, assign=True)
    if c.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = Qwen3_5TextRotaryEmbedding(config=hf_config, device=device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not left, f"still on the meta device: {left}"
    return model.eval(), hf_config


def _hf_call(model, ids, cache):
    import torch

    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=cache is not None, logits_to_keep=1)
        return out.logits[:, -1].float().cpu().numpy()


def prefill_peer(model, hf_config, rows: int, seed: int, device: str = "cuda") -> float:
    import torch
    from transformers import DynamicCache

    ids = torch.as_tensor(np.random.default_rng(seed + rows).integers(0, hf_config.vocab_size, (1, rows)), device=device)
    t0 = time.perf_counter()
    logits = _hf_call(model, ids, DynamicCache(config=hf_config))
    seconds = time.perf_counter() - t0
    assert np.isfinite(logits).all()
    return seconds


def decode_peer(model, hf_config, ctx: int, lanes: int, steps: int, seed: int, device: str = "cuda") -> float:
    """Median seconds per decode step of `lanes` sequences whose attention caches hold `ctx`
    random rows (after a real 16-token prefill fills every layer's cache)."""
    import torch
    from transformers import DynamicCache

    rng = np.random.default_rng(seed + ctx + lanes)
    cache = DynamicCache(config=hf_config)
    _hf_call(model, torch.as_tensor(rng.integers(0, hf_config.vocab_size, (lanes, 16)), device=device), cache)
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel():
            b, h, _, d = keys.shape
            layer.keys = torch.empty(b, h, ctx, d, dtype=keys.dtype, device=keys.device).uniform_(-1, 1)
            layer.values = torch.empty(b, h, ctx, d, dtype=keys.dtype, device=keys.device).uniform_(-1, 1)
    token = torch.as_tensor(rng.integers(0, hf_config.vocab_size, (lanes, 1)), device=device)
    times = []
    for _ in range(2 + steps):
        t0 = time.perf_counter()
        _hf_call(model, token, cache)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[2:]))


# driver ---------------------------------------------------------------------------------


def _numerics(ours: np.ndarray, peer: np.ndarray) -> dict:
    rel = float(np.linalg.norm(ours.astype(np.float64) - peer) / np.linalg.norm(peer.astype(np.float64)))
    top5 = len(set(np.argsort(-ours)[:5]) & set(np.argsort(-peer)[:5]))
    return {"rel_err": round(rel, 5), "top1_equal": bool(np.argmax(ours) == np.argmax(peer)), "top5_overlap": top5}


def run_preset(name: str, cfg: BenchConfig, ceil: dict, log, result: dict) -> None:
    """Measure one preset into `result` (filled as it goes, so a failure keeps the rest)."""
    c = preset(name)
    long_rows = [int(e.split(":")[1]) for e in cfg.long_prefill if e.split(":")[0] == name]
    prefill_rows = list(cfg.prefill_rows) + long_rows
    capacity = max([max(cfg.contexts, default=0) + cfg.eager_steps + cfg.graph_steps + 16] + prefill_rows)
    t0 = time.perf_counter()
    w = device_weights.random(c, cfg.seed)
    backend = NumbaCudaBackend.from_device_weights(c, w, slots=max(cfg.lanes), capacity_rows=capacity)
    for i, array in enumerate((backend.pool.keys, backend.pool.values)):
        device_weights.fill_uniform(array, cfg.seed + 90 + i, 2.0)
    result |= {"weight_bytes": weight_bytes(c), "setup_s": time.perf_counter() - t0, "decode": [], "prefill": []}
    warm = backend.new_state()
    check_ids = [int(t) for t in np.random.default_rng(cfg.seed).integers(0, c.vocab_size, cfg.check_rows)]
    ours_check = backend.prefill(warm, check_ids, (0, cfg.check_rows))
    backend.decode([warm], [1])
    backend.release(warm)
    log(f"{name}: weights + pool + warm-up {time.perf_counter() - t0:.1f} s")
    mat = backend.matrix_attention
    result["prefill_attention"] = {"kind": backend.prefill_attention, "pinned": {f"{k[0]}@{k[1]}": v for k, v in mat.pinned.items()},
                                   "failure": mat.failure}
    log(f"{name}: prefill attention {result['prefill_attention']}")
    profile = name in cfg.profile
    for ctx in cfg.contexts:
        for lanes in cfg.lanes:
            big = ctx == max(cfg.contexts) and lanes == max(cfg.lanes)
            small = ctx == min(cfg.contexts) and lanes == min(cfg.lanes)
            r = decode_ours(backend, ctx, lanes, cfg, profile and (big or small))
            r["roof_s"] = weight_bytes(c) / (ceil["copy_gbps"] * 1e9)
            r["full_roof_s"] = step_bytes(c, ctx, lanes) / (ceil["copy_gbps"] * 1e9)
            result["decode"].append(r)
            log(f"{name} decode ctx {ctx} lanes {lanes}: eager {r['eager_s'] * 1e3:.1f} ms, graph {r['graph_s'] * 1e3:.1f} ms "
                f"(device {r['graph_device_s'] * 1e3:.1f} ms)")
    chosen, chosen_delta = backend.prefill_attention, backend.prefill_delta
    result["prefill_delta"] = {"kind": chosen_delta, "passed_over": backend.delta_failures}
    chosen_accumulate, chosen_large = backend.residual_accumulate, backend.gemm.large
    chosen_lookahead = attention_flash.lookahead_status() is None
    if True in cfg.flash_lookahead and not chosen_lookahead:
        raise RuntimeError(f"--flash-lookahead on: {attention_flash.lookahead_status()}")
    chosen_products = backend.bf16_products
    settings = prefill_settings(cfg, (chosen, chosen_delta, chosen_accumulate, chosen_large, chosen_lookahead,
                                      chosen_products, True, None))
    for rows in prefill_rows:
        for path, delta, accumulate, large, lookahead, products, tail, chunk_rows in settings:
            backend.set_prefill_attention(path, after_prefill=True)
            backend.set_prefill_delta(delta, after_prefill=True)
            backend.residual_accumulate, backend.gemm.large = accumulate, large
            backend.flash_lookahead = lookahead
            backend.bf16_products = products
            # these paths' kernels compiled and warm, past 1,024 rows the bf16 products' too (and their searches)
            prefill_ours(backend, min(rows, 1025), attrs.evolve(cfg, ttft_repeats=1), False, tail)
            r = prefill_ours(backend, rows, cfg, profile and rows == max(prefill_rows), tail, chunk_rows)
            r["roof_s"] = prefill_flops(c, rows, r["last_layer_rows"]) / (ceil["bf16_tflops"] * 1e12)
            r["attention"], r["delta"], r["accumulate"], r["gemm_large"] = path, delta, accumulate, large
            r["flash_lookahead"] = lookahead if path == "flash" else None  # the other paths have no walk
            r["bf16_products"], r["tail"], r["chunk_rows"] = products, tail, chunk_rows
            result["prefill"].append(r)
            log(f"{name} prefill {rows} ({_setting(r)}): TTFT {r['ttft_s']:.3f} s (runs {r['ttft_runs_s']}), "
                f"logits sha256 {r['logits_sha256']}")
    result["tail_differs"] = tail_differs(result["prefill"])
    if result["tail_differs"]:  # after every setting ran: the rows stay in the result, beside the error
        raise AssertionError(f"the tail or the plan changed the last row's logits: {result['tail_differs']}")
    backend.gemm.large = chosen_large
    backend.set_prefill_attention(chosen, after_prefill=True)
    backend.set_prefill_delta(chosen_delta, after_prefill=True)
    backend.residual_accumulate = chosen_accumulate
    backend.flash_lookahead = None
    backend.bf16_products = chosen_products
    result["flash_lookahead"] = attention_flash.lookahead_status() or "on"
    c = backend.config  # phase 2 of the mma delta rule on wgmma at this model's shape, or why not
    result["delta_wgmma"] = (delta_mma.wgmma_walk_status(c.linear_key_head_dim, c.linear_value_head_dim,
                                                         c.linear_num_value_heads) or "on"
                             if chosen_delta == "mma" else "not the mma path")
    log(f"{name}: delta rule walk on wgmma: {result['delta_wgmma']}")
    result["accumulate_refused"] = {f"{n}x{k}": why for (n, k), why in backend.accumulate_refused.items()}
    result["gemm_large"] = {f"{n}x{k}": pinned["buckets"][-1] for (n, k), pinned in backend.gemm.pinned.items()
                            if pinned.get("buckets")}
    # what "bf16 products on" ran: per shape the kept algorithm (algo_id) or why none (then f32), and refused Ms
    result["bf16_products"] = {f"{n}x{k}": pinned["bf16"] for (n, k), pinned in backend.gemm.pinned.items()
                               if "bf16" in pinned}
    result["bf16_refused"] = {f"{m}x{n}x{k}": why for (m, n, k), why in backend.gemm.refused_bf16.items()}
    backend.pool = None
    del backend
    gc.collect()
    release_memory()
    if cfg.peer:
        import torch

        model, hf_config = hf_model(c, w)
        result["numerics_vs_peer"] = _numerics(ours_check, _hf_call(model, torch.as_tensor([check_ids], device="cuda"), None)[0])
        log(f"{name} ours vs transformers logits: {result['numerics_vs_peer']}")
        prefill_peer(model, hf_config, 256, cfg.seed)
        for r in result["prefill"]:
            r["peer_ttft_s"] = prefill_peer(model, hf_config, r["rows"], cfg.seed)
            log(f"{name} peer prefill {r['rows']}: TTFT {r['peer_ttft_s']:.3f} s")
            torch.cuda.empty_cache()
        for r in result["decode"]:
            r["peer_s"] = decode_peer(model, hf_config, r["ctx"], r["lanes"], cfg.peer_steps, cfg.seed)
            log(f"{name} peer decode ctx {r['ctx']} lanes {r['lanes']}: {r['peer_s'] * 1e3:.1f} ms")
            torch.cuda.empty_cache()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    del w
    gc.collect()
    release_memory()


def tail_differs(prefill: list[dict]) -> list[str]:
    """Prefill rows that differ only in the tail or the plan but gave other last-row logits: each as
    'rows N: digest, digest'. The tail changes no bit of them (DESIGN, "tail equals full"), nor do
    cuts on the 64-row grid (chunk invariance), so an entry here is a bug, not a timing."""
    groups: dict[tuple, set] = {}
    for r in prefill:
        key = tuple(r.get(k) for k in ("rows", "attention", "delta", "accumulate", "gemm_large", "flash_lookahead",
                                       "bf16_products"))
        groups.setdefault(key, set()).add(r["logits_sha256"])
    return [f"rows {key[0]}: {', '.join(sorted(d))}" for key, d in groups.items() if len(d) > 1]


def _ratio(num, den, fmt: str) -> str:
    return "-" if num is None or den is None else format(num / den, fmt)


def _on_off(value) -> str:
    return {True: "on", False: "off"}.get(value, "-")


def _setting(r: dict) -> str:
    """A prefill row's paths and switches, as the log and the profile lines name them."""
    return (f"{r.get('attention', '-')} attention, {r.get('delta', '-')} delta rule, residual accumulate "
            f"{_on_off(r.get('accumulate'))}, large-M GEMM {_on_off(r.get('gemm_large'))}, "
            f"lookahead {_on_off(r.get('flash_lookahead'))}, bf16 products {_on_off(r.get('bf16_products'))}, "
            f"tail {_tail(r)}, {_plan(r)}")


def _tail(r: dict) -> str:
    """'on (N rows)': N rows ran the last layer's q, attention, o_proj and MLP (the last chunk's
    tail, or the whole of a last chunk too short for one), 'off' or '-' (not recorded)."""
    if r.get("tail") is None:
        return "-"
    return f"on ({r['tail_rows']} rows)" if r["tail"] else "off"


def _plan(r: dict) -> str:
    """'1 chunk' or 'N chunks of M'."""
    n = r.get("chunks", 1)
    return "1 chunk" if n == 1 else f"{n} chunks of {r.get('chunk_rows')}"


def tables(results: dict) -> str:
    """The markdown tables of a run."""
    lines = ["| model | ctx | lanes | ours eager tok/s | ours graph tok/s | peer tok/s | roofline tok/s (weights) | "
             "graph / roofline | graph / peer | floor incl. K/V + state tok/s | graph / that floor |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, p in results["presets"].items():
        for r in p["decode"]:
            lanes, peer = r["lanes"], r.get("peer_s")
            if "graph_s" not in r:
                continue
            cells = [name, r["ctx"], lanes, _ratio(lanes, r["eager_s"], ".1f"), _ratio(lanes, r["graph_s"], ".1f"),
                     _ratio(lanes, peer, ".1f"), _ratio(lanes, r["roof_s"], ".1f"), _ratio(r["roof_s"], r["graph_s"], ".0%"),
                     _ratio(peer, r["graph_s"], ".2f") + ("x" if peer else ""), _ratio(lanes, r["full_roof_s"], ".1f"),
                     _ratio(r["full_roof_s"], r["graph_s"], ".0%")]
            lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    lines += ["", "| model | prompt rows | attention | delta rule | residual accumulate | large-M GEMM | lookahead | "
              "bf16 products | tail | plan | ours TTFT s (median) | ours rows/s | peer TTFT s | matrix roofline TTFT s | "
              "ours / roofline | ours / peer |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, p in results["presets"].items():
        for r in p["prefill"]:
            peer = r.get("peer_ttft_s")
            cells = [name, r["rows"], r.get("attention", "-"), r.get("delta", "-"), _on_off(r.get("accumulate")),
                     _on_off(r.get("gemm_large")), _on_off(r.get("flash_lookahead")), _on_off(r.get("bf16_products")),
                     _tail(r), _plan(r), f"{r['ttft_s']:.3f}",
                     _ratio(r["rows"], r["ttft_s"], ".0f"),
                     "-" if peer is None else f"{peer:.3f}", f"{r['roof_s']:.3f}", _ratio(r["roof_s"], r["ttft_s"], ".1%"),
                     _ratio(peer, r["ttft_s"], ".2f") + ("x" if peer else "")]
            lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    for name, p in results["presets"].items():
        for kind in ("decode", "prefill"):
            for r in p[kind]:
                if "profile" in r:
                    where = f"ctx {r['ctx']} lanes {r['lanes']}" if kind == "decode" else f"{r['rows']} rows, {_setting(r)}"
                    parts = ", ".join(f"{k} {v['ms']:.2f} ms ({v['calls']})" for k, v in r["profile"]["kernels"].items())
                    lines.append(f"\n{name} {kind} {where} (eager, device {r['profile']['step_ms']:.2f} ms): {parts}")
    return "\n".join(lines)


def _commit(fallback: str) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return fallback or "unknown"


def run(cfg: BenchConfig, out_dir: Path | None) -> dict:
    """Measure every preset of `cfg`; write decode_prefill.json / .md into out_dir as it goes."""
    import torch
    import transformers

    if True in cfg.flash_lookahead:
        os.environ["WARMSTATE_FLASH_LOOKAHEAD"] = "1"  # before attention_flash.lookahead_status decides (cached)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    results = {"device": device_name(), "commit": _commit(cfg.commit), "command": " ".join(sys.argv),
               "config": attrs.asdict(cfg), "torch": torch.__version__, "transformers": transformers.__version__,
               "ceilings": ceilings(), "presets": {}}
    log(f"{results['device']}: {results['ceilings']}")
    for name in cfg.presets:
        result = results["presets"][name] = {"decode": [], "prefill": []}
        try:
            run_preset(name, cfg, results["ceilings"], log, result)
        except Exception as exc:  # noqa: BLE001 - keep the other presets' numbers
            result["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            gc.collect()
            release_memory()
            torch.cuda.empty_cache()
        if out_dir is not None:
            (out_dir / "decode_prefill.json").write_text(json.dumps(results, indent=1, default=str))
    if out_dir is not None:
        (out_dir / "decode_prefill.md").write_text(tables(results) + "\n")
    return results


def main(argv: list[str] | None = None) -> None:
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", help=f"comma-separated (default {','.join(defaults.presets)})")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument("--decode-only", action="store_true", help="skip prefill (and transformers)")
    parser.add_argument("--prefill-only", action="store_true", help="skip decode")
    parser.add_argument("--lanes", help=f"decode lane counts, comma-separated (default {','.join(map(str, defaults.lanes))})")
    parser.add_argument("--contexts", help=f"decode contexts, comma-separated (default {','.join(map(str, defaults.contexts))})")
    parser.add_argument("--commit", default="", help="commit to record when git is unavailable")
    parser.add_argument("--out", type=Path, default=None, help="folder for decode_prefill.json and .md")
    parser.add_argument("--prefill-attention", default="",
                        help="prefill attention paths to time side by side, comma-separated, from "
                             "flash,matrix,cuda-core (default: the backend's choice)")
    parser.add_argument("--prefill-delta", default="",
                        help="prefill delta-rule paths to time side by side, comma-separated, from mma,cuda-core "
                             "(default: the backend's choice)")
    parser.add_argument("--residual-accumulate", default="",
                        help="residual accumulate settings to time side by side, comma-separated, from on,off "
                             "(default: the backend's, on unless WARMSTATE_RESIDUAL_ACCUMULATE=0)")
    parser.add_argument("--gemm-large", default="",
                        help="large-M GEMM settings to time side by side, comma-separated, from on,off: rows > 1024 "
                             "on the fastest cuBLASLt algorithm bit-equal to the reference, or on the reference "
                             "(default: the backend's, on unless WARMSTATE_GEMM_LARGE=0; with that set there is "
                             "no pick, and on runs the reference too: the JSON's gemm_large says)")
    parser.add_argument("--flash-lookahead", default="",
                        help="prefill attention walk orders to time side by side, comma-separated, from on,off: "
                             "on runs the wgmma walk in FlashAttention-3's order (the same bits; sets "
                             "WARMSTATE_FLASH_LOOKAHEAD=1 and stops if its bit check fails), off the backend's "
                             "walk (default: the backend's, off unless WARMSTATE_FLASH_LOOKAHEAD=1)")
    parser.add_argument("--bf16-products", default="",
                        help="bf16 product settings to time side by side, comma-separated, from on,off: on takes "
                             "in_proj and gate|up from cuBLASLt's bf16 epilogue for chunks past 1,024 rows, off in "
                             "f32 for their consumers to round (the same bits; default: the backend's, on unless "
                             "WARMSTATE_BF16_PRODUCTS=0)")
    parser.add_argument("--tail", default="",
                        help="last-layer tail settings to time side by side, comma-separated, from on,off: on passes "
                             "the server's tail_from (DESIGN rule 8: the last layer's q, attention, o_proj and MLP "
                             f"over the last {PolicyConfig().tail_rows} rows only; the same logits bits), off runs the "
                             "whole last layer (default: on, as the server runs a cold pass)")
    parser.add_argument("--chunk-rows", default="",
                        help="plans to time side by side, comma-separated chunk sizes in rows: N (a multiple of "
                             f"{nb_backend.INVARIANT_ROWS}) runs the prompt in the policy's chunks with grid_rows = "
                             f"max_chunk_rows = N (the server's defaults: {PolicyConfig().max_chunk_rows}), 0 as one "
                             "chunk; the per-kernel profile times one-chunk plans only (default: one chunk)")
    parser.add_argument("--ttft-repeats", type=int, default=defaults.ttft_repeats,
                        help=f"prefills a TTFT is the median of (default {defaults.ttft_repeats})")
    args = parser.parse_args(argv)
    if args.ttft_repeats < 1:
        parser.error(f"--ttft-repeats: must be at least 1, got {args.ttft_repeats}")
    changes = {"peer": not (args.no_peer or args.decode_only), "commit": args.commit}
    if args.decode_only:
        changes |= {"prefill_rows": (), "long_prefill": ()}
    if args.lanes:
        changes["lanes"] = tuple(int(v) for v in args.lanes.split(","))
    if args.contexts:
        changes["contexts"] = tuple(int(v) for v in args.contexts.split(","))
    if args.prefill_only:
        changes |= {"contexts": ()}
    if args.presets:
        changes["presets"] = tuple(args.presets.split(","))
    if args.prefill_attention:
        changes["prefill_attention"] = tuple(args.prefill_attention.split(","))
        unknown = set(changes["prefill_attention"]) - {"flash", "matrix", "cuda-core"}
        if unknown:
            parser.error(f"--prefill-attention: unknown paths {sorted(unknown)} (flash, matrix, cuda-core)")
    if args.prefill_delta:
        changes["prefill_delta"] = tuple(args.prefill_delta.split(","))
        unknown = set(changes["prefill_delta"]) - {"mma", "cuda-core"}
        if unknown:
            parser.error(f"--prefill-delta: unknown paths {sorted(unknown)} (mma, cuda-core)")
    if args.chunk_rows:
        try:
            sizes = [int(v) for v in args.chunk_rows.split(",")]
        except ValueError:
            parser.error(f"--chunk-rows: {args.chunk_rows!r} is not a comma-separated list of integers")
        grid = nb_backend.INVARIANT_ROWS
        if any(v < 0 or v % grid for v in sizes):
            parser.error(f"--chunk-rows: sizes must be multiples of {grid} (the backend's invariant grid, on which "
                         f"cuts change no bit), or 0 for one chunk; got {args.chunk_rows}")
        changes["chunk_rows"] = tuple(v or None for v in sizes)
    for flag, field in (("--residual-accumulate", "residual_accumulate"), ("--gemm-large", "gemm_large"),
                        ("--flash-lookahead", "flash_lookahead"), ("--bf16-products", "bf16_products"),
                        ("--tail", "tail")):
        value = getattr(args, field)
        if value:
            settings = value.split(",")
            unknown = set(settings) - {"on", "off"}
            if unknown:
                parser.error(f"{flag}: unknown settings {sorted(unknown)} (on, off)")
            changes[field] = tuple(v == "on" for v in settings)
    changes["ttft_repeats"] = args.ttft_repeats
    cfg = attrs.evolve(defaults, **changes)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    results = run(cfg, args.out)
    print("\n" + tables(results))


if __name__ == "__main__":
    main()
