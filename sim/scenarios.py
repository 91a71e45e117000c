"""Synthetic workload generators, by name: `(rng: random.Random, **size knobs) -> Workload`.

Token counts are drawn from the generator's `rng` (lognormal lengths, Poisson arrivals), so a
seed fixes the workload; every prompt is rendered by `sim.workload.render_conversation`, so
request starts are real positions. Not here: the Mooncake trace (`sim.mooncake`).
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable, Sequence

from sim.workload import (
    FOOTER_ROWS,
    HEADER_ROWS,
    Conversation,
    Message,
    Role,
    Workload,
    render_conversation,
)

DEFAULT_SCENARIO = "mixed"
_WRAP = HEADER_ROWS + FOOTER_ROWS
Item = tuple[float, str, list[Message]]


def _need(ok: bool, knob: str, value: object, need: str) -> None:
    if not ok:
        raise ValueError(f"{knob}: must be {need}, got {value!r}")


def _rows(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """A lognormal row count with this median, clipped to [lo, hi]."""
    return max(lo, min(hi, round(rng.lognormvariate(math.log(median), sigma))))


def _secs(rng: random.Random, median_s: float) -> float:
    """A lognormal duration in seconds (sigma 0.7), rounded to the millisecond."""
    return round(rng.lognormvariate(math.log(median_s), 0.7), 3)


def _msg(rng: random.Random, role: Role, rows: int, content_id: int | None = None, **kw: object) -> Message:
    """A message of fresh content (an id drawn from rng) unless content_id is given."""
    cid = rng.getrandbits(62) if content_id is None else content_id
    return Message(role=role, rows=rows, content_id=cid, **kw)


def _turn(rng: random.Random, think_s: float | None, reasoning_rows: int = 0) -> list[Message]:
    """A user message sent `think_s` s after the last reply (None: at once) and its reply, which
    reasons ~`reasoning_rows` rows first when that is > 0."""
    user = _msg(rng, Role.USER, _rows(rng, 80, 0.9, 4, 4000), think_s=think_s)
    thought = _rows(rng, reasoning_rows, 0.7, 16, 16000) if reasoning_rows else 0
    return [user, _msg(rng, Role.ASSISTANT, _rows(rng, 250, 0.7, 8, 3000), reasoning_rows=thought)]


def _dialogue(rng: random.Random, turns: int, think_s: float, reasoning_rows: int = 0) -> list[Message]:
    """`turns` user/assistant pairs; users think ~think_s s between turns."""
    return [m for k in range(turns) for m in _turn(rng, _secs(rng, think_s) if k else None, reasoning_rows)]


def _assemble(name: str, items: Sequence[Item]) -> Workload:
    """Render (start_s, label, messages) items, ordered by start, into a Workload named `name`."""
    ordered = sorted(items, key=lambda item: item[0])
    return Workload(name, tuple(render_conversation(f"{name}-{label}", s, msgs) for s, label, msgs in ordered))


def _numbered(starts: Sequence[float], messages: Sequence[list[Message]]) -> list[Item]:
    return [(round(s, 3), f"{k:05d}", m) for k, (s, m) in enumerate(zip(starts, messages))]


def chat(rng: random.Random, *, conversations: int = 40, min_turns: int = 2, max_turns: int = 8,
         system_rows: int = 800, duration_s: float = 600.0, think_s: float = 20.0) -> Workload:
    """Multi-turn chat: one shared system prompt of `system_rows`, conversations starting
    uniformly over `duration_s` seconds, `min_turns`..`max_turns` turns ~`think_s` s apart."""
    _need(1 <= min_turns <= max_turns, "min_turns", (min_turns, max_turns), "1 <= min_turns <= max_turns")
    system = rng.getrandbits(62)
    msgs = [[_msg(rng, Role.SYSTEM, system_rows, system),
             *_dialogue(rng, rng.randint(min_turns, max_turns), think_s)]
            for _ in range(conversations)]
    return _assemble("chat", _numbered([rng.uniform(0, duration_s) for _ in msgs], msgs))


def reasoning(rng: random.Random, *, conversations: int = 24, min_turns: int = 2, max_turns: int = 6,
              system_rows: int = 600, reasoning_rows: int = 1500, duration_s: float = 600.0,
              think_s: float = 30.0) -> Workload:
    """Chat whose replies think first: ~`reasoning_rows` rows of <think> per reply, generated but
    dropped by the next request, so only the reply's text is reusable."""
    _need(1 <= min_turns <= max_turns, "min_turns", (min_turns, max_turns), "1 <= min_turns <= max_turns")
    system = rng.getrandbits(62)
    msgs = [[_msg(rng, Role.SYSTEM, system_rows, system),
             *_dialogue(rng, rng.randint(min_turns, max_turns), think_s, reasoning_rows)]
            for _ in range(conversations)]
    return _assemble("reasoning", _numbered([rng.uniform(0, duration_s) for _ in msgs], msgs))


