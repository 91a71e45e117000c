"""Trace writers: JSONL (one event a line) and Chrome/Perfetto trace-event JSON.

The Perfetto file has one track per lane (lanes are reused slots, numbered from 1) and
one track for warm passes; open it at ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
from typing import IO, Any

from policy import events as ev

WARM_TRACK = 0


def name_error(err: OSError, out: IO[str]) -> OSError:
    """`err` naming the file `out` (its `name`, where it has one) when it names none: a failed
    write (ENOSPC, EIO) names no file."""
    if err.filename is None:
        err.filename = getattr(out, "name", None)
    return err


class JsonlTrace:
    """Writes each event as one JSON line (`policy.events.event_dict`) to an open text file.

    Raises OSError naming the file when a write fails."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out

    def event(self, e: ev.Event) -> None:
        try:
            self._out.write(json.dumps(ev.event_dict(e), separators=(",", ":")) + "\n")
        except OSError as err:
            raise name_error(err, self._out)


class PerfettoTrace:
    """Collects events and writes Chrome trace-event JSON (`write`). Times in microseconds."""

    def __init__(self) -> None:
        self._events: list[dict[str, Any]] = []
        self._lane_of: dict[int, int] = {}
        self._free: list[int] = []
        self._lanes = 0
        self._open: dict[int, tuple[float, str, dict[str, Any]]] = {}
        self._decode: dict[int, float] = {}
        self._stream_of: dict[str, int] = {}

    def _lane(self, stream: int) -> int:
        if stream not in self._lane_of:
            if self._free:
                self._free.sort()
                self._lane_of[stream] = self._free.pop(0)
            else:
                self._lanes += 1
                self._lane_of[stream] = self._lanes
        return self._lane_of[stream]

    def _release(self, stream: int) -> None:
        lane = self._lane_of.pop(stream, None)
        if lane is not None:
            self._free.append(lane)

    def _span(self, name: str, tid: int, t0: float, t1: float, args: dict[str, Any]) -> None:
        self._events.append({"name": name, "ph": "X", "pid": 1, "tid": tid, "ts": t0 * 1e6,
                             "dur": max(0.0, t1 - t0) * 1e6, "args": args})

    def _instant(self, name: str, tid: int, t: float, args: dict[str, Any]) -> None:
        self._events.append({"name": name, "ph": "i", "s": "t", "pid": 1, "tid": tid,
                             "ts": t * 1e6, "args": args})

    def event(self, e: ev.Event) -> None:
        if isinstance(e, ev.ChunkStarted):
            tid = WARM_TRACK if e.pass_kind == "warm" else self._lane(e.stream)
            name = f"{e.pass_kind} prefill [{e.start}, {e.end})"
            self._open[e.stream] = (e.t, name, {"tid": tid, **ev.event_dict(e)})
        elif isinstance(e, ev.ChunkDone):
            t0, name, args = self._open.pop(e.stream, (e.t, "prefill", {"tid": 0}))
            self._span(name, args.pop("tid"), t0, e.t, args)
        elif isinstance(e, ev.RequestAdmitted):
            self._lane(e.stream)
            self._stream_of[e.request] = e.stream
        elif isinstance(e, ev.FirstToken):
            self._decode[e.stream] = e.t
        elif isinstance(e, ev.RequestFinished):
            stream = self._stream_of.pop(e.request, None)
            if stream is None:
                return
            t0 = self._decode.pop(stream, None)
            if t0 is not None:
                self._span(f"decode {e.request}", self._lane(stream), t0, e.t, ev.event_dict(e))
            self._release(stream)
        elif isinstance(e, ev.StateKept):
            self._instant(f"keep row {e.row}", WARM_TRACK if e.stream not in self._lane_of
                          else self._lane_of[e.stream], e.t, ev.event_dict(e))
        elif isinstance(e, (ev.WarmStarted, ev.WarmYielded, ev.WarmCancelled, ev.WarmAdopted,
                            ev.WarmFinished, ev.StateEvicted, ev.RequestRejected)):
            self._instant(e.kind, WARM_TRACK, e.t, ev.event_dict(e))

    def write(self, out: IO[str]) -> None:
        """Write the collected trace to `out`. Raises OSError naming the file when a write fails."""
        meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": WARM_TRACK,
                 "args": {"name": "warm passes"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": f"lane {i}"}}
                 for i in range(1, self._lanes + 1)]
        try:
            json.dump({"traceEvents": meta + self._events, "displayTimeUnit": "ms"}, out)
        except OSError as err:
            raise name_error(err, out)
