"""Workloads the simulator replays (Turn, Conversation, Workload), the chat rendering that
builds them from messages, and their JSONL files (schema in sim/README.md).

Not here: synthetic generators (`sim.scenarios`), the Mooncake trace reader (`sim.mooncake`).
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs

from policy.prefix import Prompt, Run

HEADER_ROWS = 3
"""Rows of a message header `<|im_start|>role\\n` (also the generation prompt)."""
FOOTER_ROWS = 2
"""Rows of a message footer `<|im_end|>\\n`."""
FOOTER_ID = -5
"""content_id of every footer run; header ids are -1 .. -4 (Role.header_id)."""
MAX_CONTENT_ID = 1 << 126
"""Content ids in files and messages lie in [0, MAX_CONTENT_ID)."""
MAX_TIME_S = 1e7
"""Times (start_s, think_s, arrival_s) lie in [0, MAX_TIME_S] seconds (~115 days): a day's
workload is 86,400 s, and 1e308 would print sim_end_s as a 309-digit number."""
_TIME_NEED = "a finite number of seconds in [0, 1e7] (~115 days)"
"""What `_is_time` asks of a time (MAX_TIME_S), as an error message says it."""


class Role(enum.Enum):
    """A chat message's role; `header_id` names its header run."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"

    @property
    def header_id(self) -> int:
        """content_id of this role's 3-row header run: system -1, user -2, assistant -3, tool -4."""
        return _HEADER_IDS[self.value]


_HEADER_IDS = MappingProxyType({"system": -1, "user": -2, "assistant": -3, "tool": -4})


def _check(ok: bool, field: str, value: Any, need: str) -> None:
    if not ok:
        raise ValueError(f"{field}: must be {need}, got {value!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= MAX_TIME_S


def utf8_text(raw: bytes, path: str | Path, first_line: int = 1) -> str:
    """`raw`, bytes of file `path` from the start of line `first_line` on, as text.

    Raises ValueError `PATH:LINE: not UTF-8: byte 0xNN at column C`.
    """
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start)
        column = e.start - raw.rfind(b"\n", 0, e.start)
        raise ValueError(f"{path}:{line}: not UTF-8: byte 0x{raw[e.start]:02x} at column {column}") from None


def _check_starts(field: str, starts: tuple[int, ...], rows: int) -> None:
    _check(bool(starts) and starts[0] == 0, field, starts, "non-empty and start with 0")
    ascending = all(map(_is_int, starts)) and list(starts) == sorted(set(starts))
    _check(ascending, field, starts, "strictly ascending integers")
    _check(starts[-1] < rows, field, starts, f"all < {rows} (the prompt's rows)")


@attrs.frozen
class Turn:
    """One request of a conversation.

    prompt: the full request prompt (rendered history + new messages + generation prompt).
    starts: rows of each message's `<|im_start|>` in prompt, ascending, first 0, all < len.
    output_rows: tokens the reply generates; 0 marks a prefill-only primer (DESIGN rule 7).
    continuation: what the next request starts with (history + this reply as the next request
      renders it, reasoning dropped), or None when unknown (primers, trace replay).
    continuation_starts: request starts of continuation (all < its length); () when None.
    think_s: closed loop: seconds after the previous turn's reply ends (first turn: after the
      conversation's start_s) before this request arrives.
    arrival_s: open loop: absolute arrival time in seconds; when set, think_s is ignored.
    """

    prompt: Prompt
    starts: tuple[int, ...] = attrs.field(converter=tuple)
    output_rows: int
    continuation: Prompt | None
    continuation_starts: tuple[int, ...] = attrs.field(converter=tuple)
    think_s: float
    arrival_s: float | None = None

    def __attrs_post_init__(self) -> None:
        _check(len(self.prompt) > 0, "prompt", len(self.prompt), "at least 1 row")
        _check_starts("starts", self.starts, len(self.prompt))
        out = self.output_rows
        _check(_is_int(out) and out >= 0, "output_rows", out, "an integer >= 0")
        if self.continuation is None:
            cs = self.continuation_starts
            _check(not cs, "continuation_starts", cs, "() when continuation is None")
        else:
            _check_starts("continuation_starts", self.continuation_starts, len(self.continuation))
        _check(_is_time(self.think_s), "think_s", self.think_s, _TIME_NEED)
        a = self.arrival_s
        _check(a is None or _is_time(a), "arrival_s", a, f"None or {_TIME_NEED}")


