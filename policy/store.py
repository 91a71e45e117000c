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
import heapq
import math
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
    kids: set = attrs.field(factory=set, repr=False)
    pins: int = 0
    live: bool = True
    payload: Any = None
    version: int = 0

    @property
    def key(self) -> tuple[bytes, Fingerprint]:
        """What makes two kept states at one row the same state (logits are an extra)."""
        return (self.digest, self.fingerprint)


@attrs.frozen
class Eviction:
    """One entry the store let go, how (EvictKind), and the bytes that freed."""

    entry: Entry
    kind: EvictKind
    bytes: int


class Copy(enum.Enum):
    """What the executor copies for a keep (`KeepCopy`).

    NOTHING: the state is kept already (with logits, when they are asked for).
    LOGITS: a live entry only gains its last row's logits.
    FIXED: a ghost comes back: its fixed part (recurrent matrices, conv tails, logits); it
    still holds its own K/V rows.
    STATE: a new entry: the fixed part and the K/V rows [base.row, row) (from 0 without a base).
    """

    NOTHING = "nothing"
    LOGITS = "logits"
    FIXED = "fixed"
    STATE = "state"


@attrs.frozen
class KeepCopy:
    """The copy a keep at `row` makes (Store.keep_copy), decided before the chunk runs so the
    executor snapshots only what the store will count (DESIGN rule 3).

    base: the entry whose payload the kept state's payload builds on: its parent for STATE
    (None from row 0), the entry itself for LOGITS and FIXED, None for NOTHING.
    """

    copy: Copy
    row: int
    base: Entry | None = None

    @property
    def kv_from(self) -> int:
        """First K/V row the copy holds: base.row (0 without a base) for STATE, else row."""
        if self.copy is Copy.STATE:
            return self.base.row if self.base is not None else 0
        return self.row

    def bytes(self, shape: ModelShape) -> int:
        """Bytes the copy moves on the device: fixed part + (row - kv_from) K/V rows for
        STATE, the fixed part for FIXED, 0 for LOGITS (host logits) and NOTHING."""
        if self.copy is Copy.STATE:
            return shape.fixed_bytes + (self.row - self.kv_from) * shape.row_bytes
        return shape.fixed_bytes if self.copy is Copy.FIXED else 0


