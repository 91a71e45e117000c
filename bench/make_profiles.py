"""Write the analytic cost profiles sim/profiles/qwen3.5-{2b,9b,27b}-h200.json.

Derives each profile's coefficients from a Qwen3.5 text config and the H200 ceilings measured
here (shared/device/README.md); a GPU-measured profile (bench/profile.py, "table" form) replaces
one later. Usage: python bench/make_profiles.py [OUT_DIR]   (default: sim/profiles)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from policy.shape import ModelShape
from sim.cost import AnalyticCost, Profile, profile_to_dict

MATRIX_FLOPS_PER_S = 770e12
"""cuBLAS bf16 GEMM through nvmath-python on the H200 here (device/README.md)."""
COPY_BYTES_PER_S = 4.3e12
"""The H200's device-memory copy ceiling (device/README.md)."""
MATRIX_EFFICIENCY = 0.6
"""Assumed fraction of the GEMM peak a whole prefill reaches (norms, RoPE, conv, gated delta
rule and attention kernels run below peak): puts 9B prefill of 32K rows near 1.1 s."""
CHUNK_OVERHEAD_S_PER_LAYER = 30e-6
"""Assumed fixed cost per layer per prefill chunk: about a dozen kernels at ~2.5 us of gap each."""
ROUND_OVERHEAD_S_PER_LAYER = 5e-6
"""Assumed fixed cost per layer per decode round replayed from a CUDA graph (~1 us a kernel:
300 captured launches replayed in 288 us, device/README.md)."""
DELTA_CHUNK_ROWS = 64
"""Sub-chunk of the chunked gated delta rule (flash-linear-attention's chunk size)."""

CONFIGS = {
    # Given in the issue; matches THUDM/slime scripts/models/qwen3.5-27B.sh (64 layers, hidden
    # 5120, 24 heads, 4 query groups, kv-channels 256, ffn 17408, vocab 248320, untied).
    "qwen3.5-27b": dict(model="Qwen/Qwen3.5-27B", hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
                        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128,
                        linear_num_value_heads=48, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                        intermediate_size=17408, vocab_size=248320, tie_word_embeddings=False),
    # Qwen/Qwen3.5-9B config.json text_config as copied into public test fixtures (e.g. a
    # "real Qwen3.5-9B config" fixture: hidden 4096, 32 layers, 16 x 256 q, 4 x 256 kv, linear
    # 16 x 128 keys / 32 x 128 values, intermediate 12288, vocab 248320, untied).
    "qwen3.5-9b": dict(model="Qwen/Qwen3.5-9B", hidden_size=4096, num_hidden_layers=32, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128,
                       linear_num_value_heads=32, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                       intermediate_size=12288, vocab_size=248320, tie_word_embeddings=False),
    # Qwen/Qwen3.5-2B text_config as quoted in public code (hidden 2048, 24 layers, 8 x 256 q,
    # 2 x 256 kv, linear 16 x 128 keys and values, intermediate 6144, vocab 248320, tied).
    "qwen3.5-2b": dict(model="Qwen/Qwen3.5-2B", hidden_size=2048, num_hidden_layers=24, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128,
                       linear_num_value_heads=16, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                       intermediate_size=6144, vocab_size=248320, tie_word_embeddings=True),
}
"""Text configs; every 4th layer is full attention (full_attention_interval 4), the rest Gated
DeltaNet. Vision tower and MTP head are not counted (text serving)."""


_SHAPE_KEYS = ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim",
               "linear_conv_kernel_dim", "num_key_value_heads", "head_dim")


def shape_of(cfg: dict) -> ModelShape:
    """The state-sizing shape of a config (full attention every 4th layer)."""
    attention = cfg["num_hidden_layers"] // 4
    return ModelShape(linear_layers=cfg["num_hidden_layers"] - attention, attention_layers=attention,
                      **{k: cfg[k] for k in _SHAPE_KEYS})


