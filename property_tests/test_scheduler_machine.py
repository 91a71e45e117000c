"""Stateful Hypothesis test of policy.scheduler: random event sequences hold every invariant.

The sim's invariant checker (sim.invariants.Checker) watches the trace; the store's own
accounting is checked after every commit; at teardown all work drains and every request
must have ended with a reason.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from policy.config import PolicyConfig
from policy.prefix import Prompt
from policy.keep import PassKind
from policy.scheduler import Phase, Scheduler, _rows_left
from policy.shape import ModelShape
from policy.usable import BackendFacts
from policy.work import Request
from sim.invariants import Checker

SHAPE = ModelShape(linear_layers=3, attention_layers=1, linear_num_key_heads=1, linear_key_head_dim=4,
                   linear_num_value_heads=2, linear_value_head_dim=4, linear_conv_kernel_dim=4,
                   num_key_value_heads=1, head_dim=4)


class SchedulerMachine(RuleBasedStateMachine):
    """Drives one Scheduler with arrivals, steps, commits, cancels and time."""

    requests = Bundle("requests")

    @initialize(
        grid=st.sampled_from([32, 64]),
        chunk=st.sampled_from([16, 24, 64]),
        starts_on=st.booleans(),
        warm=st.booleans(),
        budget_states=st.sampled_from([0, 1, 3, 50]),
        lanes=st.integers(1, 3),
        grid_facts=st.sampled_from([None, 8, 16]),
        short_first=st.booleans(),
    )
    def setup(self, grid, chunk, starts_on, warm, budget_states, lanes, grid_facts, short_first):
        budget = budget_states * (SHAPE.fixed_bytes + 200 * SHAPE.row_bytes)
        self.cfg = PolicyConfig(grid_rows=grid, max_chunk_rows=chunk, request_starts=starts_on,
                                warm_enabled=warm, prompt_cache_bytes=budget, lanes=lanes,
                                tail_rows=8, warm_quiet_ms=5.0, queue_rows=16, short_first=short_first)
        self.facts = BackendFacts(grid_facts)
        self.reqs: dict[str, Request] = {}
        self.checker = Checker(self.cfg, self.facts, self.reqs)
        self.sched = Scheduler(self.cfg, self.facts, SHAPE, emit=self.checker.event)
        self.checker.store = self.sched.store
        self.now = 0.0
        self.inflight = None
        self.history: dict[str, tuple[list[tuple[int, int]], list[int]]] = {}
        self.turns: dict[str, int] = {}

    @rule(target=requests, conv=st.sampled_from(["a", "b", "c"]), new_rows=st.integers(1, 90),
          out=st.integers(0, 4), extend=st.sampled_from([True, True, True, False]))
    def arrive(self, conv, new_rows, out, extend):
        pieces, starts = self.history.get(conv, ([], []))
        if not extend:
            pieces, starts = [], []
        cid = 1000 * (ord(conv) - 96) + self.turns.get(conv, 0)
        rows = sum(r for _, r in pieces)
        pieces = pieces + [(cid, new_rows)]
        starts = starts + [rows]
        k = self.turns[conv] = self.turns.get(conv, 0) + 1
        prompt = Prompt.synthetic(pieces)
        reply = (cid + 500, 5)
        cont_pieces = pieces + [reply]
        cont = Prompt.synthetic(cont_pieces)
        cont_starts = tuple(starts) + (len(prompt),)
        rid = f"{conv}/{k}"
        req = Request(id=rid, conversation=conv, prompt=prompt, starts=tuple(starts), max_tokens=out,
                      continuation=cont, continuation_starts=cont_starts)
        self.history[conv] = (cont_pieces, list(cont_starts))
        self.reqs[rid] = req
        self.sched.arrive(req, self.now)
        return rid

    @precondition(lambda self: self.inflight is None)
    @rule()
    def step(self):
        step = self.sched.next_step(self.now)
        self.sched.take_effects()
        self.inflight = step
        self._check_prefill_order(step)

    def _check_prefill_order(self, step):
        """Which foreground prefill ran (PolicyConfig.short_first): the oldest waiting one,
        or, with short_first, the oldest with at most max_chunk_rows rows left ahead of an
        older one with more, at most `lanes` times in a row; a warm chunk only when none waits."""
        waiting = [(s, lane) for s, lane in self.sched._lanes.items()
                   if lane.phase is Phase.PREFILL and not lane.cancelled]
        if step is None or not waiting:
            return
        assert step.prefill is not None and step.prefill.kind is not PassKind.WARM
        oldest = waiting[0][0]
        if step.prefill.stream == oldest:
            assert self.sched._passed_over == 0
            return
        limit = self.cfg.max_chunk_rows
        shorts = [s for s, lane in waiting[1:] if _rows_left(lane.pass_) <= limit]
        assert self.cfg.short_first and _rows_left(waiting[0][1].pass_) > limit
        assert step.prefill.stream == shorts[0] and 1 <= self.sched._passed_over <= self.cfg.lanes

    @precondition(lambda self: self.inflight is not None)
    @rule(dt=st.floats(0.0005, 0.01), stop=st.booleans())
    def commit(self, dt, stop):
        step, self.inflight = self.inflight, None
        self.now += dt
        stopped = frozenset(step.decode[:1]) if stop else frozenset()
        effects = self.sched.commit(step, self.now, stopped)
        self.checker.step(step, self.sched, effects)

    @rule(dt=st.floats(0.0, 0.05))
    def wait(self, dt):
        self.now += dt

    @rule(rid=requests)
    def cancel(self, rid):
        self.checker.effects(self.sched.cancel(rid, self.now))

    @invariant()
    def store_holds(self):
        if hasattr(self, "sched"):
            store = self.sched.store
            assert store.bytes_used <= store.budget_bytes
            store.check()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(10_000):
            if self.inflight is not None:
                self.commit(0.001, False)
                continue
            step = self.sched.next_step(self.now)
            self.sched.take_effects()
            if step is None:
                if not self.sched.busy:
                    break
                self.now += 1.0
                continue
            self.inflight = step
        assert not self.sched.busy, "work left after draining"
        self.checker.finish()


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(stateful_step_count=40, deadline=None)