@attrs.frozen
class Conversation:
    """One client's requests in order. id: unique in its workload. start_s: seconds."""

    id: str
    start_s: float
    turns: tuple[Turn, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        _check(isinstance(self.id, str) and self.id != "", "id", self.id, "a non-empty string")
        _check(_is_time(self.start_s), "start_s", self.start_s, _TIME_NEED)
        _check(len(self.turns) > 0, "turns", self.turns, "non-empty")


@attrs.frozen
class Workload:
    """Conversations to replay. ideal_reuse: fraction of prompt rows reusable with an unlimited
    cache, when the source states it (Mooncake), else None."""

    name: str
    conversations: tuple[Conversation, ...] = attrs.field(converter=tuple)
    ideal_reuse: float | None = None

    def __attrs_post_init__(self) -> None:
        ids = [c.id for c in self.conversations]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"conversations: id {dup!r} appears more than once")
        r = self.ideal_reuse
        _check(r is None or (_is_time(r) and r <= 1), "ideal_reuse", r, "None or in [0, 1]")


@attrs.frozen(kw_only=True)
class Message:
    """One chat message before rendering; each assistant message is one request.

    role: Role. rows: content rows (>= 1, except a primer's 0). content_id: names the content
      (equal ids and rows = equal tokens); None derives one from (conversation id, index).
    reasoning_rows: assistant only: <think> rows generated but dropped by the next request.
    max_tokens: assistant only: None, or 0 for a prefill-only primer (not rendered in history).
    think_s / arrival_s: timing of the request this message belongs to (see Turn).
    """

    role: Role = attrs.field(converter=Role)
    rows: int = 0
    content_id: int | None = None
    reasoning_rows: int = 0
    max_tokens: int | None = None
    think_s: float | None = None
    arrival_s: float | None = None

    def __attrs_post_init__(self) -> None:
        is_reply, mt = self.role is Role.ASSISTANT, self.max_tokens
        _check(mt is None or (is_reply and _is_int(mt) and mt == 0), "max_tokens", mt,
               "absent, or 0 (a primer) on an assistant message")
        if self.is_primer:
            _check(_is_int(self.rows) and self.rows == 0, "rows", self.rows, "0 on a primer")
        else:
            _check(_is_int(self.rows) and self.rows >= 1, "rows", self.rows, "an integer >= 1")
        r = self.reasoning_rows
        _check(_is_int(r) and r >= 0 and (r == 0 or (is_reply and not self.is_primer)), "reasoning_rows", r,
               "an integer >= 0, and 0 except on a non-primer assistant message")
        c = self.content_id
        _check(c is None or (_is_int(c) and 0 <= c < MAX_CONTENT_ID and not self.is_primer), "content_id", c,
               "an integer in [0, 2**126), absent on a primer")
        for name in ("think_s", "arrival_s"):
            v = getattr(self, name)
            _check(v is None or _is_time(v), name, v, _TIME_NEED)

    @property
    def is_primer(self) -> bool:
        """True for a prefill-only request (`max_tokens: 0`)."""
        return self.max_tokens == 0


def derived_content_id(conversation_id: str, index: int) -> int:
    """The content_id of message `index` when none is given: 2**64 + a 64-bit blake2b hash."""
    h = hashlib.blake2b(f"{conversation_id}\0{index}".encode(), digest_size=8).digest()
    return (1 << 64) + int.from_bytes(h, "big")


