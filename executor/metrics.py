"""Prometheus metrics of one server, fed from the scheduler's trace events.

Each `Metrics` owns its own registry (no process-global collectors), so two servers in
one process count apart. Names are prefixed `warmstate_`; `/metrics` serves `render()`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from policy import events as ev

CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_PHASES = ("release", "restore", "forward", "keep", "decode", "sample")
"""The phases of step_phase_seconds (the same as executor.stepper.PHASES)."""
_WARM_EVENTS = {
    ev.WarmScheduled: "scheduled",
    ev.WarmStarted: "started",
    ev.WarmAdopted: "adopted",
    ev.WarmYielded: "yielded",
    ev.WarmCancelled: "cancelled",
    ev.WarmFinished: "finished",
}


class Metrics:
    """Counters, histograms and gauges of one server (see module docstring).

    requests_total{outcome}: stop, length, cancelled, error, rejected (by the scheduler,
    e.g. queue full), invalid (a 4xx before the request reached the scheduler). ttft_seconds: arrival to
    first token. prompt_rows_total{source}: computed (cold prefill) or cached (resumed).
    warm_rows_total: rows pre-filled by warm passes. warm_passes_total{event}.
    store_bytes / store_entries: the prompt cache now. evictions_total{how}: ghost or freed.
    lanes_busy: admitted foreground requests. queue_waiting: requests waiting for a lane.
    step_phase_seconds_total{phase}: host seconds the backend worker spent in each phase
    of its steps (executor.stepper.PHASES: release, restore, forward, keep, decode, sample).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("warmstate_requests", "Requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram("warmstate_ttft_seconds", "Time to first token (s)", buckets=TTFT_BUCKETS_S, registry=r)
        self.prompt_rows = Counter("warmstate_prompt_rows", "Prompt rows by source", ["source"], registry=r)
        self.warm_rows = Counter("warmstate_warm_rows", "Rows pre-filled by warm passes", registry=r)
        self.warm = Counter("warmstate_warm_passes", "Warm pass events", ["event"], registry=r)
        self.store_bytes = Gauge("warmstate_store_bytes", "Prompt-cache bytes in use", registry=r)
        self.store_entries = Gauge("warmstate_store_entries", "Live kept states", registry=r)
        self.evictions = Counter("warmstate_evictions", "Kept states evicted", ["how"], registry=r)
        self.lanes_busy = Gauge("warmstate_lanes_busy", "Admitted foreground requests", registry=r)
        self.queue_waiting = Gauge("warmstate_queue_waiting", "Requests waiting for a lane", registry=r)
        self.step_phase = Counter("warmstate_step_phase_seconds", "Host seconds of the backend's step phases",
                                  ["phase"], registry=r)
        for outcome in ("stop", "length", "cancelled", "rejected", "error", "invalid"):
            self.requests.labels(outcome)
        for source in ("computed", "cached"):
            self.prompt_rows.labels(source)
        for name in _WARM_EVENTS.values():
            self.warm.labels(name)
        for how in ("ghost", "freed"):
            self.evictions.labels(how)
        for phase in STEP_PHASES:
            self.step_phase.labels(phase)

    def event(self, e: ev.Event) -> None:
        """Count one trace event."""
        if isinstance(e, ev.FirstToken):
            self.ttft.observe(e.ttft_s)
        elif isinstance(e, ev.RequestAdmitted):
            self.prompt_rows.labels("computed").inc(e.rows - e.cached_tokens)
            self.prompt_rows.labels("cached").inc(e.cached_tokens)
        elif isinstance(e, ev.RequestRejected):
            self.requests.labels("rejected").inc()
        elif isinstance(e, ev.StateEvicted):
            self.evictions.labels(e.how).inc()
        elif isinstance(e, ev.ChunkDone) and e.pass_kind == "warm":
            self.warm_rows.inc(e.end - e.start)
        name = _WARM_EVENTS.get(type(e))
        if name is not None:
            self.warm.labels(name).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
