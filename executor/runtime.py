"""The executor's serving loop: `policy.scheduler.Scheduler` driven by wall time and a backend.

The scheduler decides (admissions, chunks, decode rounds, keeps, evictions, warm passes);
`Runtime` runs each `Step` on the backend in one worker thread (`executor.stepper`),
owns the kept states' payloads (`executor.payloads`), gives the scheduler each reply's
continuation for the next warm pass, writes the trace and hands text to each request's
`Handle`. Call it only from the asyncio loop thread: the scheduler is not thread-safe,
and only backend work and sampling run in the worker. HTTP lives in `executor/server.py`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import attrs
import structlog
from tokenizers import Tokenizer

from executor import payloads
from executor.backend import Backend
from executor.chat import Rendered
from executor.conversations import Continuation, Conversations
from executor.metrics import Metrics
from executor.sampling import new_rng
from executor.stepper import Job, Live, Outcome, Plan, Stepper
from executor.stops import TextStream
from policy import events as ev
from policy.config import PolicyConfig
from policy.keep import PassKind
from policy.prefix import Prompt
from policy.scheduler import Scheduler
from policy.store import EvictKind
from policy.usable import BackendFacts
from policy.work import Evicted, Finished, Kept, Released, Request, Step

log = structlog.get_logger(__name__)


@attrs.frozen
class Tokens:
    """Handle event: newly generated token ids and the text they released."""

    token_ids: tuple[int, ...]
    text: str


@attrs.frozen(kw_only=True)
class Done:
    """Handle event: the request ended. reason: "stop", "length", "cancelled" or "error".

    cached_tokens: the resume row (DESIGN: prompt rows not computed). token_ids / text:
    everything generated (the text without any stop string). error: what failed, or None.
    """

    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    token_ids: tuple[int, ...]
    text: str
    error: str | None = None


class Rejected(Exception):
    """The scheduler refused the request (e.g. "queue_full"), or the runtime is closing."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Sink:
    """A `Handle.queue` stand-in that hands each event to a callback at once (no asyncio
    queue, no task reading it): `Runtime.submit(job, sink=...)`."""

    __slots__ = ("_call",)

    def __init__(self, call: Callable[[Tokens | Done], None]) -> None:
        self._call = call

    def put_nowait(self, event: Tokens | Done) -> None:
        self._call(event)


@attrs.define(eq=False)
class Handle:
    """A submitted request: its id, conversation, and the queue of `Tokens` / `Done` events
    (a `Sink` when the request was submitted with one; `events` then has nothing to read)."""

    id: str
    conversation: str
    prompt_tokens: int
    queue: asyncio.Queue = attrs.field(factory=asyncio.Queue)
    done: bool = False

    async def events(self) -> AsyncIterator[Tokens | Done]:
        """Events in order, ending with one `Done`."""
        while True:
            item = await self.queue.get()
            yield item
            if isinstance(item, Done):
                return


BACKGROUND_BUDGET_S = 0.001
"""Seconds of deferred work (`Runtime.defer`) the loop runs per step, past the first item."""
BACKGROUND_MAX_WAIT_STEPS = 16
"""Steps deferred work waits at most while some request awaits its first token."""
PUBLISH_WAIT_S = 0.002
"""Seconds the worker waits, after publishing first tokens early (`Stepper.publish`), for
the loop thread to hand them on before it goes on with its step. Both threads share the
GIL: without the wait the loop thread would get it only when the worker next blocks, which
on the 27B server was the step's end (the first token then gained nothing: bench/RESULTS.md,
session 16)."""


KEEP_WARM_WAKE_S = 0.2
"""With a keep-warm kernel, the longest the idle driver waits before it asks whether the
kernel returned (after its max_s) and launches it again: the GPU idles at most this long."""


