"""Rules 3-5 as a state machine: the store against a simple dict-based model.

Rules: keep (a new state, or one from the Bundle of kept states again), lookup, pin, unpin,
evict, advance time. The model is a dict of kept states keyed by (row, digest,
fingerprint) with their parent (the nearest kept prefix the pass cut at), liveness, pins,
value and last use. From it, by brute force: bytes (fixed part of every live state + the
K/V rows of every state a live one extends), the longest usable state for a request, and
the value per byte of every eviction candidate. Invariants: the store never exceeds its
budget, never evicts a pinned state, its bytes equal the model's, it holds exactly the
model's live states and ghosts, and lookup returns the longest usable kept state.

Planted wrong stores at the end must each be caught.
"""

from __future__ import annotations

import math

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from policy_strategies import (
    CONTROL,
    Case,
    oracle_fingerprint,
    oracle_fresh_cuts,
    oracle_usable,
)

from policy.config import PolicyConfig
from policy.keep import PassKind, keep_rows
from policy.plan import fresh_cuts
from policy.prefix import Prompt
from policy.shape import QWEN35_27B, ModelShape
from policy.store import Copy, EvictKind, Store
from policy.usable import BackendFacts, cut_fingerprint, is_usable

TINY = ModelShape(  # fixed part 1,120 B = 35 rows of 32 B: sharing matters at these sizes
    linear_layers=1, attention_layers=1, linear_num_key_heads=1, linear_key_head_dim=8,
    linear_num_value_heads=2, linear_value_head_dim=16, linear_conv_kernel_dim=2,
    num_key_value_heads=1, head_dim=8,
)
assert (TINY.fixed_bytes, TINY.row_bytes) == (1120, 32)

PIECES = [  # prompts sharing prefixes: (content id, rows) runs
    [(1, 40)],
    [(1, 40), (2, 30)],
    [(1, 40), (2, 30), (3, 50)],
    [(1, 40), (4, 20)],
    [(1, 100)],
    [(1, 40), (2, 30), (3, 20), (5, 64)],
    [(6, 70)],
]
PROMPTS = [Prompt.synthetic(p) for p in PIECES]

Key = tuple  # (row, digest, fingerprint)


@attrs.define
class ModelEntry:
    row: int
    parent: Key | None
    has_logits: bool
    value_s: float
    last_used_s: float
    live: bool = True
    pins: int = 0


