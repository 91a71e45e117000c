"""The numba-cuda backend: the dense Qwen3.5 forward on one GPU, implementing
`executor.backend.Backend`, with per-stream state in a device pool.

Numerics: weights bf16, residual stream fp32, every GEMM input bf16 and output fp32.
Prefill GEMMs run on cuBLASLt with a pinned row-invariant algorithm at every row count;
decode GEMMs and the LM head on the row-invariant GEMV at every lane count. Every other
kernel computes a row independently of the chunk or lane set, so prefill rows are
chunk-invariant (tested on the GPU before `invariant_rows` is claimed). Wiring mirrors
executor/reference/backend.py; the kernels live in their own modules here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from executor.config import FULL, Qwen35Config
from executor.numba_cuda import attention, attention_prep, conv, delta_rule, elementwise, norms
from executor.numba_cuda.device import empty, to_device
from executor.numba_cuda.gemm import Gemm
from executor.numba_cuda.gemv import gemv
from executor.numba_cuda.state import DevicePayload, DeviceState, StatePool
from executor.safetensors_file import f32_to_bf16
from executor.weights import Weights, load_weights


def _i32(values) -> object:
    return to_device(np.asarray(values, dtype=np.int32))


class _Weights:
    """Device weights: bf16 matrices (fused where one GEMM reads one input), fp32 vectors."""

    def __init__(self, weights: Weights) -> None:
        c = weights.config

        def bf16(*names: str):
            parts = [self._bits(weights, n) for n in names]
            return to_device(np.concatenate(parts) if len(parts) > 1 else parts[0])

        f32 = lambda name: to_device(weights.float32(name).reshape(-1))  # noqa: E731
        self.embed = bf16("embed_tokens.weight")
        self.lm_head = self.embed if c.tie_word_embeddings else bf16("lm_head.weight")
        self.norm = f32("norm.weight")
        self.layers = []
        for i, kind in enumerate(c.layer_types):
            p = f"layers.{i}."
            w = {"in_norm": f32(p + "input_layernorm.weight"), "post_norm": f32(p + "post_attention_layernorm.weight")}
            w["gate_up"] = bf16(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            w["down"] = bf16(p + "mlp.down_proj.weight")
            if kind == FULL:
                a = p + "self_attn."
                w["q_proj"] = bf16(a + "q_proj.weight")
                w["kv_proj"] = bf16(a + "k_proj.weight", a + "v_proj.weight")
                w["o_proj"] = bf16(a + "o_proj.weight")
                w["q_norm"] = f32(a + "q_norm.weight")
                w["k_norm"] = f32(a + "k_norm.weight")
            else:
                a = p + "linear_attn."
                w["in_proj"] = bf16(a + "in_proj_qkv.weight", a + "in_proj_z.weight", a + "in_proj_b.weight",
                                    a + "in_proj_a.weight")
                w["out_proj"] = bf16(a + "out_proj.weight")
                w["conv"] = to_device(weights.float32(a + "conv1d.weight")[:, 0, :])
                w["a_log"] = f32(a + "A_log")
                w["dt_bias"] = f32(a + "dt_bias")
                w["norm"] = f32(a + "norm.weight")
            self.layers.append(w)
        self.freqs = to_device(attention_prep.inv_freq(c.rope_theta, c.rotary_dim))

    @staticmethod
    def _bits(weights: Weights, name: str) -> np.ndarray:
        if weights.dtypes.get(name, weights.dtypes.get("embed_tokens.weight")) == "bfloat16" and name in weights.tensors:
            return np.ascontiguousarray(weights.tensors[name], dtype=np.uint16)
        return f32_to_bf16(weights.float32(name))


class NumbaCudaBackend:
    """Dense Qwen3.5 on one NVIDIA GPU (numba-cuda kernels + cuBLASLt).

    slots: streams that can be live at once; capacity_rows: rows a stream may hold.
    `prefill` takes an extra `tail_from` (policy/tail.py): the absolute first row of the
    last layer's tail, or None for the full last layer when logits are read.
    """

    invariant_rows = None

    def __init__(self, weights: Weights, *, slots: int = 16, capacity_rows: int = 4096) -> None:
        config = weights.config
        if config.moe is not None:
            raise NotImplementedError("the numba-cuda backend runs dense Qwen3.5 only")
        if config.dtype != "bfloat16":
            raise ValueError(f"dtype {config.dtype!r}: the numba-cuda backend serves bf16 checkpoints")
        self.config: Qwen35Config = config
        self.w = _Weights(weights)
        self.pool = StatePool(config, slots, capacity_rows)
        self.gemm = Gemm()

    @classmethod
    def from_dir(cls, model_dir: str | Path, **kwargs) -> "NumbaCudaBackend":
        return cls(load_weights(model_dir), **kwargs)

    def new_state(self) -> DeviceState:
        return DeviceState(slot=self.pool.take())

    def release(self, state: DeviceState) -> None:
        """Return the state's slot to the pool (the state is unusable afterwards)."""
        if not state.released:
            state.released = True
            self.pool.give(state.slot)

    # layers ---------------------------------------------------------------------------

    def _linear_attention(self, i: int, li: int, h, mm, row_start, slots):
        c, w = self.config, self.w.layers[i]
        ch, vd, vh = c.conv_channels, c.linear_value_dim, c.linear_num_value_heads
        proj = mm(h, w["in_proj"])  # [rows, ch + vd + 2 vh]: qkv | z | b | a
        mixed = conv.causal_conv1d(proj[:, :ch], row_start, slots, w["conv"], self.pool.conv[li])
        b = proj[:, ch + vd : ch + vd + vh]
        a = proj[:, ch + vd + vh :]
        qn, kn, g, beta = delta_rule.delta_prep(mixed, a, b, w["a_log"], w["dt_bias"], c.linear_num_key_heads,
                                                c.linear_key_head_dim)
        out = delta_rule.delta_recurrence(qn, kn, mixed, 2 * c.linear_key_dim, g, beta, row_start, slots,
                                          self.pool.recurrent[li])
        gated = norms.gated_rms_norm(out, proj[:, ch : ch + vd], w["norm"], c.rms_norm_eps)
        return mm(gated, w["out_proj"])

    def _full_attention(self, i: int, fi: int, h, mm, positions, slots, first: int, max_pos: int, decode: bool):
        """K/V for every row; q, attention and o_proj for rows [first, rows) (None if empty)."""
        c, w = self.config, self.w.layers[i]
        kv = mm(h, w["kv_proj"])
        kc, vc = self.pool.keys[fi], self.pool.values[fi]
        attention_prep.kv_norm_rope_store(kv, w["k_norm"], self.w.freqs, positions, slots, c.rms_norm_eps, kc, vc)
        rows = h.shape[0]
        if first == rows:
            return None
        if first:
            h = _copy(h[first:])
            positions, slots = positions[first:], slots[first:]
        qg = mm(h, w["q_proj"])
        q = attention_prep.q_norm_rope(qg, w["q_norm"], self.w.freqs, positions, c.rms_norm_eps,
                                       c.num_attention_heads, c.head_dim)
        tile, split = (1, attention.DECODE_SPLIT_ROWS) if decode else (attention.TILE_ROWS, attention.PREFILL_SPLIT_ROWS)
        out = attention.attention(q, slots, positions, max_pos, kc, vc, qg, tile, split)
        return mm(out, w["o_proj"])

    def _forward(self, ids, positions, row_slots, lane_slots, row_start, max_pos: int, decode: bool, first_tail: int,
                 want_logits: bool):
        """Run the rows through every layer; returns host logits [lanes or 1, vocab] or None.

        ids, positions, row_slots: i32 device [rows]; lane_slots: i32 [lanes]; row_start:
        i32 [lanes + 1]; first_tail: the last layer's first tail row (relative)."""
        c = self.config
        mm = gemv if decode else self.gemm.matmul
        x = elementwise.embed(ids, self.w.embed)
        delta = None
        lin = full = 0
        last = c.num_hidden_layers - 1
        for i, kind in enumerate(c.layer_types):
            w = self.w.layers[i]
            h = norms.add_rms_norm(x, w["in_norm"], c.rms_norm_eps, delta=delta)
            first = first_tail if i == last else 0
            if kind == FULL:
                y = self._full_attention(i, full, h, mm, positions, row_slots, first, max_pos, decode)
                full += 1
            else:
                y = self._linear_attention(i, lin, h, mm, row_start, lane_slots)
                lin += 1
            if y is None:
                return None
            if first:
                x = x[first:]
            h = norms.add_rms_norm(x, w["post_norm"], c.rms_norm_eps, delta=y)
            delta = mm(elementwise.swiglu(mm(h, w["gate_up"])), w["down"])
        if not want_logits:
            return None
        if not decode:
            x, delta = x[x.shape[0] - 1 :], delta[delta.shape[0] - 1 :]
        h = norms.add_rms_norm(x, self.w.norm, c.rms_norm_eps, delta=delta)
        return gemv(h, self.w.lm_head).copy_to_host()

    # Backend protocol -----------------------------------------------------------------

    def prefill(self, state: DeviceState, token_ids: Sequence[int], rows: tuple[int, int], want_logits: bool = True,
                tail_from: int | None = None) -> np.ndarray | None:
        """See `Backend.prefill`. tail_from: absolute first row of the last layer's tail
        (a <= tail_from < b when logits are read, tail_from == b to skip q/o/MLP); None
        means the full last layer, or the empty tail when want_logits is False."""
        start, end = rows
        if state.released:
            raise ValueError("state was released")
        if start != state.rows:
            raise ValueError(f"rows starts at {start} but the state holds {state.rows} rows")
        if not 0 <= start < end <= len(token_ids):
            raise ValueError(f"rows {rows} is not a non-empty range within the {len(token_ids)}-token prompt")
        if end > self.pool.capacity_rows:
            raise ValueError(f"rows {rows} exceed the state capacity of {self.pool.capacity_rows} rows")
        ids = np.asarray(token_ids[start:end], dtype=np.int64)
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token_ids hold an id outside [0, {self.config.vocab_size})")
        if tail_from is None:
            tail_from = end if not want_logits and self.config.layer_types[-1] == FULL else start
        if not start <= tail_from <= end or (want_logits and tail_from == end):
            raise ValueError(f"tail_from {tail_from} is outside [{start}, {end}{')' if want_logits else ']'}")
        if tail_from > start and self.config.layer_types[-1] != FULL:
            raise ValueError("a tail needs a full-attention last layer")
        n = end - start
        logits = self._forward(
            _i32(ids), _i32(np.arange(start, end)), _i32(np.full(n, state.slot)), _i32([state.slot]), _i32([0, n]),
            end - 1, False, tail_from - start, want_logits,
        )
        state.rows = end
        state.logits = None if logits is None else logits[0]
        return None if logits is None else logits[0].copy()

    def decode(self, states: Sequence[DeviceState], token_ids: Sequence[int]) -> np.ndarray:
        """See `Backend.decode`. Every lane runs the same per-row kernels; a lane's bits
        do not depend on the other lanes."""
        if len(states) != len(token_ids):
            raise ValueError(f"token_ids has {len(token_ids)} entries for {len(states)} states")
        if len({s.slot for s in states}) != len(states) or any(s.released for s in states):
            raise ValueError("states must be distinct live states")
        for lane, (state, token) in enumerate(zip(states, token_ids)):
            if not 0 <= int(token) < self.config.vocab_size:
                raise ValueError(f"token_ids[{lane}] = {token} is outside [0, {self.config.vocab_size})")
            if state.rows >= self.pool.capacity_rows:
                raise ValueError(f"states[{lane}] is full ({state.rows} rows)")
        lanes = len(states)
        positions = [s.rows for s in states]
        slots = [s.slot for s in states]
        logits = self._forward(
            _i32(token_ids), _i32(positions), _i32(slots), _i32(slots), _i32(range(lanes + 1)), max(positions), True, 0,
            True,
        )
        for lane, state in enumerate(states):
            state.rows += 1
            state.logits = logits[lane].copy()
        return logits

    def snapshot(self, state: DeviceState) -> DevicePayload:
        logits = None
        if state.logits is not None:
            logits = state.logits.copy()
            logits.flags.writeable = False
        return DevicePayload(rows=state.rows, data=self.pool.pack(state.slot, state.rows), logits=logits)

    def restore(self, payload: DevicePayload) -> DeviceState:
        state = self.new_state()
        self.pool.unpack(payload.data, state.slot, payload.rows)
        state.rows = payload.rows
        state.logits = None if payload.logits is None else payload.logits.copy()
        return state

    def payload_bytes(self, payload: DevicePayload) -> int:
        return int(payload.data.shape[0])

    def state_bytes(self, state: DeviceState) -> int:
        return self.config.state_bytes(state.rows)


def _copy(array):
    """A fresh (256-byte aligned, contiguous) copy of a device array, for cuBLAS inputs."""
    out = empty(tuple(array.shape), array.dtype)
    out.copy_to_device(array)
    return out