def _header(role: Role) -> Run:
    return Run(role.header_id, HEADER_ROWS)


_FOOTER = Run(FOOTER_ID, FOOTER_ROWS)


def render_conversation(conversation_id: str, start_s: float, messages: Sequence[Message]) -> Conversation:
    """Render messages to Turns, one per assistant message.

    Each message renders as header (3 rows) + content (rows) + footer (2 rows) and starts at
    its header row; a request's prompt is the rendered history + the generation prompt (the
    assistant header, not a start). A reply renders into the history as content + footer, its
    reasoning dropped. A primer (max_tokens 0) is not rendered. A request's timing comes from
    the messages since the previous request (at most one think_s and one arrival_s).

    Raises:
      ValueError naming `messages[i].field`: a bad message, an assistant message with no new
      message before it (except after a primer), repeated timing, or trailing messages.
    """
    history = Prompt(())
    pending: list[Run] = []
    starts: list[int] = []
    turns: list[Turn] = []
    timing: dict[str, tuple[int, float]] = {}
    new = row = 0
    after_primer = False
    for i, m in enumerate(messages):
        for name in ("think_s", "arrival_s"):
            value = getattr(m, name)
            if value is not None:
                if name in timing:
                    first = timing[name][0]
                    raise ValueError(f"messages[{i}].{name}: this request's {name} is already set by "
                                     f"messages[{first}]")
                timing[name] = (i, float(value))
        cid = m.content_id if m.content_id is not None else derived_content_id(conversation_id, i)
        if m.role is not Role.ASSISTANT:
            starts.append(row)
            pending += [_header(m.role), Run(cid, m.rows), _FOOTER]
            row += HEADER_ROWS + m.rows + FOOTER_ROWS
            new += 1
            continue
        if new == 0 and not after_primer:
            raise ValueError(f"messages[{i}].role: an assistant message needs a user, system or tool message "
                             "before it")
        history, pending = history.extend(pending), []
        prompt = history.extend([_header(Role.ASSISTANT)])
        think_s = timing.get("think_s", (0, 0.0))[1]
        arrival_s = timing["arrival_s"][1] if "arrival_s" in timing else None
        if m.is_primer:
            turns.append(Turn(prompt, tuple(starts), 0, None, (), think_s, arrival_s))
        else:
            asked = tuple(starts)
            history = history.extend([_header(Role.ASSISTANT), Run(cid, m.rows), _FOOTER])
            starts.append(row)
            row += HEADER_ROWS + m.rows + FOOTER_ROWS
            cont = history
            turns.append(Turn(prompt, asked, m.rows + m.reasoning_rows, cont, tuple(starts), think_s, arrival_s))
        timing, new, after_primer = {}, 0, m.is_primer
    if new:
        raise ValueError(f"messages[{len(messages) - new}].role: messages after the last assistant message "
                         "are never sent")
    if not turns:
        raise ValueError("messages: no assistant message, so no request")
    return Conversation(conversation_id, float(start_s), tuple(turns))


def conversation_messages(conversation: Conversation) -> list[Message] | None:
    """The messages whose `render_conversation` equals `conversation`, or None if there are none
    (e.g. a Mooncake request or a hand-built Turn). Content ids come back explicit."""
    try:
        out = _decode(conversation)
        same = out is not None and render_conversation(conversation.id, conversation.start_s, out) == conversation
    except ValueError:
        return None
    return out if same else None


