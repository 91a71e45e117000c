"""Builders shared by the executor tests: small configs and the transformers oracle."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import attrs
import numpy as np

from executor.config import FULL, LINEAR, Qwen35Config


def small_config(**overrides) -> Qwen35Config:
    """A fast random-test shape: vocab 512, hidden 64, 4 layers (3 linear + 1 full)."""
    base = Qwen35Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rope_theta=10_000.0,
        partial_rotary_factor=0.25,
        dtype="bfloat16",
    )
    return attrs.evolve(base, **overrides)


def gpu_test_configs() -> dict[str, Qwen35Config]:
    """The tiny shapes the GPU backend's exactness tests run (test_gpu_backend.py,
    test_gpu_prefill_graphs.py): small_config (grouped value heads, untied), and a tied,
    deeper one with three full-attention layers, head_dim 16 and half-rotary RoPE."""
    return {
        "gva-untied": small_config(),
        "tied-deep": small_config(
            tie_word_embeddings=True, num_hidden_layers=8,
            layer_types=(LINEAR, FULL, LINEAR, LINEAR, LINEAR, FULL, LINEAR, FULL),
            linear_num_key_heads=1, linear_num_value_heads=3, num_attention_heads=6, num_key_value_heads=2,
            head_dim=16, partial_rotary_factor=0.5,
        ),
    }


def torch_oracle(model_dir: str | Path):
    """transformers.Qwen3_5ForCausalLM (float32, eager attention) holding the checkpoint's
    tensors, read with safetensors.torch (independent of executor.weights)."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    text = raw.get("text_config", raw)
    keep = {
        k: v for k, v in text.items() if k not in ("model_type", "dtype", "attn_output_gate", "mtp_num_hidden_layers")
    }
    keep["tie_word_embeddings"] = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    config = Qwen3_5TextConfig(**keep)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).float().eval()
    state = {}
    for file in sorted(glob.glob(str(Path(model_dir) / "*.safetensors"))):
        for name, tensor in load_file(file).items():
            if name.startswith(("mtp.", "model.visual.")):
                continue
            state[name.replace("model.language_model.", "model.")] = tensor.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    assert not missing and not unexpected, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def torch_last_logits(model, ids) -> np.ndarray:
    """float32 logits [vocab] of the last row of a full (cache-free) forward."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids, dtype=np.int64))[None], use_cache=False).logits[0, -1].numpy()
