"""Incremental detokenization with stop strings: generated token ids in, text deltas out.

A delta is released only once it can no longer change: never half a UTF-8 character
(an incomplete byte sequence decodes to a trailing U+FFFD, which is held back) and never
a prefix of a stop string (held until it either completes, ending the reply, or cannot).
Stop *tokens* (EOS) are the runtime's business; nothing here samples or decides policy.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"


class TextStream:
    """The text of one reply, built token by token.

    push(token_id) returns the newly released text (possibly ""); `stopped` turns True
    when a stop string appears, and the text is cut where it begins (the stop string is
    never released). finish() releases what is held back (nothing after a stop).
    `text` is everything released so far. Control tokens (`<|...|>`) decode to "".
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._longest = max((len(s) for s in self._stop), default=0)
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to text already appended
        self._read = 0
        self._decoded = ""  # text decoded so far (released + held back)
        self._released = 0  # chars of _decoded released
        self.stopped = False

    @property
    def text(self) -> str:
        """Text released so far."""
        return self._decoded[: self._released]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _new_text(self, final: bool) -> str:
        """Text that ids[_read:] add, or "" while it ends in an incomplete character."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _held(self) -> int:
        """Chars at the end of the unreleased text that could start a stop string."""
        tail = self._decoded[self._released :]
        for k in range(min(len(tail), self._longest - 1), 0, -1):
            end = tail[-k:]
            if any(s.startswith(end) for s in self._stop):
                return k
        return 0

    def _add(self, piece: str) -> str:
        if not piece:
            return ""
        start = max(self._released, len(self._decoded) - self._longest + 1)
        self._decoded += piece
        hits = [i for s in self._stop if (i := self._decoded.find(s, start)) >= 0]
        if hits:
            cut = min(hits)
            out = self._decoded[self._released : cut]
            self._decoded = self._decoded[:cut]
            self._released = cut
            self.stopped = True
            return out
        safe = len(self._decoded) - self._held()
        out = self._decoded[self._released : safe]
        self._released = max(self._released, safe)
        return out

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text released by it ("" after a stop)."""
        if self.stopped:
            return ""
        self._ids.append(int(token_id))
        return self._add(self._new_text(final=False))

    def finish(self) -> str:
        """The reply ended: release everything held back (incomplete characters as U+FFFD)."""
        if self.stopped:
            return ""
        out = self._add(self._new_text(final=True))
        if self.stopped:
            return out
        out += self._decoded[self._released :]
        self._released = len(self._decoded)
        return out
