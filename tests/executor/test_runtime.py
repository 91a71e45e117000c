"""`executor.runtime.Runtime` in-process on the reference backend: scripted replies (a
wrapper forces the tokens a test needs), tool-call and reasoning turns that the next
request resumes from the warm pass, stops, prefill-only, cancellation, backend errors."""

from __future__ import annotations

import asyncio
import io
import json
import threading

import attrs
import numpy as np
import pytest
from aiohttp import web

from executor.chat import ChatRenderer, load_template
from executor.conversations import Continuation, Conversations
from executor.model import tiny_model_dir
from executor.reference.backend import ReferenceBackend
from executor.runtime import Done, Job, Runtime
from executor.sampling import SamplingParams
from executor.server import Api, ApiConfig, build_app
from executor.tokenizer import load_tokenizer
from policy.config import PolicyConfig
from policy.prefix import Prompt

CFG = PolicyConfig(max_chunk_rows=16, warm_quiet_ms=0.0, prompt_cache_bytes=1 << 30)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]


class Scripted:
    """The reference backend, but every logits row it returns puts `script[k]` on top,
    k = tokens generated so far by that state (the states themselves are real)."""

    invariant_rows = None

    def __init__(self, inner: ReferenceBackend, script: list[int], fail_on: int | None = None) -> None:
        self.inner, self.config, self.script, self.fail_on = inner, inner.config, script, fail_on
        self._base: dict[int, int] = {}

    def _force(self, k: int, logits: np.ndarray) -> np.ndarray:
        out = np.array(logits, copy=True)
        out[self.script[min(k, len(self.script) - 1)]] = out.max() + 10.0
        return out

    def new_state(self):
        return self.inner.new_state()

    def prefill(self, state, token_ids, rows, want_logits=True):
        if self.fail_on is not None and self.fail_on in token_ids[rows[0] : rows[1]]:
            raise RuntimeError("planted backend failure")
        out = self.inner.prefill(state, token_ids, rows, want_logits)
        if out is None:
            return None
        self._base[id(state)] = state.rows
        return self._force(0, out)

    def decode(self, states, token_ids):
        out = self.inner.decode(states, token_ids)
        return np.stack([self._force(s.rows - self._base[id(s)], out[i]) for i, s in enumerate(states)])

    def snapshot(self, state, base=None):
        return self.inner.snapshot(state, base)

    def ghost(self, payload):
        return self.inner.ghost(payload)

    def restore(self, payload):
        state = self.inner.restore(payload)
        if payload.logits is not None:
            self._base[id(state)] = payload.rows
        return state

    def payload_bytes(self, payload):
        return self.inner.payload_bytes(payload)

    def state_bytes(self, state):
        return self.inner.state_bytes(state)


@pytest.fixture(scope="module")
def model():
    path = tiny_model_dir()
    tok = load_tokenizer(path)
    return ReferenceBackend.from_dir(path), tok, ChatRenderer(tok, load_template(path))


def _ids(tok, text: str, end: str | None = "<|im_end|>") -> list[int]:
    ids = tok.encode(text, add_special_tokens=False).ids
    return ids + ([tok.token_to_id(end)] if end else [])


def _events(trace: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in trace.getvalue().splitlines()]


async def _wait_for(trace: io.StringIO, kind: str, count: int = 1, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if sum(e["kind"] == kind for e in _events(trace)) >= count:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"no {count} x {kind} in the trace")


async def _collect(handle) -> tuple[list, Done]:
    events = [e async for e in handle.events()]
    assert isinstance(events[-1], Done)
    return events[:-1], events[-1]


