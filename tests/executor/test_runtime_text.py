"""Reply text: incremental detokenization with stop strings (`executor.stops`) and the
reasoning / content / tool-call split (`executor.replies`), streamed equal to whole."""

from __future__ import annotations

import json

import pytest

from executor.replies import ReplyParser, parse_reply
from executor.stops import TextStream
from executor.tokenizer import default_tokenizer


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def _stream(tok, ids, stop=()):
    ts = TextStream(tok, stop)
    pieces = [ts.push(i) for i in ids]
    if not ts.stopped:
        pieces.append(ts.finish())
    return pieces, ts


@pytest.mark.parametrize("text", ["𝔘𝔫𝔦 code", "a🫠b", "𓀀𓀀", "🧑\u200d🚀 ok", "𠀋x"],
                         ids=["math", "emoji", "hiero", "zwj", "cjk-ext"])
def test_never_splits_a_character(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text) // 2  # several tokens per character
    pieces, ts = _stream(tok, ids)
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == text == ts.text


@pytest.mark.parametrize("stop", ["STOP", "ST", "P here", "🫠"], ids=["word", "prefix", "spans-tokens", "multibyte"])
def test_stop_string_is_never_released(tok, stop):
    text = "hello world STOP here 🫠 and more"
    ids = tok.encode(text, add_special_tokens=False).ids
    pieces, ts = _stream(tok, ids, (stop,))
    assert ts.stopped
    out = "".join(pieces)
    assert out == text[: text.index(stop)] == ts.text
    for k in range(1, len(pieces) + 1):  # no streamed prefix ever holds the stop string
        assert stop not in "".join(pieces[:k])


def test_held_prefix_released_when_stop_does_not_follow(tok):
    ids = tok.encode("abc STOx tail", add_special_tokens=False).ids
    pieces, ts = _stream(tok, ids, ("STOP",))
    assert not ts.stopped and "".join(pieces) == "abc STOx tail"


def test_earliest_of_several_stops_wins(tok):
    ids = tok.encode("one two three", add_special_tokens=False).ids
    _, ts = _stream(tok, ids, ("three", "two"))
    assert ts.text == "one "


def test_control_tokens_decode_to_nothing(tok):
    ids = tok.encode("a<|im_start|>b", add_special_tokens=False).ids
    _, ts = _stream(tok, ids)
    assert ts.text == "ab"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "opts": {"type": "object"}}}}}]
TOOL_REPLY = (
    "\nLet me look.\n</think>\n\nChecking now.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
    "Paris 12\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"unit\": \"C\"}\n"
    "</parameter>\n</function>\n</tool_call>"
)


def test_reasoning_content_and_tool_calls():
    reply = parse_reply(TOOL_REPLY, thinking=True, tools=TOOLS, id_prefix="c")
    assert reply.reasoning == "Let me look." and reply.content == "Checking now."
    (call,) = reply.tool_calls
    assert call.name == "get_weather" and call.id == "c0"
    assert call.arguments == {"city": "Paris 12", "days": 3, "opts": {"unit": "C"}}
    assert list(call.arguments) == ["city", "days", "opts"]
    msg = reply.message()
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"])["city"] == "Paris 12"


def test_tool_text_without_tools_stays_content():
    reply = parse_reply(TOOL_REPLY, thinking=True, tools=None)
    assert reply.tool_calls == () and reply.content.startswith("Checking now.") and "<tool_call>" in reply.content


def test_broken_tool_call_is_content():
    text = "ok <tool_call>\n<function=get_weather>\n<parameter=city>\nPa"
    reply = parse_reply(text, thinking=False, tools=TOOLS)
    assert reply.tool_calls == () and reply.content == text


def test_no_think_end_means_all_reasoning():
    reply = parse_reply("still thinking about it  ", thinking=True, tools=None)
    assert reply.reasoning == "still thinking about it" and reply.content == ""


@pytest.mark.parametrize("text", [TOOL_REPLY, "a</think>b", " x </thi", "\n\n</think>\n\n content \n", "<tool_call> x"])
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streamed_deltas_concatenate_to_whole(text, step):
    for thinking in (True, False):
        whole = parse_reply(text, thinking, TOOLS)
        parser = ReplyParser(thinking, TOOLS)
        deltas = [parser.feed(text[i : i + step]) for i in range(0, len(text), step)]
        last, reply = parser.finish()
        deltas.append(last)
        assert "".join(d.reasoning for d in deltas) == whole.reasoning == reply.reasoning
        assert "".join(d.content for d in deltas) == whole.content == reply.content
        assert reply.tool_calls == whole.tool_calls
