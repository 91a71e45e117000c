"""Random checkpoints in the real Hugging Face layout, and the built-in tiny model.

`random_checkpoint` writes config.json, (sharded) safetensors, tokenizer.json and
chat_template.jinja the way an official Qwen3.5 checkpoint lays them out; tests and the
tiny default model use it. Loading lives in weights.py / tokenizer.py / chat.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import structlog

from executor.cache import cache_dir
from executor.chat import TEMPLATE_FILE, builtin_template
from executor.config import FULL, LINEAR, Qwen35Config, to_hf_dict
from executor.safetensors_file import f32_to_bf16, write_file
from executor.tokenizer import QWEN35_BASE_VOCAB, QWEN35_SPECIAL_TOKENS, TOKENIZER_FILE, default_tokenizer_path
from executor.weights import INDEX_FILE, checkpoint_name, expected_shapes

log = structlog.get_logger(__name__)

TOKENIZER_VOCAB = QWEN35_BASE_VOCAB + len(QWEN35_SPECIAL_TOKENS)
TINY_NAME = "tiny-qwen3_5-v1"


def tiny_config() -> Qwen35Config:
    """The built-in tiny model: real vocabulary (248320), 4 layers (3 linear + 1 full),
    hidden 64, 4 query heads and 2 KV heads of 16, linear attention 2 key / 4 value heads
    of 16, MLP 128, tied embeddings, bf16, nested (official) layout."""
    return Qwen35Config(
        vocab_size=248320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=262144,
        tie_word_embeddings=True,
        dtype="bfloat16",
        eos_token_ids=(248046, 248044),
        nested=True,
    )


def random_tensors(config: Qwen35Config, seed: int) -> dict[str, np.ndarray]:
    """Deterministic float32 weights for every expected tensor (canonical names).

    Scales keep activations O(1) so logits are well spread: projections ~ N(0, 1/fan_in),
    embeddings ~ N(0, 1) (N(0, 9/hidden) when tied, as they are the lm_head),
    norm weights ~ N(0, 0.1) (zero-centred norms) or 1 + N(0, 0.1)
    (the gated norm), A = exp(A_log) in [0.05, 1.5], dt_bias ~ N(0, 0.5), lm_head scaled
    for logits of std ~ 3.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("A_log"):
            value = np.log(rng.uniform(0.05, 1.5, shape))
        elif name.endswith("dt_bias"):
            value = rng.normal(0.0, 0.5, shape)
        elif name.endswith("linear_attn.norm.weight"):
            value = 1.0 + rng.normal(0.0, 0.1, shape)
        elif len(shape) == 1:
            value = rng.normal(0.0, 0.1, shape)
        elif name == "embed_tokens.weight":
            std = 3.0 / np.sqrt(shape[1]) if config.tie_word_embeddings else 1.0
            value = rng.normal(0.0, std, shape)
        elif name == "lm_head.weight":
            value = rng.normal(0.0, 3.0 / np.sqrt(shape[1]), shape)
        elif name.endswith("conv1d.weight"):
            value = rng.normal(0.0, 1.0 / np.sqrt(shape[2]), shape)
        else:
            value = rng.normal(0.0, 1.0 / np.sqrt(shape[1]), shape)
        out[name] = value.astype(np.float32)
    return out


def random_checkpoint(
    shape: Qwen35Config,
    seed: int,
    out_dir: str | Path,
    *,
    shards: int = 1,
    with_tokenizer: bool | None = None,
    with_template: bool = True,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write a complete random checkpoint of config `shape` into `out_dir`.

    Layout follows `shape.nested` (model.language_model.* + text_config, or model.* flat);
    weights in `shape.dtype` (bf16 written as bf16); `shards` > 1 writes
    model-0000i-of-0000n.safetensors plus model.safetensors.index.json. tokenizer.json
    (the embedded Qwen3.5 tokenizer) is written when with_tokenizer, or by default when
    the vocabulary holds all of its 248077 ids; chat_template.jinja when with_template.
    `extra_tensors` are added verbatim by on-disk name (e.g. "mtp.fc.weight").
    Same arguments, same bytes. Returns the directory.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_hf_dict(shape), indent=2) + "\n", encoding="utf-8")
    tensors = {checkpoint_name(name, shape.nested): value for name, value in random_tensors(shape, seed).items()}
    encoded = {}
    for name, value in {**tensors, **(extra_tensors or {})}.items():
        dtype = "float32" if shape.dtype == "float32" else "bfloat16"
        bits = value if dtype == "float32" else f32_to_bf16(value)
        encoded[name] = (dtype, bits)
    names = list(encoded)
    groups = [names[i::shards] for i in range(shards)] if shards > 1 else [names]
    weight_map = {}
    for i, group in enumerate(groups):
        file = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_file(out / file, {n: encoded[n] for n in group})
        weight_map.update({n: file for n in group})
    if shards > 1:
        total = sum(a.nbytes for _, a in encoded.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    if with_tokenizer is None:
        with_tokenizer = shape.vocab_size >= TOKENIZER_VOCAB
    if with_tokenizer:
        shutil.copyfile(default_tokenizer_path(), out / TOKENIZER_FILE)
    if with_template:
        (out / TEMPLATE_FILE).write_text(builtin_template(), encoding="utf-8")
    log.info("random_checkpoint_written", out_dir=str(out), seed=seed, shards=shards, tensors=len(encoded))
    return out


def tiny_model_dir() -> Path:
    """The built-in tiny model (tiny_config, seed 0), generated once into the cache folder
    ($WARMSTATE_CACHE or ~/.cache/warmstate) and reused; deterministic."""
    final = cache_dir() / TINY_NAME
    if (final / "config.json").is_file():
        return final
    tmp = cache_dir() / f".{TINY_NAME}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    random_checkpoint(tiny_config(), 0, tmp)
    try:
        tmp.rename(final)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return final