def _decode(conversation: Conversation) -> list[Message] | None:
    history: tuple[Run, ...] = ()
    out: list[Message] = []
    header_role = {_header(r): r for r in Role if r is not Role.ASSISTANT}
    for turn in conversation.turns:
        runs = turn.prompt.runs
        body = runs[len(history):-1]
        if runs[: len(history)] != history or runs[-1:] != (_header(Role.ASSISTANT),) or len(body) % 3:
            return None
        new: list[Message] = []
        for head, content, foot in zip(body[0::3], body[1::3], body[2::3]):
            if head not in header_role or foot != _FOOTER or content.tokens is not None:
                return None
            new.append(Message(role=header_role[head], rows=content.rows, content_id=content.content_id))
        if turn.continuation is None:
            if turn.output_rows:
                return None
            reply = dict(role=Role.ASSISTANT, max_tokens=0)
            history = runs[:-1]
        else:
            cont = turn.continuation.runs
            if cont[: len(runs)] != runs or len(cont) != len(runs) + 2 or cont[-1] != _FOOTER:
                return None
            text = cont[-2]
            if text.tokens is not None or turn.output_rows < text.rows:
                return None
            reply = dict(role=Role.ASSISTANT, rows=text.rows, content_id=text.content_id,
                         reasoning_rows=turn.output_rows - text.rows)
            history = cont
        timed = new[0] if new else None
        when = dict(think_s=turn.think_s or None, arrival_s=turn.arrival_s)
        if timed is None:
            reply.update(when)
        else:
            new[0] = attrs.evolve(timed, **when)
        out += new + [Message(**reply)]
    return out


_MESSAGE_KEYS = ("role", "rows", "content_id", "reasoning_rows", "max_tokens", "think_s", "arrival_s")
_TURN_KEYS = ("prompt", "starts", "output_rows", "continuation", "continuation_starts", "think_s", "arrival_s")


def _object(value: Any, field: str, keys: Sequence[str]) -> dict[str, Any]:
    _check(isinstance(value, dict), field or "line", value, "a JSON object")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ValueError(f"{field + '.' if field else ''}{unknown[0]}: unknown key; known keys: {', '.join(keys)}")
    return value


def _list(value: Any, field: str) -> list[Any]:
    _check(isinstance(value, list), field, value, "a JSON list")
    return value


def _runs(value: Any, field: str) -> Prompt:
    pieces = []
    for i, pair in enumerate(_list(value, field)):
        ok = isinstance(pair, list) and len(pair) == 2 and all(map(_is_int, pair)) and pair[1] > 0
        _check(ok and -(1 << 127) <= pair[0] < 1 << 127, f"{field}[{i}]", pair,
               "a [content_id, rows] pair of integers, |content_id| < 2**127, rows >= 1")
        pieces.append((pair[0], pair[1]))
    return Prompt.synthetic(pieces)


def _prefixed(field: str, make: Any, **kwargs: Any) -> Any:
    try:
        return make(**kwargs)
    except ValueError as e:
        raise ValueError(f"{field}.{e}") from None


def _message_from_json(value: Any, field: str) -> Message:
    obj = _object(value, field, _MESSAGE_KEYS)
    roles = [r.value for r in Role]
    _check(obj.get("role") in roles, f"{field}.role", obj.get("role"), f"one of {roles}")
    return _prefixed(field, Message, **obj)


def _turn_from_json(value: Any, field: str) -> Turn:
    obj = _object(value, field, _TURN_KEYS)
    for key in ("prompt", "starts", "output_rows"):
        _check(key in obj, f"{field}.{key}", None, "present")
    cont = obj.get("continuation")
    kwargs = dict(obj, prompt=_runs(obj["prompt"], f"{field}.prompt"),
                  continuation=None if cont is None else _runs(cont, f"{field}.continuation"),
                  starts=_list(obj["starts"], f"{field}.starts"),
                  continuation_starts=_list(obj.get("continuation_starts", []), f"{field}.continuation_starts"),
                  think_s=obj.get("think_s", 0.0))
    return _prefixed(field, Turn, **kwargs)


