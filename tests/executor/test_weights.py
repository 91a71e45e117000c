"""Checkpoint loading: both name layouts, shards, tied heads, skipped tensors, bf16 bits,
and one clear CheckpointError (one line naming file and tensor/field) per bad checkpoint."""

from __future__ import annotations

import json
import os

import attrs
import numpy as np
import pytest

from executor.errors import CheckpointError
from executor.model import random_checkpoint, random_tensors
from executor.safetensors_file import bf16_to_f32, f32_to_bf16, read_header, write_file
from executor.weights import expected_shapes, load_weights
from tests.executor.qwen_support import small_config


def _one_line(exc: CheckpointError, *parts: str) -> None:
    message = str(exc)
    assert "\n" not in message
    for part in parts:
        assert part in message, (part, message)


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("shards", [1, 3])
def test_layouts_and_shards_load_the_same_tensors(tmp_path, nested, shards):
    config = attrs.evolve(small_config(), nested=nested)
    weights = load_weights(random_checkpoint(config, 3, tmp_path, shards=shards))
    assert weights.nested == nested and set(weights.tensors) == set(expected_shapes(config))
    expected = random_tensors(config, 3)
    for name, value in expected.items():
        assert weights.dtypes[name] == "bfloat16"
        assert weights.tensors[name].dtype == np.uint16
        assert np.array_equal(weights.float32(name), bf16_to_f32(f32_to_bf16(value)))


def test_tied_head_reads_the_embedding(tmp_path):
    config = small_config(tie_word_embeddings=True)
    weights = load_weights(random_checkpoint(config, 1, tmp_path))
    assert "lm_head.weight" not in weights.tensors
    assert np.array_equal(weights.float32("lm_head.weight"), weights.float32("embed_tokens.weight"))


def test_float32_checkpoint_and_mtp_on_request(tmp_path):
    config = small_config(dtype="float32")
    extra = {"mtp.fc.weight": np.ones((2, 2), np.float32), "model.visual.blocks.0.w": np.ones(2, np.float32)}
    model_dir = random_checkpoint(config, 2, tmp_path, extra_tensors=extra)
    plain = load_weights(model_dir)
    assert plain.tensors["norm.weight"].dtype == np.float32 and not plain.mtp
    with_mtp = load_weights(model_dir, include_mtp=True)
    assert list(with_mtp.mtp) == ["mtp.fc.weight"]


def test_bf16_round_trip_is_exact_and_rounds_to_nearest_even():
    values = np.array([1.0, -2.5, 3.140625, 1 + 2**-8, 1 + 3 * 2**-8, np.inf], np.float32)
    bits = f32_to_bf16(values)
    assert bits.tolist()[:2] == [0x3F80, 0xC020]
    assert bf16_to_f32(bits).tolist() == [1.0, -2.5, 3.140625, 1.0, 1 + 4 * 2**-8, np.inf]


def _rewrite(path, mutate):
    header = read_header(path)
    tensors = {}
    for name, entry in header.items():
        array = np.memmap(
            path,
            dtype=np.uint16 if entry.dtype == "bfloat16" else np.float32,
            mode="r",
            offset=entry.begin,
            shape=entry.shape,
        )
        tensors[name] = (entry.dtype, np.array(array))
    mutate(tensors)
    write_file(path, tensors)


@pytest.fixture
def checkpoint(tmp_path):
    return random_checkpoint(attrs.evolve(small_config(), nested=True), 4, tmp_path)


def test_missing_tensor(checkpoint):
    _rewrite(checkpoint / "model.safetensors", lambda t: t.pop("model.language_model.layers.2.linear_attn.A_log"))
    with pytest.raises(CheckpointError) as info:
        load_weights(checkpoint)
    _one_line(info.value, str(checkpoint), "model.language_model.layers.2.linear_attn.A_log", "missing tensor")


def test_wrong_shape(checkpoint):
    name = "model.language_model.layers.3.self_attn.k_proj.weight"
    _rewrite(
        checkpoint / "model.safetensors", lambda t: t.__setitem__(name, ("bfloat16", np.zeros((3, 64), np.uint16)))
    )
    with pytest.raises(CheckpointError) as info:
        load_weights(checkpoint)
    _one_line(info.value, "model.safetensors", name, "shape [3, 64]", "[64, 64]")


def test_wrong_dtype(checkpoint):
    name = "model.language_model.layers.0.mlp.up_proj.weight"
    _rewrite(
        checkpoint / "model.safetensors", lambda t: t.__setitem__(name, ("float32", np.zeros((96, 64), np.float32)))
    )
    with pytest.raises(CheckpointError) as info:
        load_weights(checkpoint)
    _one_line(info.value, "model.safetensors", name, "dtype float32")


def test_unexpected_tensor_and_mixed_layout(checkpoint):
    _rewrite(
        checkpoint / "model.safetensors",
        lambda t: t.__setitem__(
            "model.layers.0.mlp.up_proj.weight", t["model.language_model.layers.0.mlp.up_proj.weight"]
        ),
    )
    with pytest.raises(CheckpointError) as info:
        load_weights(checkpoint)
    _one_line(info.value, "model.layers.0.mlp.up_proj.weight", "layout")


def test_truncated_file(checkpoint):
    path = checkpoint / "model.safetensors"
    header = read_header(path)
    last = max(header.values(), key=lambda e: e.end)
    os.truncate(path, last.end - 10)
    with pytest.raises(CheckpointError) as info:
        load_weights(checkpoint)
    _one_line(info.value, str(path), last.name, "truncated")
    os.truncate(path, 5)
    with pytest.raises(CheckpointError) as info:
        load_weights(checkpoint)
    _one_line(info.value, str(path), "truncated")


def test_config_missing_a_field(checkpoint):
    raw = json.loads((checkpoint / "config.json").read_text())
    del raw["text_config"]["linear_num_value_heads"]
    (checkpoint / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as info:
        load_weights(checkpoint)
    _one_line(info.value, str(checkpoint / "config.json"), "text_config.linear_num_value_heads", "missing")


def test_index_naming_a_missing_shard(tmp_path):
    model_dir = random_checkpoint(small_config(), 5, tmp_path, shards=2)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as info:
        load_weights(model_dir)
    _one_line(info.value, "model-00002-of-00002.safetensors", "missing")


def test_no_weights_at_all(tmp_path):
    model_dir = random_checkpoint(small_config(), 5, tmp_path)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_weights(model_dir)


def test_moe_weights_are_not_loaded_yet(tmp_path):
    from executor.presets import preset

    with pytest.raises(NotImplementedError, match="MoE"):
        expected_shapes(preset("qwen3.5-35b-a3b"))


def test_random_checkpoints_are_deterministic(tmp_path):
    a = random_checkpoint(small_config(), 8, tmp_path / "a", shards=2)
    b = random_checkpoint(small_config(), 8, tmp_path / "b", shards=2)
    for name in ("config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
