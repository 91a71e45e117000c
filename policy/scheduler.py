"""The serving core: an event-driven scheduler that applies the policy rules.

No I/O, no clock, no threads: drivers (the simulator's virtual clock, the executor's
wall clock) feed events in (`arrive`, `cancel`, `commit`), ask for work (`next_step`),
run it, and commit it. Every decision is emitted as a trace event (`policy.events`).
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Callable

import attrs

from policy import events as ev
from policy.config import PolicyConfig
from policy.keep import KeepRow, PassKind, keep_rows
from policy.plan import Chunk, check_starts, fresh_cuts, plan_chunks
from policy.prefix import Prompt
from policy.shape import ModelShape
from policy.store import Copy, Entry, KeepCopy, KeepResult, Store
from policy.work import ChunkRun, Evicted, Finished, Kept, Released, Request, Step
from policy.tail import TailFacts, tail_from
from policy.usable import BackendFacts, Fingerprint, cut_fingerprint, snap_starts
from policy.warm import WarmVerdict, can_adopt, decide_warm, finish_reason, is_quiet, warm_start_s


class Phase(enum.Enum):
    """Where an admitted lane is: prefilling, waiting to restore a full hit, or decoding."""

    PREFILL = "prefill"
    RESTORE = "restore"
    DECODE = "decode"


@attrs.define(eq=False)
class _Pass:
    stream: int
    kind: PassKind
    conversation: str
    prompt: Prompt
    chunks: deque[Chunk]
    cuts: tuple[int, ...]
    keeps: dict[int, KeepRow]
    done_row: int
    restore: Entry | None
    request: str | None

    def fingerprint(self, row: int, facts: BackendFacts) -> Fingerprint:
        """The cut fingerprint of this pass's state at `row` (its cuts below `row`)."""
        return cut_fingerprint(self.cuts, row, facts)


def _rows_left(p: _Pass) -> int:
    """Rows the pass has still to prefill (its remaining chunks)."""
    return p.chunks[-1].end - p.chunks[0].start if p.chunks else 0


@attrs.define(eq=False)
class _Lane:
    request: Request
    arrived_s: float
    cached_tokens: int
    pass_: _Pass
    phase: Phase
    tokens: int = 0
    cancelled: bool = False


@attrs.define(eq=False)
class _Warm:
    after: str
    conversation: str
    prompt: Prompt
    starts: tuple[int, ...]
    scheduled_s: float
    pass_: _Pass | None = None


