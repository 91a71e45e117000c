"""A chat reply's text split into reasoning, content and tool calls (the Qwen3.5 format).

The generation prompt opens `<think>` when thinking is on, so the reply is reasoning up
to `</think>`, then content; with tools, content ends where the first `<tool_call>`
begins and the calls are parsed at the end. `ReplyParser` does it incrementally (for
streaming); `parse_reply` runs the same parser over a whole text, so streamed deltas
concatenate to exactly the non-streamed reply. Rendering lives in `executor/chat.py`.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

THINK_END = "</think>"
TOOL_START = "<tool_call>"
_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>\n?(.*?)</function>\s*</tool_call>", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


@attrs.frozen
class ToolCall:
    """One parsed call: `arguments` keep the generated key order."""

    id: str
    name: str
    arguments: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `tool_calls[i]` object (arguments as a JSON string)."""
        args = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": args}}


@attrs.frozen
class Reply:
    """A finished reply: reasoning and content (both stripped), and its tool calls."""

    reasoning: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant message (what a client sends back as history)."""
        content = self.content if self.content or not self.tool_calls else None
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return out


@attrs.frozen
class ReplyDelta:
    """Newly released reasoning and content text."""

    reasoning: str = ""
    content: str = ""


class _Strip:
    """Releases text so that the concatenation equals the whole text `.strip()`ped:
    leading whitespace is dropped, trailing whitespace held until more text follows."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def feed(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body) :]
        return body


class _Mode(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    TOOLS = "tools"


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _param_types(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool)
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn.get("name", "")] = {k: v.get("type", "string") for k, v in props.items() if isinstance(v, Mapping)}
    return out


def _argument(raw: str, kind: Any) -> Any:
    """A parameter value: kept as text for string (or unknown) types, else JSON when it parses."""
    if kind in ("string", None) or not isinstance(kind, str):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_tool_calls(
    text: str, tools: Sequence[Mapping[str, Any]] | None, id_prefix: str
) -> tuple[ToolCall, ...] | None:
    """The `<tool_call>` blocks of `text` (which starts at the first one), or None when
    any part does not parse (the caller then treats the text as content)."""
    types = _param_types(tools)
    calls = []
    pos = 0
    for match in _CALL.finditer(text):
        if text[pos : match.start()].strip():
            return None
        name = match.group(1).strip()
        body = match.group(2)
        params = list(_PARAM.finditer(body))
        if _PARAM.sub("", body).strip():
            return None
        kinds = types.get(name, {})
        args = {p.group(1).strip(): _argument(p.group(2), kinds.get(p.group(1).strip())) for p in params}
        calls.append(ToolCall(f"{id_prefix}{len(calls)}", name, args))
        pos = match.end()
    if not calls or text[pos:].strip():
        return None
    return tuple(calls)


