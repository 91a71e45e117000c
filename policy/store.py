"""The prompt-cache index (DESIGN rules 3-5): kept states, their bytes, pins, lookup, eviction.

Payloads are opaque handles owned by the caller (GPU buffers in the executor, None in the
simulator). K/V rows are shared along a prefix chain: a state holds its recurrent and
conv tensors plus only the K/V rows above its nearest kept prefix (its parent). Evicting a
state that others extend frees its fixed part and leaves a *ghost* holding the shared rows,
freed when nothing extends it any more.
"""

from __future__ import annotations

import bisect
import enum
from typing import Any, Iterator

import attrs

from policy.config import PolicyConfig
from policy.plan import fresh_cuts
from policy.prefix import Prompt
from policy.shape import ModelShape
from policy.usable import BackendFacts, Fingerprint, cut_fingerprint, is_usable


class EvictKind(enum.Enum):
    """GHOST: fixed part freed, shared K/V rows stay for longer states. FREED: all gone."""

    GHOST = "ghost"
    FREED = "freed"


@attrs.define(eq=False)
class Entry:
    """One kept state (mutable bookkeeping owned by the Store; read it, do not write it).

    id: store-unique, increasing. row: rows [0, row) it holds. digest: Prompt.digest(row).
    fingerprint: cut_fingerprint of the pass that made it. has_logits: last-row logits kept.
    parent: nearest kept prefix whose K/V rows it shares, or None. own_rows: K/V rows it
    holds itself (row - parent.row). value_s: prefill seconds it saves. last_used_s: clock
    of the last keep or lookup. pins: passes using it. live: False once a ghost.
    payload: the caller's handle.
    """

    id: int
    row: int
    digest: bytes
    fingerprint: Fingerprint
    has_logits: bool
    prompt: Prompt
    parent: Entry | None
    own_rows: int
    value_s: float
    last_used_s: float
    children: int = 0
    pins: int = 0
    live: bool = True
    payload: Any = None

    @property
    def key(self) -> tuple[bytes, Fingerprint, bool]:
        """What makes two kept states at one row the same state."""
        return (self.digest, self.fingerprint, self.has_logits)


@attrs.frozen
class Eviction:
    """One entry the store let go, and how (EvictKind)."""

    entry: Entry
    kind: EvictKind


@attrs.frozen
class KeepResult:
    """Outcome of Store.keep: the entry (None when refused), evictions made, and why."""

    entry: Entry | None
    evicted: tuple[Eviction, ...]
    reason: str


