"""Compare a server trace and a simulator trace of one workload, request by request.

Both traces are `policy.events` JSONL (the server's `--trace` and the simulator's). Each
side's requests are keyed by (conversation, turn) of the client's plan; per request we
take cached_tokens (RequestAdmitted), TTFT (FirstToken.ttft_s), end-to-end latency
(RequestFinished.t - RequestArrived.t) and the ordered scheduling decisions of its
conversation while it was the newest turn (admission, chunks, keeps, warm passes). No I/O
beyond reading the trace files; bench/fidelity.py runs the workload and prints this.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs

from policy.shape import state_bytes

Key = tuple[str, int]
"""(client conversation id, turn index) of one request."""


def key_text(key: Key) -> str:
    """`conversation/turn`, the simulator's request id."""
    return f"{key[0]}/{key[1]}"


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The events of a JSONL trace, in file order."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def decision(e: dict[str, Any]) -> str | None:
    """One scheduling decision as comparable text (its kind first), or None for events that
    carry only timing (first_token, chunk_done) or no conversation (evictions)."""
    k = e["kind"]
    if k == "request_admitted":
        return f"admit cached={e['cached_tokens']} source={e['source']}"
    if k == "chunk_started":
        return f"chunk {e['pass_kind']} [{e['start']},{e['end']}) tail={e['tail_from']} restore={e['restore_row']}"
    if k == "state_kept":
        return f"keep {e['row']}{' logits' if e['logits'] else ''}"
    if k == "keep_refused":
        return f"keep_refused {e['row']} {e['reason']}"
    if k == "warm_scheduled":
        return f"warm_scheduled {e['rows']}"
    if k == "warm_started":
        return f"warm_started [{e['resume']},{e['end']})"
    if k in ("warm_yielded", "warm_adopted", "warm_finished"):
        return f"{k} {e['row']}"
    if k == "warm_cancelled":
        return f"warm_cancelled {e['row']} {e['reason']}"
    if k == "request_rejected":
        return f"rejected {e['reason']}"
    if k == "request_finished":
        return f"finish {e['reason']} out={e['output_rows']}"
    return None


@attrs.frozen(kw_only=True)
class RequestFacts:
    """One request in one trace. Times in seconds on that trace's clock; None when the
    event never came (rejected, cancelled, missing). chunks: (pass kind, start, end,
    seconds, requests admitted and unfinished when the chunk started) of its passes."""

    arrived_s: float
    rows: int
    cached_tokens: int | None = None
    ttft_s: float | None = None
    finished_s: float | None = None
    output_rows: int | None = None
    reason: str | None = None
    decisions: tuple[str, ...] = ()
    chunks: tuple[tuple[str, int, int, float, int], ...] = ()

    @property
    def e2e_s(self) -> float | None:
        """End-to-end seconds: RequestFinished.t - RequestArrived.t."""
        return None if self.finished_s is None else self.finished_s - self.arrived_s

    @property
    def token_s(self) -> float | None:
        """Mean seconds per token after the first: (finish - first token) / (output rows - 1)."""
        if self.finished_s is None or self.ttft_s is None or not self.output_rows or self.output_rows < 2:
            return None
        return (self.finished_s - self.arrived_s - self.ttft_s) / (self.output_rows - 1)


@attrs.frozen(kw_only=True)
class TraceFacts:
    """Every keyed request of a trace, and counts of what could not be keyed or was global."""

    requests: dict[Key, RequestFacts]
    unkeyed_requests: int
    evictions: int
    rejected: int


