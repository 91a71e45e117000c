"""Qwen3.5 text-model config: the frozen value, parsing of a Hugging Face config.json
(flat `qwen3_5_text` or nested under `text_config`, dense or MoE) and writing it back.

Shape presets of the published sizes live in `executor/presets.py`; weights in
`executor/weights.py`. Building a config does no I/O except `load_config`.
Source of field names and defaults: transformers 5.x configuration_qwen3_5.py and
configuration_qwen3_5_moe.py.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any

import attrs

from policy.shape import ModelShape, state_bytes

from executor.errors import CheckpointError

LINEAR = "linear_attention"
FULL = "full_attention"
KV_CACHE_DTYPE_BYTES = 2
CONV_TAIL_DTYPE_BYTES = 2
"""Conv tails are kept in bf16 in the serving format, like K/V."""
"""K/V rows are kept in bf16 (2 bytes per value) by the serving backends."""

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class Family(enum.Enum):
    """Which transformers class family a config describes."""

    DENSE = "qwen3_5"
    MOE = "qwen3_5_moe"


_TEXT_TYPES = {"qwen3_5_text": Family.DENSE, "qwen3_5_moe_text": Family.MOE}
_OUTER_TYPES = {"qwen3_5": Family.DENSE, "qwen3_5_moe": Family.MOE}
_ARCHITECTURES = {
    "Qwen3_5ForCausalLM": (Family.DENSE, False),
    "Qwen3_5ForConditionalGeneration": (Family.DENSE, True),
    "Qwen3_5MoeForCausalLM": (Family.MOE, False),
    "Qwen3_5MoeForConditionalGeneration": (Family.MOE, True),
}
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
_MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen(slots=True)
class MoeConfig:
    """Sparse MoE MLP fields of `qwen3_5_moe` (parsed and validated; not run yet)."""

    num_experts: int = attrs.field(validator=_positive)
    num_experts_per_tok: int = attrs.field(validator=_positive)
    moe_intermediate_size: int = attrs.field(validator=_positive)
    shared_expert_intermediate_size: int = attrs.field(validator=_positive)
    norm_topk_prob: bool = True

    def __attrs_post_init__(self) -> None:
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})"
            )


@attrs.frozen(slots=True)
class Qwen35Config:
    """Shapes and constants of a Qwen3.5 text model (hybrid Gated DeltaNet + gated attention).

    Sizes are element counts; `dtype` is the checkpoint weight dtype. `layer_types[i]` is
    "linear_attention" or "full_attention". Validation raises ValueError naming the field.
    """

    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_hidden_layers: int = attrs.field(validator=_positive)
    layer_types: tuple[str, ...] = attrs.field(converter=tuple)
    num_attention_heads: int = attrs.field(validator=_positive)
    num_key_value_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    linear_num_key_heads: int = attrs.field(validator=_positive)
    linear_num_value_heads: int = attrs.field(validator=_positive)
    linear_key_head_dim: int = attrs.field(validator=_positive)
    linear_value_head_dim: int = attrs.field(validator=_positive)
    linear_conv_kernel_dim: int = attrs.field(validator=_positive)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = attrs.field(default=32768, validator=_positive)
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    moe: MoeConfig | None = None
    nested: bool = False
    """True when the checkpoint is Qwen3_5(Moe)ForConditionalGeneration (config under
    text_config, tensors under model.language_model.)."""

    def __attrs_post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in (LINEAR, FULL):
                raise ValueError(f"layer_types[{i}] is {kind!r}, expected {LINEAR!r} or {FULL!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) is not a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if not (0.0 < self.partial_rotary_factor <= 1.0):
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} gives rotary_dim {self.rotary_dim}; "
                "it must be even and >= 2"
            )
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.mtp_num_hidden_layers < 0:
            raise ValueError(f"mtp_num_hidden_layers must be >= 0, got {self.mtp_num_hidden_layers}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")

    @property
    def family(self) -> Family:
        return Family.DENSE if self.moe is None else Family.MOE

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per attention head: int(head_dim * partial_rotary_factor) (64 of 256)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the depthwise conv: q, k and v of the linear attention (2 * key + value)."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def weight_dtype_bytes(self) -> int:
        """Bytes of one weight element in the checkpoint's dtype."""
        return DTYPE_BYTES[self.dtype]

    @property
    def shape(self) -> ModelShape:
        """The state-sizing facts (`policy.shape.ModelShape`): fp32 recurrent matrices, bf16
        conv tails and K/V rows, in the serving format whatever the checkpoint's dtype."""
        return ModelShape(
            linear_layers=len(self.linear_layers),
            attention_layers=len(self.full_layers),
            linear_num_key_heads=self.linear_num_key_heads,
            linear_key_head_dim=self.linear_key_head_dim,
            linear_num_value_heads=self.linear_num_value_heads,
            linear_value_head_dim=self.linear_value_head_dim,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            conv_bytes=CONV_TAIL_DTYPE_BYTES,
            kv_bytes=KV_CACHE_DTYPE_BYTES,
        )

    @property
    def recurrent_bytes_per_layer(self) -> int:
        """fp32 recurrent matrix [value_heads, key_dim, value_dim] of one linear layer."""
        return self.shape.recurrent_layer_bytes

    @property
    def conv_tail_bytes_per_layer(self) -> int:
        """Conv tail [kernel - 1, conv_channels] of one linear layer in bf16."""
        return self.shape.conv_layer_bytes

    @property
    def kv_bytes_per_row(self) -> int:
        """K and V of one row over all full-attention layers (bf16)."""
        return self.shape.row_bytes

    @property
    def fixed_state_bytes(self) -> int:
        """Row-independent part of a state: recurrent matrices and conv tails of all linear layers."""
        return self.shape.fixed_bytes

    def state_bytes(self, rows: int) -> int:
        """Bytes of a state at row `rows` (`policy.shape.state_bytes`: fixed part + K/V rows).

        Raises ValueError: rows < 0.
        """
        return state_bytes(self.shape, rows)


