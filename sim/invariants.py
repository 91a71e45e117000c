"""Invariants of DESIGN rules 1-8, checked on every event and step of a simulated run.

A broken invariant raises `InvariantBroken` naming the rule, the request and the events
that led to it; the CLI turns that into a non-zero exit.
"""

from __future__ import annotations

from collections import deque

from policy import events as ev
from policy.config import PolicyConfig
from policy.plan import check_starts, plan_chunks
from policy.scheduler import Scheduler
from policy.work import Evicted, Kept, Request, Step
from policy.keep import PassKind, keep_rows
from policy.usable import BackendFacts, KeptRow, is_usable, resume_row, snap_starts


class InvariantBroken(AssertionError):
    """A policy invariant failed; `rule`, `request` and the recent `events` say where."""

    def __init__(self, rule: str, message: str, request: str | None, recent: list[ev.Event]) -> None:
        self.rule, self.request, self.recent = rule, request, recent
        lines = [f"invariant broken: {rule}: {message}", f"request: {request}", "events leading to it:"]
        lines += [f"  {ev.event_dict(e)}" for e in recent]
        super().__init__("\n".join(lines))


class _Req:
    __slots__ = ("req", "cached", "chunks", "warm_chunks_waited", "started", "finished", "arrived")

    def __init__(self, req: Request | None, arrived: float) -> None:
        self.req = req
        self.arrived = arrived
        self.cached: int | None = None
        self.chunks: list[tuple[int, int]] = []
        self.warm_chunks_waited = 0
        self.started = False
        self.finished: str | None = None