class ReplyParser:
    """Splits reply text as it arrives (see module docstring).

    thinking: the generation prompt opened `<think>` (the reply starts as reasoning).
    tools: the request's tools, or None (then `<tool_call>` text stays content).
    id_prefix: tool call ids are id_prefix + index.
    """

    def __init__(self, thinking: bool, tools: Sequence[Mapping[str, Any]] | None, id_prefix: str = "call_") -> None:
        self._mode = _Mode.REASONING if thinking else _Mode.CONTENT
        self._tools = tools
        self._id_prefix = id_prefix
        self._pending = ""
        self._reasoning = _Strip()
        self._content = _Strip()
        self._reasoning_text: list[str] = []
        self._content_text: list[str] = []
        self._tool_text = ""

    def _emit(self, reasoning: str = "", content: str = "") -> ReplyDelta:
        r = self._reasoning.feed(reasoning) if reasoning else ""
        c = self._content.feed(content) if content else ""
        self._reasoning_text.append(r)
        self._content_text.append(c)
        return ReplyDelta(r, c)

    def feed(self, text: str) -> ReplyDelta:
        """Add reply text; returns what can be released now."""
        text = self._pending + text
        self._pending = ""
        reasoning = content = ""
        if self._mode is _Mode.REASONING:
            cut = text.find(THINK_END)
            if cut < 0:
                keep = _held_prefix(text, THINK_END)
                reasoning, self._pending = text[: len(text) - keep], text[len(text) - keep :]
                return self._emit(reasoning=reasoning)
            reasoning, text = text[:cut], text[cut + len(THINK_END) :]
            self._mode = _Mode.CONTENT
        if self._mode is _Mode.CONTENT:
            if self._tools:
                cut = text.find(TOOL_START)
                if cut >= 0:
                    content, self._tool_text = text[:cut], text[cut:]
                    self._mode = _Mode.TOOLS
                    return self._emit(reasoning, content)
                keep = _held_prefix(text, TOOL_START)
                content, self._pending = text[: len(text) - keep], text[len(text) - keep :]
            else:
                content = text
            return self._emit(reasoning, content)
        self._tool_text += text
        return self._emit(reasoning)

    def finish(self) -> tuple[ReplyDelta, Reply]:
        """The reply ended: the last delta and the whole reply."""
        rest, self._pending = self._pending, ""
        calls: tuple[ToolCall, ...] | None = None
        if self._mode is _Mode.TOOLS:
            calls = parse_tool_calls(self._tool_text, self._tools, self._id_prefix)
            if calls is None:
                rest = self._tool_text + rest
        if self._mode is _Mode.REASONING:
            last = self._emit(reasoning=rest)
        else:
            last = self._emit(content=rest)
        reply = Reply("".join(self._reasoning_text), "".join(self._content_text), calls or ())
        return last, reply


def parse_reply(
    text: str, thinking: bool, tools: Sequence[Mapping[str, Any]] | None, id_prefix: str = "call_"
) -> Reply:
    """The whole reply at once: the same result as streaming `text` through ReplyParser."""
    parser = ReplyParser(thinking, tools, id_prefix)
    parser.feed(text)
    return parser.finish()[1]


@attrs.frozen(kw_only=True)
class ChatContinuation:
    """The prompt prefix a chat request's next turn will send, given the reply's text:
    `Job.continuation` of a chat request, called once its reply ends.

    messages / tools / enable_thinking / parse_tools: the request's (as `ChatCall` holds
    them). renderer: the `executor.chat.ChatRenderer` that renders it; None while the value
    crosses to the engine process (`executor.engine`), which binds its own renderer (same
    tokenizer and template) with `attrs.evolve`. Calling it unbound raises RuntimeError.
    """

    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] | None
    enable_thinking: bool
    parse_tools: bool
    renderer: Any = attrs.field(default=None, eq=False, repr=False)

    def prewarm(self, prompt_ids: Sequence[int]) -> None:
        """Teach the bound renderer the blocks of this request's prompt, so that the call at
        the reply's end, which runs inside a step of every lane, tokenizes only the reply's
        blocks. prompt_ids: the request's rendered prompt (the API rendered it with
        add_generation_prompt=True); the text is rendered again here (string work) and
        paired with those ids block by block (`ChatRenderer.learn`): nothing is tokenized,
        since the tokenizer holds the GIL the worker's step needs. The engine process's
        renderer has not seen a request's history (the API process rendered it): on the
        H200 the steps that ended a reply ran ~1.15 ms longer for it (bench/RESULTS.md,
        session 11). Raises RuntimeError when unbound; ChatError as rendering does."""
        if self.renderer is None:
            raise RuntimeError("ChatContinuation has no renderer bound")
        tools = list(self.tools) if self.tools else None
        text = self.renderer.text(list(self.messages), tools, add_generation_prompt=True,
                                  enable_thinking=self.enable_thinking)
        self.renderer.learn(text, prompt_ids)

    def __call__(self, text: str) -> Any:
        """The rendered continuation (`executor.chat.Rendered`) after a reply of `text`."""
        if self.renderer is None:
            raise RuntimeError("ChatContinuation has no renderer bound")
        tools = list(self.tools) if self.tools else None
        reply = parse_reply(text, self.enable_thinking, tools if self.parse_tools else None)
        return self.renderer.render_continuation(list(self.messages), reply.message(), tools)
