"""The prompt-cache store (rules 3-5): shared K/V, ghosts, pins, budget, eviction order, lookup."""

from __future__ import annotations

import pytest

from policy.config import PolicyConfig
from policy.plan import fresh_cuts
from policy.prefix import Prompt
from policy.shape import QWEN35_27B, state_bytes

SHAPE = QWEN35_27B
from policy.store import Copy, EvictKind, Store
from policy.usable import BackendFacts, cut_fingerprint

FIXED = 153_944_064  # Qwen3.5-27B, see test_shape.py
ROW = 65_536
GHOST, FREED = EvictKind.GHOST, EvictKind.FREED
NO_GRID = BackendFacts()
LONG = Prompt.synthetic([(1, 9000)])  # one content: every shorter prompt of id 1 is its prefix


def make_store(budget_bytes=64 << 30, facts=NO_GRID, **changes):
    return Store(QWEN35_27B, PolicyConfig(prompt_cache_bytes=budget_bytes, **changes), facts)


def fp(store, prompt, row, starts=()):
    """Fingerprint of a fresh pass over `prompt` at `row`."""
    return cut_fingerprint(fresh_cuts(len(prompt), starts, store.cfg), row, store.facts)


def keep(store, prompt, row, *, value_s=1.0, now_s=0.0, starts=(), logits=False):
    return store.keep(prompt, row, fp(store, prompt, row, starts), has_logits=logits,
                      value_s=value_s, now_s=now_s)


def kinds(evictions):
    return [(e.entry.row, e.kind) for e in evictions]


def test_first_state_costs_state_bytes():
    store = make_store()
    result = keep(store, LONG, 4096)
    assert result.reason == "kept" and result.evicted == ()
    assert store.bytes_used == state_bytes(QWEN35_27B, 4096) == FIXED + 4096 * ROW
    assert store.entry_bytes(result.entry) == FIXED + 4096 * ROW
    store.check()


def test_longer_state_shares_kv_with_kept_prefix():
    store = make_store()
    first = keep(store, LONG, 4096).entry
    second = keep(store, LONG, 8192).entry
    assert second.parent is first and second.own_rows == 4096
    assert store.entry_bytes(second) == FIXED + 4096 * ROW
    assert store.bytes_used == 2 * FIXED + 8192 * ROW
    assert store.bytes_peak == store.bytes_used
    store.check()


def test_evicting_the_prefix_leaves_a_ghost_then_both_go():
    store = make_store()
    first = keep(store, LONG, 4096).entry
    second = keep(store, LONG, 8192).entry
    before = store.bytes_used
    assert kinds(store.evict(first)) == [(4096, GHOST)]
    assert before - store.bytes_used == FIXED
    assert store.bytes_used == FIXED + 8192 * ROW
    assert not first.live and len(store) == 1 and len(list(store.entries())) == 2
    store.check()
    assert kinds(store.evict(second)) == [(8192, FREED), (4096, FREED)]
    assert store.bytes_used == 0 and list(store.entries()) == []
    store.check()


def test_evicting_the_longer_state_keeps_the_prefix():
    store = make_store()
    first = keep(store, LONG, 4096).entry
    second = keep(store, LONG, 8192).entry
    assert kinds(store.evict(second)) == [(8192, FREED)]
    assert store.bytes_used == FIXED + 4096 * ROW and first.live and first.children == 0
    store.check()


def test_keeping_a_ghost_again_costs_only_its_fixed_part():
    store = make_store()
    first = keep(store, LONG, 4096).entry
    keep(store, LONG, 8192)
    store.evict(first)
    planned = store.keep_copy(LONG, 4096, fp(store, LONG, 4096), has_logits=False)
    assert (planned.copy, planned.base, planned.kv_from, planned.bytes(SHAPE)) == (Copy.FIXED, first, 4096, FIXED)
    again = keep(store, LONG, 4096, value_s=3.0, now_s=5.0)
    assert again.reason == "revived" and again.entry is first and first.live
    assert again.added_bytes == FIXED
    assert store.bytes_used == 2 * FIXED + 8192 * ROW
    assert (first.value_s, first.last_used_s) == (3.0, 5.0)
    store.check()


