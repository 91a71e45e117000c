"""One scheduler `Step` run on the backend: the worker-thread half of `executor.runtime`.

`Stepper.run(plan)` restores kept states, runs the prefill chunk and the decode round,
snapshots the state a keep asks for, samples each lane's token and finds stop tokens and
stop strings; it returns an `Outcome` and touches nothing the scheduler owns. The loop
thread gathers the `Plan` and commits the `Outcome` (`executor/runtime.py`).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import structlog

from executor import payloads
from executor.backend import Backend
from executor.chat import Rendered
from executor.config import FULL
from executor.sampling import SamplingParams, sample
from executor.stops import TextStream
from policy.store import Copy, Entry
from policy.work import ChunkRun, Step

log = structlog.get_logger(__name__)


@attrs.frozen(kw_only=True)
class Job:
    """One generation as the API layer hands it over.

    prompt_ids: the rendered prompt (L >= 1 token ids); starts: its request starts (rows,
    each < L). max_tokens: tokens to generate at most (0: prefill only). sampling and
    seed: temperature / top_p and the per-request RNG seed. stop: stop strings.
    stop_ids: token ids that end the reply (EOS; empty to ignore EOS). continuation:
    given the reply's text, the prompt prefix the next turn will send (None: no warm pass).
    """

    prompt_ids: tuple[int, ...] = attrs.field(converter=tuple)
    starts: tuple[int, ...] = attrs.field(converter=tuple)
    max_tokens: int
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()
    continuation: Callable[[str], Rendered] | None = None


@attrs.define(eq=False)
class Live:
    """A request between submit and finish. The worker mutates the token fields only while
    a step holding this request runs; the loop thread reads them between steps.

    handle: the runtime's Handle. rng: the per-request generator, None when the sampling is
    greedy (`SamplingParams.is_greedy`: it draws nothing, and a new generator cost 0.12 ms in
    the engine, cold, on the path to the first token, on a 2-core VM). text: its TextStream.
    ended: a stop or max_tokens was reached; stop_seen: by a stop token or string.
    flushed: what TextStream.finish released (None until then). continuation: the
    rendered continuation, once the reply ended; next_prompt: it as the runtime handed it
    to the scheduler (a `conversations.Continuation`).
    """

    handle: Any
    job: Job
    rng: np.random.Generator | None
    text: TextStream
    tokens: list[int] = attrs.field(factory=list)
    stream: int | None = None
    ended: bool = False
    stop_seen: bool = False
    flushed: str | None = None
    continuation: Rendered | None = None
    next_prompt: Any = None


@attrs.frozen(eq=False)
class Plan:
    """What the worker needs for one step, gathered in the loop thread.

    prefill_ids: the whole prompt of the chunk's pass (request or warm continuation).
    prefill_state: the stream's state, or None (then restored or new). restores: full hits
    (stream, entry, request). decodes: (stream, request, state). releases: states to give back.
    """

    step: Step
    prefill_ids: tuple[int, ...] | None
    prefill_state: Any
    prefill_live: Live | None
    restores: tuple[tuple[int, Entry, Live], ...]
    decodes: tuple[tuple[int, Live, Any], ...]
    releases: tuple[Any, ...]


@attrs.define(eq=False)
class Outcome:
    """What a step produced: new states by stream, the snapshot a keep asked for, the
    tokens (request, token id, released text), lanes that stopped, requests whose reply
    ended (the commit renders their continuation: `Stepper.render_continuation`), the
    error that stopped it, if any, and `phases`: host seconds the step spent in each of
    PHASES (only those it ran; a backend that queues work asynchronously is timed up to its
    return, so a phase that reads results back, like a prefill that returns logits, also
    waits for the device)."""

    states: dict[int, Any] = attrs.field(factory=dict)
    snapshot: payloads.Payload | None = None
    tokens: list[tuple[Live, int, str]] = attrs.field(factory=list)
    published: int = 0
    """How many of `tokens` (a prefix) went to `Stepper.publish` while the step ran; the
    runtime's commit delivers the rest."""
    published_s: float | None = None
    """Seconds from the step's start to its last early publish, taken as the tokens leave
    the worker, before `Stepper.publish` hands them on (None: none)."""
    started: float = 0.0
    """perf_counter() seconds when the step started in the worker."""
    stopped: set[int] = attrs.field(factory=set)
    ended: list[Live] = attrs.field(factory=list)
    error: BaseException | None = None
    phases: dict[str, float] = attrs.field(factory=dict)


