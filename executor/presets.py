"""Built-in shape presets of the published Qwen3.5 sizes, so benchmarks and the simulator
can use real shapes without weights. Each preset is the text config of the official
(nested, `Qwen3_5ForConditionalGeneration`) checkpoint.

Sources, per preset (verify against the checkpoint's own config.json when you have it;
a loaded checkpoint always uses its own config, never a preset):
- qwen3.5-27b: the issue text of this project (Qwen/Qwen3.5-27B text_config), matching
  THUDM/slime scripts/models/qwen3.5-27B.sh (hidden 5120, 64 layers, 24 q / 4 kv heads
  x 256, ffn 17408, rotary 0.25, base 1e7, untied, vocab 248320).
- qwen3.5-9b: transformers Qwen3_5TextConfig defaults ("Qwen3.5-9B style": hidden 4096,
  32 layers, 16 q / 4 kv heads, ffn 12288, linear 16 key / 32 value heads).
- qwen3.5-35b-a3b: transformers Qwen3_5MoeTextConfig defaults ("Qwen3.5-35B-A3B style":
  hidden 2048, 40 layers, 16 q / 2 kv heads, 256 experts, 8 per token, expert and
  shared-expert ffn 512).
- qwen3.5-4b, qwen3.5-2b, qwen3.5-0.8b: hidden, layers, q / kv heads, head_dim and ffn from
  the model cards (Qwen/Qwen3.5-*B on Hugging Face, summarised at apxml.com/models/qwen35-*);
  linear-attention head counts and tie_word_embeddings from our reading of the
  published config.json files (0.8B and 2B: 16 value heads; 4B: 32; small sizes tie).
All sizes: vocab 248320, head_dim 256, linear key/value head dim 128, conv kernel 4,
full attention every 4th layer, rope_theta 1e7, partial_rotary_factor 0.25,
max_position_embeddings 262144, one MTP layer, bf16 weights, eos <|im_end|> 248046 and
<|endoftext|> 248044.
"""

from __future__ import annotations

from executor.config import FULL, LINEAR, MoeConfig, Qwen35Config


def _layers(n: int) -> tuple[str, ...]:
    return tuple(LINEAR if (i + 1) % 4 else FULL for i in range(n))


def _shape(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    linear_value_heads: int,
    tie: bool,
    moe: MoeConfig | None = None,
) -> Qwen35Config:
    return Qwen35Config(
        vocab_size=248320,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        layer_types=_layers(layers),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=linear_value_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=262144,
        tie_word_embeddings=tie,
        mtp_num_hidden_layers=1,
        dtype="bfloat16",
        eos_token_ids=(248046, 248044),
        moe=moe,
        nested=True,
    )


def _build(name: str) -> Qwen35Config:
    if name == "qwen3.5-0.8b":
        return _shape(1024, 24, 8, 2, 3584, 16, tie=True)
    if name == "qwen3.5-2b":
        return _shape(2048, 24, 8, 2, 6144, 16, tie=True)
    if name == "qwen3.5-4b":
        return _shape(2560, 32, 16, 4, 9216, 32, tie=True)
    if name == "qwen3.5-9b":
        return _shape(4096, 32, 16, 4, 12288, 32, tie=False)
    if name == "qwen3.5-27b":
        return _shape(5120, 64, 24, 4, 17408, 48, tie=False)
    if name == "qwen3.5-35b-a3b":
        moe = MoeConfig(
            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512
        )
        return _shape(2048, 40, 16, 2, 512, 32, tie=False, moe=moe)
    raise KeyError(name)


PRESET_NAMES: tuple[str, ...] = (
    "qwen3.5-0.8b",
    "qwen3.5-2b",
    "qwen3.5-4b",
    "qwen3.5-9b",
    "qwen3.5-27b",
    "qwen3.5-35b-a3b",
)


def preset(name: str) -> Qwen35Config:
    """The config of a published size by name (case-insensitive; "Qwen/Qwen3.5-27B" works).

    Raises ValueError naming the preset when unknown. For MoE the dense
    `intermediate_size` is set to the expert size (the checkpoint has no dense MLP).
    """
    key = name.rsplit("/", 1)[-1].lower()
    if key not in PRESET_NAMES:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESET_NAMES)}")
    return _build(key)
