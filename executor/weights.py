"""Qwen3.5 text weights: the expected tensor list of a config, and loading a (sharded)
safetensors checkpoint in either name layout with every shape and dtype checked.

Canonical names drop the layout prefix: `embed_tokens.weight`, `layers.3.mlp.up_proj.weight`,
`norm.weight`, `lm_head.weight`. Vision (`model.visual.`) and MTP (`mtp.`) tensors are
skipped unless asked. The container format lives in `executor/safetensors_file.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import attrs
import numpy as np
import structlog
import tqdm

from executor.config import FULL, Qwen35Config, load_config
from executor.errors import CheckpointError
from executor.safetensors_file import TensorEntry, bf16_to_f32, load_tensor, read_header

INDEX_FILE = "model.safetensors.index.json"
FLAT_PREFIX = "model."
NESTED_PREFIX = "model.language_model."
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")
_PROGRESS_BYTES = 1 << 30

log = structlog.get_logger(__name__)


def expected_shapes(config: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Canonical tensor name -> shape of a dense Qwen3.5 text model (lm_head only if untied).

    Source: Qwen3_5TextModel / Qwen3_5DecoderLayer / Qwen3_5GatedDeltaNet / Qwen3_5Attention.
    Raises NotImplementedError for MoE configs (their MLP tensors are not listed yet).
    """
    if config.moe is not None:
        raise NotImplementedError("MoE (qwen3_5_moe) weights are parsed in the config but not loaded yet")
    h, c = config.hidden_size, config
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (c.vocab_size, h), "norm.weight": (h,)}
    for i, kind in enumerate(c.layer_types):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if kind == FULL:
            q = c.num_attention_heads * c.head_dim
            kv = c.num_key_value_heads * c.head_dim
            shapes[p + "self_attn.q_proj.weight"] = (2 * q, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, q)
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        else:
            vh = c.linear_num_value_heads
            shapes[p + "linear_attn.in_proj_qkv.weight"] = (c.conv_channels, h)
            shapes[p + "linear_attn.in_proj_z.weight"] = (c.linear_value_dim, h)
            shapes[p + "linear_attn.in_proj_b.weight"] = (vh, h)
            shapes[p + "linear_attn.in_proj_a.weight"] = (vh, h)
            shapes[p + "linear_attn.conv1d.weight"] = (c.conv_channels, 1, c.linear_conv_kernel_dim)
            shapes[p + "linear_attn.dt_bias"] = (vh,)
            shapes[p + "linear_attn.A_log"] = (vh,)
            shapes[p + "linear_attn.norm.weight"] = (c.linear_value_head_dim,)
            shapes[p + "linear_attn.out_proj.weight"] = (h, c.linear_value_dim)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, c.intermediate_size)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def allowed_dtypes(config: Qwen35Config, name: str, shape: tuple[int, ...]) -> tuple[str, ...]:
    """Dtypes accepted for a tensor: the config dtype; 1-D tensors (norms, A_log,
    dt_bias) may also be float32, as some exporters keep them so."""
    if len(shape) == 1 and config.dtype != "float32":
        return (config.dtype, "float32")
    return (config.dtype,)


def checkpoint_name(canonical: str, nested: bool) -> str:
    """The on-disk name of a canonical tensor in the flat or nested layout."""
    if canonical == "lm_head.weight":
        return canonical
    return (NESTED_PREFIX if nested else FLAT_PREFIX) + canonical


@attrs.frozen(slots=True, eq=False)
class Weights:
    """Loaded tensors by canonical name, in checkpoint dtype (bf16 as uint16 bits).

    `dtypes[name]` is "bfloat16", "float16" or "float32". Arrays may be read-only
    memory maps. `lm_head` is the embedding table when the model ties them.
    `mtp` holds the raw `mtp.*` tensors when loaded with include_mtp (unchecked).
    """

    config: Qwen35Config
    tensors: Mapping[str, np.ndarray]
    dtypes: Mapping[str, str]
    nested: bool
    mtp: Mapping[str, np.ndarray] = attrs.field(factory=dict)

    def float32(self, name: str) -> np.ndarray:
        """Tensor `name` upcast to float32 (a new array). `lm_head.weight` falls back to the
        embedding table when tied."""
        if name == "lm_head.weight" and name not in self.tensors:
            name = "embed_tokens.weight"
        array, dtype = self.tensors[name], self.dtypes[name]
        if dtype == "bfloat16":
            return bf16_to_f32(array)
        return np.array(array, dtype=np.float32)


