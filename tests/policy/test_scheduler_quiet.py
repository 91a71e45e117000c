"""policy.scheduler's quiet (the wait before a warm pass starts), by hand."""

from __future__ import annotations

from policy import events as ev
from policy.config import PolicyConfig
from policy.prefix import Prompt
from policy.scheduler import Scheduler
from policy.usable import BackendFacts
from policy.work import Request
from tests.policy.test_prefill_order import SHAPE


def _turn(rid: str, pieces: list[tuple[int, int]], max_tokens: int) -> Request:
    prompt = Prompt.synthetic(pieces)
    continuation = Prompt.synthetic(pieces + [(900 + len(pieces), 5)])
    starts = tuple(sum(r for _, r in pieces[:i]) for i in range(len(pieces)))
    return Request(id=rid, conversation="a", prompt=prompt, starts=starts, max_tokens=max_tokens,
                   continuation=continuation, continuation_starts=starts + (len(prompt),))


def test_a_request_cancelled_while_queued_starts_the_quiet_for_a_waiting_warm_pass():
    """Lane 1 decodes a/1 while a/2 waits in the queue; a/1 finishes (its warm pass is scheduled,
    but quiet cannot start: a/2 is foreground work); then a/2 is cancelled in the queue. Quiet
    starts then, and the warm pass runs once it elapses. Before the fix quiet never started:
    next_timer_s was None and the warm pass pending forever (the Hypothesis state machine in
    property_tests/test_scheduler_machine.py found it: "work left after draining")."""
    cfg = PolicyConfig(grid_rows=32, max_chunk_rows=16, request_starts=False, lanes=1, tail_rows=8,
                       warm_quiet_ms=5.0, prompt_cache_bytes=SHAPE.fixed_bytes + 200 * SHAPE.row_bytes)
    events: list[ev.Event] = []
    sched = Scheduler(cfg, BackendFacts(None), SHAPE, emit=events.append)
    sched.arrive(_turn("a/1", [(1000, 28)], 2), 0.0)  # its continuation (33 rows) passes grid row 32
    now, step = 0.0, sched.next_step(0.0)
    while step.prefill is not None:  # two chunks, then the first token
        now += 0.01
        sched.commit(step, now)
        step = sched.next_step(now)
    sched.arrive(_turn("a/2", [(1000, 28), (1500, 5), (1001, 1)], 0), now)
    assert step.decode and sched.next_timer_s() is None  # a/2 queued behind the one lane
    now += 0.01
    sched.commit(step, now)  # a/1's second token: it finishes, its warm pass waits
    assert [type(e).__name__ for e in events[-2:]] == ["RequestFinished", "WarmScheduled"]
    assert sched.next_timer_s() is None  # a/2 is still foreground work
    now += 0.01
    sched.cancel("a/2", now)
    assert sched.next_timer_s() == now + cfg.warm_quiet_ms / 1000
    assert sched.next_step(now) is None  # quiet has not elapsed
    now = sched.next_timer_s()
    step = sched.next_step(now)
    assert step is not None and step.prefill is not None and step.prefill.kind.value == "warm"
    while step is not None:
        now += 0.01
        sched.commit(step, now)
        step = sched.next_step(now)
    assert not sched.busy
    assert any(isinstance(e, ev.WarmFinished) for e in events)