def agent(rng: random.Random, *, conversations: int = 8, min_steps: int = 4, max_steps: int = 24,
          system_rows: int = 3000, max_context_rows: int = 60000, duration_s: float = 600.0,
          tool_s: float = 1.5) -> Workload:
    """Agent loops: a shared tool-definition system prompt, a task, then `min_steps`..`max_steps`
    tool calls (assistant, sometimes reasoning) each answered by a tool result (~`tool_s` s of
    tool latency), until the context passes `max_context_rows`, then a final answer."""
    _need(1 <= min_steps <= max_steps, "min_steps", (min_steps, max_steps), "1 <= min_steps <= max_steps")
    tools = rng.getrandbits(62)
    all_msgs = []
    for _ in range(conversations):
        msgs = [_msg(rng, Role.SYSTEM, system_rows, tools), _msg(rng, Role.USER, _rows(rng, 200, 0.8, 10, 4000))]
        context = system_rows + msgs[1].rows + 2 * _WRAP
        for _ in range(rng.randint(min_steps, max_steps)):
            thought = _rows(rng, 300, 0.8, 16, 4000) if rng.random() < 0.5 else 0
            call = _msg(rng, Role.ASSISTANT, _rows(rng, 120, 0.5, 16, 800), reasoning_rows=thought)
            result = _msg(rng, Role.TOOL, _rows(rng, 900, 1.0, 16, 12000), think_s=_secs(rng, tool_s))
            msgs += [call, result]
            context += call.rows + result.rows + 2 * _WRAP
            if context > max_context_rows:
                break
        msgs.append(_msg(rng, Role.ASSISTANT, _rows(rng, 400, 0.6, 16, 3000)))
        all_msgs.append(msgs)
    return _assemble("agent", _numbered([rng.uniform(0, duration_s) for _ in all_msgs], all_msgs))


def concurrent(rng: random.Random, *, users: int = 120, duration_s: float = 300.0, max_turns: int = 3,
               system_rows: int = 1200, think_s: float = 8.0) -> Workload:
    """Many users at once: conversations arrive as a Poisson process of rate users/duration_s per
    second, share one system prompt, and run 1..`max_turns` quick turns."""
    _need(users >= 1 and duration_s > 0, "users", (users, duration_s), "users >= 1 and duration_s > 0")
    system, t, starts, msgs = rng.getrandbits(62), 0.0, [], []
    for _ in range(users):
        t += rng.expovariate(users / duration_s)
        starts.append(t)
        turns = _dialogue(rng, rng.randint(1, max_turns), think_s)
        msgs.append([_msg(rng, Role.SYSTEM, system_rows, system), *turns])
    return _assemble("concurrent", _numbered(starts, msgs))


def primers(rng: random.Random, *, conversations: int = 12, min_doc_rows: int = 2000, max_doc_rows: int = 16000,
            duration_s: float = 600.0, follow_up: float = 0.5) -> Workload:
    """Prefill-only primers: a long document is sent with max_tokens 0, then the same prompt is
    sent for real ~2 s later; a `follow_up` fraction then asks one more question."""
    _need(1 <= min_doc_rows <= max_doc_rows, "min_doc_rows", (min_doc_rows, max_doc_rows), "1 <= min <= max")
    system, all_msgs = rng.getrandbits(62), []
    for _ in range(conversations):
        msgs = [_msg(rng, Role.SYSTEM, 400, system), _msg(rng, Role.USER, rng.randint(min_doc_rows, max_doc_rows)),
                Message(role=Role.ASSISTANT, max_tokens=0),
                _msg(rng, Role.ASSISTANT, _rows(rng, 250, 0.7, 8, 3000), think_s=_secs(rng, 2.0))]
        if rng.random() < follow_up:
            msgs += _turn(rng, _secs(rng, 10.0))
        all_msgs.append(msgs)
    return _assemble("primers", _numbered([rng.uniform(0, duration_s) for _ in all_msgs], all_msgs))


