"""Workload values, chat rendering and JSONL I/O (sim/workload.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.prefix import Prompt
from sim.workload import (
    FOOTER_ID,
    MAX_TIME_S,
    Conversation,
    Message,
    Role,
    Turn,
    Workload,
    conversation_messages,
    read_workload,
    render_conversation,
    write_workload,
)


def msg(role: str, rows: int = 0, **kw: object) -> Message:
    return Message(role=Role(role), rows=rows, **kw)


def continuation_problems(conversation: Conversation) -> list[str]:
    """Where the continuation contract breaks: prefix of the next prompt, a start of it, and
    an extension of this prompt through its generation prompt."""
    out = []
    for k, (turn, nxt) in enumerate(zip(conversation.turns, conversation.turns[1:])):
        cont = turn.continuation
        if cont is None:
            continue
        n = len(cont)
        if n > len(nxt.prompt) or cont.digest(n) != nxt.prompt.digest(n):
            out.append(f"{conversation.id} turn {k}: continuation is not a prefix of the next prompt")
        elif n not in nxt.starts:
            out.append(f"{conversation.id} turn {k}: len(continuation) {n} is not a start of the next prompt")
        p = len(turn.prompt)
        if n <= p or cont.digest(p) != turn.prompt.digest(p):
            out.append(f"{conversation.id} turn {k}: continuation does not extend the prompt")
    return out


EXAMPLE = [msg("system", 800, content_id=7), msg("user", 120), msg("assistant", 300, reasoning_rows=500),
           msg("user", 50, think_s=12.0), msg("assistant", 200)]


def test_render_positions_by_hand():
    c = render_conversation("c1", 5.0, EXAMPLE)
    t0, t1 = c.turns
    # system 3+800+2 = 805; user 3+120+2 = 125; generation prompt 3 rows.
    assert (len(t0.prompt), t0.starts, t0.output_rows, t0.think_s) == (933, (0, 805), 800, 0.0)
    # the reply renders as 3 + 300 + 2 (reasoning dropped): 933 + 302 = 1235.
    assert (len(t0.continuation), t0.continuation_starts) == (1235, (0, 805, 930))
    assert (len(t1.prompt), t1.starts, t1.output_rows, t1.think_s) == (1293, (0, 805, 930, 1235), 200, 12.0)
    assert t1.continuation_starts == (0, 805, 930, 1235, 1290)
    assert continuation_problems(c) == []
    assert c.start_s == 5.0 and t0.arrival_s is None


def test_runs_are_header_content_footer():
    t0 = render_conversation("c", 0.0, EXAMPLE).turns[0]
    ids = [(r.content_id, r.rows) for r in t0.prompt.runs]
    assert ids[:3] == [(Role.SYSTEM.header_id, 3), (7, 800), (FOOTER_ID, 2)]
    assert ids[3][0] == -2 and ids[-1] == (-3, 3)
    assert [r.content_id for r in t0.continuation.runs][-3:] == [-3, t0.continuation.runs[-2].content_id, FOOTER_ID]


def test_primer_then_same_prompt():
    c = render_conversation("p", 0.0, [msg("system", 40), msg("user", 4000), msg("assistant", max_tokens=0),
                                       msg("assistant", 90, think_s=2.0)])
    primer, real = c.turns
    assert (primer.output_rows, primer.continuation, primer.continuation_starts) == (0, None, ())
    assert real.prompt == primer.prompt and real.starts == primer.starts and real.think_s == 2.0
    assert real.output_rows == 90 and len(real.continuation) == len(real.prompt) + 92


def test_tool_results_and_shared_ids():
    a = render_conversation("a", 0.0, [msg("system", 100, content_id=1), msg("user", 10), msg("assistant", 20),
                                       msg("tool", 300, think_s=0.5), msg("assistant", 30)])
    b = render_conversation("b", 0.0, [msg("system", 100, content_id=1), msg("user", 10), msg("assistant", 20)])
    assert a.turns[1].prompt.runs[-4].content_id == Role.TOOL.header_id
    assert a.turns[0].prompt.digest(105) == b.turns[0].prompt.digest(105)
    assert a.turns[0].prompt.digest(109) != b.turns[0].prompt.digest(109)  # user content ids derive from the conv id
    again = render_conversation("a", 0.0, [msg("system", 100, content_id=1), msg("user", 10), msg("assistant", 20)])
    assert again.turns[0] == a.turns[0]
    assert continuation_problems(a) == []


@pytest.mark.parametrize("messages, match", [
    ([msg("assistant", 5)], r"messages\[0\].role"),
    ([msg("user", 5), msg("assistant", 5), msg("assistant", 5)], r"messages\[2\].role"),
    ([msg("user", 5), msg("assistant", 5), msg("user", 5)], r"messages\[2\].role: messages after"),
    ([msg("user", 5, think_s=1.0), msg("assistant", 5, think_s=2.0)], r"messages\[1\].think_s"),
    ([msg("user", 5)], r"messages\[0\].role"),
], ids=["reply-first", "two-replies", "trailing", "timing-twice", "no-reply"])
def test_render_errors(messages, match):
    with pytest.raises(ValueError, match=match):
        render_conversation("x", 0.0, messages)


@pytest.mark.parametrize("kw, field", [
    (dict(role="user", rows=0), "rows"), (dict(role="user", rows=3, reasoning_rows=2), "reasoning_rows"),
    (dict(role="assistant", max_tokens=5), "max_tokens"), (dict(role="user", max_tokens=0), "max_tokens"),
    (dict(role="assistant", rows=4, max_tokens=0), "rows"), (dict(role="user", rows=1, content_id=-1), "content_id"),
    (dict(role="user", rows=1, think_s=-1.0), "think_s"), (dict(role="user", rows=True), "rows"),
    (dict(role="user", rows=1, arrival_s=MAX_TIME_S * 1.001), "arrival_s"),
    (dict(role="user", rows=1, think_s=1e308), "think_s"),
], ids=["zero-rows", "user-reasoning", "max-tokens-5", "user-max-tokens", "primer-rows", "neg-id", "neg-think", "bool",
        "arrival-past-max", "think-1e308"])
def test_message_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        Message(**kw)


def test_turn_and_workload_validation():
    p = Prompt.synthetic([(1, 10)])
    with pytest.raises(ValueError, match=r"^starts:"):
        Turn(p, (1,), 1, None, (), 0.0)
    with pytest.raises(ValueError, match=r"^starts:"):
        Turn(p, (0, 10), 1, None, (), 0.0)
    with pytest.raises(ValueError, match=r"^starts:"):
        Turn(p, (0, 5, 5), 1, None, (), 0.0)
    with pytest.raises(ValueError, match=r"^continuation_starts:"):
        Turn(p, (0,), 1, None, (0,), 0.0)
    with pytest.raises(ValueError, match=r"^arrival_s:"):
        Turn(p, (0,), 1, None, (), 0.0, float("nan"))
    assert Turn(p, (0,), 1, None, (), MAX_TIME_S, MAX_TIME_S).arrival_s == MAX_TIME_S  # the limit itself is a time
    with pytest.raises(ValueError, match=r"^start_s: must be a finite number of seconds in \[0, 1e7\]"):
        Conversation("far", MAX_TIME_S * 2, (Turn(p, (0,), 1, None, (), 0.0),))
    c = Conversation("dup", 0.0, (Turn(p, (0,), 1, None, (), 0.0),))
    with pytest.raises(ValueError, match=r"'dup' appears more than once"):
        Workload("w", (c, c))


def test_jsonl_reads_the_documented_example(tmp_path):
    path = tmp_path / "ex.jsonl"
    path.write_text(
        '{"workload": "example"}\n'
        '{"id": "c1", "start_s": 0.0, "messages": [{"role": "system", "rows": 800, "content_id": 7},'
        ' {"role": "user", "rows": 120}, {"role": "assistant", "rows": 300, "reasoning_rows": 500},'
        ' {"role": "user", "rows": 50, "think_s": 12.0}, {"role": "assistant", "rows": 200}]}\n\n')
    w = read_workload(path)
    assert w.name == "example" and w.ideal_reuse is None
    assert w.conversations[0] == render_conversation("c1", 0.0, EXAMPLE)


def test_jsonl_round_trip_both_forms(tmp_path):
    chat = render_conversation("c1", 1.5, EXAMPLE)
    p = Prompt.synthetic([(11, 512), (12, 100)])
    trace = Conversation("m1", 2.0, (Turn(p, (0, 512), 7, None, (), 0.0, 2.0),))
    w = Workload("both", (chat, trace), ideal_reuse=0.25)
    path = tmp_path / "w.jsonl"
    write_workload(w, path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"workload": "both", "ideal_reuse": 0.25}
    assert "messages" in lines[1] and "turns" in lines[2]
    assert lines[1]["messages"][1] == {"role": "user", "rows": 120}  # derived ids are not written
    assert read_workload(path) == w


@pytest.mark.parametrize("line, match", [
    ('{"id": "a", "messages": [{"role": "user", "rows": 3}, {"role": "assistant", "rows": -1}]}', r":3: messages\[1\].rows"),
    ('{"id": "a", "messages": [{"role": "bot", "rows": 3}]}', r":3: messages\[0\].role"),
    ('{"id": "a", "messages": [{"role": "user", "rows": 3, "colour": 1}]}', r":3: messages\[0\].colour: unknown key"),
    ('{"id": "a", "messages": [], "turns": []}', r":3: messages:"),
    ('{"id": "", "messages": []}', r":3: id:"),
    ('{"id": "a", "turns": [{"prompt": [[1, 0]], "starts": [0], "output_rows": 1}]}', r":3: turns\[0\].prompt\[0\]"),
    ('{"id": "a", "turns": [{"prompt": [[1, 5]], "starts": [0, 9], "output_rows": 1}]}', r":3: turns\[0\].starts"),
    ('{"id": "a", "turns": [{"prompt": [[1, 5]], "starts": [0]}]}', r":3: turns\[0\].output_rows: must be present"),
    ('{"workload": "late"}', r":3: workload: must be on the first line"),
    ('{"id": "a", ', r":3: not JSON"),
], ids=["rows", "role", "unknown-key", "both-forms", "empty-id", "zero-run", "start-past-end", "missing", "late-header", "json"])
def test_jsonl_errors_name_line_and_field(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"workload": "w"}\n{"id": "ok", "messages": [{"role": "user", "rows": 1}, '
                    '{"role": "assistant", "rows": 1}]}\n' + line + "\n")
    with pytest.raises(ValueError, match=match):
        read_workload(path)


ROLES = st.sampled_from(["system", "user", "tool"])


@st.composite
def message_lists(draw):
    out: list[Message] = []
    for _ in range(draw(st.integers(1, 5))):
        for k in range(draw(st.integers(0 if out and out[-1].is_primer else 1, 3))):
            think_s = draw(st.none() | st.floats(0, 100)) if k == 0 else None  # one timing per request
            out.append(msg(draw(ROLES), draw(st.integers(1, 5000)), think_s=think_s,
                           content_id=draw(st.none() | st.integers(0, 3))))
        if draw(st.integers(0, 5)) == 0:
            out.append(Message(role=Role.ASSISTANT, max_tokens=0))
        else:
            out.append(msg("assistant", draw(st.integers(1, 3000)), reasoning_rows=draw(st.integers(0, 2000)),
                           arrival_s=draw(st.none() | st.floats(0, 1e6))))
    if out[-1].is_primer:
        out.append(msg("assistant", 3))
    return out


@settings(max_examples=60, deadline=None)
@given(message_lists(), st.floats(0, 1e5))
def test_rendered_conversations_keep_the_continuation_contract_and_round_trip(tmp_path_factory, messages, start_s):
    c = render_conversation("h", start_s, messages)
    assert len(c.turns) == sum(m.role is Role.ASSISTANT for m in messages)
    assert continuation_problems(c) == []
    back = conversation_messages(c)
    assert back is not None and render_conversation("h", start_s, back) == c
    path = tmp_path_factory.mktemp("rt") / "w.jsonl"
    write_workload(Workload("h", (c,)), path)
    assert read_workload(path).conversations == (c,)