def test_keep_copy_names_what_each_keep_moves():
    """The executor snapshots what keep_copy says before the chunk runs; keep then agrees."""
    def planned(store, row, logits=False):
        c = store.keep_copy(LONG, row, fp(store, LONG, row), has_logits=logits)
        return c.copy, c.base, c.kv_from, c.bytes(SHAPE)

    store = make_store()
    assert planned(store, 4096) == (Copy.STATE, None, 0, FIXED + 4096 * ROW)
    first = keep(store, LONG, 4096).entry
    assert planned(store, 4096) == (Copy.NOTHING, None, 4096, 0)
    assert planned(store, 4096, logits=True) == (Copy.LOGITS, first, 4096, 0)
    assert planned(store, 6000) == (Copy.STATE, first, 4096, FIXED + (6000 - 4096) * ROW)
    second = keep(store, LONG, 6000)
    assert second.reason == "kept" and second.entry.parent is first
    assert second.added_bytes == FIXED + (6000 - 4096) * ROW == store.entry_bytes(second.entry)
    assert keep(store, LONG, 4096, logits=True).reason == "logits_added"
    off = make_store(budget_bytes=0)
    assert planned(off, 4096) == (Copy.NOTHING, None, 4096, 0)


def test_keeping_the_same_state_twice():
    store = make_store()
    first = keep(store, LONG, 4096, value_s=2.0).entry
    again = keep(store, LONG, 4096, value_s=1.0, now_s=9.0)
    assert again.reason == "already_kept" and again.entry is first
    assert (first.value_s, first.last_used_s) == (2.0, 9.0)
    assert store.bytes_used == FIXED + 4096 * ROW


def test_no_sharing_with_a_prefix_the_pass_did_not_cut_at():
    # A 120-row prompt kept at its end; a 5000-row prompt with the same first 120 rows, cut
    # only at the mark 4096, computed rows [0, 120) in its chunk [0, 4096): other bits.
    store = make_store()
    short = keep(store, LONG.prefix(120), 120, logits=True).entry
    long = keep(store, LONG.prefix(5000), 4096).entry
    assert long.parent is None and long.own_rows == 4096
    # With a request start at 120 the pass cuts there, and shares the rows.
    other = keep(store, LONG.prefix(5000), 4096, starts=(0, 120)).entry
    assert other.parent is short and other.own_rows == 4096 - 120
    store.check()


def test_sharing_on_the_invariant_grid_needs_no_cut():
    store = make_store(facts=BackendFacts(invariant_rows=64))
    short = keep(store, LONG.prefix(128), 128, logits=True).entry
    long = keep(store, LONG.prefix(5000), 4096).entry
    assert long.parent is short and long.own_rows == 4096 - 128


def test_budget_refuses_a_state_that_cannot_fit():
    store = make_store(budget_bytes=FIXED + 4096 * ROW)
    keep(store, LONG, 4096)
    result = keep(store, Prompt.synthetic([(2, 9000)]), 8192)
    assert (result.entry, result.evicted, result.reason) == (None, (), "over_budget")
    assert store.bytes_used == FIXED + 4096 * ROW
    store.check()


def test_budget_evicts_to_make_room():
    store = make_store(budget_bytes=FIXED + 4096 * ROW)
    old = keep(store, LONG, 4096).entry
    result = keep(store, Prompt.synthetic([(2, 9000)]), 4096)
    assert result.reason == "kept" and kinds(result.evicted) == [(4096, FREED)]
    assert result.evicted[0].entry is old
    assert store.bytes_used == FIXED + 4096 * ROW <= store.budget_bytes
    store.check()


def test_sharing_lets_a_longer_state_fit():
    # Room for exactly two fixed parts and 8192 rows: the 8192 state fits only by sharing.
    store = make_store(budget_bytes=2 * FIXED + 8192 * ROW)
    keep(store, LONG, 4096)
    result = keep(store, LONG, 8192)
    assert result.reason == "kept" and result.evicted == ()
    assert store.bytes_used == store.budget_bytes


