"""The simulator loop, its invariant checker and planted breaks of each invariant."""

from __future__ import annotations

import importlib.util
import io
import json
import random
from pathlib import Path

import attrs
import pytest

import policy.store as store_mod
from policy.config import PolicyConfig
from policy.scheduler import Scheduler
from sim.api import facts_for, load_workload, simulate
from sim.cost import Grid, HostCost, Profile, TableCost
from sim.invariants import InvariantBroken
from sim.scenarios import chat, grid_edges


@pytest.fixture(scope="module")
def profile():
    """The analytic 9B H200 profile (bench/make_profiles.py), fixed whatever sim/profiles ships:
    these tests' timings assume its speed and no invariant grid."""
    path = Path(__file__).parents[2] / "bench" / "make_profiles.py"
    spec = importlib.util.spec_from_file_location("make_profiles", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_profile("qwen3.5-9b")


@pytest.fixture(scope="module")
def small_chat():
    return chat(random.Random(3), conversations=12)


def _trace(workload, cfg, profile, **kw) -> tuple[str, object]:
    out = io.StringIO()
    report = simulate(workload, cfg, profile, facts_for(profile), trace=out, **kw)
    return out.getvalue(), report


def test_same_seed_gives_byte_identical_traces(profile):
    a, _ = _trace(load_workload("mixed", 7), PolicyConfig(), profile)
    b, _ = _trace(load_workload("mixed", 7), PolicyConfig(), profile)
    assert a == b and len(a.splitlines()) > 1000


def test_fast_forward_changes_no_event(small_chat, profile):
    fast, rf = _trace(small_chat, PolicyConfig(), profile, fast_forward=True)
    slow, rs = _trace(small_chat, PolicyConfig(), profile, fast_forward=False)
    assert fast == slow
    assert rf.result.steps < rs.result.steps


def _table_profile(shape, host: HostCost | None) -> Profile:
    """A measured-form profile at `shape` whose lookups interpolate (inexact floats)."""
    cost = TableCost(prefill=Grid(x=(1.0, 4096.0), y=(0.0, 32768.0), seconds=((0.0031, 0.0207), (0.29, 1.03))),
                     decode=Grid(x=(1.0, 16.0), y=(0.0, 32768.0), seconds=((0.0053, 0.0071), (0.0083, 0.0217))),
                     copy_bytes_per_s=3.3e12, host=host)
    return Profile(name="table", source="measured", gpu="none", model="none", shape=shape, invariant_rows=None,
                   cost=cost)


def test_fast_forward_changes_no_event_with_host_terms(small_chat, profile):
    host = _table_profile(profile.shape, HostCost(step_s=3.1e-4, lane_s=1.7e-5, chunk_s=4.3e-4))
    fast, rf = _trace(small_chat, PolicyConfig(), host, fast_forward=True)
    slow, rs = _trace(small_chat, PolicyConfig(), host, fast_forward=False)
    assert fast == slow
    assert rf.result.steps < rs.result.steps
    plain, rp = _trace(small_chat, PolicyConfig(), attrs.evolve(host, cost=attrs.evolve(host.cost, host=None)))
    assert rp.result.end_s < rf.result.end_s  # every step costs more with host terms
    assert sum(rf.ttft_s.values()) > sum(rp.ttft_s.values())


def test_every_request_finishes_with_a_reason(small_chat, profile):
    trace, report = _trace(small_chat, PolicyConfig(), profile)
    events = [json.loads(line) for line in trace.splitlines()]
    arrived = {e["request"] for e in events if e["kind"] == "request_arrived"}
    finished = {e["request"]: e["reason"] for e in events if e["kind"] == "request_finished"}
    assert arrived == set(finished)
    assert set(finished.values()) <= {"stop", "length"}
    assert report.metrics["requests"] == sum(len(c.turns) for c in small_chat.conversations)


def test_default_policy_keeps_warm_ends_under_the_grid(small_chat, profile):
    grid_only = simulate(small_chat, PolicyConfig(request_starts=False), profile, facts_for(profile))
    default = simulate(small_chat, PolicyConfig(), profile, facts_for(profile))
    assert grid_only.metrics["cached_tokens"] < default.metrics["cached_tokens"]
    assert default.metrics["warm_finished"] > 0
    short = 0
    for conv in small_chat.conversations:
        for k, turn in enumerate(conv.turns[1:], start=1):
            rid = f"{conv.id}/{k}"
            cont = conv.turns[k - 1].continuation
            if len(turn.prompt) < 4096:
                short += 1
                # Under the grid-only rule a turn under 4096 rows resumes from nothing; the
                # default resumes at least where the warm pass kept the message start.
                assert grid_only.cached_tokens[rid] == 0
                assert default.cached_tokens[rid] >= len(cont)
    assert short >= 10


def test_invariant_grid_override(profile):
    w = grid_edges(random.Random(0))
    none = simulate(w, PolicyConfig(request_starts=False), profile, facts_for(profile, "none"))
    g64 = simulate(w, PolicyConfig(request_starts=False), profile, facts_for(profile, 64))
    assert g64.metrics["cached_tokens"] > none.metrics["cached_tokens"]


# --- planted breaks: each invariant's control must be red --------------------------------


def test_planted_resume_at_a_non_cut_row_is_caught(small_chat, profile, monkeypatch):
    import policy.scheduler as sched_mod

    monkeypatch.setattr(store_mod, "is_usable", lambda *a, **k: True)
    for mod in (store_mod, sched_mod):
        monkeypatch.setattr(mod, "cut_fingerprint", lambda cuts, row, facts: ())
    # Without warm passes the next turn's longest match is the previous prompt's end, three
    # rows past the reply's message start: not a cut of the next turn's fresh plan.
    with pytest.raises(InvariantBroken) as err:
        simulate(small_chat, PolicyConfig(warm_enabled=False), profile, facts_for(profile))
    assert err.value.rule == "rule 2 (usable)"


def test_planted_store_overfill_is_caught(small_chat, profile, monkeypatch):
    monkeypatch.setattr(store_mod.Store, "_make_room", lambda self, need, anchor, now_s: [])
    cfg = PolicyConfig(prompt_cache_bytes=3 * profile.shape.fixed_bytes)
    with pytest.raises(InvariantBroken) as err:
        simulate(small_chat, cfg, profile, facts_for(profile))
    assert err.value.rule == "rule 4 (budget)"


def test_planted_warm_pass_blocking_two_chunks_is_caught(profile, monkeypatch):
    w = load_workload("agent", 1)
    real = Scheduler._foreground_chunk

    def warm_first(self):
        if self._warm_running is not None and self._warm_running.pass_ and self._warm_running.pass_.chunks:
            return None
        return real(self)

    def warm_even_when_busy(self, now):
        w_ = self._warm_running
        if w_ is not None and w_.pass_ is not None and w_.pass_.chunks:
            return self._chunk_run(w_.pass_, None)
        return Scheduler._warm_chunk_orig(self, now)

    monkeypatch.setattr(Scheduler, "_foreground_chunk", warm_first)
    monkeypatch.setattr(Scheduler, "_warm_chunk_orig", Scheduler._warm_chunk, raising=False)
    monkeypatch.setattr(Scheduler, "_warm_chunk", warm_even_when_busy)
    cfg = PolicyConfig(max_chunk_rows=256)
    with pytest.raises(InvariantBroken) as err:
        simulate(w, cfg, profile, facts_for(profile))
    assert err.value.rule.startswith("rule 6")


def test_planted_plan_that_forgets_starts_after_resume_is_caught(small_chat, profile, monkeypatch):
    import policy.scheduler as sched_mod

    real = sched_mod.plan_chunks

    def forgetful(rows, starts, resume, cfg, **kw):
        return real(rows, [s for s in starts if s <= resume], resume, cfg, **kw)

    monkeypatch.setattr(sched_mod, "plan_chunks", forgetful)
    with pytest.raises(InvariantBroken) as err:
        simulate(small_chat, PolicyConfig(), profile, facts_for(profile))
    assert err.value.rule == "rule 1 (plan consistency)"


def test_planted_lookup_that_skips_the_longest_state_is_caught(small_chat, profile, monkeypatch):
    real = store_mod.Store.lookup

    def second_best(self, prompt, starts, now_s):
        best = real(self, prompt, starts, now_s)
        if best is None:
            return None
        return real(self, prompt.prefix(best.row), tuple(s for s in starts if s < best.row), now_s)

    monkeypatch.setattr(store_mod.Store, "lookup", second_best)
    with pytest.raises(InvariantBroken) as err:
        simulate(small_chat, PolicyConfig(), profile, facts_for(profile))
    assert err.value.rule in ("rule 5 (longest usable)", "rule 2 (usable)")


def test_planted_keep_at_a_row_the_pass_does_not_keep_is_caught(small_chat, profile, monkeypatch):
    import policy.scheduler as sched_mod
    from policy.keep import KeepRow

    real = sched_mod.keep_rows

    def extra(kind, rows, starts, resume, cfg, facts):
        out = real(kind, rows, starts, resume, cfg, facts)
        inner = [s for s in starts if resume < s < rows]
        return tuple(sorted(set(out) | {KeepRow(s) for s in inner}, key=lambda k: k.row))

    monkeypatch.setattr(sched_mod, "keep_rows", extra)
    # Without warm passes a turn resumes at the last turn's user message, so the reply's
    # message start lies between its resume row and its last start: an extra keep.
    with pytest.raises(InvariantBroken) as err:
        simulate(small_chat, PolicyConfig(warm_enabled=False), profile, facts_for(profile))
    assert err.value.rule == "rule 3 (keep)"