@attrs.frozen
class KeepResult:
    """Outcome of Store.keep: the entry (None when refused), evictions made, why, and the
    bytes the keep added to bytes_used (fixed part + own rows for a new entry, the fixed
    part for a revived ghost, 0 otherwise)."""

    entry: Entry | None
    evicted: tuple[Eviction, ...]
    reason: str
    added_bytes: int = 0


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
        self._by_row: dict[int, dict[tuple[bytes, Fingerprint], Entry]] = {}
        self._rows: list[int] = []
        self._fixed = shape.fixed_bytes
        self._row_bytes = shape.row_bytes
        self._live = 0
        self._pinned: dict[int, Entry] = {}
        # Eviction order as a lazy heap of (rank, id, version): a stale version is skipped.
        self._heap: list[tuple[float, int, int]] = []
        self._by_id: dict[int, Entry] = {}

    # --- reading -----------------------------------------------------------------
    def __len__(self) -> int:
        """Live (resumable) entries."""
        return self._live

    def entries(self) -> Iterator[Entry]:
        """Every entry, live and ghost, by row then id."""
        for row in self._rows:
            yield from self._by_row[row].values()

    def entry_bytes(self, entry: Entry) -> int:
        """Bytes an entry holds itself: fixed part when live, plus its own K/V rows."""
        return (self._fixed if entry.live else 0) + entry.own_rows * self._row_bytes

    def find(self, prompt: Prompt, row: int, fingerprint: Fingerprint, has_logits: bool = False) -> Entry | None:
        """The entry (live or ghost) for this state, or None; with `has_logits`, only one that kept them."""
        entry = self._by_row.get(row, {}).get((prompt.digest(row), fingerprint))
        if entry is None or (has_logits and not entry.has_logits):
            return None
        return entry

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
        g = self.facts.invariant_rows
        usable_rows = len(cuts) + 1 + (rows_l // g if g else 0)
        if usable_rows < hi:
            rows = set(cuts) | {rows_l} | (set(range(g, rows_l, g)) if g else set())
            candidates = sorted((r for r in rows if r in self._by_row), reverse=True)
        else:
            candidates = list(reversed(self._rows[:hi]))
        for row in candidates:
            bucket = self._by_row[row]
            digest = prompt.digest(row)
            fp = cut_fingerprint(cuts, row, self.facts)
            entry = bucket.get((digest, fp))
            if entry is None or not entry.live:
                continue
            if is_usable(row, rows_l, starts, self.cfg, self.facts, has_logits=entry.has_logits):
                entry.last_used_s = now_s
                self._rank(entry)
                return entry
        return None

    # --- pins --------------------------------------------------------------------
    def pin(self, entry: Entry) -> None:
        """Mark a live entry in use by a running pass; pinned entries are never evicted."""
        assert entry.live, "pinning a ghost"
        entry.pins += 1
        self._pinned[entry.id] = entry

    def unpin(self, entry: Entry) -> None:
        """Release one pin."""
        assert entry.pins > 0, "unpin without pin"
        entry.pins -= 1
        if entry.pins == 0:
            del self._pinned[entry.id]

    # --- keeping -------------------------------------------------------------------
    def keep_copy(self, prompt: Prompt, row: int, fingerprint: Fingerprint, *, has_logits: bool) -> KeepCopy:
        """What `keep` with these arguments would copy if it kept the state now (it may still
        refuse: over budget). The store's tree does not change between a step's plan and its
        commit, so the scheduler plans the snapshot with this and `keep` then agrees."""
        if not self.cfg.cache_enabled:
            return KeepCopy(Copy.NOTHING, row)
        return self._plan_keep(prompt, row, fingerprint, has_logits)[1]

    def _plan_keep(self, prompt: Prompt, row: int, fingerprint: Fingerprint,
                   has_logits: bool) -> tuple[Entry | None, KeepCopy]:
        """(the entry already at this state's key, live or ghost, or None; the KeepCopy)."""
        found = self._by_row.get(row, {}).get((prompt.digest(row), fingerprint))
        if found is not None and found.live:
            if found.has_logits or not has_logits:
                return found, KeepCopy(Copy.NOTHING, row)
            return found, KeepCopy(Copy.LOGITS, row, found)
        if found is not None:
            return found, KeepCopy(Copy.FIXED, row, found)
        return None, KeepCopy(Copy.STATE, row, self._parent_for(prompt, row, fingerprint))

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

        Returns the entry (existing or new) with the evictions made and a reason: "kept" (a
        new entry), "revived" (a ghost holds its fixed part again), "logits_added",
        "already_kept"; entry None and no eviction when the cache is off ("cache_off") or
        the state cannot fit even after evicting every unpinned entry ("over_budget").
        value_s: prefill seconds the state saves (its eviction value). What the executor
        copies for each reason: `keep_copy`.
        """
        if not self.cfg.cache_enabled:
            return KeepResult(None, (), "cache_off")
        if not 0 < row <= len(prompt):
            raise ValueError(f"row {row} outside (0, {len(prompt)}]")
        found, plan = self._plan_keep(prompt, row, fingerprint, has_logits)
        if plan.copy in (Copy.NOTHING, Copy.LOGITS):
            assert found is not None
            found.has_logits |= plan.copy is Copy.LOGITS
            found.last_used_s = now_s
            found.value_s = max(found.value_s, value_s)
            self._rank(found)
            return KeepResult(found, (), "already_kept" if plan.copy is Copy.NOTHING else "logits_added")
        parent = found.parent if found is not None else plan.base
        own_rows = 0 if found is not None else plan.row - plan.kv_from
        need = self._fixed + own_rows * self._row_bytes
        # A virtual child keeps the parent (or the ghost being revived) from being freed
        # while room is made: it may lose its fixed part, never the rows this state shares.
        anchor = found if found is not None else parent
        if anchor is not None:
            anchor.children += 1
            self._refresh(anchor)  # evicting it (or a state below it) frees less now
        evicted = self._make_room(need, anchor, now_s)
        if anchor is not None:
            anchor.children -= 1
            self._refresh(anchor)
        if evicted is None:
            return KeepResult(None, (), "over_budget")
        if found is not None:
            found.live = True
            found.has_logits = has_logits
            found.value_s, found.last_used_s = value_s, now_s
            self.bytes_used += self._fixed
            self._live += 1
            entry = found
        else:
            entry = Entry(
                self._next_id, row, prompt.digest(row), fingerprint, has_logits, prompt, parent,
                own_rows, value_s, now_s,
            )
            self._next_id += 1
            if parent is not None:
                parent.children += 1
                parent.kids.add(entry)
            bucket = self._by_row.setdefault(row, {})
            if not bucket:
                bisect.insort(self._rows, row)
            bucket[entry.key] = entry
            self._by_id[entry.id] = entry
            self.bytes_used += need
            self._live += 1
            if parent is not None:
                self._refresh(parent)
        self._refresh(entry, revived=found is not None)  # a revived ghost ends the ghost chains below it
        self.bytes_peak = max(self.bytes_peak, self.bytes_used)
        return KeepResult(entry, tuple(evicted), "revived" if found is not None else "kept", need)

    def drop_logits(self, entry: Entry) -> None:
        """A live entry no longer holds its last row's logits (an executor could not add
        them: see `Scheduler.unkeep`); nothing else about it changes."""
        assert entry.live, "dropping the logits of a ghost"
        entry.has_logits = False

    def evict(self, entry: Entry) -> tuple[Eviction, ...]:
        """Evict one live, unpinned entry now; returns what was let go (it and freed ghosts)."""
        assert entry.live and entry.pins == 0, "evicting a pinned or ghost entry"
        out: list[Eviction] = []
        self.bytes_used -= self._fixed
        self._live -= 1
        entry.live = False
        entry.version += 1
        node: Entry | None = entry
        while node is not None and not node.live and node.children == 0:
            freed = node.own_rows * self._row_bytes + (self._fixed if node is entry else 0)
            self.bytes_used -= node.own_rows * self._row_bytes
            self._drop(node)
            out.append(Eviction(node, EvictKind.FREED, freed))
            parent = node.parent
            if parent is not None:
                parent.children -= 1
                parent.kids.discard(node)
            node = parent
        if node is not None:
            self._refresh(node)
        if entry.children > 0:
            out.insert(0, Eviction(entry, EvictKind.GHOST, self._fixed))
        return tuple(out)

    def _refresh(self, node: Entry, revived: bool = False) -> None:
        """Re-rank `node` and every live entry whose freed bytes run through it: the
        entries below it reached through ghosts (a leaf's eviction also frees the ghosts
        above it that have no other child). A state's freed bytes walk up through ghosts
        only, so below a live `node` nothing changes unless it was a ghost until now
        (`revived`: the chains that ran through it end there): the states kept under one
        live prefix (a system prompt's hundreds of first turns) are not re-ranked on every
        keep beside them."""
        self._rank(node)
        if node.live and not revived:
            return
        stack = list(node.kids)
        while stack:
            kid = stack.pop()
            self._rank(kid)
            if not kid.live:
                stack.extend(kid.kids)

    def score(self, entry: Entry, now_s: float) -> float:
        """Value per byte freed, decayed by idle time: value_s * 0.5**(idle/half_life) / bytes.

        Eviction takes the lowest score first. Every entry decays by the same factor per
        second, so the order never changes with `now_s` alone: the store keeps it in a heap
        ranked by log2(value_s / bytes) + last_used_s / half_life.
        """
        idle = max(0.0, now_s - entry.last_used_s)
        return entry.value_s * 0.5 ** (idle / self.cfg.idle_half_life_s) / max(1, self._freed_bytes(entry))

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
        rows = set(fingerprint) | (set(range(g, row, g)) if g else set())
        for r in sorted((r for r in rows if r < row and r in self._by_row), reverse=True):
            digest = prompt.digest(r)
            fp = tuple(c for c in fingerprint if c < r)
            for entry in self._by_row[r].values():
                if entry.digest == digest and entry.fingerprint == fp:
                    return entry
        return None

    def _freed_bytes(self, entry: Entry) -> int:
        freed = self._fixed
        if entry.children:
            return freed
        freed += entry.own_rows * self._row_bytes
        node = entry.parent
        while node is not None and not node.live and node.children == 1:
            freed += node.own_rows * self._row_bytes
            node = node.parent
        return freed

    def _rank(self, entry: Entry) -> None:
        """Push `entry`'s current eviction rank (older pushes of it go stale)."""
        entry.version += 1
        if entry.live:
            rank = math.log2(max(entry.value_s, 1e-300) / max(1, self._freed_bytes(entry))) \
                + entry.last_used_s / self.cfg.idle_half_life_s
            heapq.heappush(self._heap, (rank, entry.id, entry.version))

    def _make_room(self, need: int, anchor: Entry | None, now_s: float) -> list[Eviction] | None:
        if need > self.budget_bytes:
            return None
        if self.bytes_used + need <= self.budget_bytes:
            return []
        if not self._fits_after_all(anchor, need):
            return None
        out: list[Eviction] = []
        held: list[tuple[float, int, int]] = []
        while self.bytes_used + need > self.budget_bytes:
            item = heapq.heappop(self._heap)
            e = self._by_id.get(item[1])
            if e is None or not e.live or e.version != item[2]:
                continue
            if e.pins:
                held.append(item)
                continue
            out.extend(self.evict(e))
        for item in held:
            heapq.heappush(self._heap, item)
        if len(self._heap) > 4 * len(self._by_id) + 64:
            self._heap = [(r, i, v) for r, i, v in self._heap
                          if (e := self._by_id.get(i)) is not None and e.live and e.version == v]
            heapq.heapify(self._heap)
        return out

    def _fits_after_all(self, anchor: Entry | None, need: int) -> bool:
        """Would `need` bytes fit once every unpinned entry is evicted (pins and anchor stay)?"""
        survivors: dict[int, Entry] = {}
        seeds = list(self._pinned.values()) + ([anchor] if anchor is not None else [])
        for e in seeds:
            node: Entry | None = e
            while node is not None and node.id not in survivors:
                survivors[node.id] = node
                node = node.parent
        remaining = sum(e.own_rows * self._row_bytes for e in survivors.values())
        remaining += self._fixed * sum(1 for e in survivors.values() if e.pins > 0)
        return remaining + need <= self.budget_bytes

    def _drop(self, entry: Entry) -> None:
        bucket = self._by_row[entry.row]
        del bucket[entry.key]
        del self._by_id[entry.id]
        if not bucket:
            del self._by_row[entry.row]
            self._rows.pop(bisect.bisect_left(self._rows, entry.row))