def _field_error(source: str, field: str, problem: str) -> CheckpointError:
    return CheckpointError(source, field, problem)


def _layer_types_from(text: dict[str, Any], num_layers: int, source: str, prefix: str) -> tuple[str, ...]:
    interval = text.get("full_attention_interval")
    if interval is not None and (not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0):
        raise _field_error(source, prefix + "full_attention_interval", f"must be a positive int, got {interval!r}")
    from_interval = None
    if interval is not None:
        from_interval = tuple(LINEAR if (i + 1) % interval else FULL for i in range(num_layers))
    layer_types = text.get("layer_types")
    if layer_types is None:
        return from_interval or tuple(LINEAR if (i + 1) % 4 else FULL for i in range(num_layers))
    if not isinstance(layer_types, list):
        raise _field_error(source, prefix + "layer_types", f"must be a list, got {type(layer_types).__name__}")
    for i, kind in enumerate(layer_types):
        if kind not in (LINEAR, FULL):
            raise _field_error(source, f"{prefix}layer_types[{i}]", f"unknown layer type {kind!r}")
    if len(layer_types) != num_layers:
        raise _field_error(
            source, prefix + "layer_types", f"has {len(layer_types)} entries but num_hidden_layers is {num_layers}"
        )
    if from_interval is not None and tuple(layer_types) != from_interval:
        raise _field_error(source, prefix + "layer_types", f"contradicts full_attention_interval {interval}")
    return tuple(layer_types)


def _rope_from(text: dict[str, Any], source: str, prefix: str) -> tuple[float, float]:
    params = text.get("rope_parameters")
    if params is None:
        params = text.get("rope_scaling")
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise _field_error(source, prefix + "rope_parameters.rope_type", f"unsupported rope type {rope_type!r}")
    values = {}
    for key, default in (("rope_theta", 10_000.0), ("partial_rotary_factor", 0.25)):
        nested, flat = params.get(key), text.get(key)
        if nested is not None and flat is not None and float(nested) != float(flat):
            raise _field_error(source, prefix + key, f"{flat} contradicts rope_parameters.{key} {nested}")
        value = nested if nested is not None else flat
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise _field_error(source, prefix + key, f"must be a number, got {value!r}")
        values[key] = float(value) if value is not None else default
    section = params.get("mrope_section")
    if section is not None and not (
        isinstance(section, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in section)
    ):
        raise _field_error(source, prefix + "rope_parameters.mrope_section", f"must be a list of ints, got {section!r}")
    return values["rope_theta"], values["partial_rotary_factor"]