class Store:
    """Prompt-cache index under a byte budget (rule 4). No clock: callers pass `now_s`.

    Invariants (checked by `check`): bytes_used == sum of live fixed parts + own K/V rows of
    every live or ghost entry; bytes_used <= budget_bytes; a ghost always has children;
    pinned entries are live.
    """

    def __init__(self, shape: ModelShape, cfg: PolicyConfig, facts: BackendFacts) -> None:
        self.shape = shape
        self.cfg = cfg
        self.facts = facts
        self.budget_bytes = cfg.prompt_cache_bytes
        self.bytes_used = 0
        self.bytes_peak = 0
        self._next_id = 0
        self._by_row: dict[int, dict[tuple[bytes, Fingerprint, bool], Entry]] = {}
        self._rows: list[int] = []

    # --- reading -----------------------------------------------------------------
    def __len__(self) -> int:
        return sum(1 for e in self.entries() if e.live)

    def entries(self) -> Iterator[Entry]:
        """Every entry, live and ghost, by row then id."""
        for row in self._rows:
            yield from sorted(self._by_row[row].values(), key=lambda e: e.id)

    def entry_bytes(self, entry: Entry) -> int:
        """Bytes an entry holds itself: fixed part when live, plus its own K/V rows."""
        fixed = self.shape.fixed_bytes if entry.live else 0
        return fixed + entry.own_rows * self.shape.row_bytes

    def find(self, prompt: Prompt, row: int, fingerprint: Fingerprint, has_logits: bool) -> Entry | None:
        """The entry (live or ghost) for exactly this state, or None."""
        return self._by_row.get(row, {}).get((prompt.digest(row), fingerprint, has_logits))

    def lookup(self, prompt: Prompt, starts: tuple[int, ...], now_s: float) -> Entry | None:
        """Rule 5: the longest live kept state usable by a request for `prompt`, or None.

        Candidates are the rows the store holds, longest first; a candidate counts when its
        digest equals prompt.digest(row), its fingerprint equals the request's fresh-plan
        fingerprint at that row, and `is_usable` (rule 2) holds. Marks it used at now_s.
        """
        if not self.cfg.cache_enabled:
            return None
        rows_l = len(prompt)
        cuts = fresh_cuts(rows_l, starts, self.cfg)
        hi = bisect.bisect_right(self._rows, rows_l)
        for row in reversed(self._rows[:hi]):
            bucket = self._by_row[row]
            digest = prompt.digest(row)
            fp = cut_fingerprint(cuts, row, self.facts)
            for has_logits in (True, False) if row == rows_l else (False,):
                entry = bucket.get((digest, fp, has_logits))
                if entry is None or not entry.live:
                    continue
                if is_usable(row, rows_l, starts, self.cfg, self.facts, has_logits=has_logits):
                    entry.last_used_s = now_s
                    return entry
        return None

    # --- pins --------------------------------------------------------------------
    def pin(self, entry: Entry) -> None:
        """Mark a live entry in use by a running pass; pinned entries are never evicted."""
        assert entry.live, "pinning a ghost"
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        """Release one pin."""
        assert entry.pins > 0, "unpin without pin"
        entry.pins -= 1

    # --- keeping -------------------------------------------------------------------
    def keep(
        self,
        prompt: Prompt,
        row: int,
        fingerprint: Fingerprint,
        *,
        has_logits: bool,
        value_s: float,
        now_s: float,
    ) -> KeepResult:
        """Keep the state at `row` of `prompt` (rule 3), evicting by rule 4 to make room.

        Returns the entry (existing or new) with the evictions made; entry None and no
        eviction when the cache is off or the state cannot fit even after evicting every
        unpinned entry. value_s: prefill seconds the state saves (its eviction value).
        """
        if not self.cfg.cache_enabled:
            return KeepResult(None, (), "cache_off")
        if not 0 < row <= len(prompt):
            raise ValueError(f"row {row} outside (0, {len(prompt)}]")
        digest = prompt.digest(row)
        found = self._by_row.get(row, {}).get((digest, fingerprint, has_logits))
        if found is not None and found.live:
            found.last_used_s = now_s
            found.value_s = max(found.value_s, value_s)
            return KeepResult(found, (), "already_kept")
        parent = found.parent if found is not None else self._parent_for(prompt, row, fingerprint)
        own_rows = 0 if found is not None else row - (parent.row if parent else 0)
        need = self.shape.fixed_bytes + own_rows * self.shape.row_bytes
        # A virtual child keeps the parent (or the ghost being revived) from being freed
        # while room is made: it may lose its fixed part, never the rows this state shares.
        anchor = found if found is not None else parent
        if anchor is not None:
            anchor.children += 1
        evicted = self._make_room(need, anchor, now_s)
        if anchor is not None:
            anchor.children -= 1
        if evicted is None:
            return KeepResult(None, (), "over_budget")
        if found is not None:
            found.live = True
            found.value_s, found.last_used_s = value_s, now_s
            self.bytes_used += self.shape.fixed_bytes
            entry = found
        else:
            entry = Entry(
                self._next_id, row, digest, fingerprint, has_logits, prompt, parent,
                own_rows, value_s, now_s,
            )
            self._next_id += 1
            if parent is not None:
                parent.children += 1
            bucket = self._by_row.setdefault(row, {})
            if not bucket:
                bisect.insort(self._rows, row)
            bucket[entry.key] = entry
            self.bytes_used += need
        self.bytes_peak = max(self.bytes_peak, self.bytes_used)
        return KeepResult(entry, tuple(evicted), "kept")

    def evict(self, entry: Entry) -> tuple[Eviction, ...]:
        """Evict one live, unpinned entry now; returns what was let go (it and freed ghosts)."""
        assert entry.live and entry.pins == 0, "evicting a pinned or ghost entry"
        out: list[Eviction] = []
        self.bytes_used -= self.shape.fixed_bytes
        entry.live = False
        node: Entry | None = entry
        while node is not None and not node.live and node.children == 0:
            self.bytes_used -= node.own_rows * self.shape.row_bytes
            self._drop(node)
            out.append(Eviction(node, EvictKind.FREED))
            parent = node.parent
            if parent is not None:
                parent.children -= 1
            node = parent
        if entry.children > 0:
            out.insert(0, Eviction(entry, EvictKind.GHOST))
        return tuple(out)

    def score(self, entry: Entry, now_s: float) -> float:
        """Value per byte freed, decayed by idle time: value_s * 0.5**(idle/half_life) / bytes."""
        half = self.cfg.idle_half_life_s
        idle = max(0.0, now_s - entry.last_used_s)
        decay = 0.5 ** (idle / half) if half > 0 else (1.0 if idle == 0 else 0.0)
        return entry.value_s * decay / max(1, self._freed_bytes(entry))

    def check(self) -> None:
        """Assert the store's invariants (see the class docstring)."""
        total = 0
        kids: dict[int, int] = {}
        for e in self.entries():
            total += self.entry_bytes(e)
            assert e.live or e.children > 0, f"ghost {e.id} without children"
            assert e.pins == 0 or e.live, f"pinned ghost {e.id}"
            if e.parent is not None:
                kids[e.parent.id] = kids.get(e.parent.id, 0) + 1
                assert e.own_rows == e.row - e.parent.row
        for e in self.entries():
            assert kids.get(e.id, 0) == e.children, f"children count of {e.id}"
        assert total == self.bytes_used, f"bytes {self.bytes_used} != {total}"
        assert self.bytes_used <= self.budget_bytes, "over budget"

    # --- internals -------------------------------------------------------------------
    def _parent_for(self, prompt: Prompt, row: int, fingerprint: Fingerprint) -> Entry | None:
        """Nearest kept prefix whose K/V rows [0, r) have this state's bits: same tokens,
        same cuts below r, and r a cut of this state's pass (or on the invariant grid);
        without that cut the pass computed rows near r in a chunk that crossed r."""
        g = self.facts.invariant_rows
        hi = bisect.bisect_left(self._rows, row)
        for r in reversed(self._rows[:hi]):
            if r not in fingerprint and (g is None or r % g != 0):
                continue
            digest = prompt.digest(r)
            fp = tuple(c for c in fingerprint if c < r)
            for entry in self._by_row[r].values():
                if entry.digest == digest and entry.fingerprint == fp:
                    return entry
        return None

    def _freed_bytes(self, entry: Entry) -> int:
        freed = self.shape.fixed_bytes
        if entry.children:
            return freed
        freed += entry.own_rows * self.shape.row_bytes
        node = entry.parent
        while node is not None and not node.live and node.children == 1:
            freed += node.own_rows * self.shape.row_bytes
            node = node.parent
        return freed

    def _make_room(self, need: int, anchor: Entry | None, now_s: float) -> list[Eviction] | None:
        if need > self.budget_bytes:
            return None
        if self.bytes_used + need <= self.budget_bytes:
            return []
        candidates = [e for e in self.entries() if e.live and e.pins == 0]
        if not self._fits_after_all(candidates, anchor, need):
            return None
        candidates.sort(key=lambda e: (self.score(e, now_s), e.id))
        out: list[Eviction] = []
        for e in candidates:
            if self.bytes_used + need <= self.budget_bytes:
                break
            out.extend(self.evict(e))
        assert self.bytes_used + need <= self.budget_bytes, "room check and eviction disagree"
        return out

    def _fits_after_all(self, candidates: list[Entry], anchor: Entry | None, need: int) -> bool:
        """Would `need` bytes fit once every candidate is evicted (pins and anchor stay)?"""
        doomed = {e.id for e in candidates}
        survivors: dict[int, Entry] = {}
        seeds = [e for e in self.entries() if e.live and e.id not in doomed]
        if anchor is not None:
            seeds.append(anchor)
        for e in seeds:
            node: Entry | None = e
            while node is not None and node.id not in survivors:
                survivors[node.id] = node
                node = node.parent
        remaining = sum(e.own_rows * self.shape.row_bytes for e in survivors.values())
        remaining += sum(self.shape.fixed_bytes for e in survivors.values() if e.live and e.id not in doomed)
        return remaining + need <= self.budget_bytes

    def _drop(self, entry: Entry) -> None:
        bucket = self._by_row[entry.row]
        del bucket[entry.key]
        if not bucket:
            del self._by_row[entry.row]
            self._rows.pop(bisect.bisect_left(self._rows, entry.row))