def _entries(model_dir: Path) -> dict[str, TensorEntry]:
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(str(index_path), "weight_map", f"unreadable ({exc!r})") from None
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(str(model_dir / "model.safetensors"), "", "missing: no *.safetensors file")
    entries: dict[str, TensorEntry] = {}
    for file in files:
        path = model_dir / file
        if not path.is_file():
            raise CheckpointError(str(path), "", f"missing (listed in {INDEX_FILE})")
        for name, entry in read_header(path).items():
            if name in entries:
                raise CheckpointError(str(path), name, f"duplicate tensor (also in {entries[name].file})")
            entries[name] = entry
    if weight_map is not None:
        for name, file in weight_map.items():
            entry = entries.get(name)
            if entry is None or Path(entry.file).name != file:
                raise CheckpointError(str(model_dir / file), name, f"listed in {INDEX_FILE} but not in this file")
    return entries


def load_weights(
    model_dir: str | Path,
    config: Qwen35Config | None = None,
    *,
    include_mtp: bool = False,
    progress: bool | None = None,
) -> Weights:
    """Load and check the text weights of a Qwen3.5 checkpoint directory.

    Reads `model.safetensors.index.json` when present (else every *.safetensors file),
    accepts `model.layers.N...` or `model.language_model.layers.N...` names (one layout per
    checkpoint), tied or untied lm_head, skips vision tensors and, unless include_mtp,
    `mtp.*` tensors. Every expected tensor must be present with the expected shape and an
    allowed dtype; unexpected text tensors are an error too. Raises CheckpointError naming
    the file and the first offending tensor. Shows a tqdm bar when the checkpoint is over
    1 GiB (or when progress=True).
    """
    model_dir = Path(model_dir)
    config = config or load_config(model_dir)
    shapes = expected_shapes(config)
    entries = _entries(model_dir)
    nested = any(name.startswith(NESTED_PREFIX) for name in entries)
    by_canonical: dict[str, TensorEntry] = {}
    mtp_entries: dict[str, TensorEntry] = {}
    for name, entry in entries.items():
        if name.startswith(_SKIPPED_PREFIXES):
            continue
        if name.startswith("mtp."):
            if include_mtp:
                mtp_entries[name] = entry
            continue
        prefix = NESTED_PREFIX if nested else FLAT_PREFIX
        if name == "lm_head.weight":
            canonical = name
        elif name.startswith(prefix):
            canonical = name[len(prefix) :]
        else:
            raise CheckpointError(entry.file, name, f"does not match the checkpoint's {prefix!r} layout")
        if canonical not in shapes:
            if canonical == "lm_head.weight" and config.tie_word_embeddings:
                continue  # some exporters write the tied head anyway
            raise CheckpointError(entry.file, name, "unexpected tensor for this config")
        by_canonical[canonical] = entry
    for canonical, shape in shapes.items():
        disk_name = checkpoint_name(canonical, nested)
        entry = by_canonical.get(canonical)
        if entry is None:
            raise CheckpointError(str(model_dir), disk_name, "missing tensor")
        if entry.shape != shape:
            raise CheckpointError(entry.file, disk_name, f"shape {list(entry.shape)}, config expects {list(shape)}")
        allowed = allowed_dtypes(config, canonical, shape)
        if entry.dtype not in allowed:
            raise CheckpointError(entry.file, disk_name, f"dtype {entry.dtype}, expected {' or '.join(allowed)}")
    total_bytes = sum(e.end - e.begin for e in by_canonical.values())
    show = progress if progress is not None else total_bytes > _PROGRESS_BYTES
    tensors: dict[str, np.ndarray] = {}
    with tqdm.tqdm(total=total_bytes, unit="B", unit_scale=True, desc="weights", disable=not show) as bar:
        for canonical in shapes:
            entry = by_canonical[canonical]
            tensors[canonical] = load_tensor(entry)
            bar.update(entry.end - entry.begin)
    mtp = {name: load_tensor(entry) for name, entry in mtp_entries.items()}
    log.info("weights_loaded", model_dir=str(model_dir), tensors=len(tensors), bytes=total_bytes, nested=nested)
    return Weights(
        config=config,
        tensors=tensors,
        dtypes={name: by_canonical[name].dtype for name in tensors},
        nested=nested,
        mtp=mtp,
    )
