"""`python -m executor.serve --random-weights PRESET` on a GPU: seeded random weights at a
published shape behind the real Qwen3.5 tokenizer and chat template. Marked `cuda`; skips
cleanly without an NVIDIA GPU (the CPU-side argument and error checks are in
test_serve_cli.py)."""

from __future__ import annotations

import pytest

from executor.chat import ChatRenderer, builtin_template
from executor.numba_cuda.device import is_gpu_available
from executor.tokenizer import default_tokenizer
from tests.executor.serve_support import ServerProcess

pytestmark = pytest.mark.cuda
if not is_gpu_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("nvmath")

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello! Who are you?"}]


def _chat(server: ServerProcess, model: str) -> dict:
    status, body = server.post("/v1/chat/completions", {
        "model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert status == 200, body
    return body


def test_random_weights_serve_a_preset_with_the_real_tokenizer():
    server = ServerProcess("--random-weights", "qwen3.5-0.8b", "--seed", "3", "--backend", "cuda", "--context", "2048",
                           "--lanes", "2", timeout_s=900)
    try:
        assert server.lines[0].startswith("serving qwen3.5-0.8b-random-s3 on the cuda backend")
        assert server.post("/v1/chat/completions", {"model": "other", "messages": MESSAGES})[0] == 404
        first, again = _chat(server, "qwen3.5-0.8b-random-s3"), _chat(server, "qwen3.5-0.8b-random-s3")
        rows = len(ChatRenderer(default_tokenizer(), builtin_template()).render(MESSAGES).token_ids)
        assert first["usage"]["prompt_tokens"] == rows and first["usage"]["completion_tokens"] == 8
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the repeat resumed a kept state
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    finally:
        assert server.stop() == 0