def trace_facts(events: Iterable[dict[str, Any]], key_of: Callable[[str], Key | None]) -> TraceFacts:
    """Per-request facts of a trace. key_of(request id) gives the client's key, or None for a
    request outside the workload. A trace conversation is mapped to the client conversation
    of its requests; its events go to its newest arrived turn."""
    fields: dict[Key, dict[str, Any]] = {}
    decisions: dict[Key, list[str]] = {}
    chunks: dict[Key, list[tuple[str, int, int, float, int]]] = {}
    started: dict[int, tuple[Key, float, int]] = {}
    in_flight: set[str] = set()
    conv_of: dict[str, str] = {}
    newest: dict[str, Key] = {}
    unkeyed = evictions = rejected = 0
    for e in events:
        kind = e["kind"]
        if kind == "request_admitted":
            in_flight.add(e["request"])
        elif kind == "request_finished":
            in_flight.discard(e["request"])
        if kind == "state_evicted":
            evictions += 1
            continue
        if kind == "request_arrived":
            key = key_of(e["request"])
            if key is None:
                unkeyed += 1
                continue
            conv_of[e["conversation"]] = key[0]
            newest[key[0]] = key
            fields[key] = {"arrived_s": e["t"], "rows": e["rows"]}
            decisions[key], chunks[key] = [], []
            continue
        rejected += kind == "request_rejected"
        conv = conv_of.get(e.get("conversation", ""))
        key = newest.get(conv) if conv is not None else None
        if "request" in e and e["request"] is not None:
            key = key_of(e["request"]) or key
        if key is None or key not in fields:
            continue
        f = fields[key]
        if kind == "request_admitted":
            f["cached_tokens"] = e["cached_tokens"]
        elif kind == "first_token" and "ttft_s" not in f:
            f["ttft_s"] = e["ttft_s"]
        elif kind == "request_finished":
            f.update(finished_s=e["t"], output_rows=e["output_rows"], reason=e["reason"])
        elif kind == "chunk_started":
            started[e["stream"]] = (key, e["t"], len(in_flight))
        elif kind == "chunk_done" and e["stream"] in started:
            owner, t0, active = started.pop(e["stream"])
            chunks[owner].append((e["pass_kind"], e["start"], e["end"], e["t"] - t0, active))
        text = decision(e)
        if text is not None:
            decisions[key].append(text)
    requests = {k: RequestFacts(**f, decisions=tuple(decisions[k]), chunks=tuple(chunks[k])) for k, f in fields.items()}
    return TraceFacts(requests=requests, unkeyed_requests=unkeyed, evictions=evictions, rejected=rejected)


ACTIVE_BUCKETS = ("0-2", "3-5", "6-8", "9-11", "12+")
"""Labels of `Comparison.chunk_ratio_by_active`: requests in flight on the server."""


