"""`executor.engine`: the runtime in a process of its own, on the tiny reference model.

The engine process must give the same replies, usage and warm-pass resumes as the
in-process runtime, pass rejections, cancellations and metrics through, fail open
requests (not hang them) when it dies, and report start-up failures with their kind."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from array import array
from pathlib import Path

import attrs
import pytest
from aiohttp.test_utils import make_mocked_request

from executor.api_schema import ApiError
from executor.chat import ChatRenderer, load_template
from executor.config import load_config
from executor.engine import EngineClient, EngineFailed, _pack, _post, _unpack, _unwire, _wire, reply_block
from executor.model import tiny_model_dir
from executor.numba_cuda.device import is_gpu_available
from executor.reference.backend import ReferenceBackend
from executor.replies import ChatContinuation
from executor.runtime import Done, Job, Rejected, Runtime, Tokens
from executor.sampling import SamplingParams
from executor.serve import ServeConfig, run_engine
from executor.server import Api, ApiConfig
from executor.tokenizer import load_tokenizer
from policy.config import PolicyConfig
from policy.prefix import Prompt
from tests.executor.serve_support import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
POLICY = PolicyConfig(max_chunk_rows=16, warm_quiet_ms=0.0, prompt_cache_bytes=1 << 30)
MESSAGES = ({"role": "user", "content": "What is the weather like in Paris today?"},)


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    model = tiny_model_dir()
    return ChatRenderer(load_tokenizer(model), load_template(model))


def _job(renderer: ChatRenderer, messages=MESSAGES, max_tokens: int = 6, seed: int = 7) -> Job:
    rendered = renderer.render(list(messages), add_generation_prompt=True, enable_thinking=False)
    return Job(prompt_ids=rendered.token_ids, starts=rendered.starts, max_tokens=max_tokens,
               sampling=SamplingParams(temperature=0.8, top_p=0.9), seed=seed,
               continuation=ChatContinuation(messages=tuple(messages), tools=None, enable_thinking=False,
                                             parse_tools=False, renderer=renderer))


async def _collect(handle) -> tuple[list[Tokens], Done]:
    tokens = []
    async for event in handle.events():
        if isinstance(event, Done):
            return tokens, event
        tokens.append(event)
    raise AssertionError("no Done")


async def _turns(runtime, renderer: ChatRenderer) -> list[tuple[tuple[int, ...], str, int, int]]:
    """Two turns of one chat: (token ids, text, cached_tokens, prompt_tokens) of each."""
    first = await _collect(await runtime.enqueue(_job(renderer)))
    reply = {"role": "assistant", "content": first[1].text}
    await asyncio.sleep(0.5)  # the warm pass of the reply runs (warm_quiet_ms = 0)
    second_messages = (*MESSAGES, reply, {"role": "user", "content": "And tomorrow?"})
    second = await _collect(await runtime.enqueue(_job(renderer, second_messages, seed=8)))
    return [(d.token_ids, d.text, d.cached_tokens, d.prompt_tokens) for _, d in (first, second)]


def test_engine_process_equals_in_process_runtime(renderer):
    """Same tokens, text and cached_tokens (the second turn resumes where the warm pass
    kept the reply) from the engine process and from a runtime in this process."""
    cfg = ServeConfig(backend="reference", policy=POLICY)

    async def engine():
        client = await EngineClient.start(run_engine, (cfg,), timeout_s=120)
        try:
            assert client.info.backend == "reference" and client.facts.invariant_rows is None
            assert client.vocab_size == load_config(tiny_model_dir()).vocab_size
            return await _turns(client, renderer)
        finally:
            await client.close()

    async def local():
        runtime = Runtime(ReferenceBackend.from_dir(tiny_model_dir()), renderer.tokenizer, POLICY)
        await runtime.start()
        try:
            return await _turns(runtime, renderer)
        finally:
            await runtime.close()

    remote, here = asyncio.run(engine()), asyncio.run(local())
    assert remote == here
    assert len(remote[0][0]) == 6
    prompt_rows = remote[1][3]
    assert 0 < remote[1][2] < prompt_rows  # the second turn resumed from a kept state


def test_the_api_renderer_learns_each_reply_block_from_the_engine():
    """A reply's continuation is rendered in the engine process; its text and ids cross back
    ("learn"), so a renderer in the API process tokenizes only the next turn's new message
    (one block missed: the user's), where one that was not taught also misses the reply's."""
    cfg = ServeConfig(backend="reference", policy=POLICY)
    model = tiny_model_dir()
    taught, plain = (ChatRenderer(load_tokenizer(model), load_template(model)) for _ in range(2))

    async def main():
        client = await EngineClient.start(run_engine, (cfg,), timeout_s=120)
        client.learn = taught.learn
        try:
            plain.render(list(MESSAGES), add_generation_prompt=True, enable_thinking=False)
            first = await _collect(await client.enqueue(_job(taught)))
            await asyncio.sleep(0.5)  # the "learn" follows the reply's last events
            return (*MESSAGES, {"role": "assistant", "content": first[1].text}, {"role": "user", "content": "And tomorrow?"})
        finally:
            await client.close()

    second = asyncio.run(main())
    misses = []
    for renderer in (taught, plain):
        before = renderer._blocks.misses
        rendered = renderer.render(list(second), add_generation_prompt=True, enable_thinking=False)
        misses.append(renderer._blocks.misses - before)
    assert misses == [1, 2]
    learned = taught.render(list(second), enable_thinking=False)
    assert learned == plain.render(list(second), enable_thinking=False)
    assert learned.token_ids == tuple(taught.tokenizer.encode(learned.text, add_special_tokens=False).ids)


def test_reply_block_is_the_continuation_s_last_block_within_a_budget(renderer):
    history = [*MESSAGES, {"role": "assistant", "content": "Sunny, 21 degrees."}]
    rendered = renderer.render_continuation(history[:-1], history[-1])
    text, ids = reply_block(rendered, 1 << 16)
    assert text.startswith("<|im_start|>assistant\n") and "Sunny, 21 degrees." in text
    assert rendered.text.endswith(text) and len(text) < len(rendered.text) / 2
    assert tuple(ids) == tuple(renderer.tokenizer.encode(text, add_special_tokens=False).ids)
    assert tuple(ids) == rendered.token_ids[len(rendered.token_ids) - len(ids) :]
    assert reply_block(rendered, len(text) + 4 * len(ids)) is not None
    assert reply_block(rendered, len(text) + 4 * len(ids) - 1) is None  # past the budget: not sent
    assert reply_block(attrs.evolve(rendered, text="no marker", starts=()), 1 << 16) is None


def _learn_storm(rounds: int = 5, concurrent: int = 8) -> None:
    """Concurrent 5,000-row chats through an engine process, each reply's learn crossing back
    while large submits cross forward (run in a subprocess by the test below: a hang is its
    failure). Sending each whole continuation back deadlocked both processes in round 0."""
    import random

    model = tiny_model_dir()
    renderer = ChatRenderer(load_tokenizer(model), load_template(model))
    rng = random.Random(0)
    words = "the of and weather Paris sunny rain tomorrow forecast temperature degrees".split()
    messages = [{"role": "system", "content": "You are helpful."}]
    for _ in range(10):
        messages.append({"role": "user", "content": " ".join(rng.choices(words, k=200))})
        messages.append({"role": "assistant", "content": " ".join(rng.choices(words, k=300))})
    messages.append({"role": "user", "content": "last?"})
    policy = PolicyConfig(warm_quiet_ms=0.0, prompt_cache_bytes=4 << 30)

    async def main():
        client = await EngineClient.start(run_engine, (ServeConfig(backend="reference", policy=policy,
                                                                   context_rows=None),), timeout_s=120)
        learns = []
        client.learn = lambda text, ids: learns.append(len(ids))
        async def one(seed: int) -> None:
            await _collect(await client.enqueue(_job(renderer, messages, 2, seed)))

        try:
            for r in range(rounds):
                await asyncio.gather(*(one(100 * r + k) for k in range(concurrent)))
            assert learns, "no reply block came back"
        finally:
            await client.close()

    asyncio.run(main())
    print("storm done")


def test_learns_and_large_submits_do_not_deadlock_the_two_processes():
    code = "from tests.executor.test_engine import _learn_storm; _learn_storm()"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "storm done" in done.stdout, done.stderr[-2000:]


def test_rejection_cancellation_metrics_and_close(renderer):
    cfg = ServeConfig(backend="reference", policy=POLICY.with_changes(lanes=1, queue_rows=1))

    async def run():
        client = await EngineClient.start(run_engine, (cfg,), timeout_s=120)
        try:
            long = await client.enqueue(_job(renderer, max_tokens=400))
            events = long.events()
            assert isinstance(await events.__anext__(), Tokens)  # admitted and decoding
            waiting = await client.enqueue(_job(renderer, max_tokens=2, seed=1))
            with pytest.raises(Rejected) as rejected:
                await client.enqueue(_job(renderer, max_tokens=2, seed=2))
            assert rejected.value.reason == "queue_full"
            client.cancel(long)
            done = [e async for e in events if isinstance(e, Done)]
            assert done[0].reason == "cancelled"
            _, second = await _collect(waiting)
            assert second.reason == "length" and second.completion_tokens == 2
            client.count_invalid()
            text = (await client.render_metrics()).decode()
            assert 'warmstate_requests_total{outcome="cancelled"} 1.0' in text
            assert 'warmstate_requests_total{outcome="rejected"} 1.0' in text
            assert 'warmstate_requests_total{outcome="length"} 1.0' in text
            assert 'warmstate_requests_total{outcome="invalid"} 1.0' in text
            assert client.lanes_busy == 0 and client.waiting == 0 and client.broken is None
            # close: a request still open ends "cancelled"
            open_handle = await client.enqueue(_job(renderer, max_tokens=400, seed=3))
            await client.close()
            _, last = await _collect(open_handle)
            assert last.reason == "cancelled"
            assert client.process.exitcode == 0
            with pytest.raises(Rejected) as after:
                await client.enqueue(_job(renderer))
            assert after.value.reason == "shutting_down"
        finally:
            await client.close()

    asyncio.run(run())


def test_engine_death_fails_open_requests(renderer):
    cfg = ServeConfig(backend="reference", policy=POLICY)

    async def run():
        client = await EngineClient.start(run_engine, (cfg,), timeout_s=120)
        try:
            handle = await client.enqueue(_job(renderer, max_tokens=2000))
            events = handle.events()
            assert isinstance(await events.__anext__(), Tokens)
            os.kill(client.process.pid, signal.SIGKILL)
            rest = [e async for e in events]
            assert isinstance(rest[-1], Done) and rest[-1].reason == "error"
            assert "engine process died" in rest[-1].error
            assert "engine process died" in client.broken
            with pytest.raises(Rejected) as exc:
                await client.enqueue(_job(renderer))
            assert exc.value.reason == "runtime_failed"
            assert await client.render_metrics() == b""
            api = Api(client, renderer, ApiConfig(model_id="tiny", context_rows=4096, stop_ids=frozenset()))
            with pytest.raises(ApiError) as gone:  # /metrics: a 503 naming the death, not an empty 200
                await api.metrics(make_mocked_request("GET", "/metrics"))
            assert gone.value.status == 503 and "engine process died" in str(gone.value)
        finally:
            await asyncio.wait_for(client.close(), 30)

    asyncio.run(run())


def test_start_failure_names_the_error_and_its_kind(tmp_path: Path):
    (tmp_path / "config.json").write_text('{"model_type": "not-qwen"}')

    async def run(cfg):
        await EngineClient.start(run_engine, (cfg,), timeout_s=120)

    with pytest.raises(EngineFailed) as bad_checkpoint:
        asyncio.run(run(ServeConfig(model=tmp_path, backend="reference")))
    assert bad_checkpoint.value.kind == "value" and "model_type" in str(bad_checkpoint.value)
    with pytest.raises(EngineFailed) as missing:
        asyncio.run(run(ServeConfig(model=tmp_path / "missing", backend="reference")))
    assert missing.value.kind == "value" and "missing" in str(missing.value)
    if not is_gpu_available():  # CI: --backend cuda cannot start (exit 1, not 2)
        with pytest.raises(EngineFailed) as no_gpu:
            asyncio.run(run(ServeConfig(backend="cuda")))
        assert no_gpu.value.kind == "runtime" and "--backend cuda" in str(no_gpu.value)


def test_only_chat_continuations_cross_the_pipe(renderer):
    job = _job(renderer)
    wired, packed = _wire(job)
    assert wired.continuation.renderer is None and wired.continuation == job.continuation
    assert _wire(attrs.evolve(job, continuation=None))[0].continuation is None
    with pytest.raises(ValueError, match="ChatContinuation"):
        _wire(attrs.evolve(job, continuation=lambda text: None))
    with pytest.raises(RuntimeError, match="no renderer"):
        wired.continuation("hello")


def test_prompt_ids_cross_the_pipe_packed_and_come_back_with_their_prompt(renderer):
    """The ids leave the job and travel as native int64 bytes (8 an id); `_unwire` gives the job
    back equal, its ids plain ints, with the `Prompt` that `Prompt.from_tokens` makes of them
    (runs and digests); the job's other fields cross unchanged."""
    job = attrs.evolve(_job(renderer), continuation=None, seed=7, max_tokens=5)
    wired, packed = _wire(job)
    assert wired.prompt_ids == () and len(packed) == 8 * len(job.prompt_ids)
    assert packed == array("q", job.prompt_ids).tobytes()
    here, there = multiprocessing.Pipe()
    _post(here, ("submit", 3, wired, packed))
    _, _, wired_back, packed_back = there.recv()
    back, prompt = _unwire(wired_back, packed_back)
    assert back == job and all(type(t) is int for t in back.prompt_ids)
    assert prompt == Prompt.from_tokens(job.prompt_ids)
    assert [prompt.digest(r) for r in range(len(prompt) + 1)] == [
        Prompt.from_tokens(job.prompt_ids).digest(r) for r in range(len(prompt) + 1)]
    with pytest.raises(ValueError, match="8 bytes each, got 5 bytes"):
        _unwire(wired, b"12345")
    here.close()
    there.close()


def test_events_cross_the_pipe_as_tuples_and_come_back_equal():
    """`_post` writes what `Connection.recv` reads; token events travel as plain tuples and
    come back as the same `Tokens`; a `Done` travels as itself."""
    here, there = multiprocessing.Pipe()
    tokens = Tokens((5, 248046), " hi")
    done = Done(reason="stop", prompt_tokens=3, completion_tokens=2, cached_tokens=1, token_ids=(5, 248046),
                text=" hi")
    _post(here, ("events", [_pack("req-1", tokens), _pack("req-1", done)], (1, 0, None)))
    message = there.recv()
    assert message == ("events", [("req-1", (5, 248046), " hi"), ("req-1", done)], (1, 0, None))
    assert [_unpack(item) for item in message[1]] == [("req-1", tokens), ("req-1", done)]
    here.close()
    with pytest.raises(OSError):
        _post(there, ("close",))


def test_runtime_sink_and_after_commit(renderer):
    """A sink gets every event in order (no queue); after_commit runs once per committed
    step, after that step's events reached the sink."""
    async def run():
        runtime = Runtime(ReferenceBackend.from_dir(tiny_model_dir()), renderer.tokenizer, POLICY)
        seen: list = []
        commits: list[int] = []
        runtime.after_commit = lambda: commits.append(len(seen))
        await runtime.start()
        try:
            handle = runtime.submit(_job(renderer, max_tokens=5), sink=seen.append)
            for _ in range(500):
                if seen and isinstance(seen[-1], Done):
                    break
                await asyncio.sleep(0.01)
        finally:
            await runtime.close()
        return handle, seen, commits

    handle, seen, commits = asyncio.run(run())
    assert isinstance(seen[-1], Done) and all(isinstance(e, Tokens) for e in seen[:-1])
    assert sum(len(e.token_ids) for e in seen if isinstance(e, Tokens)) == 5 and seen[-1].completion_tokens == 5
    assert handle.queue.__class__.__name__ == "Sink"
    assert commits == sorted(commits) and commits[-1] == len(seen)  # every event went out by a commit


def test_status_is_asked_not_cached_and_a_stopped_engine_is_unresponsive(renderer):
    """refresh_status reads the engine's counts now (no event needed), and returns False
    when the engine does not answer (SIGSTOP: a wedged engine); it answers again after SIGCONT."""
    cfg = ServeConfig(backend="reference", policy=POLICY)

    async def run():
        client = await EngineClient.start(run_engine, (cfg,), timeout_s=120)
        try:
            handle = await client.enqueue(_job(renderer, max_tokens=2000))
            events = handle.events()
            await events.__anext__()
            assert await client.refresh_status(10) is True and client.lanes_busy == 1
            os.kill(client.process.pid, signal.SIGSTOP)
            try:
                assert await client.refresh_status(0.5) is False
                with pytest.raises(TimeoutError):
                    await client.render_metrics(timeout_s=0.5)
            finally:
                os.kill(client.process.pid, signal.SIGCONT)
            assert await client.refresh_status(10) is True and client.broken is None
            client.cancel(handle)
            assert [e async for e in events][-1].reason == "cancelled"
            assert await client.refresh_status(10) is True and client.lanes_busy == 0
        finally:
            await client.close()

    asyncio.run(run())


def test_sigterm_while_the_engine_loads_stops_both_processes():
    """A signal before `ready` stops the server (exit 0) and its engine process with it."""
    proc = subprocess.Popen([sys.executable, "-m", "executor.serve", "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 30
        while not children and time.monotonic() < deadline and proc.poll() is None:
            children = _children(proc.pid)
            time.sleep(0.05)
        assert children, "no engine process was started"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "ready" not in out
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in children)


def _children(pid: int) -> set[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return set()
    return {int(x) for x in text.split()}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_second_signal_kills_a_wedged_engine():
    """SIGTERM waits for the engine's step in flight (up to minutes); a second one kills the
    engine at once (here: a SIGSTOPped engine) and the server still exits 0."""
    server = ServerProcess()
    try:
        engines = [pid for pid in _children(server.proc.pid)
                   if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]  # not the resource tracker
        assert len(engines) == 1
        engine = engines[0]
        os.kill(engine, signal.SIGSTOP)
        status, _ = server.get("/health")
        assert status == 503
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert server.proc.poll() is None  # still waiting for the engine
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=20) == 0
        assert time.monotonic() - t0 < 15
        deadline = time.monotonic() + 10
        while _alive(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(engine)
    finally:
        server.kill()


def test_deferred_work_runs_in_the_loop_between_steps(renderer, monkeypatch):
    """Runtime.defer: each item runs once, in order, in the loop thread, after a step's
    commit; with no time budget, one item a step; a failing item is logged and serving
    goes on."""
    import threading

    from executor import runtime as runtime_module

    monkeypatch.setattr(runtime_module, "BACKGROUND_BUDGET_S", 0.0)

    async def run():
        runtime = Runtime(ReferenceBackend.from_dir(tiny_model_dir()), renderer.tokenizer, POLICY)
        dispatched: list[int] = []
        inner = runtime._run_background

        def counted(*args):
            dispatched.append(1)
            inner(*args)

        runtime._run_background = counted
        commits: list[int] = []
        inner_commit = runtime._commit

        def counted_commit(*args, **kwargs):
            inner_commit(*args, **kwargs)
            commits.append(1)

        runtime._commit = counted_commit
        ran: list[tuple[str, int, str, int]] = []

        def item(name):
            return lambda: ran.append((name, len(dispatched), threading.current_thread().name, len(commits),
                                       runtime._awaiting_first_token()))

        await runtime.start()
        try:
            runtime.defer(item("a"))
            runtime.defer(lambda: 1 / 0)
            runtime.defer(item("b"))
            job = attrs.evolve(_job(renderer, max_tokens=6), continuation=None)  # no render: one item a step
            done = await _collect(runtime.submit(job))
        finally:
            await runtime.close()
        return dispatched, ran, done, len(commits)

    dispatched, ran, done, commits = asyncio.run(run())
    assert done[1].completion_tokens == 6 and len(dispatched) == 3  # the failing item stopped nothing
    assert [name for name, *_ in ran] == ["a", "b"]
    assert all(thread == threading.main_thread().name for _, _, thread, _, _ in ran)
    # "a" in the first call, the failing one in the second, "b" in the third
    assert [step for _, step, _, _, _ in ran] == [1, 3]
    (_, _, _, a, a_waiting), (_, _, _, b, b_waiting) = ran
    assert b == a + 2 and 1 <= a and b + 2 < commits  # after consecutive commits, never while a step runs
    assert not a_waiting and not b_waiting  # the request had its first token by then


def test_deferred_work_waits_for_a_first_token_and_runs_before_a_render(renderer):
    """Deferred work (the chat prewarm) does not run between the chunks of a request that
    has yet to get its first token (the next step may be the one that makes it), and a
    commit that renders a reply's continuation runs it first: a one-token reply, which
    ends in its first step, renders after its prewarm."""

    async def run(job):
        runtime = Runtime(ReferenceBackend.from_dir(tiny_model_dir()), renderer.tokenizer, POLICY)
        order: list[tuple[str, int]] = []
        commits: list[int] = []
        inner_commit = runtime._commit

        def counted_commit(*args, **kwargs):
            commits.append(1)
            inner_commit(*args, **kwargs)

        runtime._commit = counted_commit
        inner_render = job.continuation

        def render(text):
            order.append(("render", len(commits)))
            return inner_render(text)

        delivered: list[int] = []
        inner_deliver = runtime._deliver_tokens

        def deliver(tokens):
            delivered.extend(token for _, token, _ in tokens)
            inner_deliver(tokens)

        runtime._deliver_tokens = deliver
        await runtime.start()
        try:
            handle = runtime.submit(attrs.evolve(job, continuation=render))
            runtime.defer(lambda: order.append(("other", len(commits), len(delivered))), key="req-other")
            runtime.defer(lambda: order.append(("prewarm", len(commits), len(delivered))), key=handle.id)
            done = await _collect(handle)
        finally:
            await runtime.close()
        return order, done

    long_chat = ({"role": "user", "content": "Tell me about the weather in Paris, Lyon, Nice and Lille today. " * 3},)
    job = _job(renderer, long_chat, max_tokens=2)
    assert len(job.prompt_ids) > 2 * POLICY.max_chunk_rows  # three chunks or more before the first token
    (other, at, tokens), (prewarm, at2, _), (render, rendered_at) = asyncio.run(run(job))[0]
    assert (other, prewarm, render) == ("other", "prewarm", "render")
    assert at >= 3 and tokens == 1  # not after the first chunks: once the first token was out
    assert at2 >= at and rendered_at > at2  # in order, then the render in a later commit
    order, done = asyncio.run(run(_job(renderer, max_tokens=1)))
    assert done[1].completion_tokens == 1
    (prewarm, at, tokens), (render, rendered_at) = order[:2]
    # one commit: the reply's own prewarm, then its render; the other request's work stays queued
    assert (prewarm, render, tokens) == ("prewarm", "render", 1) and at == rendered_at
    assert [name for name, *_ in order[2:]] == ["other"]


def test_a_reply_s_tokens_leave_before_its_continuation_renders(renderer):
    """The commit of a step that ends a chat reply delivers the step's tokens and calls
    after_commit (the engine process sends them) before the continuation renders (the
    render held the GIL inside the step, 0.5-5 ms on a CPU server, delaying every lane's
    token); the continuation still reaches the scheduler: the warm pass runs."""

    async def run():
        runtime = Runtime(ReferenceBackend.from_dir(tiny_model_dir()), renderer.tokenizer, POLICY)
        job = _job(renderer, max_tokens=3)
        delivered: list[int] = []
        sent: list[int] = []
        seen: list[tuple[int, int | None]] = []
        inner_deliver, inner_render = runtime._deliver_tokens, job.continuation

        def deliver(tokens):
            delivered.extend(token for _, token, _ in tokens)
            inner_deliver(tokens)

        def render(text):
            seen.append((len(delivered), sent[-1] if sent else None))
            return inner_render(text)

        runtime._deliver_tokens = deliver
        runtime.after_commit = lambda: sent.append(len(delivered))
        await runtime.start()
        try:
            done = await _collect(runtime.submit(attrs.evolve(job, continuation=render)))
            await asyncio.sleep(0.5)  # the warm pass runs
            metrics = runtime.metrics_text().decode()
        finally:
            await runtime.close()
        return seen, done, metrics

    seen, done, metrics = asyncio.run(run())
    assert done[1].completion_tokens == 3
    assert seen == [(3, 3)]  # rendered once, with all three tokens delivered and sent
    assert 'warmstate_warm_passes_total{event="finished"} 1.0' in metrics


def test_the_engine_prewarms_each_chat_request_s_history(renderer):
    """serve_engine defers the prewarm of every chat job it accepts (bound to its own
    renderer, with the job's prompt ids), and of nothing else; a ChatContinuation prewarm
    tokenizes nothing and leaves only the reply's blocks for the call at the reply's end,
    with the same ids as a cold render."""
    import multiprocessing

    from executor.engine import EngineInfo, serve_engine
    from policy.usable import BackendFacts

    class FakeRuntime:
        lanes_busy = waiting = 0
        broken = None
        after_commit = None

        def __init__(self):
            self.deferred, self.jobs = [], []

        async def start(self):
            pass

        async def close(self):
            pass

        def defer(self, work, key=None):
            self.deferred.append((work, key))

        def submit(self, job, sink, prompt=None):
            assert prompt == Prompt.from_tokens(job.prompt_ids)  # built from the packed ids
            self.jobs.append(job)
            return type("H", (), {"id": f"req-{len(self.jobs)}", "conversation": "c", "prompt_tokens": 3})()

    async def run():
        here, there = multiprocessing.Pipe(duplex=True)
        runtime = FakeRuntime()
        info = EngineInfo(backend="fake", context_rows=64, vocab_size=10, facts=BackendFacts())
        task = asyncio.get_running_loop().create_task(serve_engine(there, runtime, renderer, info))
        job = _job(renderer)
        here.send(("submit", 1, *_wire(job)))
        here.send(("submit", 2, *_wire(attrs.evolve(job, continuation=None))))
        here.send(("close",))
        await asyncio.wait_for(task, 10)
        return runtime

    runtime = asyncio.run(run())
    assert len(runtime.jobs) == 2 and len(runtime.deferred) == 1
    prewarm, key = runtime.deferred[0]
    assert key == "req-1"  # keyed by its request: a render of that reply runs it first
    assert prewarm.func.__self__.renderer is renderer  # bound to the engine's renderer
    assert prewarm.args == (runtime.jobs[0].prompt_ids,)

    job = _job(renderer)
    cold = attrs.evolve(job.continuation, renderer=ChatRenderer(renderer.tokenizer, renderer.template))("Sunny, 20 C.")
    fresh = ChatRenderer(renderer.tokenizer, renderer.template)
    cont = attrs.evolve(job.continuation, renderer=fresh)
    cont.prewarm(job.prompt_ids)
    assert fresh._blocks.misses == 0  # learned from the ids: nothing tokenized
    warm = cont("Sunny, 20 C.")
    assert warm.token_ids == cold.token_ids and warm.starts == cold.starts
    assert fresh._blocks.misses == 2  # the reply's block and the next message's probe
    # ids that do not line up with the text's blocks teach nothing
    other = ChatRenderer(renderer.tokenizer, renderer.template)
    attrs.evolve(job.continuation, renderer=other).prewarm(job.prompt_ids[1:])
    assert len(other._blocks) == 0


def test_a_caller_gone_while_its_submit_waits_for_acceptance_cancels_the_request(renderer):
    """A client that goes away while `EngineClient.enqueue` waits for "accepted" (aiohttp
    cancels the handler) never gets a handle to cancel: the client cancels the request when
    its acceptance arrives, instead of leaving it to run to max_tokens holding a lane (a
    fresh review, session 24: 10 of 10 such requests ran on)."""
    cfg = ServeConfig(backend="reference", policy=POLICY)

    async def run():
        client = await EngineClient.start(run_engine, (cfg,), timeout_s=120)
        try:
            gone = asyncio.create_task(client.enqueue(_job(renderer, max_tokens=400)))
            await asyncio.sleep(0)  # the submit is on the pipe
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
            for _ in range(400):
                text = (await client.render_metrics()).decode()
                if 'warmstate_requests_total{outcome="cancelled"} 1.0' in text:
                    break
                await asyncio.sleep(0.025)
            assert 'warmstate_requests_total{outcome="cancelled"} 1.0' in text
            assert client.lanes_busy == 0
        finally:
            await client.close()

    asyncio.run(run())


def test_a_malformed_submit_is_rejected_not_lost(renderer):
    """A "submit" that is not `submit_message`'s shape (the 3-field message of before the ids
    travelled packed, or ids whose bytes are not whole int64s) is answered ("rejected", its
    token, "malformed_submit"), and the engine goes on to accept a well-formed one: before,
    the unpacking raised inside the pipe's reader callback, the message was dropped, and the
    sender (bench/host_cost.py's harness) waited forever."""
    import multiprocessing

    from executor.engine import EngineInfo, serve_engine, submit_message
    from policy.usable import BackendFacts

    class FakeRuntime:
        lanes_busy = waiting = 0
        broken = None
        after_commit = None

        def __init__(self):
            self.jobs = []

        async def start(self):
            pass

        async def close(self):
            pass

        def submit(self, job, sink, prompt=None):
            self.jobs.append(job)
            return type("H", (), {"id": "req-1", "conversation": "c", "prompt_tokens": len(job.prompt_ids)})()

    job = attrs.evolve(_job(renderer), continuation=None)
    wired, packed = _wire(job)

    async def run():
        here, there = multiprocessing.Pipe(duplex=True)
        runtime = FakeRuntime()
        info = EngineInfo(backend="fake", context_rows=64, vocab_size=10, facts=BackendFacts())
        task = asyncio.get_running_loop().create_task(serve_engine(there, runtime, renderer, info))
        here.send(("submit", 1, job))  # the old shape
        here.send(("submit", 2, wired, packed[:-3]))  # 5 stray bytes past the last whole id
        here.send(submit_message(3, job))
        replies = []
        while len(replies) < 3:
            await asyncio.sleep(0.01)
            while here.poll():
                message = here.recv()
                if message[0] in ("rejected", "accepted"):
                    replies.append(message[:3])
        here.send(("close",))
        await asyncio.wait_for(task, 10)
        return runtime, replies

    runtime, replies = asyncio.run(asyncio.wait_for(run(), 20))
    assert replies == [("rejected", 1, "malformed_submit"), ("rejected", 2, "malformed_submit"),
                       ("accepted", 3, "req-1")]
    assert runtime.jobs == [job]