class StoreMachine(RuleBasedStateMachine):
    """The store under test is built by `make_store` (planted stores override it)."""

    kept = Bundle("kept")

    def make_store(self, shape, cfg, facts):
        return Store(shape, cfg, facts)

    # --- setup ----------------------------------------------------------------------------
    @initialize(data=st.data())
    def setup(self, data):
        draw = data.draw
        self.shape = draw(st.sampled_from([TINY, QWEN35_27B]), label="shape")
        fixed_units = draw(st.integers(0, 6), label="budget fixed parts")
        row_units = draw(st.sampled_from([0, 40, 100, 250, 400]), label="budget rows")
        budget = fixed_units * self.shape.fixed_bytes + row_units * self.shape.row_bytes
        self.cfg = PolicyConfig(
            grid_rows=draw(st.sampled_from([16, 32, 50]), label="grid_rows"),
            max_chunk_rows=draw(st.sampled_from([16, 24, 64]), label="max_chunk_rows"),
            request_starts=draw(st.booleans(), label="request_starts"),
            prompt_cache_bytes=budget,
            idle_half_life_s=draw(st.sampled_from([1.0, 60.0, math.inf]), label="half life"),
        )
        self.facts = BackendFacts(draw(st.sampled_from([None, None, 8, 16]), label="invariant_rows"))
        # Request starts per prompt: the message starts (run boundaries), or fewer.
        self.starts = []
        for p in PROMPTS:
            bounds = list(p.run_ends[:-1])
            if draw(st.booleans(), label="fewer starts"):
                bounds = [b for b in bounds if draw(st.booleans())]
            self.starts.append(tuple(bounds))
        self.store = self.make_store(self.shape, self.cfg, self.facts)
        self.model: dict[Key, ModelEntry] = {}
        self.now_s = 0.0

    # --- model helpers -------------------------------------------------------------------
    def fresh_fp(self, i, rows, row):
        starts = tuple(s for s in self.starts[i] if s < rows)
        return cut_fingerprint(fresh_cuts(rows, starts, self.cfg), row, self.facts)

    def closure(self, keys):
        out, todo = set(), list(keys)
        while todo:
            k = todo.pop()
            if k is not None and k not in out:
                out.add(k)
                todo.append(self.model[k].parent)
        return out

    def model_bytes(self, live, hold=()):
        own = sum(k[0] - (self.model[k].parent[0] if self.model[k].parent else 0)
                  for k in self.closure([*live, *hold]))
        return len(live) * self.shape.fixed_bytes + own * self.shape.row_bytes

    def live_keys(self):
        return {k for k, e in self.model.items() if e.live}

    def model_parent(self, prompt, row, fp):
        g = self.facts.invariant_rows
        best = None
        for k in self.model:
            r, digest, kfp = k
            if r < row and digest == prompt.digest(r) and kfp == tuple(c for c in fp if c < r) \
                    and (r in fp or (g is not None and r % g == 0)) and (best is None or r > best[0]):
                best = k
        return best

    def score(self, key, live, hold):
        e = self.model[key]
        freed = self.model_bytes(live, hold) - self.model_bytes(live - {key}, hold)
        idle = max(0.0, self.now_s - e.last_used_s)
        return e.value_s * 0.5 ** (idle / self.cfg.idle_half_life_s) / max(1, freed)

    def entry(self, key):
        for e in self.store.entries():
            if (e.row, e.digest, e.fingerprint) == key:
                return e
        raise AssertionError(f"store lost {key}")

    def drop_unreachable(self, hold=()):
        keep = self.closure([*self.live_keys(), *hold])
        for k in [k for k in self.model if k not in keep]:
            del self.model[k]

    @staticmethod
    def check_planned(planned, result):
        """keep_copy, asked before the keep, named what the keep made (the executor copies it)."""
        e = result.entry
        if e is None:
            return
        want = {"already_kept": (Copy.NOTHING, None, e.row), "logits_added": (Copy.LOGITS, e, e.row),
                "revived": (Copy.FIXED, e, e.row), "kept": (Copy.STATE, e.parent, e.row - e.own_rows)}
        assert (planned.copy, planned.base, planned.kv_from) == want[result.reason], (planned, result.reason)

    # --- rules ---------------------------------------------------------------------------
    def do_keep(self, i, rows, row, with_logits, value_s):
        prompt = PROMPTS[i].prefix(rows)
        fp = self.fresh_fp(i, rows, row)
        key = (row, prompt.digest(row), fp)
        has_logits = with_logits and row == rows
        found = self.model.get(key)
        live_before = self.live_keys()
        bytes_before = self.store.bytes_used
        planned = self.store.keep_copy(prompt, row, fp, has_logits=has_logits)
        result = self.store.keep(prompt, row, fp, has_logits=has_logits, value_s=value_s, now_s=self.now_s)
        self.check_planned(planned, result)
        if not self.cfg.cache_enabled:
            assert (result.entry, result.evicted, result.reason) == (None, (), "cache_off")
            return None
        if found is not None and found.live:
            assert result.evicted == () and self.store.bytes_used == bytes_before
            assert result.reason in ("already_kept", "logits_added"), result.reason
            found.has_logits |= has_logits
            found.value_s = max(found.value_s, value_s)
            found.last_used_s = self.now_s
            return key
        parent = found.parent if found is not None else self.model_parent(prompt, row, fp)
        own = 0 if found is not None else row - (parent[0] if parent else 0)
        need = self.shape.fixed_bytes + own * self.shape.row_bytes
        anchor = key if found is not None else parent
        hold = [anchor] if anchor is not None else []
        pinned = {k for k in live_before if self.model[k].pins}
        fits_now = bytes_before + need <= self.cfg.prompt_cache_bytes
        fits_at_all = need <= self.cfg.prompt_cache_bytes and \
            self.model_bytes(pinned, hold) + need <= self.cfg.prompt_cache_bytes
        if result.entry is None:
            assert result.reason == "over_budget" and result.evicted == ()
            assert not fits_now and not fits_at_all, "refused a state that fits"
            assert self.store.bytes_used == bytes_before
            return None
        assert result.reason == ("revived" if found is not None else "kept"), result.reason
        assert result.added_bytes == need
        assert fits_now or fits_at_all, "kept a state that cannot fit"
        got_parent = result.entry.parent
        assert (None if got_parent is None else (got_parent.row, got_parent.digest, got_parent.fingerprint)) == \
            parent, "shares K/V with the wrong prefix"
        # Evictions: live, unpinned, lowest value per byte first, and no more than needed.
        victims = [(e.entry.row, e.entry.digest, e.entry.fingerprint) for e in result.evicted]
        primary = list(dict.fromkeys(k for k in victims if k in live_before))  # a ghost may be freed later
        assert not (set(victims) - set(self.model)), "evicted an unknown state"
        live = set(live_before)
        for n, k in enumerate(primary):
            assert self.model[k].pins == 0, f"evicted pinned state {k}"
            assert self.model_bytes(live, hold) + need > self.cfg.prompt_cache_bytes, "evicted more than needed"
            scores = {c: self.score(c, live, hold) for c in live if self.model[c].pins == 0}
            low = min(scores.values())
            assert scores[k] <= low * (1 + 1e-9), f"victim {n} scored {scores[k]}, lowest {low}"
            live.discard(k)
        for k in primary:
            self.model[k].live = False
        self.drop_unreachable(hold)
        freed = {k for k in victims if k not in self.model}
        kinds = {(e.entry.row, e.entry.digest, e.entry.fingerprint): e.kind for e in result.evicted}
        assert {k for k, kind in kinds.items() if kind is EvictKind.FREED} == freed
        assert {k for k, kind in kinds.items() if kind is EvictKind.GHOST} == set(primary) - freed
        if found is not None and key in self.model:
            e = self.model[key]
            e.live, e.has_logits, e.value_s, e.last_used_s = True, has_logits, value_s, self.now_s
        else:
            self.model[key] = ModelEntry(row, parent, has_logits, value_s, self.now_s)
        assert (result.entry.row, result.entry.digest, result.entry.fingerprint) == key
        return key

    @rule(target=kept, data=st.data())
    def keep(self, data):
        i = data.draw(st.integers(0, len(PROMPTS) - 1), label="prompt")
        full = len(PROMPTS[i])
        rows = data.draw(st.sampled_from([full, full, data.draw(st.integers(1, full))]), label="rows")
        starts = tuple(s for s in self.starts[i] if s < rows)
        plan_rows = [k.row for k in keep_rows(PassKind.COLD, rows, starts, 0, self.cfg.with_changes(prompt_cache_bytes=1), self.facts)]
        row = data.draw(st.one_of(st.sampled_from(plan_rows), st.integers(1, rows)), label="row")
        value = data.draw(st.sampled_from([0.5, 1.0, 2.0, 3.0, 8.0]), label="value_s")
        key = self.do_keep(i, rows, row, data.draw(st.booleans(), label="logits"), value)
        return multiple() if key is None else (i, rows, row)

    @rule(state=kept, value=st.sampled_from([0.5, 4.0]), with_logits=st.booleans())
    def keep_again(self, state, value, with_logits):
        self.do_keep(*state, with_logits, value)

    @rule(data=st.data())
    def lookup(self, data):
        i = data.draw(st.integers(0, len(PROMPTS) - 1), label="prompt")
        full = len(PROMPTS[i])
        rows = data.draw(st.one_of(st.just(full), st.integers(1, full)), label="rows")
        prompt = PROMPTS[i].prefix(rows)
        starts = tuple(s for s in self.starts[i] if s < rows)
        request = Case(rows, starts, self.cfg, self.facts)
        cuts = oracle_fresh_cuts(rows, starts, self.cfg)
        best = None
        for k in self.live_keys():
            row, digest, fp = k
            if row <= rows and digest == prompt.digest(row) and fp == oracle_fingerprint(cuts, row, self.facts) \
                    and oracle_usable(request, row, self.model[k].has_logits) and (best is None or row > best[0]):
                best = k
        got = self.store.lookup(prompt, starts, self.now_s)
        got_key = None if got is None else (got.row, got.digest, got.fingerprint)
        assert got_key == best, f"lookup {got_key}, longest usable {best}"
        if best is not None:
            self.model[best].last_used_s = self.now_s

    def unpinned_live(self):
        return sorted(k for k in self.live_keys() if self.model[k].pins == 0)

    @precondition(lambda self: self.live_keys())
    @rule(data=st.data())
    def pin(self, data):
        key = data.draw(st.sampled_from(sorted(self.live_keys())), label="pin")
        self.store.pin(self.entry(key))
        self.model[key].pins += 1

    @precondition(lambda self: any(e.pins for e in self.model.values()))
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, e in self.model.items() if e.pins)), label="unpin")
        self.store.unpin(self.entry(key))
        self.model[key].pins -= 1

    @precondition(lambda self: self.unpinned_live())
    @rule(data=st.data())
    def evict(self, data):
        key = data.draw(st.sampled_from(self.unpinned_live()), label="evict")
        out = self.store.evict(self.entry(key))
        self.model[key].live = False
        held = set(self.model)
        self.drop_unreachable()
        freed = held - set(self.model)
        kinds = {(e.entry.row, e.entry.digest, e.entry.fingerprint): e.kind for e in out}
        assert {k for k, kind in kinds.items() if kind is EvictKind.FREED} == freed
        assert {k for k, kind in kinds.items() if kind is EvictKind.GHOST} == ({key} - freed)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 30.0, 120.0]))
    def advance(self, dt):
        self.now_s += dt

    # --- invariants ----------------------------------------------------------------------------
    @invariant()
    def matches_model(self):
        if not hasattr(self, "store"):
            return
        live = self.live_keys()
        assert self.store.bytes_used == self.model_bytes(live), (self.store.bytes_used, self.model_bytes(live))
        assert self.store.bytes_used <= self.cfg.prompt_cache_bytes, "over budget"
        held = {(e.row, e.digest, e.fingerprint): e for e in self.store.entries()}
        assert set(held) == set(self.model), "store and model hold different states"
        for k, e in held.items():
            m = self.model[k]
            assert e.live == m.live and e.pins == m.pins, k
            assert e.pins == 0 or e.live, "pinned ghost"
        assert len(self.store) == len(live)
        self.store.check()