def _checked(value: Any, source: str, field: str, kind: type, default: Any = None) -> Any:
    if value is None:
        return default
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise _field_error(source, field, f"must be an int, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise _field_error(source, field, f"must be a number, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise _field_error(source, field, f"must be true or false, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise _field_error(source, field, f"must be a string, got {value!r}")
    return float(value) if kind is float else value


def parse_config(raw: dict[str, Any], source: str = "config.json") -> Qwen35Config:
    """Parse a Hugging Face Qwen3.5 config.json object.

    Accepts the flat layout (`Qwen3_5ForCausalLM`, model_type `qwen3_5_text`, or the
    `_moe` twins) and the nested one (`Qwen3_5ForConditionalGeneration`, model_type
    `qwen3_5`, text fields under `text_config`; the official checkpoints). Layer kinds
    come from `layer_types` or `full_attention_interval` (both must agree); RoPE from
    `rope_parameters` (or `rope_scaling`) and/or flat `rope_theta`/`partial_rotary_factor`.
    Raises CheckpointError naming `source` and the field for a missing, unknown or
    contradictory value. Source: transformers configuration_qwen3_5(_moe).py.
    """
    if not isinstance(raw, dict):
        raise _field_error(source, "", "must hold a JSON object")
    model_type = raw.get("model_type")
    if model_type in _OUTER_TYPES or "text_config" in raw:
        if model_type not in _OUTER_TYPES:
            raise _field_error(source, "model_type", f"unknown model_type {model_type!r} for a nested config")
        family, nested, prefix = _OUTER_TYPES[model_type], True, "text_config."
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise _field_error(source, "text_config", "missing or not an object")
        inner_type = text.get("model_type", family.value + "_text")
        if _TEXT_TYPES.get(inner_type) is not family:
            raise _field_error(
                source, "text_config.model_type", f"{inner_type!r} contradicts model_type {model_type!r}"
            )
    elif model_type in _TEXT_TYPES:
        family, nested, prefix, text = _TEXT_TYPES[model_type], False, "", raw
    else:
        raise _field_error(source, "model_type", f"unknown model_type {model_type!r}")

    architectures = raw.get("architectures")
    if architectures is not None:
        if not isinstance(architectures, list) or len(architectures) != 1:
            raise _field_error(source, "architectures", f"expected one architecture, got {architectures!r}")
        arch = _ARCHITECTURES.get(architectures[0])
        if arch is None:
            raise _field_error(source, "architectures", f"unknown architecture {architectures[0]!r}")
        if arch != (family, nested):
            raise _field_error(source, "architectures", f"{architectures[0]} contradicts model_type {model_type!r}")

    for name in _REQUIRED + (("intermediate_size",) if family is Family.DENSE else ()):
        if text.get(name) is None:
            raise _field_error(source, prefix + name, "missing")
    ints = {name: _checked(text[name], source, prefix + name, int) for name in _REQUIRED}

    for name, expected in (("hidden_act", "silu"), ("mamba_ssm_dtype", "float32")):
        if text.get(name) is not None and text[name] != expected:
            raise _field_error(source, prefix + name, f"unsupported value {text[name]!r} (expected {expected!r})")
    for name, expected in (("attention_bias", False), ("attn_output_gate", True)):
        if text.get(name) is not None and text[name] is not expected:
            raise _field_error(source, prefix + name, f"unsupported value {text[name]!r} (expected {expected!r})")

    tie_values = {
        k: v
        for k, v in (
            ("tie_word_embeddings", raw.get("tie_word_embeddings")),
            (prefix + "tie_word_embeddings", text.get("tie_word_embeddings")),
        )
        if v is not None
    }
    for field, value in tie_values.items():
        _checked(value, source, field, bool)
    if len(set(tie_values.values())) > 1:
        raise _field_error(source, prefix + "tie_word_embeddings", "contradicts the top-level tie_word_embeddings")
    tie = next(iter(tie_values.values()), False)

    dtypes = {text.get(k) or raw.get(k) for k in ("dtype", "torch_dtype")} - {None}
    if len(dtypes) > 1:
        raise _field_error(source, prefix + "dtype", f"contradicts torch_dtype ({sorted(dtypes)})")
    dtype = next(iter(dtypes), "bfloat16")
    if dtype not in DTYPE_BYTES:
        raise _field_error(source, prefix + "dtype", f"unsupported dtype {dtype!r}")

    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    for i, e in enumerate(eos_ids):
        _checked(e, source, f"{prefix}eos_token_id[{i}]", int)

    moe = None
    present_moe = [n for n in _MOE_FIELDS if text.get(n) is not None]
    if family is Family.MOE:
        for name in _MOE_FIELDS:
            if text.get(name) is None:
                raise _field_error(source, prefix + name, "missing (required for qwen3_5_moe)")
        if text.get("intermediate_size") is not None:
            _checked(text["intermediate_size"], source, prefix + "intermediate_size", int)
        mlp_only = text.get("mlp_only_layers") or []
        if mlp_only:
            raise _field_error(
                source, prefix + "mlp_only_layers", f"dense layers inside a MoE model are not supported: {mlp_only!r}"
            )
        step = text.get("decoder_sparse_step", 1)
        if step != 1:
            raise _field_error(source, prefix + "decoder_sparse_step", f"unsupported value {step!r} (expected 1)")
        try:
            moe = MoeConfig(
                *(_checked(text[n], source, prefix + n, int) for n in _MOE_FIELDS),
                norm_topk_prob=_checked(text.get("norm_topk_prob"), source, prefix + "norm_topk_prob", bool, True),
            )
        except ValueError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise _field_error(source, prefix + str(exc).split()[0], str(exc)) from None
    elif present_moe:
        raise _field_error(source, prefix + present_moe[0], "is a MoE field but model_type is dense")

    num_layers = ints["num_hidden_layers"]
    layer_types = _layer_types_from(text, num_layers, source, prefix)
    rope_theta, prf = _rope_from(text, source, prefix)
    mtp = _checked(text.get("mtp_num_hidden_layers"), source, prefix + "mtp_num_hidden_layers", int, 0)
    intermediate = _checked(text.get("intermediate_size"), source, prefix + "intermediate_size", int)
    if intermediate is None:
        intermediate = moe.moe_intermediate_size  # MoE checkpoints may omit the dense size
    kwargs = dict(
        ints,
        intermediate_size=intermediate,
        layer_types=layer_types,
        rms_norm_eps=_checked(text.get("rms_norm_eps"), source, prefix + "rms_norm_eps", float, 1e-6),
        rope_theta=rope_theta,
        partial_rotary_factor=prf,
        max_position_embeddings=_checked(
            text.get("max_position_embeddings"), source, prefix + "max_position_embeddings", int, 32768
        ),
        tie_word_embeddings=tie,
        mtp_num_hidden_layers=mtp,
        dtype=dtype,
        eos_token_ids=eos_ids,
        moe=moe,
        nested=nested,
    )
    try:
        return Qwen35Config(**kwargs)
    except ValueError as exc:
        field = str(exc).split()[0]
        raise _field_error(source, prefix + field, str(exc)) from None


def load_config(model_dir: str | Path) -> Qwen35Config:
    """Read and parse `model_dir/config.json`; CheckpointError names the file and field."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(str(path), "", "missing")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(str(path), "", f"not valid JSON ({exc})") from None
    return parse_config(raw, source=str(path))


def to_hf_dict(config: Qwen35Config) -> dict[str, Any]:
    """The config.json object of `config`, nested under text_config when `config.nested`.

    Writes `layer_types`, `full_attention_interval` when the layer kinds follow one, and
    `rope_parameters`; parse_config(to_hf_dict(c)) == c.
    """
    moe = config.moe is not None
    text: dict[str, Any] = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "layer_types": list(config.layer_types),
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "linear_key_head_dim": config.linear_key_head_dim,
        "linear_value_head_dim": config.linear_value_head_dim,
        "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attn_output_gate": True,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "mtp_num_hidden_layers": config.mtp_num_hidden_layers,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.partial_rotary_factor,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        "dtype": config.dtype,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
    for interval in range(1, config.num_hidden_layers + 1):
        if config.layer_types == tuple(LINEAR if (i + 1) % interval else FULL for i in range(config.num_hidden_layers)):
            text["full_attention_interval"] = interval
            break
    if config.eos_token_ids:
        ids = list(config.eos_token_ids)
        text["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    if config.moe is not None:
        text.update(attrs.asdict(config.moe))
    if not config.nested:
        arch = "Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"
        return {"architectures": [arch], **text}
    arch = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    return {
        "architectures": [arch],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "tie_word_embeddings": config.tie_word_embeddings,
        "text_config": text,
    }