def pick(live: Live, logits: np.ndarray, state: Any = None) -> int:
    """The lane's next token from the logits [vocab] of its state: `state.greedy` when the
    request is greedy and the backend computed the argmax (`Backend` docstring: equal to
    np.argmax of those logits), else `sampling.sample`. On the H200 server the host's
    argmax over 248,320 logits took 0.1-0.3 ms a decode lane and 0.5-1.1 ms for a first
    token (bench/RESULTS.md, session 21)."""
    sampling = live.job.sampling
    if sampling.is_greedy:
        greedy = getattr(state, "greedy", None)
        if greedy is not None:
            return greedy
    return sample(logits, sampling, live.rng)


PHASES = ("release", "restore", "forward", "keep", "decode", "sample")
"""A step's phases: give states back, restore kept states, the prefill chunk, the keep's
snapshot, the decode round (the backend call), and every token pick with its text (first
tokens and decode lanes); executor.metrics.STEP_PHASES names the same (a test checks)."""


class Stepper:
    """Runs plans on `backend` (one at a time, in the worker thread).

    rows_s: measured seconds per prefill row (chunks of 16+ rows), the eviction value rate.
    publish: called from the worker thread with the first tokens taken so far, as soon as
    each is taken, when the step has more work after it (the chunk's keep, more restores,
    the prefill, a decode round): the runtime hands them to their clients without waiting
    for the rest of the step (thread-safe; None: every token waits for the commit). In a
    27B first-token step the keep is 0.5-0.9 ms of host time (1.5-2.0 ms before prefill
    logits were shared), which the first token no longer waits for (bench/RESULTS.md,
    sessions 15 and 16). The first token is the same either way: it is sampled from the
    chunk's logits, which the keep only copies.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.rows_s = 1e-4
        self.publish: Callable[[list[tuple[Live, int, str]]], None] | None = None
        self._takes_tail = ("tail_from" in inspect.signature(backend.prefill).parameters
                            and backend.config.layer_types[-1] == FULL)

    def run(self, plan: Plan) -> Outcome:
        """Run one step; a backend exception is returned in `Outcome.error`, not raised. A
        keep whose snapshot raises (the device out of memory for the copy, say) is logged and
        leaves `Outcome.snapshot` None: the step and its requests go on, and the runtime
        hands the keep back to the scheduler (`Scheduler.unkeep`)."""
        out = Outcome()
        t0 = out.started = time.perf_counter()
        try:
            if plan.releases:
                for state in plan.releases:
                    payloads.release(self.backend, state)
                self._lap(out, "release", t0)
            for i, (stream, entry, live) in enumerate(plan.restores):
                t = time.perf_counter()
                out.states[stream] = payloads.restore(self.backend, entry.payload)
                self._lap(out, "restore", t)
                self._first_token(stream, live, entry.payload.logits, out)
                more = i + 1 < len(plan.restores) or plan.step.prefill is not None or bool(plan.decodes)
                self._publish(out, more)
            if plan.step.prefill is not None:
                self._prefill(plan, out)
            self._decode(plan, out)
        except Exception as exc:
            out.error = exc
            return out
        run = plan.step.prefill
        if run is not None and run.chunk.rows >= 16 and not plan.decodes:
            self.rows_s = (time.perf_counter() - t0) / run.chunk.rows
        return out

    @staticmethod
    def _lap(out: Outcome, phase: str, since: float) -> None:
        out.phases[phase] = out.phases.get(phase, 0.0) + time.perf_counter() - since

    def _prefill(self, plan: Plan, out: Outcome) -> None:
        run = plan.step.prefill
        assert run is not None and plan.prefill_ids is not None
        state = plan.prefill_state
        if state is None:
            if run.restore is not None:
                t = time.perf_counter()
                state = payloads.restore(self.backend, run.restore.payload)
                self._lap(out, "restore", t)
            else:
                assert run.chunk.start == 0, "a pass that resumes needs a state"
                state = self.backend.new_state()
            out.states[run.stream] = state
        tail = {"tail_from": run.tail_from} if self._takes_tail and run.tail_from is not None else {}
        t = time.perf_counter()
        logits = self.backend.prefill(state, plan.prefill_ids, (run.chunk.start, run.chunk.end),
                                      want_logits=run.chunk.reads_logits, **tail)
        self._lap(out, "forward", t)
        keeps = run.keep is not None and (run.keep_copy is None or run.keep_copy.copy is not Copy.NOTHING)
        live = plan.prefill_live
        if live is not None and run.chunk.reads_logits and live.job.max_tokens > 0:
            self._first_token(run.stream, live, logits, out, state)  # before the keep, which only copies
            self._publish(out, keeps or bool(plan.decodes))
        if keeps:
            t = time.perf_counter()
            try:
                out.snapshot = self._keep(run, state, logits if run.keep.with_logits else None)
            except Exception as exc:  # noqa: BLE001 - out of device memory, say: keep nothing, serve on
                log.warning("keep_failed", row=run.keep.row, error=repr(exc))
            self._lap(out, "keep", t)

    def _keep(self, run: ChunkRun, state: Any, logits: np.ndarray | None) -> payloads.Payload | None:
        """The payload the chunk's keep makes, copying what its `KeepCopy` says (the caller
        skips Copy.NOTHING): the logits for a state that gains them, the fixed part for a
        ghost that comes back, the fixed part and the K/V rows above the parent for a new one
        (a run without a KeepCopy copies the whole state). Raises ValueError when the entry
        the copy builds on has no payload."""
        copy = run.keep_copy
        if copy is None:
            return payloads.snapshot(self.backend, state, logits)
        base = None
        if copy.base is not None:
            base = copy.base.payload
            if not isinstance(base, payloads.Payload):
                raise ValueError(f"the kept state at row {copy.base.row} this keep builds on has no payload")
        if copy.copy is Copy.LOGITS:
            assert base is not None and logits is not None
            return payloads.with_logits(base, logits)
        return payloads.snapshot(self.backend, state, logits, base)

    def _decode(self, plan: Plan, out: Outcome) -> bool:
        """The decode round of the plan's lanes (False when there is none)."""
        lanes = []
        for stream, live, state in plan.decodes:
            if live.ended:  # ended by its first token, at max_tokens: the commit finishes it
                continue
            lanes.append((stream, live, state))
        if not lanes:
            return False
        t = time.perf_counter()
        logits = self.backend.decode([s for _, _, s in lanes], [lv.tokens[-1] for _, lv, _ in lanes])
        self._lap(out, "decode", t)
        t = time.perf_counter()
        for i, (stream, live, state) in enumerate(lanes):
            self._take(live, pick(live, logits[i], state), out)
            if live.stop_seen:
                out.stopped.add(stream)
        self._lap(out, "sample", t)
        return True

    def _first_token(self, stream: int, live: Live, logits: np.ndarray | None, out: Outcome, state: Any = None) -> None:
        if logits is None:
            raise ValueError("the first token needs the last prompt row's logits")
        t = time.perf_counter()
        self._take(live, pick(live, logits, state), out)
        self._lap(out, "sample", t)
        if live.stop_seen:  # the scheduler finishes it with "stop" in this step's commit
            out.stopped.add(stream)

    def _publish(self, out: Outcome, more: bool) -> None:
        """Hand the tokens not yet published to `publish` when the step has `more` work;
        `Outcome.published_s` is stamped as they leave, before `publish` (which may wait for
        the loop thread: stamped after it, a contended hand-off read as a late publish, and
        a CPU test saw the engine "publish" after the client had the token)."""
        if more and self.publish is not None and len(out.tokens) > out.published:
            out.published_s = time.perf_counter() - out.started
            tokens = out.tokens[out.published :]
            out.published = len(out.tokens)
            self.publish(tokens)

    @staticmethod
    def render_continuation(live: Live) -> None:
        """Render the continuation of a reply that ended into `live.continuation` (None when
        the job has none, or when the chat format cannot render the reply: then no warm pass,
        and a warning). The runtime calls it in its commit, after the step's tokens went
        out, not in the step: the render (0.5-5 ms on a CPU server, holding the GIL) delayed
        the tokens of every lane in the step that ended a reply (bench/RESULTS.md, session 21)."""
        if live.job.continuation is None or live.continuation is not None:
            return
        try:
            live.continuation = live.job.continuation(live.text.text)
        except Exception as exc:  # a reply the chat format cannot render: no warm pass
            log.warning("continuation_failed", request=live.handle.id, error=repr(exc))

    def _take(self, live: Live, token: int, out: Outcome) -> None:
        """Record one sampled token: the text it releases, and whether it ends the reply."""
        live.tokens.append(token)
        text = ""
        if token in live.job.stop_ids:
            live.ended = live.stop_seen = True
        else:
            text = live.text.push(token)
            live.ended = live.stop_seen = live.text.stopped
        if len(live.tokens) >= live.job.max_tokens:
            live.ended = True
        if live.ended:  # its continuation is rendered in the commit (`render_continuation`)
            live.flushed = live.text.finish()
            text += live.flushed
            out.ended.append(live)
        out.tokens.append((live, token, text))
