"""Conversation ids for OpenAI requests, which carry none, and the warm passes' token ids.

After a reply, the runtime registers its continuation (history + reply, rendered as the
next request will render it). A new request whose prompt starts with a registered
continuation (equal `Prompt.digest` at the continuation's length, which must be one of
the request's starts) belongs to that conversation; any other request starts a new one.
The scheduler's warm ChunkRuns name only the conversation: `warm_ids` maps it back to
the token ids of the continuation the scheduler scheduled (set on its WarmScheduled
event, dropped when that warm pass finishes, is cancelled or adopted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import attrs

from policy import events as ev
from policy.prefix import Prompt


@attrs.frozen
class Continuation:
    """A continuation: its prompt, token ids and request starts (rows < len)."""

    prompt: Prompt
    token_ids: tuple[int, ...]
    starts: tuple[int, ...]

    @staticmethod
    def of(token_ids: Sequence[int], starts: Sequence[int]) -> Continuation:
        """The continuation of these token ids and starts."""
        ids = tuple(int(t) for t in token_ids)
        return Continuation(Prompt.from_tokens(ids), ids, tuple(sorted(set(starts))))


class Conversations:
    """Registered continuations by conversation, at most `capacity` of them (oldest
    dropped first), and the token ids of the warm passes the scheduler holds."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._next = 0
        self._by_conv: OrderedDict[str, Continuation] = OrderedDict()
        self._by_key: dict[tuple[int, bytes], str] = {}
        self._warm: dict[str, tuple[int, ...]] = {}

    def new(self) -> str:
        """A fresh conversation id."""
        self._next += 1
        return f"conv-{self._next}"

    def match(self, prompt: Prompt, starts: Sequence[int]) -> str | None:
        """The conversation whose continuation `prompt` starts with (at one of `starts`), or None."""
        for row in sorted(set(starts), reverse=True):
            if row <= 0:
                continue
            conv = self._by_key.get((row, prompt.digest(row)))
            if conv is not None:
                self._by_conv.move_to_end(conv)
                return conv
        return None

    def expect(self, conversation: str, cont: Continuation) -> None:
        """Register the continuation of `conversation` (replacing its previous one)."""
        old = self._by_conv.pop(conversation, None)
        if old is not None:
            self._forget(conversation, old)
        self._by_conv[conversation] = cont
        self._by_key[(len(cont.prompt), cont.prompt.digest(len(cont.prompt)))] = conversation
        while len(self._by_conv) > self.capacity:
            conv, dropped = self._by_conv.popitem(last=False)
            self._forget(conv, dropped)

    def warm_scheduled(self, conversation: str, cont: Continuation) -> None:
        """The scheduler scheduled a warm pass of `cont` for `conversation`."""
        self._warm[conversation] = cont.token_ids

    def warm_ids(self, conversation: str) -> tuple[int, ...]:
        """Token ids of the continuation the warm pass of `conversation` pre-fills."""
        return self._warm[conversation]

    def event(self, e: ev.Event) -> None:
        """Forget a warm pass's token ids once it finished, was cancelled or adopted."""
        if isinstance(e, (ev.WarmFinished, ev.WarmCancelled, ev.WarmAdopted)):
            self._warm.pop(e.conversation, None)

    def __len__(self) -> int:
        return len(self._by_conv)

    def _forget(self, conversation: str, old: Continuation) -> None:
        key = (len(old.prompt), old.prompt.digest(len(old.prompt)))
        if self._by_key.get(key) == conversation:
            del self._by_key[key]
