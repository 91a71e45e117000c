"""The OpenAI API of a real `python -m executor.serve` process (tiny model, reference
backend): endpoints, streaming equals non-streaming, stop strings, prefill-only, and a
4xx with an OpenAI error body for every kind of bad input, the server staying up."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request

import openai
import pytest

from tests.executor.serve_support import ServerProcess

MODEL = "tiny-qwen3_5-v1"
CONTEXT = 512
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    policy = tmp_path_factory.mktemp("policy") / "p.toml"
    policy.write_text("queue_rows = 2\nmax_chunk_rows = 64\n")
    srv = ServerProcess("--backend", "reference", "--policy", str(policy), "--lanes", "1", "--context", str(CONTEXT))
    yield srv
    assert srv.stop() == 0


def _ok(server) -> None:
    out = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_models_health_metrics(server):
    assert [m.id for m in server.client().models.list()] == [MODEL]
    assert server.client().models.retrieve(MODEL).id == MODEL
    status, body = server.get("/v1/models/other")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    status, body = server.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    _ok(server)
    status, body = server.get("/metrics")
    text = body.decode()
    for name in ("warmstate_requests_total", "warmstate_ttft_seconds_bucket", "warmstate_prompt_rows_total",
                 "warmstate_warm_passes_total", "warmstate_store_bytes", "warmstate_evictions_total",
                 "warmstate_lanes_busy"):
        assert name in text, name
    assert server.metric("warmstate_ttft_seconds_count") >= 1


def _chat_text(resp) -> tuple[str, str]:
    m = resp.choices[0].message
    return getattr(m, "reasoning_content", None) or "", m.content or ""


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.8, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_stream_equals_whole_chat(server, sampling):
    client = server.client()
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=10, extra_body={"return_token_ids": True}, **sampling)
    client.chat.completions.create(**kw)  # both runs below then resume the same kept state
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert (reasoning, content) == _chat_text(whole)
    assert ids == whole.choices[0].model_extra["token_ids"] and len(ids) == whole.usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert whole.usage.prompt_tokens_details.cached_tokens is not None


def test_top_k_and_min_p_are_served_and_reproduce_with_a_seed(server):
    """vLLM's extra sampling parameters (Qwen3.5's card recommends top_k 20): accepted,
    -1 meaning no limit as in vLLM, and a seed reproduces the reply; top_k 1 is greedy."""
    client = server.client()
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.9, top_p=0.95, seed=5)
    ids = [client.chat.completions.create(**kw, extra_body={"top_k": 20, "min_p": 0.01, "return_token_ids": True})
           .choices[0].token_ids for _ in range(2)]
    assert ids[0] == ids[1] and len(ids[0]) == 8
    assert client.chat.completions.create(**{**kw, "extra_body": {"top_k": -1}}).choices[0].message is not None
    greedy = client.chat.completions.create(**{**kw, "temperature": 0, "extra_body": {"return_token_ids": True}})
    top1 = client.chat.completions.create(**{**kw, "extra_body": {"top_k": 1, "return_token_ids": True}})
    assert top1.choices[0].token_ids == greedy.choices[0].token_ids


def test_stream_equals_whole_completion(server):
    client = server.client()
    kw = dict(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0)
    client.completions.create(**kw)  # both runs below then resume the same kept state
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0


def test_stop_string_never_leaks(server):
    client = server.client()
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text[3:9]
    assert len(stop.strip()) > 2
    expect = text[: text.index(stop)]
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, stop=[stop])
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expect, "stop")
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, stop=stop, stream=True) if c.choices]
    assert "".join(pieces) == expect and all("\ufffd" not in p for p in pieces)


def test_prefill_only_request(server):
    client = server.client()
    messages = [{"role": "user", "content": "Prime me: " + "alpha " * 20}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=0)
    for r in (first, again):
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens


LONG = "word " * (CONTEXT + 10)
BAD_CHAT = [
    ("wrong-type-messages", {"messages": "hi"}, "messages"),
    ("empty-messages", {"messages": []}, "messages"),
    ("unknown-role", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("no-user", {"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ("content-type", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("unknown-field", {"messages": MESSAGES, "frobnicate": 1}, "frobnicate"),
    ("max-tokens-string", {"messages": MESSAGES, "max_tokens": "10"}, "max_tokens"),
    ("max-tokens-negative", {"messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
    ("max-tokens-huge", {"messages": MESSAGES, "max_tokens": 10**12}, "max_tokens"),
    ("max-tokens-float", {"messages": MESSAGES, "max_tokens": 3.5}, "max_tokens"),
    ("n-zero", {"messages": MESSAGES, "n": 0}, "n"),
    ("n-two", {"messages": MESSAGES, "n": 2}, "n"),
    ("temperature-negative", {"messages": MESSAGES, "temperature": -0.5}, "temperature"),
    ("temperature-string", {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ("top-p-big", {"messages": MESSAGES, "top_p": 1.5}, "top_p"),
    ("top-k-below-minus-one", {"messages": MESSAGES, "top_k": -2}, "top_k"),
    ("top-k-float", {"messages": MESSAGES, "top_k": 2.5}, "top_k"),
    ("min-p-big", {"messages": MESSAGES, "min_p": 1.5}, "min_p"),
    ("stream-string", {"messages": MESSAGES, "stream": "yes"}, "stream"),
    ("stream-options-without-stream", {"messages": MESSAGES, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("stop-type", {"messages": MESSAGES, "stop": 7}, "stop"),
    ("stop-empty", {"messages": MESSAGES, "stop": [""]}, "stop"),
    ("seed-type", {"messages": MESSAGES, "seed": "x"}, "seed"),
    ("tools-type", {"messages": MESSAGES, "tools": {"a": 1}}, "tools"),
    ("thinking-type", {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": "no"}},
     "chat_template_kwargs.enable_thinking"),
    ("too-long", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("model-unknown", {"messages": MESSAGES, "model": "gpt-9"}, "model"),
]


@pytest.mark.parametrize("body, param", [(b, p) for _, b, p in BAD_CHAT], ids=[i for i, _, _ in BAD_CHAT])
def test_bad_chat_body_gets_4xx_naming_the_field(server, body, param):
    status, out = server.post("/v1/chat/completions", {"model": MODEL, **body})
    assert 400 <= status < 500, out
    err = out["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]
    _ok(server)


RAW = [
    ("malformed-json", b'{"messages": [', None),
    ("not-an-object", b"[1, 2]", None),
    ("invalid-utf8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    ("lone-surrogate", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    ("nested-too-deep", b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    ("integer-too-long", b'{"max_tokens": ' + b"9" * 5000 + b"}", None),
]


@pytest.mark.parametrize("raw, param", [(r, p) for _, r, p in RAW], ids=[i for i, _, _ in RAW])
def test_bad_raw_body_gets_400(server, raw, param):
    status, out = server.post("/v1/chat/completions", raw)
    assert status == 400 and out["error"]["param"] == param and out["error"]["message"]
    _ok(server)


BAD_COMPLETION = [
    ("empty-prompt", {"prompt": ""}, "prompt"),
    ("token-out-of-range", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("prompt-list", {"prompt": ["a", "b"]}, "prompt"),
    ("echo", {"prompt": "a", "echo": True}, "echo"),
    ("unknown-field", {"prompt": "a", "messages": []}, "messages"),
]


@pytest.mark.parametrize("body, param", [(b, p) for _, b, p in BAD_COMPLETION], ids=[i for i, _, _ in BAD_COMPLETION])
def test_bad_completion_body_gets_4xx(server, body, param):
    status, out = server.post("/v1/completions", {"model": MODEL, **body})
    assert 400 <= status < 500 and out["error"]["param"] == param
    _ok(server)


def test_completion_default_max_tokens_fits_the_room_left(server):
    """/v1/completions without max_tokens generates at most 16 (OpenAI's default), fewer when the
    prompt leaves less room: a prompt 3 rows short of the context gets 3, not a 400 naming a
    max_tokens the client never sent (a review found "you requested ... 16 for the
    completion"). Given explicitly, a max_tokens past the context is still a 400; a prompt that
    fills the context leaves no room at all."""
    body = {"model": MODEL, "prompt": [5] * (CONTEXT - 3), "temperature": 0, "ignore_eos": True}
    status, out = server.post("/v1/completions", body)
    assert status == 200, out
    assert (out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]) == (3, "length")
    status, out = server.post("/v1/completions", {**body, "prompt": [5] * 10})
    assert status == 200 and out["usage"]["completion_tokens"] == 16
    status, out = server.post("/v1/completions", {**body, "max_tokens": 16})
    assert status == 400 and (out["error"]["param"], out["error"]["code"]) == ("max_tokens", "context_length_exceeded")
    status, out = server.post("/v1/completions", {**body, "prompt": [5] * CONTEXT})
    assert status == 400 and (out["error"]["param"], out["error"]["code"]) == ("prompt", "context_length_exceeded")


def test_corrupt_gzip_body_gets_400_and_counts_as_invalid(server):
    before = server.metric("warmstate_requests_total", outcome="invalid")
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=b"xx",
                                 headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    out = json.loads(err.value.read())
    assert out["error"]["code"] == "invalid_body" and "cannot be read" in out["error"]["message"]
    assert server.metric("warmstate_requests_total", outcome="invalid") == before + 1
    _ok(server)


def test_oversized_body_and_unknown_route(server):
    status, out = server.post("/v1/chat/completions", b"{" + b" " * (33 << 20) + b"}")
    assert status == 413 and out["error"]["message"]
    status, body = server.get("/v1/nothing")
    assert status == 404 and json.loads(body)["error"]["message"]
    _ok(server)


def test_queue_full_gets_503_and_others_are_served(server):
    client = server.client()

    def one(i: int):
        try:
            r = client.chat.completions.create(model=MODEL, max_tokens=40, temperature=0,
                                               extra_body={"ignore_eos": True},
                                               messages=[{"role": "user", "content": f"count {i}"}])
            return r.usage.completion_tokens
        except openai.APIStatusError as err:
            return err.status_code, err.body

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    served = [r for r in results if r == 40]
    refused = [r for r in results if isinstance(r, tuple)]
    assert len(served) >= 3 and refused and len(served) + len(refused) == 6
    for status, body in refused:
        assert status == 503 and body["code"] == "queue_full"
    _ok(server)


def test_disconnect_mid_stream_frees_the_lane(server):
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps({
        "model": MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True, "temperature": 0,
        "ignore_eos": True}).encode(), headers={"Content-Type": "application/json"})
    before = server.metric("warmstate_requests_total", outcome="cancelled")
    resp = urllib.request.urlopen(req, timeout=30)
    resp.readline()
    resp.readline()
    resp.close()
    server.wait_metric("warmstate_requests_total", before + 1, outcome="cancelled")
    assert server.metric("warmstate_lanes_busy") == 0
    _ok(server)


def test_prompt_type_errors_say_what_is_wrong():
    """A list of non-integers is a type error; only a list of prompts is "one prompt per request"."""
    from executor.api_schema import ApiError, parse_completion

    for prompt, words in (([1.0, 2.0], "list of token ids"), ([1, "a"], "list of token ids"),
                          (["a", "b"], "one prompt per request"), ([[1], [2]], "one prompt per request")):
        with pytest.raises(ApiError) as err:
            parse_completion({"prompt": prompt}, 100)
        assert err.value.param == "prompt" and words in err.value.message


def test_prompt_ids_out_of_the_vocabulary_name_the_first_bad_one():
    from executor.api_schema import ApiError, parse_completion

    assert parse_completion({"prompt": [0, 5, 99]}, 100).prompt == (0, 5, 99)
    for prompt, bad in (([3, 100, -1], 100), ([3, -1, 100], -1), ([7] * 40000 + [250000], 250000)):
        with pytest.raises(ApiError) as err:
            parse_completion({"prompt": prompt}, 100)
        assert err.value.param == "prompt" and f"token id {bad} is outside [0, 100)" in err.value.message
    for prompt in ([True, 2], [1, 2.0], [1, None]):  # JSON's true is no token id
        with pytest.raises(ApiError, match="list of token ids"):
            parse_completion({"prompt": prompt}, 100)


def test_an_id_prompt_starts_a_request_at_each_im_start():
    from executor.server import rows_of

    assert rows_of((5, 9, 1, 9, 9), 9) == (1, 3, 4)
    assert rows_of((5, 1, 2), 9) == ()
    assert rows_of((9,), 9) == (0,)


@pytest.mark.parametrize(("raw", "where"), [(b'{"a": [1, 2, {"b": ["\\udc00"]}]}', "a[2].b[0]"),
                                            (b'{"prompt": [5, "x\\uDBFFy"]}', "prompt[1]"),
                                            (b'{"k\\ud83d": 1}', "k\ud83d")])
def test_a_lone_surrogate_behind_ids_is_still_found(raw, where):
    from executor.api_schema import ApiError, decode_body

    with pytest.raises(ApiError) as err:
        decode_body(raw)
    assert err.value.message == f"{where}: contains a lone surrogate (invalid Unicode)"
    assert err.value.param == where


def test_a_body_without_a_surrogate_escape_is_not_walked(monkeypatch):
    """A 32K-id prompt's walk took 7-8 ms (a call and a path string an id); valid UTF-8 holds no surrogate, so
    only a \\uD800-\\uDFFF escape needs it. A pair (an emoji) and an escaped backslash before 'ud800' pass."""
    from executor import api_schema

    calls = []
    real = api_schema._check_strings
    monkeypatch.setattr(api_schema, "_check_strings", lambda v, p: calls.append(p) or real(v, p))
    assert api_schema.decode_body(b'{"prompt": [1, 2, 3], "stop": ["a\\u00e9"]}')["stop"] == ["a\u00e9"]
    assert calls == []
    assert api_schema.decode_body(b'{"prompt": "\\ud83d\\ude00 \\\\ud800"}')["prompt"] == "\U0001f600 \\ud800"
    assert calls[:1] == [""]  # an escape in the surrogate range: walked (from the top), and nothing lone found
