"""The discrete-event loop: runs `policy.scheduler.Scheduler` on a virtual clock.

Events are ordered by (time, sequence number), defined once in `_Clock`. The runner is
the cost model (`sim.cost.Profile`); nothing here decides policy.
"""

from __future__ import annotations

import heapq
from typing import Callable

import attrs

from policy import events as ev
from policy.config import PolicyConfig
from policy.scheduler import Scheduler
from policy.work import Finished, Request, Step
from policy.shape import state_bytes
from policy.store import Copy
from policy.usable import BackendFacts
from sim.cost import Profile
from sim.workload import Workload

_ARRIVAL, _STEP_DONE, _TIMER = 0, 1, 2


@attrs.define
class _Clock:
    """Event queue ordered by (time s, sequence number)."""

    heap: list = attrs.field(factory=list)
    seq: int = 0

    def push(self, t: float, kind: int, data: object = None) -> None:
        heapq.heappush(self.heap, (t, self.seq, kind, data))
        self.seq += 1

    def pop(self) -> tuple[float, int, object]:
        t, _, kind, data = heapq.heappop(self.heap)
        return t, kind, data

    def next_time(self) -> float | None:
        return self.heap[0][0] if self.heap else None


@attrs.frozen
class SimResult:
    """What a run leaves besides its trace: clock end (s) and the store's peak bytes."""

    end_s: float
    store_bytes_peak: int
    steps: int
    requests: int


def request_id(conversation: str, turn: int) -> str:
    """Stable request id of a conversation's turn."""
    return f"{conversation}/{turn}"


class Simulation:
    """One simulated run of `workload` under `cfg` on `profile` (deterministic).

    emit(event) receives every trace event in order; `requests` (optional) is filled with
    every Request by id as it arrives; on_step(step, scheduler) runs after
    each committed step with its effects (the invariant checker hooks in there).
    fast_forward: decode-only stretches run as one step of many rounds; the trace and
    every invariant are the same as round by round (tested).
    """

    def __init__(
        self,
        workload: Workload,
        cfg: PolicyConfig,
        profile: Profile,
        facts: BackendFacts,
        *,
        emit: Callable[[ev.Event], None],
        on_step: Callable[[Step, Scheduler, list[object]], None] | None = None,
        requests: dict[str, Request] | None = None,
        fast_forward: bool = True,
    ) -> None:
        self.workload, self.cfg, self.profile, self.facts = workload, cfg, profile, facts
        self.fast_forward = fast_forward
        self._on_step = on_step
        self.scheduler = Scheduler(
            cfg, facts, profile.shape, emit=emit,
            value_s=lambda rows: profile.prefill_s(rows, 0),
        )
        self._clock = _Clock()
        self._convs = {c.id: c for c in workload.conversations}
        self._turn_of: dict[str, tuple[str, int]] = {}
        self.requests: dict[str, Request] = {} if requests is None else requests
        self._timer_at: float | None = None
        self._inflight: Step | None = None
        self.steps = 0

    def run(self) -> SimResult:
        """Run to completion; returns the end time and peaks."""
        for conv in self.workload.conversations:
            for k, turn in enumerate(conv.turns):
                if turn.arrival_s is not None:
                    self._clock.push(turn.arrival_s, _ARRIVAL, (conv.id, k))
                elif k == 0:
                    self._clock.push(conv.start_s + turn.think_s, _ARRIVAL, (conv.id, k))
        now = 0.0
        while self._clock.heap:
            now, kind, data = self._clock.pop()
            if kind == _ARRIVAL:
                self._arrive(data, now)
            elif kind == _STEP_DONE:
                step = self._inflight
                assert step is data
                self._inflight = None
                effects = self.scheduler.commit(step, now)
                self._effects(effects, now)
                self.steps += 1
                if self._on_step is not None:
                    self._on_step(step, self.scheduler, effects)
            elif kind == _TIMER:
                if self._timer_at == now:
                    self._timer_at = None
            if self._inflight is None:
                self._start(now)
        return SimResult(now, self.scheduler.store.bytes_peak, self.steps, len(self._turn_of))

    # --- internals -----------------------------------------------------------------
    def _arrive(self, key: tuple[str, int], now: float) -> None:
        conv_id, k = key
        turn = self._convs[conv_id].turns[k]
        rid = request_id(conv_id, k)
        self._turn_of[rid] = key
        req = Request(
            id=rid, conversation=conv_id, prompt=turn.prompt, starts=turn.starts,
            max_tokens=turn.output_rows, continuation=turn.continuation,
            continuation_starts=turn.continuation_starts,
        )
        self.requests[rid] = req
        self.scheduler.arrive(req, now)

    def _effects(self, effects: list[object], now: float) -> None:
        for e in effects:
            if isinstance(e, Finished) and e.reason in ("stop", "length"):
                conv_id, k = self._turn_of[e.request]
                turns = self._convs[conv_id].turns
                if k + 1 < len(turns) and turns[k + 1].arrival_s is None:
                    self._clock.push(now + turns[k + 1].think_s, _ARRIVAL, (conv_id, k + 1))

    def _start(self, now: float) -> None:
        step = self.scheduler.next_step(now)
        self._effects(self.scheduler.take_effects(), now)
        if step is None:
            timer = self.scheduler.next_timer_s()
            if timer is not None and timer > now and self._timer_at != timer:
                self._timer_at = timer
                self._clock.push(timer, _TIMER)
            return
        if self.fast_forward and step.prefill is None and not step.restores:
            step, end = self._decode_span(step, now)
        else:
            end = now + self._step_s(step)
        self._inflight = step
        self._clock.push(end, _STEP_DONE, step)

    def _step_s(self, step: Step) -> float:
        """Seconds of one step: its decode round, its chunk (with the restore its pass resumes
        from and the keep it makes: the bytes its `KeepCopy` moves, none for a state already
        kept or logits added), its restored lanes, then the serving loop's host seconds
        (`Profile.host_s`; a decode-only step sums as `Profile.decode_span` does a round)."""
        p = self.profile
        t = p.decode_round_s(len(step.decode), step.contexts) if step.decode else 0.0
        if step.prefill is not None:
            run = step.prefill
            t += p.prefill_s(run.chunk.rows, run.chunk.start)
            if run.restore is not None:
                t += p.restore_s(state_bytes(p.shape, run.restore.row))
            if run.keep_copy is not None and run.keep_copy.copy in (Copy.STATE, Copy.FIXED):
                t += p.keep_s(run.keep_copy.bytes(p.shape))
        for _, entry in step.restores:
            t += p.restore_s(state_bytes(p.shape, entry.row))
        return t + p.host_s(len(step.decode) + len(step.restores), step.prefill is not None)

    def _decode_span(self, step: Step, now: float) -> tuple[Step, float]:
        """Rounds until a lane finishes or the round in flight at the next event ends.

        The end time accumulates round by round, as committing each round would.
        """
        left = self.scheduler.decode_rounds_left()
        horizon = self._clock.next_time()
        rounds, t = self.profile.decode_span(len(step.decode), sum(step.contexts), left, now, horizon)
        return attrs.evolve(step, rounds=rounds), t
