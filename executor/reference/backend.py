"""The reference backend: the dense Qwen3.5 forward in NumPy, wired from the ops in
`executor/reference/ops.py`. It is the oracle of every other backend (CPU, slow, exact
enough: float32 with float64 reductions). MoE models are not run yet.

Source: transformers 5.x models/qwen3_5/modeling_qwen3_5.py (Qwen3_5TextModel,
Qwen3_5DecoderLayer, Qwen3_5GatedDeltaNet, Qwen3_5Attention, Qwen3_5ForCausalLM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import attrs
import numpy as np

from executor.backend import frozen_logits, shared_segments
from executor.config import FULL, Qwen35Config
from executor.reference import ops
from executor.weights import Weights, load_weights


@attrs.define(slots=True, eq=False)
class ReferenceState:
    """Per-stream state at row `rows` (float32 arrays, owned and mutated by the backend).

    recurrent[i]: [value_heads, key_dim, value_dim], conv_tail[i]: [kernel - 1, conv_channels]
    for linear layer i; keys[i], values[i]: [rows, kv_heads, head_dim] for full layer i;
    logits: [vocab] of row rows - 1 when the last call computed it, else None.
    """

    rows: int
    recurrent: dict[int, np.ndarray]
    conv_tail: dict[int, np.ndarray]
    keys: dict[int, np.ndarray]
    values: dict[int, np.ndarray]
    logits: np.ndarray | None = None


@attrs.frozen(slots=True, eq=False)
class KVSegment:
    """K/V rows [start, end) of every full layer i: keys[i], values[i] [end - start, kv_heads,
    head_dim] float32, read-only."""

    start: int
    end: int
    keys: dict[int, np.ndarray]
    values: dict[int, np.ndarray]


@attrs.frozen(slots=True, eq=False)
class ReferencePayload:
    """An immutable copy of a ReferenceState (arrays are read-only).

    recurrent, conv_tail: the fixed part, None for a ghost (`ReferenceBackend.ghost`).
    segments: K/V rows [0, rows), contiguous and ascending; all but the last may be shared
    with the payload it was built on (`snapshot`'s base), as the GPU backend does.
    """

    rows: int
    recurrent: dict[int, np.ndarray] | None
    conv_tail: dict[int, np.ndarray] | None
    segments: tuple[KVSegment, ...]
    logits: np.ndarray | None

    @property
    def kv_from(self) -> int:
        """First row of the K/V rows this payload holds itself (`rows` when none)."""
        last = self.segments[-1] if self.segments else None
        return last.start if last is not None and last.end == self.rows else self.rows


def _frozen_copy(arrays: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    out = {}
    for i, a in arrays.items():
        c = np.array(a, copy=True)
        c.flags.writeable = False
        out[i] = c
    return out


@attrs.frozen(slots=True)
class _Layer:
    """float32 weights of one decoder layer, by short name."""

    kind: str
    w: dict[str, np.ndarray]


class ReferenceBackend:
    """NumPy Qwen3.5 (dense) implementing `executor.backend.Backend`.

    Weights are upcast to float32 once at construction. `invariant_rows` is None: the
    reference gives no bit-level chunk-invariance promise (its GEMMs are BLAS calls whose
    rows may depend on the row count); chunked equals whole to float tolerance.
    """

    invariant_rows = None

    def __init__(self, weights: Weights) -> None:
        config = weights.config
        if config.moe is not None:
            raise NotImplementedError("the reference backend runs dense Qwen3.5 only (MoE later)")
        self.config: Qwen35Config = config
        f = weights.float32
        self._embed = f("embed_tokens.weight")
        self._lm_head = self._embed if config.tie_word_embeddings else f("lm_head.weight")
        self._norm = f("norm.weight")
        self._layers = []
        for i, kind in enumerate(config.layer_types):
            prefix = f"layers.{i}."
            names = [n[len(prefix) :] for n in weights.tensors if n.startswith(prefix)]
            w = {n: f(prefix + n) for n in names}
            if kind != FULL:
                w["linear_attn.conv1d.weight"] = w["linear_attn.conv1d.weight"][:, 0, :]
            self._layers.append(_Layer(kind, w))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ReferenceBackend":
        """Load a checkpoint directory (config.json + safetensors) into a reference backend."""
        return cls(load_weights(model_dir))

    def new_state(self) -> ReferenceState:
        c = self.config
        kv_shape = (0, c.num_key_value_heads, c.head_dim)
        return ReferenceState(
            rows=0,
            recurrent={
                i: np.zeros((c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim), np.float32)
                for i in c.linear_layers
            },
            conv_tail={
                i: np.zeros((c.linear_conv_kernel_dim - 1, c.conv_channels), np.float32) for i in c.linear_layers
            },
            keys={i: np.zeros(kv_shape, np.float32) for i in c.full_layers},
            values={i: np.zeros(kv_shape, np.float32) for i in c.full_layers},
        )

    def _linear_attention(
        self, layer: _Layer, state: ReferenceState, i: int, h: np.ndarray, decode: bool
    ) -> np.ndarray:
        c, w = self.config, layer.w
        rows = h.shape[0]
        qkv = ops.linear(h, w["linear_attn.in_proj_qkv.weight"])  # [rows, conv_channels]
        z = ops.linear(h, w["linear_attn.in_proj_z.weight"]).reshape(rows, c.linear_num_value_heads, -1)
        b = ops.linear(h, w["linear_attn.in_proj_b.weight"])  # [rows, value_heads]
        a = ops.linear(h, w["linear_attn.in_proj_a.weight"])  # [rows, value_heads]
        mixed, state.conv_tail[i] = ops.causal_conv1d(qkv, state.conv_tail[i], w["linear_attn.conv1d.weight"])
        kd = c.linear_key_dim
        q = ops.l2_normalize(mixed[:, :kd].reshape(rows, c.linear_num_key_heads, c.linear_key_head_dim))
        k = ops.l2_normalize(mixed[:, kd : 2 * kd].reshape(rows, c.linear_num_key_heads, c.linear_key_head_dim))
        v = mixed[:, 2 * kd :].reshape(rows, c.linear_num_value_heads, c.linear_value_head_dim)
        g, beta = ops.delta_gates(a, b, w["linear_attn.A_log"], w["linear_attn.dt_bias"])
        if decode:
            out, s = ops.gated_delta_rule_step(q, k, v, g, beta, state.recurrent[i][None])
            state.recurrent[i] = s[0]
        else:
            out, state.recurrent[i] = ops.gated_delta_rule_chunked(q, k, v, g, beta, state.recurrent[i], state.rows)
        out = ops.gated_rms_norm(out, z, w["linear_attn.norm.weight"], c.rms_norm_eps)
        return ops.linear(out.reshape(rows, c.linear_value_dim), w["linear_attn.out_proj.weight"])

    def _full_attention(self, layer: _Layer, state: ReferenceState, i: int, h: np.ndarray) -> np.ndarray:
        c, w = self.config, layer.w
        rows = h.shape[0]
        positions = np.arange(state.rows, state.rows + rows)
        q, gate = ops.split_query_gate(ops.linear(h, w["self_attn.q_proj.weight"]), c.num_attention_heads, c.head_dim)
        k = ops.linear(h, w["self_attn.k_proj.weight"]).reshape(rows, c.num_key_value_heads, c.head_dim)
        v = ops.linear(h, w["self_attn.v_proj.weight"]).reshape(rows, c.num_key_value_heads, c.head_dim)
        q = ops.rope(
            ops.rms_norm(q, w["self_attn.q_norm.weight"], c.rms_norm_eps), positions, c.rope_theta, c.rotary_dim
        )
        k = ops.rope(
            ops.rms_norm(k, w["self_attn.k_norm.weight"], c.rms_norm_eps), positions, c.rope_theta, c.rotary_dim
        )
        state.keys[i] = np.concatenate([state.keys[i], k])
        state.values[i] = np.concatenate([state.values[i], v])
        out = ops.attention(q, state.keys[i], state.values[i], state.rows)
        out = ops.sigmoid_gate(out.reshape(rows, -1), gate)
        return ops.linear(out, w["self_attn.o_proj.weight"])

    def _forward(self, state: ReferenceState, ids: np.ndarray, decode: bool, want_logits: bool) -> np.ndarray | None:
        """Run rows [state.rows, state.rows + len(ids)) and advance the state."""
        c = self.config
        x = ops.embed(ids, self._embed)  # [rows, hidden]
        for i, layer in enumerate(self._layers):
            h = ops.rms_norm(x, layer.w["input_layernorm.weight"], c.rms_norm_eps)
            if layer.kind == FULL:
                h = self._full_attention(layer, state, i, h)
            else:
                h = self._linear_attention(layer, state, i, h, decode)
            x = x + h
            h = ops.rms_norm(x, layer.w["post_attention_layernorm.weight"], c.rms_norm_eps)
            x = x + ops.swiglu_mlp(
                h, layer.w["mlp.gate_proj.weight"], layer.w["mlp.up_proj.weight"], layer.w["mlp.down_proj.weight"]
            )
        state.rows += len(ids)
        state.logits = None
        if not want_logits:
            return None
        last = ops.rms_norm(x[-1:], self._norm, c.rms_norm_eps)
        state.logits = ops.linear(last, self._lm_head)[0]
        return state.logits.copy()

    def prefill(
        self,
        state: ReferenceState,
        token_ids: Sequence[int],
        rows: tuple[int, int],
        want_logits: bool = True,
        tail_from: int | None = None,
    ) -> np.ndarray | None:
        """See `Backend.prefill`. Gated delta sub-chunks are anchored at absolute rows.

        The oracle always runs the whole last layer (tail_from is checked, then ignored).
        """
        start, end = rows
        if tail_from is not None and not start <= tail_from <= end:
            raise ValueError(f"tail_from {tail_from} outside the chunk [{start}, {end}]")
        if start != state.rows:
            raise ValueError(f"rows starts at {start} but the state holds {state.rows} rows")
        if not 0 <= start < end <= len(token_ids):
            raise ValueError(f"rows {rows} is not a non-empty range within the {len(token_ids)}-token prompt")
        ids = np.asarray(token_ids[start:end], dtype=np.int64)
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token_ids hold an id outside [0, {self.config.vocab_size})")
        return self._forward(state, ids, decode=False, want_logits=want_logits)

    def decode(self, states: Sequence[ReferenceState], token_ids: Sequence[int]) -> np.ndarray:
        """See `Backend.decode`. Lanes run one at a time, so no lane depends on another."""
        if len(states) != len(token_ids):
            raise ValueError(f"token_ids has {len(token_ids)} entries for {len(states)} states")
        out = np.empty((len(states), self.config.vocab_size), np.float32)
        for lane, (state, token) in enumerate(zip(states, token_ids)):
            if not 0 <= int(token) < self.config.vocab_size:
                raise ValueError(f"token_ids[{lane}] = {token} is outside [0, {self.config.vocab_size})")
            out[lane] = self._forward(state, np.asarray([token], np.int64), decode=True, want_logits=True)
        return out

    def snapshot(self, state: ReferenceState, base: ReferencePayload | None = None) -> ReferencePayload:
        """See `Backend.snapshot`: copies the fixed part and the K/V rows [base.rows, rows)."""
        segments, start = shared_segments(base, state.rows)
        if state.rows > start:
            rows = lambda arrays: {i: a[start:state.rows] for i, a in arrays.items()}  # noqa: E731
            segments = segments + (KVSegment(start, state.rows, _frozen_copy(rows(state.keys)),
                                             _frozen_copy(rows(state.values))),)
        return ReferencePayload(
            rows=state.rows,
            recurrent=_frozen_copy(state.recurrent),
            conv_tail=_frozen_copy(state.conv_tail),
            segments=segments,
            logits=frozen_logits(state.logits),
        )

    def restore(self, payload: ReferencePayload) -> ReferenceState:
        """See `Backend.restore`. Raises ValueError for a ghost."""
        if payload.recurrent is None or payload.conv_tail is None:
            raise ValueError("a ghost payload (no fixed part) cannot be restored")
        copy = lambda arrays: {i: np.array(a, copy=True) for i, a in arrays.items()}  # noqa: E731
        empty = (0, self.config.num_key_value_heads, self.config.head_dim)
        keys = {i: np.zeros(empty, np.float32) for i in self.config.full_layers}
        values = {i: np.zeros(empty, np.float32) for i in self.config.full_layers}
        if payload.segments:
            keys = {i: np.concatenate([s.keys[i] for s in payload.segments]) for i in keys}
            values = {i: np.concatenate([s.values[i] for s in payload.segments]) for i in values}
        return ReferenceState(
            rows=payload.rows,
            recurrent=copy(payload.recurrent),
            conv_tail=copy(payload.conv_tail),
            keys=keys,
            values=values,
            logits=None if payload.logits is None else payload.logits.copy(),
        )

    def ghost(self, payload: ReferencePayload) -> ReferencePayload:
        """See `Backend.ghost`: the payload without its fixed part and logits."""
        return attrs.evolve(payload, recurrent=None, conv_tail=None, logits=None)

    def payload_bytes(self, payload: ReferencePayload) -> int:
        """Serving-format bytes the payload holds itself (the GPU backend's payload_bytes):
        the fixed part (config.state_bytes(0)) when held, plus its own K/V rows. The
        reference itself holds float32 copies."""
        fixed = 0 if payload.recurrent is None else self.config.state_bytes(0)
        return fixed + (payload.rows - payload.kv_from) * self.config.kv_bytes_per_row

    def state_bytes(self, state: ReferenceState) -> int:
        """Serving-format bytes of a live state (config.state_bytes)."""
        return self.config.state_bytes(state.rows)

    def release(self, state: ReferenceState) -> None:
        """Nothing to return: NumPy memory goes with the last reference."""
