"""Config parsing (flat, nested, dense, MoE), validation errors naming the field, the
round trip to config.json, agreement with transformers, and the shape presets."""

from __future__ import annotations

import copy
import json

import attrs
import pytest

from executor.config import FULL, LINEAR, Family, load_config, parse_config, to_hf_dict
from executor.errors import CheckpointError
from executor.presets import PRESET_NAMES, preset
from tests.executor.qwen_support import small_config

NESTED_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "image_token_id": 248056,
    "tie_word_embeddings": False,
    "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5"},
    "text_config": {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 24,
        "num_hidden_layers": 64,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "use_cache": True,
        "vocab_size": 248320,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
    },
}


def test_nested_official_layout_parses_to_the_27b_preset():
    config = parse_config(NESTED_27B)
    assert config.nested and config.family is Family.DENSE
    assert len(config.linear_layers) == 48 and len(config.full_layers) == 16
    assert config.full_layers[:2] == (3, 7)
    assert config.rotary_dim == 64 and config.rope_theta == 1e7
    assert config.conv_channels == 2 * 16 * 128 + 48 * 128
    assert config.mtp_num_hidden_layers == 1 and config.eos_token_ids == (248044,)
    assert attrs.evolve(config, eos_token_ids=(248046, 248044)) == preset("qwen3.5-27b")


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
def test_round_trip(nested):
    config = attrs.evolve(small_config(layer_types=(LINEAR, FULL, LINEAR, FULL)), nested=nested)
    assert parse_config(json.loads(json.dumps(to_hf_dict(config)))) == config


def test_flat_layout_with_flat_rope_fields():
    raw = {k: v for k, v in to_hf_dict(small_config()).items() if k != "rope_parameters"}
    raw.update(rope_theta=5e5, partial_rotary_factor=0.5)
    config = parse_config(raw)
    assert not config.nested and config.rope_theta == 5e5 and config.rotary_dim == 16


def test_layer_types_from_interval_when_absent():
    raw = to_hf_dict(small_config())
    del raw["layer_types"]
    raw["full_attention_interval"] = 2
    assert parse_config(raw).layer_types == (LINEAR, FULL, LINEAR, FULL)


def test_matches_transformers_defaults():
    transformers = pytest.importorskip("transformers")
    raw = transformers.Qwen3_5Config().to_dict()
    raw["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    config = parse_config(raw)
    text = transformers.Qwen3_5TextConfig()
    assert config.layer_types == tuple(text.layer_types)
    assert config.hidden_size == text.hidden_size and config.linear_num_value_heads == text.linear_num_value_heads
    assert config.rotary_dim == int(text.head_dim * text.rope_parameters["partial_rotary_factor"])
    moe = transformers.Qwen3_5MoeConfig().to_dict()
    parsed = parse_config(moe)
    assert parsed.family is Family.MOE and parsed.moe.num_experts == 256 and parsed.moe.num_experts_per_tok == 8


def _nested(**changes):
    raw = copy.deepcopy(NESTED_27B)
    for path, value in changes.items():
        target = raw
        keys = path.split("__")
        for key in keys[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[keys[-1]]
        else:
            target[keys[-1]] = value
    return raw


_DELETE = object()
BAD = {
    "missing hidden_size": (_nested(text_config__hidden_size=_DELETE), "text_config.hidden_size"),
    "unknown model_type": (_nested(model_type="qwen9"), "model_type"),
    "unknown architecture": (_nested(architectures=["LlamaForCausalLM"]), "architectures"),
    "inner type contradicts": (_nested(text_config__model_type="qwen3_5_moe_text"), "text_config.model_type"),
    "interval contradicts layer_types": (
        _nested(text_config__layer_types=[LINEAR] * 63 + [FULL]),
        "text_config.layer_types",
    ),
    "unknown layer type": (_nested(text_config__layer_types=["mamba"] * 64), "text_config.layer_types[0]"),
    "layer_types length": (
        _nested(text_config__layer_types=[FULL] * 3, text_config__full_attention_interval=_DELETE),
        "text_config.layer_types",
    ),
    "rope type": (_nested(text_config__rope_parameters={"rope_type": "yarn"}), "rope_type"),
    "rope theta contradicts": (_nested(text_config__rope_theta=5.0), "text_config.rope_theta"),
    "tie contradicts": (_nested(text_config__tie_word_embeddings=True), "text_config.tie_word_embeddings"),
    "hidden_act": (_nested(text_config__hidden_act="gelu"), "text_config.hidden_act"),
    "attention_bias": (_nested(text_config__attention_bias=True), "text_config.attention_bias"),
    "heads not divisible": (_nested(text_config__num_key_value_heads=5), "text_config.num_attention_heads"),
    "negative size": (_nested(text_config__hidden_size=-1), "text_config.hidden_size"),
    "string size": (_nested(text_config__vocab_size="big"), "text_config.vocab_size"),
    "moe field in dense": (_nested(text_config__num_experts=8), "text_config.num_experts"),
    "dtype": (_nested(text_config__dtype="int8"), "text_config.dtype"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_name_the_field(case):
    raw, field = BAD[case]
    with pytest.raises(CheckpointError) as info:
        parse_config(raw, source="ckpt/config.json")
    message = str(info.value)
    assert "\n" not in message and message.startswith("ckpt/config.json: ") and field in message


def _moe_raw(**changes):
    raw = to_hf_dict(preset("qwen3.5-35b-a3b"))
    raw["text_config"].update(changes)
    return {k: v for k, v in raw.items()}


def test_moe_preset_round_trips_and_validates():
    config = preset("qwen3.5-35b-a3b")
    assert parse_config(to_hf_dict(config)) == config
    with pytest.raises(CheckpointError, match="text_config.num_experts_per_tok"):
        parse_config(_moe_raw(num_experts_per_tok=300))
    raw = _moe_raw()
    del raw["text_config"]["moe_intermediate_size"]
    with pytest.raises(CheckpointError, match="text_config.moe_intermediate_size: missing"):
        parse_config(raw)
    with pytest.raises(CheckpointError, match="mlp_only_layers"):
        parse_config(_moe_raw(mlp_only_layers=[0]))


def test_load_config_names_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_config(tmp_path)


def test_presets():
    assert set(PRESET_NAMES) == {
        "qwen3.5-0.8b",
        "qwen3.5-2b",
        "qwen3.5-4b",
        "qwen3.5-9b",
        "qwen3.5-27b",
        "qwen3.5-35b-a3b",
    }
    for name in PRESET_NAMES:
        config = preset(name)
        assert config.vocab_size == 248320 and config.rotary_dim == 64
        assert len(config.full_layers) * 4 == config.num_hidden_layers
        assert parse_config(to_hf_dict(config)) == config
    assert preset("Qwen/Qwen3.5-27B") == preset("qwen3.5-27b")
    assert preset("qwen3.5-9b").hidden_size == 4096 and preset("qwen3.5-0.8b").hidden_size == 1024
    with pytest.raises(ValueError, match="qwen3.5-1t"):
        preset("qwen3.5-1t")