def test_pinned_states_are_never_evicted():
    store = make_store(budget_bytes=2 * (FIXED + 4096 * ROW))
    a = keep(store, Prompt.synthetic([(1, 4096)]), 4096, value_s=1.0).entry
    b = keep(store, Prompt.synthetic([(2, 4096)]), 4096, value_s=9.0).entry
    store.pin(a)  # the lower value, but in use
    result = keep(store, Prompt.synthetic([(3, 4096)]), 4096)
    assert [e.entry for e in result.evicted] == [b] and a.live
    store.pin(result.entry)
    refused = keep(store, Prompt.synthetic([(4, 4096)]), 4096)
    assert (refused.entry, refused.evicted, refused.reason) == (None, (), "over_budget")
    store.unpin(a)
    freed = keep(store, Prompt.synthetic([(4, 4096)]), 4096)
    assert [e.entry for e in freed.evicted] == [a]
    store.check()


def test_pin_bookkeeping():
    store = make_store()
    entry = keep(store, LONG, 4096).entry
    store.pin(entry)
    store.pin(entry)
    store.unpin(entry)
    assert entry.pins == 1
    with pytest.raises(AssertionError):
        store.evict(entry)
    store.unpin(entry)
    with pytest.raises(AssertionError):
        store.unpin(entry)


def _three_equal_states(store):
    """Three unrelated 4096-row states (equal bytes) with values 10, 6, 8 kept at t=0."""
    return [
        keep(store, Prompt.synthetic([(cid, 4096)]), 4096, value_s=v, now_s=0.0).entry
        for cid, v in ((1, 10.0), (2, 6.0), (3, 8.0))
    ]


def test_eviction_takes_the_lowest_value_first():
    store = make_store(budget_bytes=3 * (FIXED + 4096 * ROW))
    a, b, c = _three_equal_states(store)
    result = keep(store, Prompt.synthetic([(4, 4096)]), 4096, now_s=0.0)
    assert [e.entry for e in result.evicted] == [b] and a.live and c.live


def test_idle_decay_changes_the_order():
    # Half-life 600 s: after 1200 idle seconds value 10 is worth 2.5; a lookup refreshes 6.
    store = make_store(budget_bytes=3 * (FIXED + 4096 * ROW), idle_half_life_s=600.0)
    a, b, c = _three_equal_states(store)
    assert store.lookup(Prompt.synthetic([(2, 5000)]), (), now_s=1200.0) is b
    assert store.score(a, 1200.0) == pytest.approx(2.5 / (FIXED + 4096 * ROW))
    assert store.score(b, 1200.0) == pytest.approx(6.0 / (FIXED + 4096 * ROW))
    result = keep(store, Prompt.synthetic([(4, 4096)]), 4096, value_s=100.0, now_s=1200.0)
    assert [e.entry for e in result.evicted] == [c]  # 8 -> 2.0 is now the lowest
    result = keep(store, Prompt.synthetic([(5, 4096)]), 4096, value_s=100.0, now_s=1200.0)
    assert [e.entry for e in result.evicted] == [a]


def test_value_is_per_byte():
    # Equal value: the larger state frees more bytes per second of prefill lost, so it goes.
    store = make_store(budget_bytes=2 * FIXED + 8193 * ROW)
    small = keep(store, Prompt.synthetic([(1, 10)]), 1, value_s=5.0).entry
    big = keep(store, Prompt.synthetic([(2, 9000)]), 8192, value_s=5.0).entry
    assert store.score(big, 0.0) < store.score(small, 0.0)
    result = keep(store, Prompt.synthetic([(3, 10)]), 1, value_s=5.0)
    assert [e.entry for e in result.evicted] == [big] and small.live


def test_ghost_score_counts_only_its_fixed_part():
    store = make_store()
    first = keep(store, LONG, 4096, value_s=4.0).entry
    keep(store, LONG, 8192, value_s=4.0)
    assert store.score(first, 0.0) == pytest.approx(4.0 / FIXED)


def test_lookup_returns_the_longest_usable_state():
    store = make_store()
    for row in (4096, 8192, 8500):  # 8500 is no cut of a fresh 9000-row plan
        keep(store, LONG, row)
    assert store.lookup(LONG, (), now_s=7.0).row == 8192
    assert store.lookup(LONG.prefix(8300), (), now_s=7.0).row == 8192
    assert store.lookup(LONG.prefix(8192), (), now_s=7.0).row == 4096
    assert store.lookup(LONG.prefix(4096), (), now_s=7.0) is None
    assert store.lookup(Prompt.synthetic([(2, 9000)]), (), now_s=7.0) is None


