"""The reference backend against transformers' Qwen3_5ForCausalLM (CPU torch, float32)."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from executor.config import FULL, LINEAR
from executor.model import random_checkpoint
from executor.reference.backend import ReferenceBackend
from executor.reference.ops import log_softmax
from tests.executor.qwen_support import small_config, torch_last_logits, torch_oracle
from tests.helpers import assert_close

pytest.importorskip("torch")
pytest.importorskip("transformers")

L, F = LINEAR, FULL
CONFIGS = {
    # more value heads than key heads (2 -> 4), untied lm_head, head_dim 32, rotary 8
    "gva-untied": small_config(),
    # tied embeddings, key heads == value heads, MHA-like attention (4 q / 4 kv heads)
    "tied": small_config(
        tie_word_embeddings=True,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        num_key_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
    ),
    # 8 layers with an irregular hybrid pattern, 3x value grouping, half-rotary, 2 shards
    "deep": small_config(
        num_hidden_layers=8,
        layer_types=(L, F, L, L, L, F, L, F),
        linear_num_key_heads=1,
        linear_num_value_heads=3,
        partial_rotary_factor=0.5,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=1_000_000.0,
        dtype="float32",
    ),
}
PROMPT_ROWS = 57
STEPS = 16


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "flat"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logprobs_and_greedy_match_transformers(tmp_path, name, nested):
    config = attrs.evolve(CONFIGS[name], nested=nested)
    shards = 2 if name == "deep" else 1
    extra = {"mtp.fc.weight": np.ones((4, 4), np.float32), "model.visual.patch.weight": np.ones(3, np.float32)}
    model_dir = random_checkpoint(config, seed=len(name) + nested, out_dir=tmp_path, shards=shards, extra_tensors=extra)
    oracle = torch_oracle(model_dir)
    backend = ReferenceBackend.from_dir(model_dir)
    rng = np.random.default_rng(7)
    ids = [int(x) for x in rng.integers(0, config.vocab_size, PROMPT_ROWS)]
    state = backend.new_state()
    logits = backend.prefill(state, ids, (0, len(ids)))
    ours, theirs = [], []
    for step in range(STEPS):
        expected = torch_last_logits(oracle, ids)
        assert_close(f"{name} step {step} logprobs", log_softmax(expected), log_softmax(logits), 1e-4)
        ours.append(int(np.argmax(logits)))
        theirs.append(int(np.argmax(expected)))
        ids.append(theirs[-1])
        logits = backend.decode([state], [ours[-1]])[0]
    assert ours == theirs
