"""`python -m executor.generate`: the JSON output, seeds, logprobs, id-only checkpoints,
and the built-in tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import attrs
import numpy as np
import pytest

from executor.generate import GenerateRequest, generate, main
from executor.model import random_checkpoint, tiny_config, tiny_model_dir
from executor.reference.backend import ReferenceBackend
from executor.sampling import SamplingParams
from executor.weights import load_weights
from tests.executor.qwen_support import small_config


@pytest.fixture(scope="module")
def idonly(tmp_path_factory):
    return random_checkpoint(small_config(), 9, tmp_path_factory.mktemp("ids"), with_tokenizer=False)


def _run(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_prompt_ids_without_tokenizer(capsys, idonly):
    out = _run(
        capsys, "--model", str(idonly), "--prompt-ids", "1,2,3,4", "--max-tokens", "5", "--json", "--logprobs", "3"
    )
    assert len(out["tokens"]) == 5 and out["text"] is None and out["finish_reason"] == "length"
    assert len(out["top_logprobs"]) == 5
    for step, token in zip(out["top_logprobs"], out["tokens"]):
        assert len(step) == 3 and step[0][0] == token  # greedy picks the top entry
        assert [lp for _, lp in step] == sorted((lp for _, lp in step), reverse=True)
        assert all(lp <= 0 for _, lp in step)


def test_library_greedy_matches_prefill_argmax(idonly):
    backend = ReferenceBackend(load_weights(idonly))
    result = generate(backend, GenerateRequest(prompt_ids=(5, 6, 7), max_tokens=3))
    state = backend.new_state()
    first = int(np.argmax(backend.prefill(state, [5, 6, 7], (0, 3))))
    assert result.tokens[0] == first and len(result.tokens) == 3


def test_seed_reproduces_a_sampled_reply(capsys, idonly):
    args = [
        "--model",
        str(idonly),
        "--prompt-ids",
        "9,8,7",
        "--max-tokens",
        "6",
        "--temperature",
        "1.5",
        "--top-p",
        "0.95",
        "--json",
    ]
    a = _run(capsys, *args, "--seed", "42")
    b = _run(capsys, *args, "--seed", "42")
    assert a["tokens"] == b["tokens"] and a["seed"] == 42


def test_stop_token_ends_the_reply(idonly):
    backend = ReferenceBackend(load_weights(idonly))
    greedy = generate(backend, GenerateRequest(prompt_ids=(1, 2), max_tokens=4)).tokens
    stopped = generate(backend, GenerateRequest(prompt_ids=(1, 2), max_tokens=4, stop_ids={greedy[1]}))
    assert stopped.tokens == greedy[:2] and stopped.finish_reason == "stop"
    assert generate(backend, GenerateRequest(prompt_ids=(1,), max_tokens=0, sampling=SamplingParams())).tokens == ()


def test_text_prompt_needs_a_tokenizer(capsys, idonly):
    assert main(["--model", str(idonly), "--prompt", "hi"]) == 2
    assert "use --prompt-ids" in capsys.readouterr().err


def test_tiny_model_is_deterministic_and_cached():
    path = tiny_model_dir()
    assert path == tiny_model_dir() and (path / "tokenizer.json").is_file() and (path / "chat_template.jinja").is_file()
    assert load_weights(path).config == tiny_config()


def test_chat_file_on_the_tiny_model(capsys, tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Hello!"}], "enable_thinking": False}))
    out = _run(capsys, "--chat", str(chat), "--max-tokens", "3", "--json")
    assert len(out["tokens"]) <= 3 and isinstance(out["text"], str) and out["prompt_tokens"] > 5


def test_module_entry_point_prints_one_json_object():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "executor.generate",
            "--prompt",
            "Hi there",
            "--max-tokens",
            "2",
            "--json",
            "--seed",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["tokens"]) == 2 and isinstance(out["text"], str)


@pytest.mark.parametrize("argv, message", [
    (("--prompt-ids", "1,2,3", "--max-tokens", "62"), "the prompt's 3 tokens and 62 to generate pass the model's "
                                                      "context of 64 (max_position_embeddings)"),
    (("--prompt-ids", "1,2,3", "--max-tokens", "2", "--logprobs", "100000000"), "logprobs: at most the vocabulary's"),
], ids=["past-the-context", "logprobs-past-the-vocabulary"])
def test_requests_the_model_cannot_serve_exit_2_naming_the_limit(capsys, tmp_path, argv, message):
    """A prompt + max_tokens past max_position_embeddings (the server's 400) and logprobs past
    the vocabulary: one `error:` line, exit 2. Before the fix the CLI generated past the
    context and accepted any logprobs."""
    model = random_checkpoint(attrs.evolve(small_config(), max_position_embeddings=64), 9, tmp_path,
                              with_tokenizer=False)
    assert main(["--model", str(model), *argv]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after the weights' log lines
    assert last.startswith("error: ") and message in last
    assert main(["--model", str(model), "--prompt-ids", "1,2,3", "--max-tokens", "61", "--json"]) == 0  # fits exactly


def test_chat_file_with_an_unknown_role_names_it(capsys, tmp_path):
    """--chat checks the message list as the server does: an unknown role is named (it said
    "No user query found in messages." before)."""
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "wizard", "content": "Hello!"}]))
    assert main(["--chat", str(chat), "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --chat {chat}: messages[0].role") and "wizard" in err

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("extra", [{}, {"enable_thinking": False}, {"tools": [TOOL]},
                                   {"tools": [TOOL], "enable_thinking": False}], ids=["plain", "no-think", "tools", "both"])
def test_chat_file_renders_as_the_server_does(capsys, tmp_path, extra):
    """--chat's tools and enable_thinking (default on) reach the template: the prompt is the
    server's rendering of the same request."""
    from executor.chat import ChatRenderer, load_template
    from executor.tokenizer import load_tokenizer

    messages = [{"role": "user", "content": "Hello!"}]
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": messages, **extra}))
    out = _run(capsys, "--chat", str(chat), "--max-tokens", "0", "--json")
    model = tiny_model_dir()
    renderer = ChatRenderer(load_tokenizer(model), load_template(model))
    want = renderer.render(messages, extra.get("tools"), enable_thinking=extra.get("enable_thinking", True)).token_ids
    assert out["prompt_tokens"] == len(want)


def test_chat_file_thinking_type_error_names_the_file_s_field(capsys, tmp_path):
    """A non-bool enable_thinking in the --chat file is named as the file names it (it was named
    chat_template_kwargs.enable_thinking, the API's field)."""
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "enable_thinking": "no"}))
    assert main(["--chat", str(chat), "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --chat {chat}: enable_thinking:"), err


def test_logprobs_up_to_the_vocabulary_fit(capsys, tmp_path):
    """--logprobs may be the vocabulary's size, not one more."""
    model = random_checkpoint(attrs.evolve(small_config(), max_position_embeddings=64), 9, tmp_path,
                              with_tokenizer=False)
    vocab = small_config().vocab_size
    assert main(["--model", str(model), "--prompt-ids", "1,2", "--max-tokens", "1", "--logprobs", str(vocab)]) == 0
    capsys.readouterr()
    assert main(["--model", str(model), "--prompt-ids", "1,2", "--max-tokens", "1", "--logprobs", str(vocab + 1)]) == 2
