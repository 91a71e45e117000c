"""Warm passes through a real server: each turn resumes the state the previous reply's
warm pass kept, with the same tokens as a server without a prompt cache; reasoning and
tool-call turns; a request arriving mid warm pass waits at most one chunk (from the
trace); a client gone mid-prefill frees its lane and leaves its kept states usable."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import pytest

from executor.chat import ChatRenderer, load_template
from executor.model import tiny_model_dir
from executor.tokenizer import load_tokenizer
from policy import events as ev
from tests.executor.serve_support import ServerProcess

MODEL = "tiny-qwen3_5-v1"
POLICY = "max_chunk_rows = 4\nwarm_quiet_ms = 0\n"
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                           "parameters": {"type": "object",
                                                          "properties": {"word": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("warm")
    (tmp / "p.toml").write_text(POLICY)
    trace = tmp / "trace.jsonl"
    warm = ServerProcess("--backend", "reference", "--policy", str(tmp / "p.toml"), "--trace", str(trace))
    cold = ServerProcess("--backend", "reference", "--policy", str(tmp / "p.toml"), "--prompt-cache-gib", "0")
    warm.trace = trace
    yield warm, cold
    assert warm.stop() == 0 and cold.stop() == 0
    assert json.loads((tmp / "trace.jsonl.meta.json").read_text())["policy"]["max_chunk_rows"] == 4


@pytest.fixture(scope="module")
def renderer():
    path = tiny_model_dir()
    return ChatRenderer(load_tokenizer(path), load_template(path))


def _events(server) -> list[dict]:
    # only whole lines: the server may be writing the last one (a partial line failed CI once)
    whole = server.trace.read_text().split("\n")[:-1]
    return [json.loads(line) for line in whole if line.strip()]


def _turn(server, messages, max_tokens=6, **kw):
    return server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
        extra_body={"return_token_ids": True, **kw.pop("extra_body", {})}, **kw)


def _reply(resp) -> dict:
    msg = resp.choices[0].message.model_dump(exclude_none=True)
    return {k: v for k, v in msg.items() if k in ("role", "content", "reasoning_content", "tool_calls")}


def _run_conversation(servers, renderer, turns, tools=None, thinking=True):
    """Each turn: warm server and cold server answer alike; from turn 2 on, the warm one
    resumes at least at the previous continuation (history + rendered reply)."""
    warm, cold = servers
    history: list[dict] = []
    cont_rows = 0
    for k, new in enumerate(turns):
        history = [*history, *new]
        finished = warm.metric("warmstate_warm_passes_total", event="finished")
        kw = {"tools": tools} if tools else {}
        extra = {"chat_template_kwargs": {"enable_thinking": thinking}}
        a = _turn(warm, history, extra_body=extra, **kw)
        b = _turn(cold, history, extra_body=extra, **kw)
        assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
        assert _reply(a) == _reply(b) and a.usage.completion_tokens == b.usage.completion_tokens
        assert b.usage.prompt_tokens_details.cached_tokens == 0
        cached = a.usage.prompt_tokens_details.cached_tokens
        if k:
            assert cached >= cont_rows > 0
        reply = _reply(a)
        cont_rows = len(renderer.render_continuation(history, reply, tools).token_ids)
        warm.wait_metric("warmstate_warm_passes_total", finished + 1, event="finished")
        history.append(reply)
    return history


def test_three_turn_chat_resumes_warm_states_exactly(servers, renderer):
    turns = [
        [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Hi, who are you?"}],
        [{"role": "user", "content": "Tell me more."}],
        [{"role": "user", "content": "And a last word?"}],
    ]
    _run_conversation(servers, renderer, turns)
    admitted = [e for e in _events(servers[0]) if e["kind"] == "request_admitted"][-3:]
    assert len({e["conversation"] for e in admitted}) == 1
    assert [e["source"] for e in admitted][1:] == ["store", "store"]


def test_reasoning_and_tool_call_turns_hit_the_warm_state(servers, renderer):
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{\"word\": \"warm\"}"}}
    turns = [
        [{"role": "user", "content": "Look up 'warm'."},
         {"role": "assistant", "content": "", "reasoning_content": "I need the tool.", "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "call_1", "content": "warm: not cold"}],
        [{"role": "user", "content": "Thanks. Think about it."}],
        [{"role": "user", "content": "Now answer directly."}],
    ]
    history = _run_conversation(servers, renderer, turns, tools=TOOLS)
    assert any(m.get("reasoning_content") for m in history if m["role"] == "assistant")
    _run_conversation(servers, renderer, turns[1:], tools=None, thinking=False)


NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}  # the reply is content, kept in the history


def _long_reply_then_warm(warm, messages) -> tuple[int, object]:
    """A long reply to `messages`; returns once its warm pass started (trace index, reply)."""
    start = len(_events(warm))
    reply = warm.client().chat.completions.create(model=MODEL, max_tokens=480, temperature=0, messages=messages,
                                                  extra_body={"ignore_eos": True, **NO_THINK})
    deadline = time.monotonic() + 30
    while not any(e["kind"] == "warm_started" for e in _events(warm)[start:]):
        assert time.monotonic() < deadline, "no warm pass started"
        time.sleep(0.002)
    return start, reply


def _running_warm(events: list[dict], arrived: int) -> dict | None:
    """The warm_started event of the pass running at index `arrived`, or None."""
    began = [i for i, e in enumerate(events[:arrived]) if e["kind"] == "warm_started"]
    if not began or any(e["kind"] in ("warm_finished", "warm_cancelled") for e in events[began[-1] : arrived]):
        return None
    return events[began[-1]]


def test_request_during_warm_pass_waits_at_most_one_chunk(servers):
    warm, _ = servers
    for attempt in range(5):  # the request must land inside the warm pass's window
        start, _ = _long_reply_then_warm(warm, [{"role": "user", "content": f"Write a long story, take {attempt}."}])
        other = warm.client().chat.completions.create(
            model=MODEL, max_tokens=1, temperature=0, messages=[{"role": "user", "content": f"Quick {attempt}?"}])
        assert other.choices[0].finish_reason in ("stop", "length")
        events = _events(warm)[start:]
        arrived = next(i for i, e in enumerate(events) if e["kind"] == "request_arrived" and e["max_tokens"] == 1)
        rid = events[arrived]["request"]
        first = next(i for i, e in enumerate(events) if e["kind"] == "chunk_started" and e["request"] == rid)
        running = _running_warm(events, arrived)
        if running is None:
            continue
        assert running["end"] - running["resume"] > 40
        between = events[arrived + 1 : first]
        assert not [e for e in between if e["kind"] == "chunk_started"]  # no new chunk before it
        assert len([e for e in between if e["kind"] == "chunk_done"]) <= 1  # only the one in flight
        assert any(e["kind"] == "warm_yielded" for e in between)
        return
    pytest.fail("no request arrived while a warm pass ran, in 5 attempts")


def test_client_gone_mid_prefill_frees_lane_and_keeps_states(servers):
    warm, _ = servers
    messages = [{"role": "system", "content": "Rules: " + "be kind. " * 30},
                {"role": "user", "content": "Summarise: " + "lorem ipsum dolor " * 300}]
    start = len(_events(warm))
    cancelled = warm.metric("warmstate_requests_total", outcome="cancelled")
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 5}).encode()
    sock = socket.create_connection(("127.0.0.1", warm.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    def this_request(events):
        """(request id, its stream) once admitted, else (None, None)."""
        rid = next((e["request"] for e in events if e["kind"] == "request_arrived" and e["max_tokens"] == 5), None)
        stream = next((e["stream"] for e in events if e["kind"] == "request_admitted" and e["request"] == rid), None)
        return rid, stream

    deadline = time.monotonic() + 30
    while True:  # until this request's pass kept its system cut (another pass's keep does not count:
        events = _events(warm)[start:]  # a warm pass of an earlier test can keep a state meanwhile)
        rid, stream = this_request(events)
        if stream is not None and any(e["kind"] == "state_kept" and e["stream"] == stream for e in events):
            break
        assert time.monotonic() < deadline, "nothing was kept"
        time.sleep(0.002)
    sock.close()
    warm.wait_metric("warmstate_requests_total", cancelled + 1, outcome="cancelled")
    events = _events(warm)[start:]
    done = next(e for e in events if e["kind"] == "request_finished" and e["request"] == rid)
    # How far the pass got before the disconnect was seen depends on the machine's load
    # (the client leaves after the first keep); the request never completes its reply.
    assert done["reason"] == "cancelled" and done["output_rows"] < 5
    kept = [e["row"] for e in events if e["kind"] == "state_kept" and e["stream"] == stream]
    again = _turn(warm, messages, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == max(kept) > 0
    assert warm.metric("warmstate_lanes_busy") == 0


def test_next_turn_adopts_a_running_warm_pass(servers):
    warm, cold = servers
    for attempt in range(5):  # the next turn must land inside the warm pass's window
        history = [{"role": "user", "content": f"Write a long poem, take {attempt}."}]
        start, first = _long_reply_then_warm(warm, history)
        history += [_reply(first), {"role": "user", "content": "Shorter, please."}]
        a = _turn(warm, history, extra_body=NO_THINK)
        events = _events(warm)[start:]
        adopted = [e for e in events if e["kind"] == "warm_adopted"]
        if not adopted:
            continue
        b = _turn(cold, history, extra_body=NO_THINK)
        assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
        admitted = next(e for e in events if e["kind"] == "request_admitted" and e["request"] == adopted[0]["request"])
        assert admitted["source"] == "warm" and admitted["stream"] == adopted[0]["stream"]
        assert a.usage.prompt_tokens_details.cached_tokens == adopted[0]["row"] > first.usage.prompt_tokens
        return
    pytest.fail("the next turn never arrived while its warm pass ran, in 5 attempts")


def test_concurrent_requests_equal_solo_ones(servers):
    warm, cold = servers
    prompts = [[{"role": "user", "content": f"Topic {i}: " + "many words here " * (3 + 5 * i)}] for i in range(3)]
    solo = [_turn(cold, p, max_tokens=8).choices[0].model_extra["token_ids"] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda p: _turn(warm, p, max_tokens=8).choices[0].model_extra["token_ids"], prompts))
    assert together == solo


def test_trace_lines_are_policy_events(servers):
    """The server's trace is the simulator's format: each line is `event_dict` of an event."""
    classes = {c.__attrs_attrs__.kind.default: c for c in vars(ev).values()
               if isinstance(c, type) and issubclass(c, ev.Event) and c is not ev.Event}
    lines = _events(servers[0])
    assert len(lines) > 50
    for line in lines:
        fields = {k: v for k, v in line.items() if k != "kind"}
        assert ev.event_dict(classes[line["kind"]](**fields)) == line