TestStoreMachine = StoreMachine.TestCase


# --- planted wrong stores are caught --------------------------------------------------------------
class _EvictsPinned(Store):
    """Wrong: makes room as if no state were pinned (the pins come back on what survives)."""

    def _make_room(self, need, anchor, now_s):
        pinned = [(e, e.pins) for e in self.entries() if e.pins]
        for e, pins in pinned:
            for _ in range(pins):
                self.unpin(e)
        try:
            return super()._make_room(need, anchor, now_s)
        finally:
            for e, pins in pinned:
                for _ in range(pins if e.live else 0):
                    self.pin(e)


class _ForgetsSharedKV(Store):
    """Wrong: evicting a state that others extend stops counting the K/V rows they share."""

    def evict(self, entry):
        out = super().evict(entry)
        if any(e.entry is entry and e.kind is EvictKind.GHOST for e in out):
            self.bytes_used -= entry.own_rows * self.shape.row_bytes
        return out

    def check(self) -> None:
        pass


class _NoBudget(Store):
    """Wrong: never evicts and never refuses."""

    def _make_room(self, need, anchor, now_s):
        return []

    def check(self) -> None:
        pass


class _ShortestLookup(Store):
    """Wrong: returns the shortest usable kept state (marked used as the real lookup does)."""

    def lookup(self, prompt, starts, now_s):
        cuts = fresh_cuts(len(prompt), starts, self.cfg)
        for e in self.entries():
            if e.live and e.row <= len(prompt) and e.digest == prompt.digest(e.row) \
                    and e.fingerprint == cut_fingerprint(cuts, e.row, self.facts) \
                    and is_usable(e.row, len(prompt), starts, self.cfg, self.facts, has_logits=e.has_logits):
                self.keep(e.prompt, e.row, e.fingerprint, has_logits=False, value_s=0.0, now_s=now_s)
                return e
        return None