class Runtime:
    """Serves `Job`s on `backend` under `cfg` (see the module docstring).

    tokenizer: decodes replies. facts: the backend's proven numerics (default: its
    `invariant_rows`). trace: an open text file for the JSONL trace (one
    `policy.events.event_dict` per line, as the simulator writes), or None. steps: an open
    text file for one JSON line per step (its seconds in the worker and per phase: where the
    server's time goes beside the simulator's cost model; bench/fidelity.py reads it), or None.
    clock: seconds,
    monotonic; trace times are seconds since the runtime was built. keep_warm: None, or an
    object whose `start()` the driver calls as it goes idle and whose `stop()` it calls before
    it hands a step to the worker (`executor.numba_cuda.keep_warm.KeepWarm`: a one-thread
    kernel that keeps the GPU from idling; `close()` at shutdown).
    """

    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        cfg: PolicyConfig,
        *,
        facts: BackendFacts | None = None,
        metrics: Metrics | None = None,
        trace: IO[str] | None = None,
        steps: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        keep_warm: Any = None,
    ) -> None:
        self.backend, self.tokenizer, self.cfg = backend, tokenizer, cfg
        self._keep_warm = keep_warm
        self.metrics = metrics or Metrics()
        self.facts = facts or BackendFacts(getattr(backend, "invariant_rows", None))
        self._trace, self._steps, self._clock = trace, steps, clock
        self._origin = clock()
        self._stepper = Stepper(backend)
        self.scheduler = Scheduler(cfg, self.facts, payloads.model_shape(backend.config), emit=self._emit,
                                   value_s=lambda rows: rows * self._stepper.rows_s)
        self.conversations = Conversations()
        self._lives: dict[str, Live] = {}
        self._by_stream: dict[int, Live] = {}
        self._states: dict[int, Any] = {}
        self._releases: list[Any] = []
        self._rejected: dict[str, str] = {}
        self._next_id = 0
        self._wake = asyncio.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="warmstate-backend")
        self._task: asyncio.Task | None = None
        self._closing = False
        self.broken: str | None = None
        self._background: collections.deque[tuple[Callable[[], None], int, str | None]] = collections.deque()
        self._steps_run = 0
        self.stepping = False
        """True while a step runs in the worker (a busy-polling loop waits instead then:
        `executor.polling`)."""
        self.on_continuation: Callable[[Rendered], None] | None = None
        """Called in the loop thread with each reply's rendered continuation, in the commit that
        rendered it, after the step's tokens went out (the engine process sends its reply block
        to the API process, whose chat renderer learns it: `EngineClient.learn`)."""
        self.after_commit: Callable[[], None] | None = None
        """Called in the loop thread after each step's commit has delivered its events and
        before the next step starts (the engine process sends the step's tokens here, so
        that no event work runs while the next step's host work holds the GIL), after first
        tokens a step published early (`Stepper.publish`), while the worker waits, and in a
        commit whose step ended a chat reply, once its tokens are delivered and before the
        continuation renders."""

    # --- public, loop thread only -------------------------------------------------------
    def now(self) -> float:
        """Seconds since the runtime was built (the scheduler's and the trace's clock)."""
        return self._clock() - self._origin

    async def start(self) -> None:
        """Start the driver task on the running loop."""
        loop = asyncio.get_running_loop()

        def publish(tokens: list) -> None:  # worker thread
            handed = threading.Event()

            def hand_on() -> None:  # loop thread
                self._deliver_tokens(tokens)
                if self.after_commit is not None:  # the engine process sends them now
                    self.after_commit()
                handed.set()

            loop.call_soon_threadsafe(hand_on)
            handed.wait(PUBLISH_WAIT_S)

        self._stepper.publish = publish
        self._task = loop.create_task(self._drive(), name="warmstate-runtime")

    async def close(self) -> None:
        """Cancel every request, let the step in flight finish, stop the worker."""
        self._closing = True
        for rid in list(self._lives):
            self._apply(self.scheduler.cancel(rid, self.now()))
        self._wake.set()
        if self._task is not None:
            await self._task
        for rid in list(self._lives):
            self._deliver_done(self._lives[rid], "cancelled", 0, "server shutting down")
        for state in [*self._states.values(), *self._releases]:
            payloads.release(self.backend, state)
        self._states.clear()
        self._releases.clear()
        self._pool.shutdown(wait=True)
        if self._keep_warm is not None:
            self._keep_warm.close()

    def defer(self, work: Callable[[], None], key: str | None = None) -> None:
        """Run `work` in the loop thread between two steps, after a step's commit has sent its
        tokens and before the next step is planned, in order, at most BACKGROUND_BUDGET_S of
        such work a step (and at least one item), and only once no request awaits its first
        token (or the oldest item has waited BACKGROUND_MAX_WAIT_STEPS steps): the next
        step may be the one that makes a first token. key: the request id the work prepares
        for (the engine's chat prewarm of that request's history); a commit that renders that
        request's continuation runs its pending work first, so that the render does not
        tokenize the whole history (a reply can end in its first step). Run as a step went
        to the worker (until session 21), the work held the GIL the worker needed to start
        that step: on the H200 the off-grid warm turn's step started 0.45 ms after its
        request arrived, against 0.15 ms without the chat prewarm. Keep each item short (the
        engine's chat prewarm pairs blocks with ids and tokenizes nothing). An exception it
        raises is logged, not raised."""
        self._background.append((work, self._steps_run, key))

    def submit(self, job: Job, sink: Callable[[Tokens | Done], None] | None = None,
               prompt: Prompt | None = None) -> Handle:
        """Queue `job`; returns its Handle. Raises Rejected with the scheduler's reason.
        sink: called with each event instead of queueing it on the Handle (from the loop
        thread, during the step's commit or a cancel). prompt: `Prompt.from_tokens(job.prompt_ids)`
        when the caller built it already (the engine process builds it from the packed ids
        that crossed the pipe: `executor.engine._unwire`); ValueError when its rows are not
        the job's."""
        if self._closing or self.broken:
            raise Rejected("shutting_down" if self._closing else "runtime_failed")
        if prompt is None:
            prompt = Prompt.from_tokens(job.prompt_ids)
        elif len(prompt) != len(job.prompt_ids):
            raise ValueError(f"prompt has {len(prompt)} rows but the job {len(job.prompt_ids)} ids")
        conversation = self.conversations.match(prompt, job.starts) or self.conversations.new()
        self._next_id += 1
        rid = f"req-{self._next_id}"
        handle = Handle(rid, conversation, len(job.prompt_ids))
        if sink is not None:
            handle.queue = Sink(sink)
        rng = None if job.sampling.is_greedy else new_rng(job.seed)  # greedy draws nothing
        live = Live(handle, job, rng, TextStream(self.tokenizer, job.stop))
        self._lives[rid] = live
        request = Request(id=rid, conversation=conversation, prompt=prompt, starts=job.starts,
                          max_tokens=job.max_tokens)
        self.scheduler.arrive(request, self.now())
        reason = self._rejected.pop(rid, None)
        if reason is not None:
            del self._lives[rid]
            self._flush_traces()  # the driver is not woken for it
            raise Rejected(reason)
        self._wake.set()
        return handle

    async def enqueue(self, job: Job) -> Handle:
        """`submit`, awaitable: the interface `executor.server.Api` uses, which
        `executor.engine.EngineClient` also offers for a runtime in another process.

        Yields to the loop once before it returns, so an idle driver (woken by the submit, one
        hop away: `_idle`) plans the step and hands it to the worker before the caller goes
        on to write its response headers and first chunk. On the H200 machine (27B, one
        process) the off-grid continuation's chunk then started 0.12 ms after its arrival
        instead of 0.31; the handler's writes now overlap the step's restore, which they slow
        by ~0.1 ms through the GIL (bench/RESULTS.md, session 24)."""
        handle = self.submit(job)
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:  # the caller went away (a client gone) and will never cancel it
            self.cancel(handle)
            raise
        return handle

    def cancel(self, handle: Handle) -> None:
        """The client went away: free its lane within one chunk (kept states stay)."""
        if handle.id in self._lives:
            self._apply(self.scheduler.cancel(handle.id, self.now()))
            self._wake.set()

    @property
    def vocab_size(self) -> int:
        """The served model's vocabulary size (token ids are in [0, vocab_size))."""
        return int(self.backend.config.vocab_size)

    def count_invalid(self) -> None:
        """Count a request the API layer refused before it reached the scheduler (a 4xx)."""
        self.metrics.requests.labels("invalid").inc()

    def metrics_text(self) -> bytes:
        """The Prometheus text of this runtime's metrics, gauges read now."""
        self._gauges()
        return self.metrics.render()

    async def refresh_status(self, timeout_s: float = 5.0) -> bool:
        """Always True: in this process `lanes_busy`, `waiting` and `broken` are live (the
        interface `executor.server.Api` uses; the engine process's client asks its engine)."""
        return True

    async def render_metrics(self) -> bytes:
        """`metrics_text`, awaitable (the interface `executor.server.Api` uses)."""
        return self.metrics_text()

    @property
    def lanes_busy(self) -> int:
        """Admitted foreground requests."""
        return len(self._by_stream)

    @property
    def waiting(self) -> int:
        """Requests submitted but not yet admitted."""
        return len(self._lives) - len(self._by_stream)

    def _warm_gpu(self, idle: bool) -> None:
        """Start the keep-warm kernel as the driver idles, stop it before a step (a store to
        host memory). A failure to launch it is logged once and turns it off."""
        if self._keep_warm is None:
            return
        try:
            if idle:
                self._keep_warm.start()
            else:
                self._keep_warm.stop()
        except Exception as exc:  # noqa: BLE001 - an optimisation: serve on without it
            log.warning("keep_warm_failed", error=repr(exc))
            keep, self._keep_warm = self._keep_warm, None
            try:
                keep.stop()  # a store to host memory: whatever it launched returns
            except Exception:  # noqa: BLE001, S110 - nothing more to do for an optimisation
                pass

    # --- trace events ----------------------------------------------------------------------
    def _flush_traces(self) -> None:
        """Write out the trace and step files' buffered lines: once a step is handed to the
        worker (the last commit's lines and this step's arrivals and chunk, written while it
        computes: a crash in it leaves them on disk), before the driver idles and after a
        rejection; never between a request's arrival and the hand-off of its step, nor between
        a commit and the next step (a line-buffered trace made a write system call per event
        there: bench/RESULTS.md, session 24). A reader of an idle server's files sees every
        event; a process killed mid-step loses the lines of that step's commit."""
        try:
            for f in (self._trace, self._steps):
                if f is not None:
                    f.flush()
        except OSError as exc:
            self._stop_tracing(exc)

    def _stop_tracing(self, exc: OSError) -> None:
        """A trace or steps file could not be written (a full disk, a closed pipe): log it once
        and trace no more. The files are a record of the serving, not part of it: a failed write
        must not fail the requests (it did: the driver's error handler marked the runtime failed
        and every later request got 503)."""
        log.error("trace_write_failed", error=repr(exc), detail="tracing stopped; serving goes on")
        files, self._trace, self._steps = (self._trace, self._steps), None, None
        for f in files:
            if f is not None:
                try:
                    f.close()  # flushes what is buffered: may fail the same way
                except OSError:
                    pass

    def _write_trace(self, f: IO[str], record: dict) -> None:
        """One JSONL line to the trace or steps file; on a write error, `_stop_tracing`."""
        try:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
        except OSError as exc:
            self._stop_tracing(exc)

    def _emit(self, e: ev.Event) -> None:
        if self._trace is not None:
            self._write_trace(self._trace, ev.event_dict(e))
        self.metrics.event(e)
        self.conversations.event(e)
        if isinstance(e, ev.RequestAdmitted):
            live = self._lives[e.request]
            live.stream = e.stream
            self._by_stream[e.stream] = live
        elif isinstance(e, ev.RequestRejected):
            self._rejected[e.request] = e.reason
        elif isinstance(e, ev.WarmScheduled):
            live = self._lives.get(e.after)
            assert live is not None and live.next_prompt is not None, "a warm pass without its continuation"
            self.conversations.warm_scheduled(e.conversation, live.next_prompt)

    # --- the driver ------------------------------------------------------------------------
    async def _drive(self) -> None:
        try:
            await self._drive_steps()
        finally:  # closing, or failed: no kernel spins on while the device is released
            self._warm_gpu(False)

    async def _drive_steps(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            self._wake.clear()
            try:
                step = self.scheduler.next_step(self.now())
                self._apply(self.scheduler.take_effects())
                self._gauges()
                if step is None:
                    self._flush_traces()
                    self._warm_gpu(True)
                    await self._idle()
                    continue
                self._warm_gpu(False)
                plan = self._plan(step)
                t0 = self._clock()
                running = loop.run_in_executor(self._pool, self._stepper.run, plan)
                self._flush_traces()  # while the step computes: its arrivals and chunk are on disk if it crashes
                self.stepping = True
                try:
                    outcome = await running
                finally:
                    self.stepping = False
                self._commit(plan, outcome, self._clock() - t0)  # its lines go out at the next hand-off or idle
                self._steps_run += 1
                if self._background and (not self._awaiting_first_token()
                                         or self._steps_run - self._background[0][1] >= BACKGROUND_MAX_WAIT_STEPS):
                    self._run_background()
                plan = outcome = running = None  # a refused keep's snapshot goes now, not after the next step
            except Exception as exc:  # a bug here must not leave clients hanging
                log.exception("runtime_failed")
                self.broken = repr(exc)
                for live in list(self._lives.values()):
                    self._deliver_done(live, "error", 0, f"internal error: {exc!r}")
                return

    def _awaiting_first_token(self) -> bool:
        """Whether some request (queued or admitted) has yet to get its first token."""
        return any(not live.tokens and live.job.max_tokens > 0 for live in self._lives.values())

    def _run_background(self) -> None:
        """Deferred work in order: at least one item, then items until BACKGROUND_BUDGET_S
        seconds have passed."""
        t0 = time.perf_counter()
        while self._background:
            self._run_work(self._background.popleft()[0])
            if time.perf_counter() - t0 >= BACKGROUND_BUDGET_S:
                return

    def _run_keyed(self, keys: set[str]) -> None:
        """The pending deferred work of these request ids, now, in order; the rest stays queued."""
        mine = [item for item in self._background if item[2] in keys]
        if mine:
            self._background = collections.deque(item for item in self._background if item[2] not in keys)
            for work, _, _ in mine:
                self._run_work(work)

    @staticmethod
    def _run_work(work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - background work never stops serving
            log.warning("background_work_failed", error=repr(exc))

    async def _idle(self) -> None:
        timer = self.scheduler.next_timer_s()
        timeout = None if timer is None else max(0.001, timer - self.now())
        if self._keep_warm is not None:  # wake to launch the keep-warm kernel again once it returned (max_s)
            timeout = KEEP_WARM_WAKE_S if timeout is None else min(timeout, KEEP_WARM_WAKE_S)
        try:
            async with asyncio.timeout(timeout):  # in this task: a wake resumes the driver in one hop,
                await self._wake.wait()           # where wait_for's inner task (Python 3.11) took three
        except TimeoutError:
            pass

    def _gauges(self) -> None:
        store = self.scheduler.store
        self.metrics.store_bytes.set(store.bytes_used)
        self.metrics.store_entries.set(len(store))
        self.metrics.lanes_busy.set(self.lanes_busy)
        self.metrics.queue_waiting.set(self.waiting)

    def _plan(self, step: Step) -> Plan:
        run = step.prefill
        ids = state = live = None
        if run is not None:
            if run.kind is PassKind.COLD:
                live = self._lives[run.request]
                ids = live.job.prompt_ids
            else:
                ids = self.conversations.warm_ids(run.conversation)
            state = self._states.get(run.stream)
        restores = tuple((s, entry, self._by_stream[s]) for s, entry in step.restores)
        decodes = tuple((s, self._by_stream[s], self._states[s]) for s in step.decode)
        releases, self._releases = tuple(self._releases), []
        return Plan(step, ids, state, live, restores, decodes, releases)

    def _commit(self, plan: Plan, out: Outcome, ran_s: float | None = None) -> None:
        step = plan.step
        for phase, seconds in out.phases.items():
            self.metrics.step_phase.labels(phase).inc(seconds)
        if self._steps is not None and ran_s is not None:
            self._trace_step(plan, out, ran_s)
        self._states.update(out.states)
        failed: list[Live] = []
        if out.error is not None:
            log.error("step_failed", error=repr(out.error), step=repr(step))
            failed = [*(lv for _, _, lv in plan.restores), *(lv for _, lv, _ in plan.decodes)]
            if plan.prefill_live is not None:
                failed.append(plan.prefill_live)
            for live in failed:
                self._apply(self.scheduler.cancel(live.handle.id, self.now()))
        if any(live.job.continuation is not None for live in out.ended):
            # the step's tokens leave first: the renders hold the GIL for 0.5-5 ms
            self._deliver_tokens(out.tokens[out.published :])
            out.published = len(out.tokens)
            if self.after_commit is not None:
                self.after_commit()
            self._run_keyed({live.handle.id for live in out.ended})  # each render after its prewarm
        for live in out.ended:
            Stepper.render_continuation(live)
            self._attach_continuation(live)
            if self.on_continuation is not None and live.continuation is not None:
                self.on_continuation(live.continuation)
        effects = self.scheduler.commit(step, self.now(), frozenset(out.stopped))
        self._deliver_tokens(out.tokens[out.published :])
        for live in failed:
            self._deliver_done(live, "error", 0, f"backend error: {out.error!r}")
        self._apply(effects, out.snapshot)
        if self.after_commit is not None:
            self.after_commit()

    def _deliver_tokens(self, tokens: list[tuple[Live, int, str]]) -> None:
        """Queue each (request, token, text) on its handle (loop thread): at the commit, or
        earlier for first tokens the worker published while its step ran on
        (`Stepper.publish`; call_soon_threadsafe keeps them ahead of that step's commit)."""
        for live, token, text in tokens:
            if not live.handle.done:
                live.handle.queue.put_nowait(Tokens((token,), text))

    def _trace_step(self, plan: Plan, out: Outcome, ran_s: float) -> None:
        """One line in the step file (`steps`; JSON with kind "step", on the trace's clock):
        seconds the step took in the worker (ran_s,
        from the hand-off to the worker until the loop got the outcome back) and the worker's
        host seconds per phase (`Outcome.phases`: restore, forward, keep, decode, sample,
        release; a GPU backend's forward includes its device time only where it waits for
        it), with what the step ran: prefill rows and start, restored lanes, decode lanes,
        and for a chunk with a keep the bytes its copy moved (keep_bytes, `KeepCopy.bytes`);
        published_s: seconds into the step when its first tokens went out early
        (`Stepper.publish`), when they did.
        bench/fidelity_report.py splits server against simulator time with them."""
        run = plan.step.prefill
        record = {"kind": "step", "t": round(self.now(), 6), "ran_s": round(ran_s, 6),
                  "phases": {k: round(v, 6) for k, v in out.phases.items()},
                  "prefill_rows": 0 if run is None else run.chunk.rows,
                  "prefill_start": None if run is None else run.chunk.start,
                  "restores": len(plan.restores), "decode": len(plan.decodes)}
        if run is not None and run.keep_copy is not None:
            record["keep_bytes"] = run.keep_copy.bytes(self.backend.config.shape)
        if out.published_s is not None:
            record["published_s"] = round(out.published_s, 6)
        self._write_trace(self._steps, record)

    def _attach_continuation(self, live: Live) -> None:
        """Give the scheduler the reply's continuation before it finishes the request.

        The scheduler reads `Request.continuation` when the request finishes, but the
        executor learns it only when the reply ends: `Scheduler.set_continuation`.
        """
        rendered = live.continuation
        if rendered is None or live.stream is None or not rendered.token_ids:
            return
        cont = Continuation.of(rendered.token_ids, rendered.starts)
        live.next_prompt = cont
        self.conversations.expect(live.handle.conversation, cont)
        self.scheduler.set_continuation(live.handle.id, cont.prompt, cont.starts)

    def _apply(self, effects: list[object], snapshot: payloads.Payload | None = None) -> None:
        for e in effects:
            if isinstance(e, Kept):
                if snapshot is None:  # the snapshot failed: the scheduler takes the keep back
                    held = payloads.holds_state(e.entry.payload)  # kept before; this keep only added logits
                    log.warning("keep_without_snapshot", entry=e.entry.id, row=e.entry.row, held=held)
                    self._apply(self.scheduler.unkeep(e.entry, self.now(), held=held))
                    continue
                own_from = e.entry.row - e.entry.own_rows
                if snapshot.rows != e.entry.row or snapshot.kv_from != own_from:
                    # the plan's KeepCopy and the store disagree (policy checks it; a bug): keep nothing
                    log.error("keep_mismatch", entry=e.entry.id, row=e.entry.row, own_from=own_from,
                              snapshot_rows=snapshot.rows, kv_from=snapshot.kv_from)
                    self._apply(self.scheduler.unkeep(e.entry, self.now(), held=payloads.holds_state(e.entry.payload)))
                    continue
                e.entry.payload = snapshot
            elif isinstance(e, Evicted):
                held = e.entry.payload
                # a ghost keeps its own K/V rows for the payloads built on it (DESIGN rule 3)
                e.entry.payload = payloads.ghost(self.backend, held) \
                    if e.how is EvictKind.GHOST and held is not None else None
            elif isinstance(e, Released):
                state = self._states.pop(e.stream, None)
                if state is not None:
                    self._releases.append(state)
            elif isinstance(e, Finished):
                live = self._lives.get(e.request)
                if live is not None:
                    why = "server shutting down" if self._closing and e.reason == "cancelled" else None
                    self._deliver_done(live, e.reason, e.cached_tokens, why)

    def _deliver_done(self, live: Live, reason: str, cached_tokens: int, error: str | None = None) -> None:
        self._lives.pop(live.handle.id, None)
        if live.stream is not None and self._by_stream.get(live.stream) is live:
            del self._by_stream[live.stream]
        if live.handle.done:
            return
        if reason in ("stop", "length") and live.flushed is None:
            tail = live.text.finish()
            live.flushed = tail
            if tail:
                live.handle.queue.put_nowait(Tokens((), tail))
        if reason == "length" and live.stop_seen:
            reason = "stop"
        if error is not None:
            reason = "error" if reason != "cancelled" else reason
        self.metrics.requests.labels(reason if reason in ("stop", "length", "cancelled") else "error").inc()
        live.handle.done = True
        live.handle.queue.put_nowait(Done(
            reason=reason, prompt_tokens=len(live.job.prompt_ids), completion_tokens=len(live.tokens),
            cached_tokens=cached_tokens, token_ids=tuple(live.tokens), text=live.text.text, error=error,
        ))
