"""The summary table of a run, built from trace events alone (so a server trace works too)."""

from __future__ import annotations

import math
from collections import defaultdict

from policy import events as ev


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def turn_of(request: str) -> int:
    """Turn index of a request id `conversation/turn` (0 when it has none)."""
    head, _, tail = request.rpartition("/")
    return int(tail) if head and tail.isdigit() else 0


class Summary:
    """Accumulates the metrics of one run from its events; `metrics()` gives them by name."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.ttft_by_request: dict[str, float] = {}
        self.cached_by_request: dict[str, int] = {}
        self.count: dict[str, int] = defaultdict(int)
        self.rows_requested = 0
        self.rows_cached = 0
        self.rows_cold = 0
        self.rows_warm = 0
        self.cached_by_turn: dict[int, list[int]] = defaultdict(list)
        self.bytes_now = 0
        self.bytes_peak = 0
        self.end_s = 0.0
        self.events = 0

    def event(self, e: ev.Event) -> None:
        """Feed one trace event."""
        self.end_s = max(self.end_s, e.t)
        self.events += 1
        self.count[e.kind] += 1
        if isinstance(e, ev.RequestAdmitted):
            self.rows_requested += e.rows
            self.rows_cached += e.cached_tokens
            self.cached_by_request[e.request] = e.cached_tokens
            self.cached_by_turn[turn_of(e.request)].append(e.cached_tokens)
            self.count[f"admitted_{e.source}"] += 1
        elif isinstance(e, ev.ChunkStarted):
            if e.pass_kind == "warm":
                self.rows_warm += e.end - e.start
            else:
                self.rows_cold += e.end - e.start
        elif isinstance(e, ev.FirstToken):
            self.ttft.append(e.ttft_s)
            self.ttft_by_request[e.request] = e.ttft_s
        elif isinstance(e, ev.RequestFinished):
            self.count[f"finished_{e.reason}"] += 1
        elif isinstance(e, ev.WarmCancelled):
            self.count[f"warm_cancelled_{e.reason}"] += 1
        elif isinstance(e, ev.StateKept):
            self.bytes_now += e.bytes

    def metrics(self, store_bytes_peak: int | None = None) -> dict[str, float]:
        """Metric name -> value, in table order. Times in s, rows in rows, bytes in bytes."""
        c = self.count
        m: dict[str, float] = {
            "requests": c["request_arrived"],
            "finished": c["request_finished"],
            "rejected": c["request_rejected"],
            "ttft_p50_s": percentile(self.ttft, 50),
            "ttft_p95_s": percentile(self.ttft, 95),
            "ttft_p99_s": percentile(self.ttft, 99),
            "prompt_rows": self.rows_requested,
            "cached_tokens": self.rows_cached,
            "cached_fraction": self.rows_cached / self.rows_requested if self.rows_requested else 0.0,
            "prefill_rows_cold": self.rows_cold,
            "prefill_rows_warm": self.rows_warm,
            "warm_scheduled": c["warm_scheduled"],
            "warm_started": c["warm_started"],
            "warm_adopted": c["warm_adopted"],
            "warm_yielded": c["warm_yielded"],
            "warm_cancelled": c["warm_cancelled"],
            "warm_finished": c["warm_finished"],
            "states_kept": c["state_kept"],
            "keeps_refused": c["keep_refused"],
            "evictions": c["state_evicted"],
            "store_bytes_peak": float(store_bytes_peak) if store_bytes_peak is not None else math.nan,
            "sim_end_s": self.end_s,
        }
        for turn in sorted(self.cached_by_turn)[:6]:
            vals = self.cached_by_turn[turn]
            m[f"cached_tokens_turn{turn}_mean"] = sum(vals) / len(vals)
        return m


def format_value(name: str, value: float) -> str:
    """One metric value as the table prints it (bytes in GiB, seconds in ms below 10 s)."""
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if name.endswith("_bytes_peak"):
        return f"{value / (1 << 30):.2f} GiB"
    if name.endswith("_s"):
        return f"{value * 1000:.1f} ms" if abs(value) < 10 else f"{value:.2f} s"
    if name.endswith("_fraction"):
        return f"{value:.1%}"
    if name.endswith("_mean"):
        return f"{value:.0f}"
    return f"{int(value):,}"


def format_table(rows: list[list[str]]) -> str:
    """Left-aligned first column, right-aligned others."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def summary_table(metrics: dict[str, float]) -> str:
    """The run summary as a two-column text table."""
    return format_table([["metric", "value"]] + [[k, format_value(k, v)] for k, v in metrics.items()])