class Checker:
    """Checks invariants as events arrive (`event`) and after each step (`step`).

    requests: the Request objects by id (the checker needs prompts and starts to rebuild
    fresh plans). history: how many recent events an error report shows.
    """

    def __init__(self, cfg: PolicyConfig, facts: BackendFacts, requests: dict[str, Request],
                 history: int = 40) -> None:
        self.cfg, self.facts, self.requests = cfg, facts, requests
        self._recent: deque[ev.Event] = deque(maxlen=history)
        self._reqs: dict[str, _Req] = {}
        self._waiting: dict[str, _Req] = {}
        self._stream_req: dict[int, _Req] = {}
        self.store = None
        self._warm_running_chunk = False
        self.events = 0
        self._changes = 0
        self._store = None

    def fail(self, rule: str, message: str, request: str | None) -> None:
        raise InvariantBroken(rule, message, request, list(self._recent))

    def event(self, e: ev.Event) -> None:
        """Feed one trace event (in emission order)."""
        self._recent.append(e)
        self.events += 1
        if isinstance(e, ev.RequestArrived):
            r = self._reqs[e.request] = _Req(self.requests.get(e.request), e.t)
            r.warm_chunks_waited = 1 if self._warm_running_chunk else 0
            self._waiting[e.request] = r
        elif isinstance(e, ev.RequestAdmitted):
            r = self._reqs[e.request]
            r.cached = e.cached_tokens
            req = r.req
            if e.cached_tokens > e.rows:
                self.fail("cached_tokens<=rows", f"cached_tokens {e.cached_tokens} > rows {e.rows}", e.request)
            if req is not None and e.cached_tokens > 0:
                starts = snap_starts(check_starts(len(req.prompt), req.starts), self.cfg, self.facts)
                usable = is_usable(e.cached_tokens, len(req.prompt), starts, self.cfg, self.facts,
                                   has_logits=e.cached_tokens == len(req.prompt))
                if not usable:
                    self.fail("rule 2 (usable)", f"resumed at row {e.cached_tokens}, not usable", e.request)
            if req is not None:
                self._stream_req[e.stream] = r
                self._check_longest(req, e)
        elif isinstance(e, ev.StateKept):
            r = self._stream_req.get(e.stream)
            if r is not None and r.req is not None and r.cached is not None and r.finished is None:
                req = r.req
                starts = snap_starts(req.starts, self.cfg, self.facts)
                keeps = keep_rows(PassKind.COLD, len(req.prompt), starts, r.cached, self.cfg, self.facts)
                rows = {k.row for k in keeps}
                if e.row not in rows:
                    self.fail("rule 3 (keep)", f"kept row {e.row}; the pass keeps only {sorted(rows)[:8]}",
                              req.id)
        elif isinstance(e, ev.ChunkDone):
            if e.pass_kind == "warm":
                self._warm_running_chunk = False
        elif isinstance(e, ev.ChunkStarted):
            if e.pass_kind == "warm":
                self._warm_running_chunk = True
                for rid, r in self._waiting.items():
                    if r.finished is None and not r.started:
                        r.warm_chunks_waited += 1
                        if r.warm_chunks_waited > 1:
                            self.fail("rule 6 (a warm pass delays foreground work by at most one chunk)",
                                      f"warm chunk [{e.start}, {e.end}) started while it waited", rid)
            elif e.request is not None:
                r = self._reqs[e.request]
                r.started = True
                self._waiting.pop(e.request, None)
                r.chunks.append((e.start, e.end))
                self._check_tail(e)
        elif isinstance(e, ev.FirstToken):
            self._reqs[e.request].started = True
            self._waiting.pop(e.request, None)
        elif isinstance(e, ev.RequestFinished):
            r = self._reqs.get(e.request)
            if r is None:
                self.fail("finish", "finished a request that never arrived", e.request)
            r.finished = e.reason
            r.started = True
            self._waiting.pop(e.request, None)
            if e.cached_tokens > e.rows:
                self.fail("cached_tokens<=rows", f"{e.cached_tokens} > {e.rows}", e.request)
            if r.req is not None and r.req.max_tokens == 0 and e.reason not in ("length", "cancelled"):
                self.fail("rule 7 (prefill-only)", f"finish_reason {e.reason!r}", e.request)
            if r.req is not None and r.cached is not None and e.reason != "cancelled":
                self._check_plan(r)
        elif isinstance(e, ev.RequestRejected):
            self._reqs[e.request].finished = "rejected"
            self._waiting.pop(e.request, None)

    def step(self, step: Step, sched: Scheduler, effects: list[object]) -> None:
        """After each committed step: no pinned eviction and the budget, every step; the
        store's full accounting (O(entries)) after every change while it holds under 256
        entries, after every 1024th change above that, and at `finish`."""
        self.effects(effects)
        store = sched.store
        self._store = store
        if store.bytes_used > store.budget_bytes:
            self.fail("rule 4 (budget)", f"store holds {store.bytes_used} > {store.budget_bytes} bytes", None)
        if any(isinstance(e, (Kept, Evicted)) for e in effects):
            self._changes += 1
            if len(store) < 256 or self._changes % 1024 == 0:
                self._check_store(store)

    def _check_store(self, store) -> None:
        try:
            store.check()
        except AssertionError as err:
            self.fail("rule 4 (store accounting)", str(err), None)

    def effects(self, effects: list[object]) -> None:
        """Effects of a commit: evictions must never touch a pinned state."""
        for e in effects:
            if isinstance(e, Evicted) and e.entry.pins > 0:
                self.fail("rule 4 (no pinned eviction)", f"evicted pinned entry {e.entry.id}", None)

    def finish(self) -> None:
        """At the end of the run: every arrived request finished or was rejected, with a reason."""
        for rid, r in self._reqs.items():
            if r.finished is None:
                self.fail("every request ends", "request never finished", rid)
        if self._store is not None:
            self._check_store(self._store)

    def _check_longest(self, req: Request, e: ev.RequestAdmitted) -> None:
        """Rule 5 by brute force over every live kept state (while the store is small)."""
        store = self.store
        if store is None or len(store) > 512:
            return
        L = len(req.prompt)
        kept = [KeptRow(x.row, x.fingerprint, x.has_logits) for x in store.entries()
                if x.live and x.row <= L and x.digest == req.prompt.digest(x.row)]
        best = resume_row(L, snap_starts(req.starts, self.cfg, self.facts), self.cfg, self.facts, kept)
        if e.source == "warm" and e.cached_tokens >= best:
            return
        if e.cached_tokens != best:
            self.fail("rule 5 (longest usable)", f"resumed at {e.cached_tokens}, longest usable is {best}", req.id)

    def _check_plan(self, r: _Req) -> None:
        req = r.req
        assert req is not None and r.cached is not None
        starts = snap_starts(req.starts, self.cfg, self.facts)
        want = [(c.start, c.end) for c in plan_chunks(len(req.prompt), starts, r.cached, self.cfg)]
        if r.chunks != want:
            self.fail("rule 1 (plan consistency)",
                      f"ran chunks {r.chunks[:8]} but the fresh plan from row {r.cached} is {want[:8]}",
                      req.id)

    def _check_tail(self, e: ev.ChunkStarted) -> None:
        if e.tail_from is None or e.tail_from == e.end:
            return
        rows = e.end - e.start
        if rows <= self.cfg.tail_rows or e.end - e.tail_from != self.cfg.tail_rows:
            self.fail("rule 8 (tail)", f"tail from {e.tail_from} on chunk [{e.start}, {e.end})", e.request)