def active_bucket(active: int) -> str:
    """The ACTIVE_BUCKETS label of `active` requests in flight (0-2, 3-5, ..., 12+)."""
    return ACTIVE_BUCKETS[min(max(active, 0) // 3, len(ACTIVE_BUCKETS) - 1)]


def ape(sim: float | None, server: float | None) -> float | None:
    """Absolute percentage error |sim - server| / server (a fraction), None if either is missing."""
    if sim is None or server is None or server <= 0:
        return None
    return abs(sim - server) / server


def median(values: Iterable[float]) -> float:
    """Median of the values; NaN when there are none."""
    xs = sorted(values)
    if not xs:
        return math.nan
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


@attrs.frozen(kw_only=True)
class Row:
    """One request on both sides. first_diff: (index, server decision, sim decision) of the
    first decision that differs ("-" past a list's end), or None when they are equal."""

    key: Key
    server: RequestFacts | None
    sim: RequestFacts | None
    first_diff: tuple[int, str, str] | None

    @property
    def cached_equal(self) -> bool:
        """Both sides admitted it with the same cached_tokens."""
        return self.server is not None and self.sim is not None and self.server.cached_tokens is not None \
            and self.server.cached_tokens == self.sim.cached_tokens


def _first_diff(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[int, str, str] | None:
    for i in range(max(len(a), len(b))):
        x, y = (a[i] if i < len(a) else "-"), (b[i] if i < len(b) else "-")
        if x != y:
            return i, x, y
    return None


@attrs.frozen(kw_only=True)
class Comparison:
    """All rows (the server's keys first, in arrival order) and the summary numbers.

    ttft_mdape / e2e_mdape: median absolute percentage error (fractions) over requests with
    both values; ttft_bias: median signed (sim - server) / server. chunk_mdape / chunk_bias:
    the same over the duration of each prefill step (ChunkStarted to ChunkDone, the chunk and
    any decode round beside it) matched by (request, pass kind, rows); chunk_ratio_by_active:
    (label, median server / sim seconds of those steps, count) by how many requests were in
    flight on the server when the step began ("0-2", "3-5", "6-8", "9-11", "12+"; a lone
    step's ratio is the cost model against this host, the growth with load is contention and
    per-lane work the model lacks); token_mdape /
    token_bias: over each request's mean seconds per token after the first. These two say how
    far the cost model is off, apart from queueing. kind_counts: per decision kind, (server
    count, sim count) where they differ.
    """

    rows: tuple[Row, ...]
    cached_equal: int
    ttft_mdape: float
    e2e_mdape: float
    ttft_bias: float
    chunk_mdape: float
    chunk_bias: float
    chunk_ratio_by_active: tuple[tuple[str, float, int], ...]
    token_mdape: float
    token_bias: float
    decisions_equal: int
    kind_counts: dict[str, tuple[int, int]]
    server: TraceFacts
    sim: TraceFacts

    @property
    def all_cached_equal(self) -> bool:
        """Every request of both sides has the same cached_tokens."""
        return self.cached_equal == len(self.rows)


def compare(server: TraceFacts, sim: TraceFacts) -> Comparison:
    """Pair the two traces' requests by key and compute the errors."""
    keys = sorted(server.requests, key=lambda k: server.requests[k].arrived_s)
    keys += sorted(set(sim.requests) - set(server.requests))
    rows = []
    for k in keys:
        a, b = server.requests.get(k), sim.requests.get(k)
        diff = _first_diff(a.decisions if a else (), b.decisions if b else ())
        rows.append(Row(key=k, server=a, sim=b, first_diff=diff))
    both = [(r.server, r.sim) for r in rows if r.server is not None and r.sim is not None]
    ttft = [e for a, b in both if (e := ape(b.ttft_s, a.ttft_s)) is not None]
    e2e = [e for a, b in both if (e := ape(b.e2e_s, a.e2e_s)) is not None]
    signed = lambda x, y: None if x is None or y is None or y <= 0 else (x - y) / y
    bias = [v for a, b in both if (v := signed(b.ttft_s, a.ttft_s)) is not None]
    steps = []
    ratios: dict[str, list[float]] = {label: [] for label in ACTIVE_BUCKETS}
    for a, b in both:
        sim_chunks = {c[:3]: c[3] for c in b.chunks}
        for c in a.chunks:
            sim_s = sim_chunks.get(c[:3])
            if (v := signed(sim_s, c[3])) is not None:
                steps.append(v)
                if sim_s:
                    ratios[active_bucket(c[4])].append(c[3] / sim_s)
    by_active = tuple((label, median(v), len(v)) for label, v in ratios.items() if v)
    tokens = [v for a, b in both if (v := signed(b.token_s, a.token_s)) is not None]
    count = lambda facts: Counter(d.split(" ", 1)[0] for f in facts.requests.values() for d in f.decisions)
    cs, cm = count(server), count(sim)
    kinds = {k: (cs[k], cm[k]) for k in sorted(set(cs) | set(cm)) if cs[k] != cm[k]}
    return Comparison(rows=tuple(rows), cached_equal=sum(r.cached_equal for r in rows), ttft_mdape=median(ttft),
                      e2e_mdape=median(e2e), ttft_bias=median(bias), chunk_mdape=median(map(abs, steps)),
                      chunk_bias=median(steps), chunk_ratio_by_active=by_active, token_mdape=median(map(abs, tokens)), token_bias=median(tokens),
                      decisions_equal=sum(r.first_diff is None for r in rows), kind_counts=kinds,
                      server=server, sim=sim)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v * 100:.1f}%"


def report_lines(c: Comparison) -> list[str]:
    """The request-by-request table, then the summary."""
    lines = [(f"{'request':<16} {'rows':>6} {'out':>4} {'cached srv':>10} {'cached sim':>10} {'TTFT srv ms':>11} "
              f"{'TTFT sim ms':>11} {'TTFT err':>8} {'E2E srv ms':>10} {'E2E sim ms':>10} {'E2E err':>7}  decisions")]
    for r in c.rows:
        a, b = r.server, r.sim
        get = lambda f, name: None if f is None else getattr(f, name)
        flag = "" if r.cached_equal else " CACHED DIFFERS"
        why = "same" if r.first_diff is None else f"#{r.first_diff[0]}: srv '{r.first_diff[1]}' sim '{r.first_diff[2]}'"
        lines.append(
            f"{key_text(r.key):<16} {get(a or b, 'rows') or 0:>6} {get(a, 'output_rows') or 0:>4} "
            f"{get(a, 'cached_tokens')!s:>10} {get(b, 'cached_tokens')!s:>10} {_ms(get(a, 'ttft_s')):>11} "
            f"{_ms(get(b, 'ttft_s')):>11} {_pct(ape(get(b, 'ttft_s'), get(a, 'ttft_s'))):>8} "
            f"{_ms(get(a, 'e2e_s')):>10} {_ms(get(b, 'e2e_s')):>10} {_pct(ape(get(b, 'e2e_s'), get(a, 'e2e_s'))):>7}"
            f"  {why}{flag}")
    return lines + summary_lines(c)


def summary_lines(c: Comparison) -> list[str]:
    """The summary block."""
    n = len(c.rows)
    ttft = lambda facts: [f.ttft_s for f in facts.requests.values() if f.ttft_s is not None]
    p = lambda xs, q: "-" if not xs else f"{sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3:.1f} ms"
    kinds = ", ".join(f"{k} {a}/{b}" for k, (a, b) in c.kind_counts.items()) or "none"
    return [
        (f"requests: {n} (server {len(c.server.requests)}, sim {len(c.sim.requests)}; server requests outside the "
         f"workload {c.server.unkeyed_requests}; rejected server {c.server.rejected}, sim {c.sim.rejected})"),
        f"cached_tokens identical: {c.cached_equal}/{n}" + ("" if c.all_cached_equal else "  <- MISMATCH"),
        (f"TTFT median absolute error: {_pct(c.ttft_mdape)} (median signed sim vs server {_pct(c.ttft_bias)}); "
         f"p50 server {p(ttft(c.server), 0.5)}, sim {p(ttft(c.sim), 0.5)}; "
         f"p95 server {p(ttft(c.server), 0.95)}, sim {p(ttft(c.sim), 0.95)}"),
        f"end-to-end median absolute error: {_pct(c.e2e_mdape)}",
        (f"cost model alone: prefill step median absolute error {_pct(c.chunk_mdape)} "
         f"(signed {_pct(c.chunk_bias)}), seconds per decoded token {_pct(c.token_mdape)} "
         f"(signed {_pct(c.token_bias)})"),
        ("prefill step server / sim by requests in flight: "
         + (", ".join(f"{label}: {ratio:.2f}x ({n})" for label, ratio, n in c.chunk_ratio_by_active) or "none")),
        (f"decisions identical on {c.decisions_equal}/{n} requests; decision kinds whose counts differ "
         f"(server/sim): {kinds}"),
        f"evictions server {c.server.evictions}, sim {c.sim.evictions}",
    ]


def report_json(c: Comparison) -> dict[str, Any]:
    """The comparison as JSON: summary numbers and one object per request."""
    def side(f: RequestFacts | None) -> dict[str, Any] | None:
        return None if f is None else {**attrs.asdict(f), "e2e_s": f.e2e_s}

    return {"requests": len(c.rows), "cached_equal": c.cached_equal, "ttft_mdape": c.ttft_mdape,
            "e2e_mdape": c.e2e_mdape, "ttft_bias": c.ttft_bias, "chunk_mdape": c.chunk_mdape,
            "chunk_bias": c.chunk_bias,
            "chunk_ratio_by_active": [list(x) for x in c.chunk_ratio_by_active], "token_mdape": c.token_mdape, "token_bias": c.token_bias,
            "decisions_equal": c.decisions_equal,
            "kind_counts": c.kind_counts, "evictions": [c.server.evictions, c.sim.evictions],
            "rows": [{"request": key_text(r.key), "server": side(r.server), "sim": side(r.sim),
                      "first_diff": r.first_diff} for r in c.rows]}


BUSY_GAP_S = 0.002
"""Gaps between one step's end and the next one's start shorter than this count as the
serving loop's own time (longer ones are idle waits for requests)."""


def busy_gaps(steps: Iterable[dict[str, Any]]) -> list[float]:
    """Seconds the serving loop took between consecutive step records while busy: the next
    step's start (t - ran_s) minus the last one's end (t), where that is in [0, BUSY_GAP_S)."""
    ordered = sorted((e for e in steps if e.get("kind") == "step"), key=lambda e: e["t"])
    gaps = [b["t"] - b["ran_s"] - a["t"] for a, b in zip(ordered, ordered[1:])]
    return [g for g in gaps if 0 <= g < BUSY_GAP_S]


def keep_lines(steps: Iterable[dict[str, Any]], profile) -> list[str]:
    """The server's keeps against the profile's price for them: the keep phases of the step
    records summed, beside the profile's keep seconds (`Profile.keep_s`) at the bytes each
    such step's keep copied (its record's keep_bytes, as the simulator charges a keep's
    `KeepCopy`; records from before keep_bytes: the whole state at the kept row, the chunk's
    end). Keeps that copied no device bytes (logits added: the simulator charges nothing)
    are left out. Empty without keeps."""
    kept = [e for e in steps if e.get("kind") == "step" and "keep" in e["phases"] and e["prefill_rows"]
            and e.get("keep_bytes", 1)]
    if not kept:
        return []
    server = [e["phases"]["keep"] for e in kept]
    model = sum(profile.keep_s(_keep_bytes(e, profile)) for e in kept)
    return [f"  keeps ({len(kept)}): server {sum(server) * 1e3:.1f} ms in all (median {median(server) * 1e3:.2f}), "
            f"profile {model * 1e3:.1f} ms by bytes; server / profile {sum(server) / model:.2f}x"]


def _keep_bytes(step: dict[str, Any], profile) -> int:
    if "keep_bytes" in step:
        return int(step["keep_bytes"])
    return state_bytes(profile.shape, step["prefill_start"] + step["prefill_rows"])


def step_split_lines(events: Iterable[dict[str, Any]], profile) -> list[str]:
    """Where the server's step time went against what the profile charges for the same steps:
    for the `step` records of the server's step file (executor.runtime writes them beside
    the trace) of three kinds, prefill-only
    steps (a chunk, no decode lanes), steps with a chunk and decode lanes (less the keep
    phase and the profile's restore; median, and the sum over the profile's sum) and decode-only steps
    (by lanes), the median of the
    step's seconds in the worker and of each phase, beside the median of the profile's
    seconds for the same steps (prefill: prefill_s(rows, start) + host_s(restored lanes,
    chunk), as sim.loop charges a step; decode: the round at context 0 + host_s(lanes); the
    restores and the keep a step makes show in the server's phases, the simulator adds them by
    bytes), and the loop's median time between steps while busy (the next step's start,
    t - ran_s, minus the last one's end) beside the profile's host seconds a step. Empty when
    there are no step records."""
    steps = [e for e in events if e.get("kind") == "step"]
    if not steps:
        return []
    lines = ["server steps against the profile (median ms; phases are the worker's host seconds):"]
    chunk = [e for e in steps if e["prefill_rows"] and not e["decode"]]
    if chunk:
        # host_s as sim.loop charges a step: restored lanes count as lanes
        model = [profile.prefill_s(e["prefill_rows"], e["prefill_start"]) + profile.host_s(e["restores"], True)
                 for e in chunk]
        phases = sorted({p for e in chunk for p in e["phases"]})
        lines.append(f"  prefill-only steps ({len(chunk)}): server {median(e['ran_s'] for e in chunk) * 1e3:.2f}, "
                     f"profile {median(model) * 1e3:.2f} (chunk + host); server / profile per step "
                     f"{median(e['ran_s'] / m for e, m in zip(chunk, model)):.2f}x; phases "
                     + ", ".join(f"{p} {median(e['phases'].get(p, 0.0) for e in chunk) * 1e3:.2f}" for p in phases))
    by_lanes: dict[int, list[dict[str, Any]]] = {}
    for e in steps:
        if e["decode"] and not e["prefill_rows"] and not e["restores"]:
            by_lanes.setdefault(e["decode"], []).append(e)
    busy = busy_gaps(steps)
    if busy:
        lines.append(f"  between steps while busy (gap < {BUSY_GAP_S * 1e3:.0f} ms, {len(busy)}): loop median "
                     f"{median(busy) * 1e6:.0f} us; the profile's host terms charge {profile.host_s(0, False) * 1e6:.0f} "
                     f"us a step (step_s, with the steps' worker hand-off)")
    mixed = [e for e in steps if e["prefill_rows"] and e["decode"]]
    if mixed:
        # less the keep phase and the profile's whole restore (the restore phase is only the
        # launch of its copies; their device time sits in forward), as bench/serve_profile does
        def restore_s(e: dict[str, Any]) -> float:
            restored = "restore" in e["phases"]
            return profile.restore_s(state_bytes(profile.shape, e["prefill_start"])) if restored else 0.0

        server = [e["ran_s"] - e["phases"].get("keep", 0.0) - restore_s(e) for e in mixed]
        model = [profile.prefill_s(e["prefill_rows"], e["prefill_start"])
                 + profile.decode_round_s(e["decode"], [0] * e["decode"])
                 + profile.host_s(e["decode"] + e["restores"], True) for e in mixed]
        lines.append(f"  steps with a chunk and decode lanes ({len(mixed)}), less keep and restore: server "
                     f"{median(server) * 1e3:.2f}, profile {median(model) * 1e3:.2f} (chunk + round at context 0 + "
                     f"host); in all {sum(server) / sum(model):.2f}x")
    for lanes, group in sorted(by_lanes.items()):
        model = profile.decode_round_s(lanes, [0] * lanes) + profile.host_s(lanes, False)
        lines.append(f"  decode-only steps, {lanes} lanes ({len(group)}): server "
                     f"{median(e['ran_s'] for e in group) * 1e3:.2f}, profile at context 0 {model * 1e3:.2f}; "
                     f"phases " + ", ".join(f"{p} {median(e['phases'].get(p, 0.0) for e in group) * 1e3:.2f}"
                                            for p in sorted({p for e in group for p in e['phases']})))
    return lines