def grid_edges(rng: random.Random, *, grid_rows: int = 4096, marks: Sequence[int] = (1, 2),
               spacing_s: float = 60.0) -> Workload:
    """Shared prefixes exactly on, one below and one above each mark m * grid_rows (m in marks):
    per target T, two conversations share a system prompt whose system cut is T (labels
    `sys{T}a`/`sys{T}b`), and one conversation's first reply ends at T (`reply{T}`), so the
    warm pass and the next turn meet at T."""
    _need(grid_rows >= 1024, "grid_rows", grid_rows, ">= 1024 (room for the reply before the first mark)")
    items: list[Item] = []
    for m in marks:
        for target in (m * grid_rows - 1, m * grid_rows, m * grid_rows + 1):
            system = rng.getrandbits(62)
            for tag in "ab":
                msgs = [_msg(rng, Role.SYSTEM, target - _WRAP, system), *_dialogue(rng, 2, 10.0)]
                items.append((spacing_s * len(items), f"sys{target}{tag}", msgs))
            reply = _rows(rng, 200, 0.5, 16, 800)
            msgs = [_msg(rng, Role.SYSTEM, 200), _msg(rng, Role.USER, target - 200 - reply - 3 * _WRAP),
                    _msg(rng, Role.ASSISTANT, reply), *_turn(rng, _secs(rng, 10.0))]
            items.append((spacing_s * len(items), f"reply{target}", msgs))
    return _assemble("grid_edges", items)


def mixed(rng: random.Random, *, conversations: int = 150, duration_s: float = 600.0) -> Workload:
    """The default: about `conversations` conversations over `duration_s` seconds, ~32% chat,
    16% reasoning, 8% agent, 34% concurrent users, 10% primers, plus 9 grid-edge conversations
    (one mark). Sized so the simulator runs it in well under 10 s."""
    _need(conversations >= 1, "conversations", conversations, ">= 1")
    n = max(conversations - 9, 5)
    parts = [chat(rng, conversations=max(1, round(0.32 * n)), duration_s=duration_s),
             reasoning(rng, conversations=max(1, round(0.16 * n)), duration_s=duration_s),
             agent(rng, conversations=max(1, round(0.08 * n)), max_steps=16, duration_s=duration_s),
             concurrent(rng, users=max(1, round(0.34 * n)), duration_s=duration_s),
             primers(rng, conversations=max(1, round(0.10 * n)), duration_s=duration_s),
             grid_edges(rng, marks=(1,), spacing_s=duration_s / 9)]
    merged: list[Conversation] = sorted((c for p in parts for c in p.conversations), key=lambda c: c.start_s)
    return Workload("mixed", tuple(merged))


def day(rng: random.Random, *, conversations: int = 10000, duration_s: float = 86400.0, apps: int = 8,
        min_turns: int = 2, max_turns: int = 8, think_s: float = 30.0, reasoning_share: float = 0.25) -> Workload:
    """A day of traffic for the speed benchmark: `conversations` multi-turn chats over `duration_s`
    seconds with a diurnal rate (peak at midday, 4x the trough), `min_turns`..`max_turns` turns,
    each using one of `apps` shared system prompts; a `reasoning_share` fraction reasons first."""
    _need(apps >= 1 and conversations >= 1, "apps", (apps, conversations), "apps >= 1 and conversations >= 1")
    _need(1 <= min_turns <= max_turns, "min_turns", (min_turns, max_turns), "1 <= min_turns <= max_turns")
    systems = [(rng.getrandbits(62), _rows(rng, 1000, 0.8, 50, 8000)) for _ in range(apps)]
    starts = []
    while len(starts) < conversations:
        t = rng.uniform(0, duration_s)
        if rng.random() * 1.6 < 1 - 0.6 * math.cos(2 * math.pi * t / duration_s):
            starts.append(t)
    msgs = []
    for _ in starts:
        system, rows = rng.choice(systems)
        thinks = 800 if rng.random() < reasoning_share else 0
        turns = _dialogue(rng, rng.randint(min_turns, max_turns), think_s, thinks)
        msgs.append([_msg(rng, Role.SYSTEM, rows, system), *turns])
    return _assemble("day", _numbered(starts, msgs))


def scenarios() -> dict[str, Callable[..., Workload]]:
    """The generators by name (what `--workload NAME` finds); a fresh dict on every call."""
    return {"chat": chat, "reasoning": reasoning, "agent": agent, "concurrent": concurrent, "primers": primers,
            "grid_edges": grid_edges, "mixed": mixed, "day": day}


def generate(name: str, seed: int, **knobs: object) -> Workload:
    """The workload of scenario `name` for `seed` (a `random.Random(seed)`), with size knobs.

    Raises:
      ValueError: an unknown name or knob (listing the known ones), or a knob out of range.
    """
    table = scenarios()
    if name not in table:
        raise ValueError(f"workload {name!r}: unknown; known: {', '.join(table)}")
    known = [p for p in inspect.signature(table[name]).parameters if p != "rng"]
    for knob in knobs:
        if knob not in known:
            raise ValueError(f"{knob}: unknown knob of workload {name!r}; known: {', '.join(known)}")
    return table[name](random.Random(seed), **knobs)
