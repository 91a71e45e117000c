"""Where the API renders a request (executor/server.py `_off_loop_if_large`): small bodies on
the event loop (two thread hops cost more than a cached render), large ones in a worker thread
(so the loop keeps serving while a long text is rendered and tokenized)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from executor.server import INLINE_RENDER_BYTES, _off_loop_if_large
from executor.tokenizer import RELEASE_GIL_CHARS


class _Api:
    off_loop = 0


class _Request:
    def __init__(self, content_length: int | None) -> None:
        self.content_length = content_length


@pytest.mark.parametrize(("length", "on_loop"), [
    (0, True), (8_000, True), (INLINE_RENDER_BYTES, True),  # a 2,036-row chat is ~8 KB
    (INLINE_RENDER_BYTES + 1, False), (1 << 20, False),
    (None, False),  # chunked: no Content-Length, size unknown
])
def test_small_bodies_render_on_the_loop_and_large_ones_in_a_thread(length, on_loop):
    api = _Api()

    def fn(arg):
        return threading.get_ident(), arg, api.off_loop  # a busy-polling loop waits while this is 1

    async def main() -> tuple[int, tuple]:
        loop_thread = threading.get_ident()
        ran = await _off_loop_if_large(api, _Request(length), fn, "x")
        assert ran[1] == "x"
        return loop_thread, ran

    loop_thread, (ran_in, _, counted) = asyncio.run(main())
    assert (ran_in == loop_thread) is on_loop
    assert counted == (0 if on_loop else 1) and api.off_loop == 0


def test_inline_bodies_hold_no_text_the_tokenizer_would_encode_without_the_gil():
    """A body of INLINE_RENDER_BYTES holds at most that many characters of text, which
    `tokenizers` encodes holding the GIL (encode_ids), so a thread would not free the loop."""
    assert INLINE_RENDER_BYTES <= RELEASE_GIL_CHARS