class _SharesWithoutCut(Store):
    """Wrong (the code before the fix): shares K/V with a kept prefix at a row the pass did
    not cut at, whose rows it computed in a chunk that crossed that row."""

    def _parent_for(self, prompt, row, fingerprint):
        for r in sorted((r for r in self._by_row if r < row), reverse=True):
            fp = tuple(c for c in fingerprint if c < r)
            for entry in self._by_row[r].values():
                if entry.digest == prompt.digest(r) and entry.fingerprint == fp:
                    return entry
        return None


class _OldestFirst(Store):
    """Wrong: evicts the oldest state first, whatever its value per byte."""

    def _make_room(self, need, anchor, now_s):
        if self.bytes_used + need <= self.budget_bytes:
            return []
        pinned = [e for e in self.entries() if e.live and e.pins]
        held, todo = set(), [*pinned, *([anchor] if anchor else [])]
        while todo:
            e = todo.pop()
            if e is not None and id(e) not in held:
                held.add(id(e))
                todo.append(e.parent)
        keep_bytes = len(pinned) * self.shape.fixed_bytes + self.shape.row_bytes * sum(
            e.own_rows for e in self.entries() if id(e) in held)
        if keep_bytes + need > self.budget_bytes:
            return None
        out = []
        for e in sorted((e for e in self.entries() if e.live and not e.pins), key=lambda e: e.id):
            if self.bytes_used + need <= self.budget_bytes:
                break
            out.extend(self.evict(e))
        return out


def _machine_with(make):
    class Planted(StoreMachine):
        def make_store(self, shape, cfg, facts):
            return make(shape, cfg, facts)

    return Planted


def _assert_machine_caught(make) -> None:
    try:
        run_state_machine_as_test(_machine_with(make), settings=CONTROL)
    except AssertionError:
        return
    raise AssertionError("the state machine did not catch the planted store")


def test_catches_a_store_that_evicts_pinned_states():
    _assert_machine_caught(_EvictsPinned)


def test_catches_a_store_that_forgets_shared_kv():
    _assert_machine_caught(_ForgetsSharedKV)


def test_catches_a_store_over_budget():
    _assert_machine_caught(_NoBudget)


def test_catches_a_lookup_that_is_not_the_longest():
    _assert_machine_caught(_ShortestLookup)


def test_catches_sharing_kv_at_a_row_the_pass_did_not_cut():
    _assert_machine_caught(_SharesWithoutCut)


def test_catches_oldest_first_eviction():
    _assert_machine_caught(_OldestFirst)