def test_lookup_with_request_starts_and_logits():
    store = make_store()
    keep(store, LONG.prefix(6000), 6000, starts=(0, 5000), logits=True)
    keep(store, LONG.prefix(6000), 5000, starts=(0, 5000))
    assert store.lookup(LONG.prefix(6000), (0, 5000), now_s=0.0).row == 6000
    # A longer prompt cannot use the 6000 state (no cut there) but can use the start.
    assert store.lookup(LONG, (0, 5000), now_s=0.0).row == 5000
    # A prompt whose fresh plan has no cut at 5000 computes other bits there.
    assert store.lookup(LONG, (0,), now_s=0.0) is None


def test_lookup_skips_ghosts_and_marks_use():
    store = make_store()
    first = keep(store, LONG, 4096).entry
    second = keep(store, LONG, 8192).entry
    store.evict(second)
    store.evict(first)
    assert store.lookup(LONG, (), now_s=1.0) is None
    third = keep(store, LONG, 8192).entry
    store.evict(keep(store, LONG, 4096).entry)
    found = store.lookup(LONG, (), now_s=42.0)
    assert found is third and third.last_used_s == 42.0


def test_cache_off_keeps_and_finds_nothing():
    store = make_store(budget_bytes=0)
    result = keep(store, LONG, 4096)
    assert (result.entry, result.reason) == (None, "cache_off")
    assert store.lookup(LONG, (), now_s=0.0) is None and store.bytes_used == 0


def test_keep_row_outside_prompt_is_an_error():
    store = make_store()
    with pytest.raises(ValueError, match=r"row 9001 outside \(0, 9000\]"):
        keep(store, LONG, 9001)


def test_eviction_order_after_a_ghost_loses_a_child():
    # G at 40 is extended by A (60) and B (70); evicting G leaves a ghost, evicting B then
    # makes A the only state holding G's 40 rows: evicting A now frees fixed + 60 rows, not
    # fixed + 20. C's value per byte lies between A's old and new ones, so A goes first.
    store = make_store(budget_bytes=3 * FIXED + 134 * ROW - 1, idle_half_life_s=600.0)
    pa, pb = Prompt.synthetic([(1, 40), (4, 20)]), Prompt.synthetic([(1, 40), (2, 30)])
    g = keep(store, pa, 40, value_s=5.0, starts=(0, 40)).entry
    a = keep(store, pa, 60, value_s=1.0, starts=(0, 40), logits=True).entry
    b = keep(store, pb, 70, value_s=5.0, starts=(0, 40), logits=True).entry
    assert a.parent is g and b.parent is g
    store.evict(g)
    store.evict(b)
    between = 0.5 * (1.0 / (FIXED + 60 * ROW) + 1.0 / (FIXED + 20 * ROW))
    c = keep(store, Prompt.synthetic([(6, 70)]), 64, value_s=between * (FIXED + 64 * ROW)).entry
    assert store.score(a, 0.0) < store.score(c, 0.0)
    result = keep(store, Prompt.synthetic([(7, 10)]), 10, value_s=100.0, logits=True)
    assert [(e.entry, e.kind) for e in result.evicted] == [(a, FREED), (g, FREED)] and c.live


def test_a_keep_beside_many_siblings_under_a_live_prefix_ranks_only_itself_and_its_parent(monkeypatch):
    # 40 first turns kept under one live system prompt: the freed bytes of a state walk up
    # through ghosts only, so a new sibling changes no other sibling's rank. The store used
    # to re-rank every sibling on each keep (2 ms a keep with 400 of them).
    store = make_store(facts=BackendFacts(64))
    system = Prompt.synthetic([(1, 512), (0, 100)])
    parent = keep(store, system, 512).entry
    for i in range(39):
        keep(store, Prompt.synthetic([(1, 512), (100 + i, 100)]), 576)
    ranked = []
    real_rank = Store._rank
    monkeypatch.setattr(Store, "_rank", lambda self, entry: (ranked.append(entry), real_rank(self, entry)))
    new = keep(store, Prompt.synthetic([(1, 512), (999, 100)]), 576).entry
    assert new.parent is parent and parent.children == 40
    assert set(ranked) == {parent, new}
    store.evict(parent)  # now a ghost: every child's freed bytes run through it again
    assert len(ranked) > 40
    store.check()