def _run_api(model, script, test, cfg=CFG):
    # imported here, not at the top: the GPU machine has no openai, and this file's cuda cases run there
    openai = pytest.importorskip("openai")
    backend, tok, renderer = model
    trace = io.StringIO()

    async def main():
        runtime = Runtime(Scripted(backend, script), tok, cfg, trace=trace)
        stop_ids = frozenset({tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")})
        api = Api(runtime, renderer, ApiConfig(model_id="tiny", context_rows=4096, stop_ids=stop_ids))
        runner = web.AppRunner(build_app(api), handler_cancellation=True, access_log=None)
        await runtime.start()
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{runner.addresses[0][1]}/v1", api_key="x",
                                    max_retries=0)
        try:
            await test(client, trace)
        finally:
            await client.close()
            await runtime.close()
            await runner.cleanup()

    asyncio.run(main())
    return _events(trace)


def test_tool_call_turn_then_tool_result_resumes_warm_state(model):
    _, tok, renderer = model
    text = ("I should call the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
            "Paris\n</parameter>\n</function>\n</tool_call>")
    messages = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"}]

    async def test(client, trace):
        r1 = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=80,
                                                  temperature=0)
        choice = r1.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.reasoning_content == "I should call the tool."
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        await _wait_for(trace, "warm_finished")
        history = [*messages, choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        cont = renderer.render_continuation(messages, choice.message.model_dump(exclude_none=True), TOOLS)
        r2 = await client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=2,
                                                  temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens == len(cont.token_ids)
        assert len(cont.token_ids) >= r1.usage.prompt_tokens + r1.usage.completion_tokens - 2

    events = _run_api(model, _ids(tok, text), test)
    admitted = [e for e in events if e["kind"] == "request_admitted"]
    assert admitted[1]["conversation"] == admitted[0]["conversation"] and admitted[1]["source"] == "store"


def test_reasoning_turn_then_user_turn_resumes_warm_state(model):
    _, tok, renderer = model
    text = "Two and two.\n</think>\n\nThe answer is 4."

    async def test(client, trace):
        messages = [{"role": "user", "content": "2+2?"}]
        r1 = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0)
        msg = r1.choices[0].message
        assert (msg.reasoning_content, msg.content, r1.choices[0].finish_reason) == ("Two and two.", "The answer is 4.",
                                                                                     "stop")
        await _wait_for(trace, "warm_finished")
        reply = {"role": "assistant", "content": msg.content, "reasoning_content": msg.reasoning_content}
        cont = renderer.render_continuation(messages, reply)
        r2 = await client.chat.completions.create(
            model="tiny", messages=[*messages, reply, {"role": "user", "content": "and 3+3?"}], max_tokens=2,
            temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens == len(cont.token_ids) > r1.usage.prompt_tokens

    _run_api(model, _ids(tok, text), test)


def test_streamed_tool_call(model):
    _, tok, _ = model
    text = ("x</think>ok<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
            "</tool_call>")

    async def test(client, trace):
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=60, temperature=0,
            stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert content == "ok" and finish == ["tool_calls"] and chunks[-1].usage.completion_tokens > 5
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Oslo"}]

    _run_api(model, _ids(tok, text), test)


def _run_jobs(model, script, jobs_fn, cfg=CFG, fail_on=None):
    backend, tok, _ = model
    trace = io.StringIO()

    async def main():
        runtime = Runtime(Scripted(backend, script, fail_on), tok, cfg, trace=trace)
        await runtime.start()
        try:
            return await jobs_fn(runtime, trace)
        finally:
            await runtime.close()

    return asyncio.run(main()), _events(trace)


def _job(tok, text="<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", **kw):
    ids = tok.encode(text, add_special_tokens=False).ids
    starts = [i for i, t in enumerate(ids) if t == tok.token_to_id("<|im_start|>")]
    stop_ids = frozenset({tok.token_to_id("<|im_end|>")})
    return Job(prompt_ids=ids, starts=starts, stop_ids=stop_ids, **{"max_tokens": 8, **kw})


def test_first_token_stop_and_stop_strings(model):
    _, tok, _ = model

    async def jobs(runtime, trace):
        first = await _collect(runtime.submit(_job(tok)))
        return first

    (_, done), _ = _run_jobs(model, [tok.token_to_id("<|im_end|>")], jobs)
    assert (done.reason, done.completion_tokens, done.text) == ("stop", 1, "")

    async def jobs2(runtime, trace):
        return await _collect(runtime.submit(_job(tok, stop=("STOP",), max_tokens=30)))

    (events, done), _ = _run_jobs(model, _ids(tok, "abc STOP def"), jobs2)
    assert done.reason == "stop" and done.text == "abc " == "".join(e.text for e in events)


def test_submit_takes_a_prompt_built_already_and_refuses_one_of_other_rows(model):
    """`submit(prompt=)` (the engine process's packed ids) serves as `from_tokens` would: a
    second job with the same ids and its prompt given hits the first one's kept state; a prompt
    of other rows is a ValueError before anything is queued."""
    _, tok, _ = model

    async def jobs(runtime, trace):
        job = _job(tok, max_tokens=0)
        a = await _collect(runtime.submit(job))
        b = await _collect(runtime.submit(job, prompt=Prompt.from_tokens(job.prompt_ids)))
        with pytest.raises(ValueError, match=f"prompt has 3 rows but the job {len(job.prompt_ids)} ids"):
            runtime.submit(job, prompt=Prompt.from_tokens((1, 2, 3)))
        return a[1], b[1], runtime.waiting

    (a, b, waiting), _ = _run_jobs(model, _ids(tok, "hey"), jobs)
    assert (a.cached_tokens, b.cached_tokens, waiting) == (0, b.prompt_tokens, 0)


def test_prefill_only_and_full_hit(model):
    _, tok, _ = model

    async def jobs(runtime, trace):
        a = await _collect(runtime.submit(_job(tok, max_tokens=0)))
        b = await _collect(runtime.submit(_job(tok, max_tokens=0)))
        c = await _collect(runtime.submit(_job(tok, max_tokens=3)))
        return a[1], b[1], c[1]

    (a, b, c), events = _run_jobs(model, _ids(tok, "hey there friend"), jobs)
    assert (a.reason, a.completion_tokens, a.cached_tokens) == ("length", 0, 0)
    assert (b.reason, b.cached_tokens) == ("length", b.prompt_tokens)
    assert c.cached_tokens == c.prompt_tokens and c.completion_tokens == 3  # first token from the kept logits
    assert not any(e["kind"] == "request_finished" and e["reason"] == "cancelled" for e in events)


def test_step_phases_are_timed_into_metrics(model):
    """/metrics' warmstate_step_phase_seconds_total{phase}: a cold reply times its forward,
    keep and decode phases, a full hit its restore; every count only grows."""
    import re

    from executor import metrics, stepper

    assert stepper.PHASES == metrics.STEP_PHASES
    _, tok, _ = model

    async def jobs(runtime, trace):
        def phases():
            text = runtime.metrics_text().decode()
            return {p: float(re.search(rf'warmstate_step_phase_seconds_total{{phase="{p}"}} (\S+)', text).group(1))
                    for p in stepper.PHASES}

        seen = [phases()]
        await _collect(runtime.submit(_job(tok, max_tokens=3)))
        seen.append(phases())
        hit = await _collect(runtime.submit(_job(tok, max_tokens=3)))
        seen.append(phases())
        return seen, hit[1]

    (seen, hit), _ = _run_jobs(model, _ids(tok, "hey there friend"), jobs)
    zero, cold, after = seen
    assert set(zero.values()) == {0.0}
    assert cold["forward"] > 0 and cold["keep"] > 0 and cold["decode"] > 0 and cold["sample"] > 0, cold
    assert hit.cached_tokens == hit.prompt_tokens and after["restore"] > 0, after
    assert all(after[p] >= cold[p] for p in stepper.PHASES)


def test_cancel_mid_prefill_frees_the_lane_within_one_chunk(model):
    _, tok, _ = model
    long_text = ("<|im_start|>system\n" + "rule " * 40 + "<|im_end|>\n<|im_start|>user\n" + "word " * 300
                 + "<|im_end|>\n<|im_start|>assistant\n")

    async def jobs(runtime, trace):
        handle = runtime.submit(_job(tok, long_text, max_tokens=4))
        await _wait_for(trace, "state_kept")  # the system cut
        at = len(_events(trace))
        runtime.cancel(handle)
        _, done = await _collect(handle)
        other = await _collect(runtime.submit(_job(tok, long_text, max_tokens=1)))
        return done, other[1], at

    (done, other, at), events = _run_jobs(model, _ids(tok, "x"), jobs)
    assert done.reason == "cancelled"
    after = events[at:]
    finished = next(i for i, e in enumerate(after) if e["kind"] == "request_finished")
    assert after[finished]["request"] == "req-1"
    assert len([e for e in after[:finished] if e["kind"] == "chunk_done"]) <= 1  # the chunk in flight, if any
    kept_row = next(e["row"] for e in events if e["kind"] == "state_kept")
    assert other.cached_tokens == kept_row  # what the cancelled pass kept is still usable


def test_backend_error_fails_only_that_request(model):
    _, tok, _ = model
    poison = tok.encode(" zebra", add_special_tokens=False).ids[0]

    async def jobs(runtime, trace):
        bad = await _collect(runtime.submit(_job(tok, "<|im_start|>user\n zebra<|im_end|>\n<|im_start|>assistant\n")))
        good = await _collect(runtime.submit(_job(tok, max_tokens=2)))
        return bad[1], good[1]

    (bad, good), _ = _run_jobs(model, _ids(tok, "fine"), jobs, fail_on=poison)
    assert bad.reason == "error" and "planted" in bad.error
    assert (good.reason, good.text, good.completion_tokens) == ("stop", "fine", 2)


def test_a_failed_keep_keeps_nothing_and_fails_no_request(model, monkeypatch):
    """A snapshot that raises (the device out of memory for the copy) costs the cache that
    state, not the request: the reply completes, and the same prompt again finds nothing
    kept (cached_tokens 0) instead of a state without a payload."""
    _, tok, _ = model
    failures = []

    def failing_snapshot(self, state, base=None):
        failures.append(state.rows)
        raise MemoryError("planted: no device memory for the keep")

    monkeypatch.setattr(Scripted, "snapshot", failing_snapshot)

    async def jobs(runtime, trace):
        first = await _collect(runtime.submit(_job(tok, max_tokens=2)))
        again = await _collect(runtime.submit(_job(tok, max_tokens=2)))
        return first[1], again[1]

    (first, again), events = _run_jobs(model, _ids(tok, "fine"), jobs)
    assert failures  # the keeps ran, and raised
    assert (first.reason, first.text, first.completion_tokens) == ("stop", "fine", 2)
    assert (again.reason, again.text, again.cached_tokens) == ("stop", "fine", 0)
    assert not any(e["kind"] == "request_finished" and e["reason"] not in ("stop", "length") for e in events)


def test_a_failed_keep_is_taken_back_by_the_scheduler(model):
    """runtime._apply of a Kept effect without a snapshot (the snapshot raised):
    - the keep only added logits to an entry that holds a snapshot without them (a cold
      pass ending where an earlier pass kept): the entry stays, without logits, so no later
      identical prompt takes it for a full hit whose first token has no logits;
    - a new entry: evicted through the scheduler, so the trace says so (state_evicted) and
      the store's bytes go back."""
    from executor.payloads import Payload
    from policy.prefix import Prompt
    from policy.work import Kept

    backend, tok, _ = model
    trace = io.StringIO()
    runtime = Runtime(Scripted(backend, [0]), tok, CFG, trace=trace)
    store = runtime.scheduler.store
    a = Prompt.from_tokens(list(range(100, 148)))
    first = store.keep(a, 32, (), has_logits=False, value_s=1.0, now_s=0.0).entry
    first.payload = Payload(snapshot=None, rows=32, logits=None, bytes=0)
    assert store.keep(a, 32, (), has_logits=True, value_s=1.0, now_s=1.0).reason == "logits_added"
    runtime._apply([Kept(0, first)], None)
    assert first.live and not first.has_logits and first.payload is not None

    used = store.bytes_used
    fresh = store.keep(Prompt.from_tokens(list(range(200, 248))), 48, (), has_logits=True, value_s=1.0,
                       now_s=2.0).entry
    assert store.bytes_used > used
    runtime._apply([Kept(0, fresh)], None)
    assert not fresh.live and store.bytes_used == used
    assert [e["entry"] for e in _events(trace) if e["kind"] == "state_evicted"] == [fresh.id]


def test_two_runtimes_give_identical_results(model):
    backend, tok, _ = model
    job = _job(tok, max_tokens=6, sampling=SamplingParams(temperature=0.8, top_p=0.9), seed=7)

    async def run_twice() -> list[tuple[int, ...]]:
        rt = Runtime(backend, tok, CFG)
        await rt.start()
        try:
            return [(await _collect(rt.submit(job)))[1].token_ids for _ in range(2)]
        finally:
            await rt.close()

    first, second = asyncio.run(run_twice()), asyncio.run(run_twice())
    assert first == second and first[0] == first[1]


def test_only_sampled_requests_get_a_generator(model, monkeypatch):
    """A greedy request (temperature 0, or top_k 1) draws nothing, so none is made for it; a
    sampled one gets `new_rng(seed)`, and its reply is the one that generator draws."""
    import executor.runtime as runtime_module

    backend, tok, _ = model
    made: list[int] = []
    monkeypatch.setattr(runtime_module, "new_rng", lambda seed: made.append(seed) or np.random.default_rng(seed))
    sampled = SamplingParams(temperature=0.8, top_p=0.9)

    async def run() -> dict[str, tuple[int, ...]]:
        rt = Runtime(backend, tok, CFG)
        await rt.start()
        try:
            handles = {name: rt.submit(_job(tok, max_tokens=4, sampling=params, seed=seed))
                       for name, params, seed in (("greedy", SamplingParams(), 5),
                                                  ("top_k_1", SamplingParams(temperature=0.8, top_k=1), 6),
                                                  ("sampled", sampled, 7))}
            assert [rt._lives[h.id].rng is None for h in handles.values()] == [True, True, False]
            return {name: (await _collect(h))[1].token_ids for name, h in handles.items()}
        finally:
            await rt.close()

    replies = asyncio.run(run())
    assert made == [7]
    assert replies["greedy"] == replies["top_k_1"] and len(replies["sampled"]) == 4


def test_conversation_matching():
    convs = Conversations(capacity=2)
    ids = list(range(100, 140))
    a = convs.new()
    convs.expect(a, Continuation.of(ids[:20], (0, 10)))
    assert convs.match(Prompt.from_tokens(ids), (0, 10, 20, 30)) == a
    assert convs.match(Prompt.from_tokens(ids), (0, 10, 30)) is None  # 20 must be a start
    assert convs.match(Prompt.from_tokens([1] + ids[1:]), (0, 20)) is None
    b, c = convs.new(), convs.new()
    convs.expect(b, Continuation.of(ids[:25], ()))
    convs.expect(c, Continuation.of(ids[:30], ()))
    assert len(convs) == 2 and convs.match(Prompt.from_tokens(ids), (20,)) is None  # oldest dropped
    convs.warm_scheduled(c, Continuation.of(ids[:30], ()))
    assert convs.warm_ids(c) == tuple(ids[:30])


def _held_bytes(config, store) -> int:
    """Bytes the store's payloads hold, each shared K/V segment counted once (what device
    memory holds): the GPU backend's device buffers, the reference's serving-format sizes."""
    fixed, segments = 0, {}
    for e in store.entries():
        assert e.payload is not None, f"entry {e.id} at row {e.row} has no payload"
        snap = e.payload.snapshot
        part = snap.fixed if hasattr(snap, "fixed") else snap.recurrent
        assert e.payload.ghost == (not e.live) == (part is None), f"entry {e.id}: live {e.live}"
        if part is not None:
            fixed += int(part.shape[0]) if hasattr(snap, "fixed") else config.state_bytes(0)
        for seg in snap.segments:
            segments[id(seg)] = seg.nbytes if hasattr(seg, "nbytes") else (seg.end - seg.start) * config.kv_bytes_per_row
    return fixed + sum(segments.values())


def _backend(model, kind):
    if kind == "reference":
        return model[0]
    from executor.numba_cuda.device import is_gpu_available
    if not is_gpu_available():
        pytest.skip("needs an NVIDIA GPU")
    from executor.numba_cuda.backend import NumbaCudaBackend
    return NumbaCudaBackend.from_dir(tiny_model_dir(), slots=8, capacity_rows=512)


@pytest.mark.parametrize("kind", ["reference", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_kept_states_share_kv_rows_and_hold_what_the_store_counts(model, kind):
    """Prompts that extend one another under a budget that forces evictions: the payloads
    hold exactly the store's bytes_used (each K/V row once, ghosts without their fixed
    part), and every reply equals a cache-off runtime's, token for token."""
    _, tok, _ = model
    backend = _backend(model, kind)
    c = backend.config
    turns = ["<|im_start|>system\nYou are terse and kind, always.<|im_end|>\n"]
    for k in range(5):
        turns.append(f"<|im_start|>user\nquestion number {k} about rivers<|im_end|>\n<|im_start|>assistant\n")
    prompts = ["".join(turns[:n]) for n in range(2, len(turns) + 1)]
    prompts += [turns[0] + turns[3], prompts[2], prompts[-1]]
    budget = 4 * c.state_bytes(0) + 120 * c.kv_bytes_per_row
    cfg = attrs.evolve(CFG, grid_rows=16, prompt_cache_bytes=budget)

    def run(cfg):
        held = []

        async def main():
            runtime = Runtime(backend, tok, cfg, trace=trace)
            await runtime.start()
            try:
                out = []
                for text in prompts:
                    out.append((await _collect(runtime.submit(_job(tok, text, max_tokens=3))))[1])
                    store = runtime.scheduler.store
                    held.append((_held_bytes(c, store), store.bytes_used))
                return out
            finally:
                await runtime.close()
        trace = io.StringIO()
        return asyncio.run(main()), held, _events(trace)

    warm, held, events = run(cfg)
    cold, _, _ = run(attrs.evolve(cfg, prompt_cache_bytes=0))
    assert [d.token_ids for d in warm] == [d.token_ids for d in cold]
    assert all(d.cached_tokens == 0 for d in cold) and sum(d.cached_tokens > 0 for d in warm) >= 4
    assert [h for h, _ in held] == [u for _, u in held]
    assert max(u for _, u in held) > 3 * c.state_bytes(0)  # the budget was in play
    hows = {e["how"] for e in events if e["kind"] == "state_evicted"}
    assert hows == {"ghost", "freed"}, hows
    assert not any(e["kind"] == "request_finished" and e["reason"] not in ("stop", "length") for e in events)


def test_first_token_reaches_the_client_before_its_steps_keep(model, monkeypatch):
    """A first token goes to its handle as soon as it is sampled (`Stepper.publish`), not at
    the commit after the chunk's keep: the keep's snapshot here blocks until the token has
    arrived (up to 10 s). The reply is the same as with the token held back: every token
    once, in order, and the keep still happens (a second identical request is a full hit)."""
    import threading

    _, tok, _ = model
    arrived, waited = threading.Event(), []
    inner = Scripted.snapshot
    end = len(_job(tok).prompt_ids)

    def blocking_snapshot(self, state, base=None):
        if state.rows == end and not waited:  # the keep at the prompt's end: the first token's step
            waited.append(arrived.wait(10.0))
        return inner(self, state, base)

    monkeypatch.setattr(Scripted, "snapshot", blocking_snapshot)

    async def jobs(runtime, trace):
        handle = runtime.submit(_job(tok, max_tokens=3))
        first = await handle.queue.get()
        arrived.set()
        events, done = await _collect(handle)
        again = await _collect(runtime.submit(_job(tok, max_tokens=3)))
        return [first, *events], done, again[1]

    (events, done, again), trace = _run_jobs(model, _ids(tok, "hey there friend"), jobs)
    assert waited == [True]  # the prompt end's keep saw the token delivered while it ran
    assert [t for e in events for t in e.token_ids] == list(done.token_ids) == _ids(tok, "hey there friend")[:3]
    assert "".join(e.text for e in events) == done.text
    assert again.cached_tokens == again.prompt_tokens and again.token_ids == done.token_ids


def test_published_s_is_stamped_as_the_tokens_leave_not_after_the_hand_off():
    """`Outcome.published_s` is the moment the worker hands first tokens on, before
    `Stepper.publish` returns: the runtime's publish waits for the loop thread (up to
    PUBLISH_WAIT_S), and a stamp after it read a contended hand-off as a late publish (a CPU
    run had the engine "publish" 0.6 ms after the client had the token)."""
    import time

    from executor.stepper import Outcome, Stepper

    stepper = Stepper.__new__(Stepper)  # no backend needed for _publish
    calls: list[tuple[float, int]] = []

    def slow_publish(tokens):
        calls.append((time.perf_counter(), len(tokens)))
        time.sleep(0.05)

    stepper.publish = slow_publish
    out = Outcome()
    out.started = time.perf_counter()
    out.tokens = [(None, 1, "a"), (None, 2, "b")]
    stepper._publish(out, more=True)
    assert calls and calls[0][1] == 2 and out.published == 2
    assert out.published_s <= calls[0][0] - out.started < 0.05  # not the 50 ms the hand-off took
    stepper._publish(out, more=True)  # nothing new: no call, no new stamp
    assert len(calls) == 1
    out.tokens.append((None, 3, "c"))
    stepper._publish(out, more=False)  # no more work in the step: the commit delivers it
    assert len(calls) == 1 and out.published == 2


def test_pick_takes_the_backend_s_greedy_for_greedy_requests_only():
    """`stepper.pick`: a greedy request takes the state's `greedy` (the backend's argmax)
    when there is one, else np.argmax; a sampled request always draws from the logits."""
    from types import SimpleNamespace

    from executor.stepper import pick

    logits = np.asarray([0.0, 5.0, 1.0, 4.9], np.float32)
    live = lambda params, rng=None: SimpleNamespace(job=SimpleNamespace(sampling=params), rng=rng)  # noqa: E731
    marked = SimpleNamespace(greedy=3)  # not the argmax: shows whose pick it is
    assert pick(live(SamplingParams(temperature=0.0)), logits, marked) == 3
    assert pick(live(SamplingParams(temperature=0.7, top_k=1)), logits, marked) == 3
    assert pick(live(SamplingParams(temperature=0.0)), logits, SimpleNamespace(greedy=None)) == 1
    assert pick(live(SamplingParams(temperature=0.0)), logits, None) == 1
    draws = [pick(live(SamplingParams(temperature=1.0), np.random.default_rng(s)), logits, marked) for s in range(40)]
    assert set(draws) <= {0, 1, 2, 3} and 1 in draws  # sampled from the logits, not the mark


class _Boxed:
    """A reference state with the `greedy` a device backend may attach (Backend docstring)."""

    def __init__(self, inner) -> None:
        self.inner, self.greedy = inner, None


class Marking(Scripted):
    """Scripted, with states that carry `greedy`: (argmax + 1) % vocab of the logits each
    call returns, a value the host's argmax would never give, so a reply built from it
    shows that the stepper took the backend's pick for the first token and every decode
    round."""

    def __init__(self, inner, script) -> None:
        super().__init__(inner, script)

    def _mark(self, box, logits):
        box.greedy = None if logits is None else int((np.argmax(logits) + 1) % logits.shape[-1])

    def new_state(self):
        return _Boxed(super().new_state())

    def prefill(self, state, token_ids, rows, want_logits=True):
        out = super().prefill(state.inner, token_ids, rows, want_logits)
        self._mark(state, out)
        return out

    def decode(self, states, token_ids):
        out = super().decode([s.inner for s in states], token_ids)
        for box, row in zip(states, out):
            self._mark(box, row)
        return out

    def snapshot(self, state, base=None):
        return super().snapshot(state.inner, base)

    def restore(self, payload):
        return _Boxed(super().restore(payload))

    def state_bytes(self, state):
        return super().state_bytes(state.inner)


def test_greedy_lanes_take_the_state_s_pick_sampled_lanes_do_not(model):
    """Through the runtime: a greedy reply is the backend's picks (first token from the
    prefill's state, the rest from decode rounds); a sampled reply ignores them."""
    backend, tok, _ = model
    script = [tok.token_to_id(w) for w in ("Hi", "there", "friend", "again")]
    marking = Marking(backend, script)

    async def run(params):
        rt = Runtime(marking, tok, CFG)
        await rt.start()
        try:
            return (await _collect(rt.submit(_job(tok, max_tokens=4, sampling=params))))[1]
        finally:
            await rt.close()

    greedy = asyncio.run(run(SamplingParams(temperature=0.0)))
    assert greedy.token_ids == tuple((t + 1) % backend.config.vocab_size for t in script)
    sampled = asyncio.run(run(SamplingParams(temperature=1e-3)))  # near-greedy sampling: the scripted tokens
    assert sampled.token_ids == tuple(script)


def test_enqueue_returns_with_an_idle_runtime_s_step_already_started(model):
    """`Runtime.enqueue` yields once so that an idle driver plans the request and hands its
    step to the worker before the API handler goes on to write its response headers (the
    HTTP work sat in front of the first step, bench/RESULTS.md session 24). Before the change
    the driver was three loop hops away on Python 3.11 (wait_for's inner task) and still idle
    when enqueue returned."""
    _, tok, _ = model

    async def jobs(runtime, trace):
        await asyncio.sleep(0.05)  # the driver is idle, waiting for work
        started = []
        for _ in range(3):
            handle = await runtime.enqueue(_job(tok, max_tokens=2))
            started.append(runtime.stepping)
            await _collect(handle)
            await asyncio.sleep(0.02)  # idle again
        return started

    started, _ = _run_jobs(model, _ids(tok, "ok"), jobs)
    assert started == [True, True, True]


def test_block_buffered_trace_files_hold_every_event_once_the_runtime_idles(model, tmp_path):
    """The server opens its trace and steps files block-buffered (no write system call per
    event between a request's arrival and its first token); the runtime flushes them after
    each step and before it idles, so a reader sees a finished request's events while the
    server runs on."""
    backend, tok, _ = model
    trace_path, steps_path = tmp_path / "t.jsonl", tmp_path / "t.jsonl.steps.jsonl"

    async def main():
        with trace_path.open("w", encoding="utf-8") as trace, steps_path.open("w", encoding="utf-8") as steps:
            runtime = Runtime(Scripted(backend, _ids(tok, "one two three four five")), tok, CFG, trace=trace,
                              steps=steps)
            await runtime.start()
            try:
                _, done = await _collect(await runtime.enqueue(_job(tok, max_tokens=3)))
                await asyncio.sleep(0.05)  # the driver flushes before it idles
                return done, trace_path.read_text(), steps_path.read_text()
            finally:
                await runtime.close()

    done, trace_text, steps_text = asyncio.run(main())
    kinds = [json.loads(line)["kind"] for line in trace_text.splitlines()]
    assert (done.reason, done.completion_tokens) == ("length", 3)
    assert kinds[0] == "request_arrived" and "request_finished" in kinds
    assert len(steps_text.splitlines()) >= 3  # a prefill step and two decode rounds


class _KeepWarm:
    """Records the runtime's start/stop calls; `fail` makes start raise."""

    def __init__(self, fail: bool = False) -> None:
        self.running, self.calls, self.fail, self.closed = False, [], fail, False

    def start(self) -> None:
        if self.fail:
            raise RuntimeError("planted launch failure")
        self.running = True
        self.calls.append("start")

    def stop(self) -> None:
        self.running = False
        self.calls.append("stop")

    def close(self) -> None:
        self.closed = True


class _Watching(Scripted):
    """Scripted, and notes whether the keep-warm kernel ran during each prefill and decode."""

    def __init__(self, inner, script, keep) -> None:
        super().__init__(inner, script)
        self.keep, self.seen = keep, []

    def prefill(self, state, token_ids, rows, want_logits=True):
        self.seen.append(self.keep.running)
        return super().prefill(state, token_ids, rows, want_logits)

    def decode(self, states, token_ids):
        self.seen.append(self.keep.running)
        return super().decode(states, token_ids)


def test_keep_warm_runs_while_idle_and_never_during_a_step(model):
    """`Runtime(keep_warm=...)`: started as the driver idles, stopped before each step is
    handed to the worker (`--keep-gpu-warm`); closed with the runtime."""
    backend, tok, _ = model
    keep = _KeepWarm()
    watching = _Watching(backend, _ids(tok, "one two three four five"), keep)

    async def main():
        runtime = Runtime(watching, tok, CFG, keep_warm=keep)
        await runtime.start()
        try:
            await asyncio.sleep(0.02)
            idle_before = keep.running
            _, done = await _collect(await runtime.enqueue(_job(tok, max_tokens=3)))
            await asyncio.sleep(0.05)
            return idle_before, done, keep.running
        finally:
            await runtime.close()

    idle_before, done, idle_after = asyncio.run(main())
    assert (idle_before, idle_after) == (True, True)
    assert done.completion_tokens == 3
    assert watching.seen and not any(watching.seen)  # never running while a step computed
    assert keep.calls[0] == "start" and "stop" in keep.calls and keep.closed


def test_a_keep_warm_that_fails_to_start_is_dropped_and_serving_goes_on(model):
    backend, tok, _ = model
    keep = _KeepWarm(fail=True)

    async def main():
        runtime = Runtime(Scripted(backend, _ids(tok, "one two three")), tok, CFG, keep_warm=keep)
        await runtime.start()
        try:
            await asyncio.sleep(0.02)
            return await _collect(await runtime.enqueue(_job(tok, max_tokens=2)))
        finally:
            await runtime.close()

    _, done = asyncio.run(main())
    assert (done.reason, done.completion_tokens) == ("length", 2)
    assert keep.calls == ["stop"] and not keep.closed  # stopped and dropped at its first failure, never called again


def test_a_caller_cancelled_inside_enqueue_cancels_its_request(model):
    """`Runtime.enqueue` yields after the submit; a handler cancelled there (its client gone)
    never gets the handle, so enqueue cancels the request itself (a fresh review, session 24:
    without it the request ran to max_tokens holding a lane)."""
    _, tok, _ = model

    async def jobs(runtime, trace):
        task = asyncio.create_task(runtime.enqueue(_job(tok, max_tokens=400)))
        await asyncio.sleep(0)  # submitted; the task waits in enqueue's yield
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_for(trace, "request_finished")
        return runtime.lanes_busy

    busy, events = _run_jobs(model, _ids(tok, "one two three four five"), jobs)
    finished = [e for e in events if e["kind"] == "request_finished"]
    assert [e["reason"] for e in finished] == ["cancelled"] and busy == 0


class _Blocking(Scripted):
    """Scripted, whose prefill waits for `go` (a step in flight, as long as a test needs)."""

    def __init__(self, inner, script) -> None:
        super().__init__(inner, script)
        self.entered, self.go = threading.Event(), threading.Event()

    def prefill(self, state, token_ids, rows, want_logits=True):
        self.entered.set()
        assert self.go.wait(10.0)
        return super().prefill(state, token_ids, rows, want_logits)


def test_a_step_s_arrival_and_chunk_are_on_disk_while_it_computes(model, tmp_path):
    """The block-buffered trace is flushed once a step is handed to the worker: a process that
    dies in the step leaves the request's arrival, admission and chunk_started behind (a
    fresh review, session 24: a kill mid-step left an empty trace)."""
    backend, tok, _ = model
    path = tmp_path / "t.jsonl"
    blocking = _Blocking(backend, _ids(tok, "one two"))

    async def main():
        with path.open("w", encoding="utf-8") as trace:
            runtime = Runtime(blocking, tok, CFG, trace=trace)
            await runtime.start()
            try:
                handle = await runtime.enqueue(_job(tok, max_tokens=2))
                assert await asyncio.to_thread(blocking.entered.wait, 10.0)
                during = path.read_text()
                blocking.go.set()
                await _collect(handle)
                return during
            finally:
                blocking.go.set()
                await runtime.close()

    during = asyncio.run(main())
    kinds = [json.loads(line)["kind"] for line in during.splitlines()]
    assert kinds[:3] == ["request_arrived", "request_admitted", "chunk_started"]


def test_the_idle_driver_asks_the_keep_warm_kernel_again_while_idle(model):
    """With a keep-warm kernel the idle driver wakes every KEEP_WARM_WAKE_S to launch it again
    once it returned after its max_s (a fresh review, session 24: idle spells over max_s let the
    GPU idle)."""
    from executor.runtime import KEEP_WARM_WAKE_S

    backend, tok, _ = model
    keep = _KeepWarm()

    async def main():
        runtime = Runtime(Scripted(backend, _ids(tok, "ok")), tok, CFG, keep_warm=keep)
        await runtime.start()
        try:
            await asyncio.sleep(5 * KEEP_WARM_WAKE_S)
            return keep.calls.count("start")
        finally:
            await runtime.close()

    starts = asyncio.run(main())
    assert 3 <= starts <= 7
    assert keep.calls[-1] == "stop"  # the driver stops it as it exits


class _FlushFails(io.StringIO):
    """A trace file on a full disk as a buffered file behaves: writes are buffered, flush raises ENOSPC."""

    def flush(self):
        raise OSError(28, "No space left on device")


class _FullDisk(_FlushFails):
    """A trace file on a full disk written unbuffered: every write raises ENOSPC too (as /dev/full does)."""

    def write(self, s):
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("file", [_FullDisk, _FlushFails], ids=["write", "flush"])
def test_a_trace_write_error_stops_tracing_and_fails_no_request(model, file):
    """`--trace` on a full disk, the error at a write or at the flush of the buffered lines
    (`_flush_traces`, where a real full disk raises it): the first failure logs and stops
    tracing; every request still gets its tokens and the runtime stays healthy. Before the fix
    the OSError reached the driver's error handler: the first request got 500 and every later
    one 503 runtime_failed."""
    backend, tok, _ = model
    trace, steps = file(), file()

    async def main():
        runtime = Runtime(Scripted(backend, _ids(tok, "one two three four five")), tok, CFG, trace=trace,
                          steps=steps)
        await runtime.start()
        try:
            dones = []
            for _ in range(2):
                _, done = await _collect(await runtime.enqueue(_job(tok, max_tokens=3)))
                dones.append(done)
            return dones, runtime.broken
        finally:
            await runtime.close()

    dones, failed = asyncio.run(main())
    assert [(d.reason, d.completion_tokens, d.error) for d in dones] == [("length", 3, None)] * 2
    assert failed is None
    assert trace.closed and steps.closed