def conversation_from_json(value: Any) -> Conversation:
    """A Conversation from one parsed JSONL line (`messages` or `turns` form; sim/README.md).

    Raises:
      ValueError naming the field, e.g. `messages[2].rows: must be an integer >= 1, got 0`.
    """
    obj = _object(value, "", ("id", "start_s", "messages", "turns"))
    conv_id, start_s = obj.get("id"), obj.get("start_s", 0.0)
    _check(isinstance(conv_id, str) and conv_id != "", "id", conv_id, "a non-empty string")
    _check(_is_time(start_s), "start_s", start_s, _TIME_NEED)
    _check(("messages" in obj) != ("turns" in obj), "messages", None, "given, or turns given, but not both")
    if "messages" in obj:
        listed = _list(obj["messages"], "messages")
        messages = [_message_from_json(m, f"messages[{i}]") for i, m in enumerate(listed)]
        return render_conversation(conv_id, start_s, messages)
    turns = [_turn_from_json(t, f"turns[{i}]") for i, t in enumerate(_list(obj["turns"], "turns"))]
    return Conversation(conv_id, float(start_s), tuple(turns))


def _message_to_json(m: Message, conversation_id: str, index: int) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role.value}
    if not m.is_primer:
        out["rows"] = m.rows
    if m.content_id is not None and m.content_id != derived_content_id(conversation_id, index):
        out["content_id"] = m.content_id
    if m.reasoning_rows:
        out["reasoning_rows"] = m.reasoning_rows
    if m.is_primer:
        out["max_tokens"] = 0
    for key in ("think_s", "arrival_s"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def _turn_to_json(t: Turn) -> dict[str, Any]:
    def pairs(p: Prompt) -> list[list[int]]:
        if any(r.tokens is not None for r in p.runs):
            raise ValueError("prompt: runs of real tokens cannot be written, only synthetic runs")
        return [[r.content_id, r.rows] for r in p.runs]

    out: dict[str, Any] = {"prompt": pairs(t.prompt), "starts": list(t.starts), "output_rows": t.output_rows}
    if t.continuation is not None:
        out.update(continuation=pairs(t.continuation), continuation_starts=list(t.continuation_starts))
    if t.think_s:
        out["think_s"] = t.think_s
    if t.arrival_s is not None:
        out["arrival_s"] = t.arrival_s
    return out


def conversation_to_json(c: Conversation) -> dict[str, Any]:
    """One JSONL object: the `messages` form when the turns are a chat rendering, else `turns`."""
    messages = conversation_messages(c)
    if messages is None:
        return {"id": c.id, "start_s": c.start_s, "turns": [_turn_to_json(t) for t in c.turns]}
    return {"id": c.id, "start_s": c.start_s,
            "messages": [_message_to_json(m, c.id, i) for i, m in enumerate(messages)]}


def read_workload(path: str | Path) -> Workload:
    """Read a JSONL workload: an optional header line `{"workload": name, "ideal_reuse": x}`, then
    one conversation a line. The name defaults to the file's stem.

    Raises:
      ValueError `PATH:LINE: field: problem` for a bad line (not UTF-8, not JSON, a bad field);
      OSError when unreadable.
    """
    path = Path(path)
    name, ideal, conversations, seen = path.stem, None, [], False
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = utf8_text(raw, path, lineno)
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e.msg}") from None
            first, seen = not seen, True
            try:
                if isinstance(value, dict) and "workload" in value:
                    _check(first, "workload", value["workload"], "on the first line only")
                    _object(value, "", ("workload", "ideal_reuse"))
                    _check(isinstance(value["workload"], str), "workload", value["workload"], "a string")
                    name, ideal = value["workload"], value.get("ideal_reuse")
                    continue
                conversations.append(conversation_from_json(value))
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
    try:
        return Workload(name, tuple(conversations), ideal)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def write_workload(workload: Workload, path: str | Path) -> None:
    """Write `workload` as JSONL that `read_workload` reads back equal (header line first)."""
    header: dict[str, Any] = {"workload": workload.name}
    if workload.ideal_reuse is not None:
        header["ideal_reuse"] = workload.ideal_reuse
    lines = [json.dumps(header)] + [json.dumps(conversation_to_json(c)) for c in workload.conversations]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