class Scheduler:
    """Applies DESIGN rules 1-8 to a stream of events; see the module docstring.

    value_s(rows) -> seconds a fresh prefill of `rows` rows costs: the eviction value of a
    kept state (the simulator passes its cost model, the executor a measured rate).
    emit(event) receives every trace event in order.
    tail: the model's tail facts (last layer attention, even head grouping, a reader the
    model always has); default: Qwen3.5's (rule 8). tail_rows comes from cfg.
    """

    def __init__(
        self,
        cfg: PolicyConfig,
        facts: BackendFacts,
        shape: ModelShape,
        *,
        emit: Callable[[ev.Event], None],
        value_s: Callable[[int], float] = lambda rows: rows * 1e-4,
        tail: TailFacts | None = None,
    ) -> None:
        self.cfg, self.facts, self.shape = cfg, facts, shape
        self.store = Store(shape, cfg, facts)
        self._emit, self._value_s = emit, value_s
        self._tail_model = tail if tail is not None else TailFacts(tail_rows=cfg.tail_rows)
        self._queue: deque[tuple[Request, float]] = deque()
        self._lanes: dict[int, _Lane] = {}
        self._warm: dict[str, _Warm] = {}
        self._warm_running: _Warm | None = None
        self._quiet_since: float | None = 0.0
        self._inflight: Step | None = None
        self._next_stream = 0
        self._admission_effects: list[object] = []
        self._passed_over = 0  # short_first: times in a row the oldest prefill gave way

    # --- reading ---------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """True while anything is queued, admitted or warm-pending."""
        return bool(self._queue or self._lanes or self._warm)

    def decode_rounds_left(self) -> int:
        """Rounds until the first decoding lane reaches max_tokens (0 when none decodes)."""
        left = [
            lane.request.max_tokens - lane.tokens
            for lane in self._lanes.values()
            if lane.phase is Phase.DECODE and not lane.cancelled
        ]
        return min(left, default=0)

    def next_timer_s(self) -> float | None:
        """When a waiting warm pass may start (quiet elapses), or None."""
        if not self._warm or self._quiet_since is None or self._foreground_work():
            return None
        return warm_start_s(self._quiet_since, self.cfg)

    # --- events in -----------------------------------------------------------------
    def arrive(self, req: Request, now: float) -> None:
        """A request arrived: queue it, or reject it with a reason (never drop silently)."""
        self._emit(ev.RequestArrived(t=now, request=req.id, conversation=req.conversation,
                                     rows=len(req.prompt), max_tokens=req.max_tokens))
        reason = self._invalid(req)
        if reason is None and len(self._queue) >= self.cfg.queue_rows:
            reason = "queue_full"
        if reason is not None:
            self._emit(ev.RequestRejected(t=now, request=req.id, conversation=req.conversation,
                                          reason=reason))
            return
        self._queue.append((req, now))

    def cancel(self, request_id: str, now: float) -> list[object]:
        """The client went away: free its lane within one chunk; kept states stay usable."""
        for i, (req, _) in enumerate(self._queue):
            if req.id == request_id:
                del self._queue[i]
                effects = self._finish_unadmitted(req, now, "cancelled")
                self._note_quiet(now)
                return effects
        for stream, lane in self._lanes.items():
            if lane.request.id == request_id:
                lane.cancelled = True
                if not self._in_flight(stream):
                    return self._finish(stream, now, "cancelled")
        return []

    # --- work out --------------------------------------------------------------------
    def next_step(self, now: float) -> Step | None:
        """The next round to run at `now`, or None when nothing can run yet."""
        assert self._inflight is None, "next_step while a step is in flight"
        effects: list[object] = []
        while self._queue and len(self._lanes) < self.cfg.lanes:
            req, arrived = self._queue.popleft()
            effects.extend(self._admit(req, arrived, now))
        self._admission_effects.extend(effects)
        restores = tuple(
            (s, lane.pass_.restore) for s, lane in self._lanes.items()
            if lane.phase is Phase.RESTORE and lane.pass_.restore is not None
        )
        decoding = [s for s, lane in self._lanes.items() if lane.phase is Phase.DECODE]
        chunk = self._foreground_chunk()
        if chunk is None and not decoding and not restores and not self._queue:
            chunk = self._warm_chunk(now)
        if chunk is None and not decoding and not restores:
            return None
        contexts = tuple(len(self._lanes[s].request.prompt) + self._lanes[s].tokens for s in decoding)
        step = Step(tuple(decoding), contexts, chunk, restores)
        self._inflight = step
        if chunk is not None:
            self._emit(ev.ChunkStarted(
                t=now, stream=chunk.stream, request=chunk.request, conversation=chunk.conversation,
                pass_kind=chunk.kind.value, start=chunk.chunk.start, end=chunk.chunk.end,
                tail_from=chunk.tail_from,
                restore_row=None if chunk.restore is None else chunk.restore.row))
        if decoding or restores or (chunk is not None and chunk.kind is PassKind.COLD):
            self._quiet_since = None
        return step

    def take_effects(self) -> list[object]:
        """Effects of admissions made by the last next_step (finishes of full hits etc.)."""
        out, self._admission_effects = self._admission_effects, []
        return out

    def set_continuation(self, request_id: str, prompt: Prompt, starts: tuple[int, ...]) -> bool:
        """Attach what the next turn will start with to an admitted request, once its reply
        is known (the executor renders it when the reply ends, before committing that step).

        Returns False when the request holds no lane (finished, cancelled, never admitted).
        """
        for lane in self._lanes.values():
            if lane.request.id == request_id:
                lane.request = attrs.evolve(lane.request, continuation=prompt,
                                            continuation_starts=tuple(starts))
                return True
        return False

    def commit(self, step: Step, now: float, stopped: frozenset[int] = frozenset()) -> list[object]:
        """`step` finished at `now`. Returns runner effects.

        stopped: streams whose newest token (a decode round's, or the first token of a lane
        whose last prefill chunk or full-hit restore ran in this step) is a stop token or
        ends a stop string; they finish with "stop".
        """
        inflight = self._inflight
        assert inflight is not None and attrs.evolve(step, rounds=1) == inflight, \
            "commit of a step that is not in flight"
        assert step.rounds == 1 or (step.prefill is None and not step.restores), \
            "several rounds only in a decode-only step"
        self._inflight = None
        effects: list[object] = []
        if step.prefill is not None:
            effects.extend(self._commit_chunk(step.prefill, now, stopped))
        for stream, entry in step.restores:
            lane = self._lanes[stream]
            self.store.unpin(entry)
            lane.pass_.restore = None
            lane.phase = Phase.DECODE
            if lane.cancelled:
                continue
            effects.extend(self._first_token(stream, lane, now, stream in stopped))
        for stream in step.decode:
            lane = self._lanes.get(stream)
            if lane is None:
                continue
            lane.tokens += step.rounds
            if lane.cancelled:
                effects.extend(self._finish(stream, now, "cancelled"))
            elif stream in stopped or lane.tokens >= lane.request.max_tokens:
                effects.extend(self._finish(stream, now, "stop" if stream in stopped else "length"))
        for stream, lane in list(self._lanes.items()):
            if lane.cancelled:
                effects.extend(self._finish(stream, now, "cancelled"))
        self._note_quiet(now)
        if step.prefill is not None and step.prefill.kind is PassKind.WARM and self._foreground_work():
            w = self._warm_running
            if w is not None and w.pass_ is not None:
                self._emit(ev.WarmYielded(t=now, conversation=w.conversation, stream=w.pass_.stream,
                                          row=w.pass_.done_row))
        return effects

    # --- internals: admission -------------------------------------------------------------
    def _invalid(self, req: Request) -> str | None:
        if len(req.prompt) == 0:
            return "empty_prompt"
        if req.max_tokens < 0:
            return "max_tokens_negative"
        try:
            check_starts(len(req.prompt), req.starts)
        except ValueError as err:
            return f"bad_starts: {err}"
        return None

    def _stream(self) -> int:
        self._next_stream += 1
        return self._next_stream

    def _admit(self, req: Request, arrived: float, now: float) -> list[object]:
        rows = len(req.prompt)
        starts = snap_starts(req.starts, self.cfg, self.facts)
        effects: list[object] = []
        entry = self.store.lookup(req.prompt, starts, now)
        resume = entry.row if entry is not None else 0
        adopted: _Pass | None = None
        warm = self._warm.pop(req.conversation, None)
        if warm is not None:
            p = warm.pass_
            if p is not None and p.done_row >= resume and can_adopt(
                warm.prompt, p.done_row, p.fingerprint(p.done_row, self.facts),
                req.prompt, starts, self.cfg, self.facts,
            ):
                adopted = p
                self._emit(ev.WarmAdopted(t=now, conversation=req.conversation, request=req.id,
                                          stream=p.stream, row=p.done_row))
            else:
                effects.extend(self._cancel_warm(warm, now, "superseded"))
            if self._warm_running is warm:
                self._warm_running = None
        if adopted is not None:
            stream, resume, source, base = adopted.stream, adopted.done_row, "warm", adopted.cuts
            entry = None
            if adopted.restore is not None:
                self.store.unpin(adopted.restore)
        else:
            stream = self._stream()
            source = "store" if entry is not None else "none"
            base = () if entry is None else entry.fingerprint
            if entry is not None:
                self.store.pin(entry)
        chunks = plan_chunks(rows, starts, resume, self.cfg, reads_logits=True)
        keeps = {k.row: k for k in keep_rows(PassKind.COLD, rows, starts, resume, self.cfg, self.facts)}
        cuts = tuple(c for c in base if c < resume) + tuple(c.start for c in chunks if c.start > 0)
        if resume > 0 and resume not in cuts:
            cuts = tuple(sorted(set(cuts) | {resume}))
        p = _Pass(stream, PassKind.COLD, req.conversation, req.prompt, deque(chunks), cuts,
                  keeps, resume, entry, req.id)
        phase = Phase.PREFILL if chunks else Phase.RESTORE
        lane = _Lane(req, arrived, resume, p, phase)
        self._lanes[stream] = lane
        self._emit(ev.RequestAdmitted(t=now, request=req.id, conversation=req.conversation,
                                      stream=stream, rows=rows, cached_tokens=resume, source=source))
        if not chunks and req.max_tokens == 0:
            effects.extend(self._finish(stream, now, "length"))
        return effects

    # --- internals: choosing chunks --------------------------------------------------------
    def _foreground_work(self) -> bool:
        return bool(self._queue) or any(not lane.cancelled for lane in self._lanes.values())

    def _note_quiet(self, now: float) -> None:
        """Quiet (the wait before a warm pass) starts at `now` if foreground work just ended:
        after a commit, or a cancel that emptied the queue. Without the second, a request
        cancelled while queued behind a finishing one left quiet unset and the finished one's
        warm pass pending forever (a Hypothesis state machine found it)."""
        if self._quiet_since is None and self._inflight is None and not self._foreground_work():
            self._quiet_since = now

    def _in_flight(self, stream: int) -> bool:
        step = self._inflight
        if step is None:
            return False
        return stream in step.decode or (step.prefill is not None and step.prefill.stream == stream) \
            or any(s == stream for s, _ in step.restores)

    def _tail(self, chunk: Chunk, req: Request | None) -> int | None:
        facts = attrs.evolve(self._tail_model, tail_rows=self.cfg.tail_rows,
                             has_reader=self._tail_model.has_reader or bool(req and req.has_reader))
        return tail_from(chunk, facts)

    def _chunk_run(self, p: _Pass, req: Request | None) -> ChunkRun:
        chunk = p.chunks[0]
        keep = p.keeps.get(chunk.end)
        copy = None
        if keep is not None:
            copy = self.store.keep_copy(p.prompt, keep.row, p.fingerprint(keep.row, self.facts),
                                        has_logits=keep.with_logits)
        return ChunkRun(p.stream, p.kind, p.request, p.conversation, chunk, self._tail(chunk, req),
                        p.restore, keep, copy)

    def _foreground_chunk(self) -> ChunkRun | None:
        """The next foreground chunk: the oldest admitted prefill's, or with `short_first`
        that of the oldest prefill with at most `max_chunk_rows` rows left, ahead of an
        older one with more (at most `lanes` times in a row; the count is the scheduler's,
        reset whenever the oldest prefill runs). Rows, not chunks: a chat turn of a few rows
        has two chunks (its generation prompt's start is a cut)."""
        waiting = [lane for lane in self._lanes.values() if lane.phase is Phase.PREFILL and not lane.cancelled]
        if not waiting:
            return None
        pick = waiting[0]
        short_rows = self.cfg.max_chunk_rows
        if self.cfg.short_first and _rows_left(pick.pass_) > short_rows and self._passed_over < self.cfg.lanes:
            short = next((lane for lane in waiting[1:] if _rows_left(lane.pass_) <= short_rows), None)
            if short is not None:
                self._passed_over += 1
                return self._chunk_run(short.pass_, short.request)
        self._passed_over = 0
        return self._chunk_run(pick.pass_, pick.request)

    def _warm_chunk(self, now: float) -> ChunkRun | None:
        if not is_quiet(now, self._quiet_since, self.cfg):
            return None
        w = self._warm_running
        while w is None and self._warm:
            w = self._start_warm(next(iter(self._warm.values())), now)
        if w is None or w.pass_ is None:
            return None
        return self._chunk_run(w.pass_, None)

    def _start_warm(self, w: _Warm, now: float) -> _Warm | None:
        entry = self.store.lookup(w.prompt, w.starts, now)
        resume = entry.row if entry is not None else 0
        rows = len(w.prompt)
        keeps_all = keep_rows(PassKind.WARM, rows, w.starts, resume, self.cfg, self.facts)
        base = () if entry is None else entry.fingerprint
        trial_cuts = tuple(c for c in base if c < resume) + ((resume,) if resume else ())
        cuts_all = tuple(sorted(set(trial_cuts) | {c for c in fresh_cuts(rows, w.starts, self.cfg) if c > resume}))
        have = [
            k.row for k in keeps_all
            if (e := self.store.find(w.prompt, k.row, cut_fingerprint(cuts_all, k.row, self.facts), k.with_logits))
            is not None and e.live
        ]
        decision = decide_warm(rows, w.starts, resume, self.cfg, self.facts, have)
        if decision.verdict is WarmVerdict.CANCEL:
            self._warm.pop(w.conversation, None)
            self._emit(ev.WarmCancelled(t=now, conversation=w.conversation, row=resume,
                                        reason=decision.reason))
            return None
        end = decision.end_row
        starts = tuple(s for s in w.starts if s < end)
        chunks = plan_chunks(end, starts, resume, self.cfg, reads_logits=False)
        cuts = tuple(sorted(set(trial_cuts) | {c.start for c in chunks if c.start > 0}))
        if entry is not None:
            self.store.pin(entry)
        stream = self._stream()
        w.pass_ = _Pass(stream, PassKind.WARM, w.conversation, w.prompt, deque(chunks), cuts,
                        {k.row: k for k in decision.keeps}, resume, entry, None)
        self._warm_running = w
        self._emit(ev.WarmStarted(t=now, conversation=w.conversation, stream=stream,
                                  resume=resume, end=end))
        return w

    # --- internals: commits ---------------------------------------------------------------
    def _commit_chunk(self, run: ChunkRun, now: float, stopped: frozenset[int]) -> list[object]:
        effects: list[object] = []
        lane = self._lanes.get(run.stream) if run.kind is PassKind.COLD else None
        w = self._warm_running if run.kind is PassKind.WARM else None
        p = lane.pass_ if lane is not None else (w.pass_ if w is not None else None)
        if p is None:
            return effects
        chunk = p.chunks.popleft()
        assert chunk == run.chunk
        if p.restore is not None:
            self.store.unpin(p.restore)
            p.restore = None
        p.done_row = chunk.end
        self._emit(ev.ChunkDone(t=now, stream=run.stream, request=run.request,
                                conversation=run.conversation, pass_kind=run.kind.value,
                                start=chunk.start, end=chunk.end))
        keep = p.keeps.get(chunk.end)
        if keep is not None:
            effects.extend(self._keep(p, keep, now, run.keep_copy))
        if p.chunks:
            return effects
        if lane is not None:
            lane.phase = Phase.DECODE
            if lane.cancelled:
                return effects
            effects.extend(self._first_token(run.stream, lane, now, run.stream in stopped))
        elif w is not None:
            self._warm.pop(w.conversation, None)
            self._warm_running = None
            self._emit(ev.WarmFinished(t=now, conversation=w.conversation, stream=p.stream,
                                       row=p.done_row))
            effects.append(Released(p.stream))
        return effects

    def _first_token(self, stream: int, lane: _Lane, now: float, stopped: bool) -> list[object]:
        if lane.request.max_tokens == 0:
            return self._finish(stream, now, "length")
        lane.tokens = 1
        self._emit(ev.FirstToken(t=now, request=lane.request.id, conversation=lane.request.conversation,
                                 stream=stream, ttft_s=now - lane.arrived_s))
        if stopped:
            return self._finish(stream, now, "stop")
        if lane.tokens >= lane.request.max_tokens:
            return self._finish(stream, now, "length")
        return []

    def unkeep(self, entry: Entry, now: float, *, held: bool) -> list[object]:
        """The executor could not snapshot the state a `Kept` effect asked for (out of device
        memory, say). held: the entry already held a snapshot, without logits, and the keep
        only added them: it stays, without logits. Otherwise it is evicted now (events and
        `Evicted` effects as any eviction), unless a pass pins it (then nothing changes and
        a resume from it fails that pass, as a missing payload does). Returns the effects."""
        if held:
            self.store.drop_logits(entry)
            return []
        if not entry.live or entry.pins:
            return []
        return self._evicted(self.store.evict(entry), now)

    def _evicted(self, evictions, now: float) -> list[object]:
        effects: list[object] = []
        for e in evictions:
            self._emit(ev.StateEvicted(t=now, entry=e.entry.id, row=e.entry.row,
                                       bytes=e.bytes, how=e.kind.value))
            effects.append(Evicted(e.entry, e.kind))
        return effects

    def _keep(self, p: _Pass, keep: KeepRow, now: float, planned: KeepCopy | None) -> list[object]:
        fp = p.fingerprint(keep.row, self.facts)
        result: KeepResult = self.store.keep(
            p.prompt, keep.row, fp, has_logits=keep.with_logits,
            value_s=self._value_s(keep.row), now_s=now)
        _check_planned(planned, result)
        effects: list[object] = self._evicted(result.evicted, now)
        if result.entry is None:
            self._emit(ev.KeepRefused(t=now, stream=p.stream, conversation=p.conversation,
                                      row=keep.row, reason=result.reason))
        elif result.reason in ("kept", "revived", "logits_added"):
            self._emit(ev.StateKept(t=now, stream=p.stream, conversation=p.conversation,
                                    entry=result.entry.id, row=keep.row, bytes=result.added_bytes,
                                    logits=keep.with_logits))
            effects.append(Kept(p.stream, result.entry))
        return effects

    def _finish(self, stream: int, now: float, reason: str) -> list[object]:
        lane = self._lanes.pop(stream)
        req = lane.request
        if lane.pass_.restore is not None:
            self.store.unpin(lane.pass_.restore)
            lane.pass_.restore = None
        if req.max_tokens == 0 and reason != "cancelled":
            reason = finish_reason(0, 0, False)
        self._emit(ev.RequestFinished(t=now, request=req.id, conversation=req.conversation,
                                      reason=reason, rows=len(req.prompt),
                                      cached_tokens=lane.cached_tokens, output_rows=lane.tokens))
        effects: list[object] = [Released(stream), Finished(req.id, reason, lane.cached_tokens)]
        if reason != "cancelled" and req.max_tokens > 0 and req.continuation is not None \
                and self.cfg.warm_active:
            old = self._warm.pop(req.conversation, None)
            if old is not None:
                effects.extend(self._cancel_warm(old, now, "superseded"))
            self._warm[req.conversation] = _Warm(req.id, req.conversation, req.continuation,
                                                 snap_starts(req.continuation_starts, self.cfg, self.facts), now)
            self._emit(ev.WarmScheduled(t=now, conversation=req.conversation, after=req.id,
                                        rows=len(req.continuation)))
        if not self._foreground_work() and self._inflight is None:
            self._quiet_since = now
        return effects

    def _finish_unadmitted(self, req: Request, now: float, reason: str) -> list[object]:
        self._emit(ev.RequestFinished(t=now, request=req.id, conversation=req.conversation,
                                      reason=reason, rows=len(req.prompt), cached_tokens=0,
                                      output_rows=0))
        return [Finished(req.id, reason, 0)]

    def _cancel_warm(self, w: _Warm, now: float, reason: str) -> list[object]:
        if self._warm_running is w:
            self._warm_running = None
        p = w.pass_
        self._emit(ev.WarmCancelled(t=now, conversation=w.conversation,
                                    row=p.done_row if p else 0, reason=reason))
        if p is None:
            return []
        if p.restore is not None:
            self.store.unpin(p.restore)
            p.restore = None
        return [Released(p.stream)]


def _check_planned(planned: KeepCopy | None, result: KeepResult) -> None:
    """The keep the store made is the one the step's plan copied (`Store.keep_copy`), so the
    executor's snapshot holds exactly what the entry claims. Nothing changes the store's tree
    between a step's plan and its commit: a difference is a bug, raised as AssertionError."""
    e = result.entry
    if e is None:
        return
    expected = {"already_kept": (Copy.NOTHING, None), "logits_added": (Copy.LOGITS, e),
                "revived": (Copy.FIXED, e), "kept": (Copy.STATE, e.parent)}[result.reason]
    got = None if planned is None else (planned.copy, planned.base)
    assert got is not None and got[0] is expected[0] and got[1] is expected[1], \
        f"keep at row {e.row}: planned {got}, the store made {result.reason} {expected}"
