"""policy.scheduler's choice among foreground prefills (PolicyConfig.short_first): which
request's chunk each step runs, by hand."""

from __future__ import annotations

import pytest

from policy.config import PolicyConfig
from policy.prefix import Prompt
from policy.scheduler import Scheduler
from policy.shape import ModelShape
from policy.usable import BackendFacts
from policy.work import Request

SHAPE = ModelShape(linear_layers=3, attention_layers=1, linear_num_key_heads=1, linear_key_head_dim=4,
                   linear_num_value_heads=2, linear_value_head_dim=4, linear_conv_kernel_dim=4,
                   num_key_value_heads=1, head_dim=4)


def request(rid: str, rows: int, tag: int, starts: tuple[int, ...] = (0,)) -> Request:
    return Request(id=rid, conversation=rid, prompt=Prompt.synthetic([(tag, rows)]), starts=starts, max_tokens=1)


def chunk_order(short_first: bool, arrivals: list[tuple], lanes: int = 8) -> list[tuple[str, int, int]]:
    """(request, start, end) of each step's prefill chunk, all requests arriving at t = 0 in
    order ((id, rows) or (id, rows, request starts)), chunks of 16 rows, no cache."""
    cfg = PolicyConfig(max_chunk_rows=16, grid_rows=1024, prompt_cache_bytes=0, warm_enabled=False, lanes=lanes,
                       short_first=short_first)
    sched = Scheduler(cfg, BackendFacts(None), SHAPE, emit=lambda e: None)
    for i, (rid, rows, *starts) in enumerate(arrivals):
        sched.arrive(request(rid, rows, 100 + i, *starts), 0.0)
    order, now = [], 0.0
    for _ in range(200):
        step = sched.next_step(now)
        sched.take_effects()
        if step is None:
            break
        if step.prefill is not None:
            order.append((step.prefill.request, step.prefill.chunk.start, step.prefill.chunk.end))
        now += 0.001
        sched.commit(step, now, frozenset())
    assert not sched.busy
    return order


def test_first_come_first_served_when_off():
    order = chunk_order(False, [("long", 64), ("short", 10)])
    assert order == [("long", 0, 16), ("long", 16, 32), ("long", 32, 48), ("long", 48, 64), ("short", 0, 10)]


def test_a_one_chunk_request_goes_before_an_older_longer_prefill():
    order = chunk_order(True, [("long", 64), ("short", 10), ("two", 20), ("short2", 16)])
    # the one-chunk requests first, oldest first; then the long one, and "two" once it is
    # the oldest (a two-chunk request does not jump ahead)
    assert order == [("short", 0, 10), ("short2", 0, 16), ("long", 0, 16), ("long", 16, 32), ("long", 32, 48),
                     ("long", 48, 64), ("two", 0, 16), ("two", 16, 20)]


def test_short_is_by_rows_left_not_by_chunks():
    """A chat turn of a few rows has two chunks (its generation prompt's start is a cut, as
    the server renders it): it is short all the same (a fresh-user review found the chunk
    count let no chat request through)."""
    order = chunk_order(True, [("long", 64), ("chat", 15, (0, 10))])
    assert order[:3] == [("chat", 0, 10), ("chat", 10, 15), ("long", 0, 16)]
    assert chunk_order(False, [("long", 64), ("chat", 15, (0, 10))])[-2:] == [("chat", 0, 10), ("chat", 10, 15)]
    # 17 rows left is more than one chunk's worth: not short
    assert chunk_order(True, [("long", 64), ("mid", 17)])[0] == ("long", 0, 16)


def test_the_last_chunk_of_a_longer_request_counts_as_one_chunk():
    # "two" has one chunk left after its first: it then goes before the older "long"
    order = chunk_order(True, [("two", 20), ("long", 64)])
    assert order[:2] == [("two", 0, 16), ("two", 16, 20)]


@pytest.mark.parametrize("lanes", [2, 3])
def test_an_older_prefill_gives_way_at_most_lanes_times_in_a_row(lanes):
    arrivals = [("long", 64)] + [(f"s{i}", 8) for i in range(6)]
    order = chunk_order(True, arrivals, lanes=lanes)
    # lanes - 1 short requests hold the other lanes; each leaves after its one chunk and
    # its one token, and the next is admitted: "long" gives way `lanes` times in a row at most
    run = 0
    for rid, _, _ in order:
        if rid == "long":
            run = 0
        else:
            run += 1
            assert run <= lanes
    assert [r for r, _, _ in order].count("long") == 4 and len(order) == 4 + 6