def layer_params(cfg: dict, shape: ModelShape) -> tuple[int, int]:
    """(non-embedding params, LM head params) of a Qwen3.5 text model.

    Attention layer: q_proj (query + output gate: 2 x heads x head_dim), k_proj, v_proj,
    o_proj, q/k norms. Gated DeltaNet layer: in_proj_qkv (conv channels), in_proj_z (V x Dv),
    in_proj_a and in_proj_b (V each), conv1d (channels x kernel), A_log and dt_bias (V), norm
    (Dv), out_proj. Every layer: SwiGLU MLP (3 x hidden x intermediate) and two RMSNorms.
    """
    h, hd, q = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    attn = h * 2 * q * hd + 2 * h * kv + q * hd * h + 2 * hd
    v = shape.linear_num_value_heads
    vd = v * shape.linear_value_head_dim
    ch = shape.conv_channels
    linear = (h * ch + h * vd + 2 * h * v + ch * shape.linear_conv_kernel_dim + 2 * v
              + shape.linear_value_head_dim + vd * h)
    common = 3 * h * cfg["intermediate_size"] + 2 * h
    body = shape.attention_layers * (attn + common) + shape.linear_layers * (linear + common) + h
    return body, h * cfg["vocab_size"]


def delta_flops_per_row(shape: ModelShape, chunk: int = DELTA_CHUNK_ROWS) -> int:
    """FLOPs per row of the chunked gated delta rule over every linear layer.

    Per value head (keys broadcast to value heads), C = chunk rows, dk/dv head dims:
    6 dk dv (inter-chunk: q S, the w S correction, the S update) + 6 C dk (k k^T, w = A k,
    intra-chunk q k^T) + 4 C dv (u = A v, intra-chunk P v) + C^2 (the triangular solve).
    """
    dk, dv, c = shape.linear_key_head_dim, shape.linear_value_head_dim, chunk
    per_head = 6 * dk * dv + 6 * c * dk + 4 * c * dv + c * c
    return per_head * shape.linear_num_value_heads * shape.linear_layers


def make_profile(key: str) -> Profile:
    """The analytic H200 profile of CONFIGS[key]."""
    cfg = CONFIGS[key]
    shape = shape_of(cfg)
    body, head = layer_params(cfg, shape)
    layers = cfg["num_hidden_layers"]
    cost = AnalyticCost(
        matrix_flops_per_s=MATRIX_FLOPS_PER_S, matrix_efficiency=MATRIX_EFFICIENCY,
        copy_bytes_per_s=COPY_BYTES_PER_S,
        weight_bytes=2 * (body + head), dense_flops_per_row=2.0 * body, logits_flops_per_row=2.0 * head,
        attention_flops_per_pair=4.0 * cfg["num_attention_heads"] * cfg["head_dim"] * shape.attention_layers,
        linear_flops_per_row=float(delta_flops_per_row(shape)),
        chunk_overhead_s=CHUNK_OVERHEAD_S_PER_LAYER * layers, round_overhead_s=ROUND_OVERHEAD_S_PER_LAYER * layers)
    embed = 0 if cfg["tie_word_embeddings"] else head
    notes = (f"analytic roofline from the {cfg['model']} text config (bench/make_profiles.py): "
             f"{body:,} non-embedding params, {head:,} LM head, {body + head + embed:,} text params in all; "
             f"bf16 weights; ceilings {MATRIX_FLOPS_PER_S / 1e12:.0f} TFLOP/s x {MATRIX_EFFICIENCY} and "
             f"{COPY_BYTES_PER_S / 1e12:.1f} TB/s; overheads assumed, not measured")
    return Profile(name=f"{key}-h200-roofline", source="analytic", gpu="NVIDIA H200", model=cfg["model"], shape=shape,
                   invariant_rows=None, cost=cost, notes=notes)


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for key in CONFIGS:
        profile = make_profile(key)
        path = out_dir / f"{profile.name}.json"
        path.write_text(json.dumps(profile_to_dict(profile), indent=2) + "\n", encoding="utf-8")
        decode = profile.decode_round_s(1, [0])
        print(f"{path}: decode 1 lane {decode * 1e3:.2f} ms (1/{1 / decode:.0f} s), "
              f"prefill 32K {profile.prefill_s(32768, 0):.2f} s, "
              f"prefill 4K {profile.prefill_s(4096, 0) * 1e3:.0f} ms")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "sim" / "profiles")
