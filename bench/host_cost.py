"""The serving loop's own host seconds per step: a profile's "host" terms (`sim.cost.HostCost`).

bench/profile.py times the backend calls the stepper makes; this times what the serving loop
adds around them. `executor.runtime.Runtime` runs as the engine process runs it
(`executor.engine.serve_engine`: each event into an outbox, one "events" batch per step over a
multiprocessing pipe, a line-buffered JSONL trace) on `NullBackend`, whose calls return at once
and log when they were made. A step's host seconds are the time from one step's backend call
to the next step's (decide, plan, hand-off to the worker thread and back, commit, trace lines,
events, the batch over the pipe), less each token's pick and detokenization, which the profile's
tables already hold. Not here: the backend's own cost (bench/profile.py), the API process,
work that scales with something other than steps and lanes (a request's arrival hashes its
prompt, ~0.4 us a row; a keep re-ranks every other state kept under the same parent).
"""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from executor.config import Qwen35Config
from executor.engine import EngineInfo, serve_engine, submit_message
from executor.runtime import Runtime
from executor.sampling import SamplingParams, new_rng, sample
from executor.stepper import Job
from executor.stops import TextStream
from executor.tokenizer import default_tokenizer
from policy.config import PolicyConfig
from sim.cost import HostCost


@attrs.frozen(kw_only=True)
class HostGrid:
    """What to run, in `sweeps` sweeps (medians over all of them, so that a slow spell of the
    host falls on every lane count alike).

    lanes: decode lane counts (strictly ascending, >= 1); rounds: rounds per sweep at each count,
    every lane decoding. requests: prefill-only requests (max_tokens 1) per sweep, all admitted
    at once, each a restore of the sweep's shared prefix of prefix_rows rows, a chunk of
    chunk_rows rows to its last request start and a chunk of chunk_rows that takes its first
    token (the shape of a chat turn's pass). mixed_lanes: decode lanes beside one more such batch
    (a check of the additive model, logged). wakes: single requests sent to an idle loop (its
    wake-up latency, logged). seed: token ids.
    """

    lanes: tuple[int, ...] = (1, 2, 4, 8, 16)
    rounds: int = 40
    sweeps: int = 3
    requests: int = 16
    mixed_lanes: int = 8
    prefix_rows: int = 512
    chunk_rows: int = 32
    wakes: int = 5
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.lanes or self.lanes[0] < 1 or list(self.lanes) != sorted(set(self.lanes)):
            raise ValueError(f"lanes: must be strictly ascending integers >= 1, got {self.lanes!r}")
        for name in ("rounds", "sweeps", "requests", "mixed_lanes", "prefix_rows", "chunk_rows", "wakes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")

    @property
    def policy(self) -> PolicyConfig:
        """The serving policy of the run: lanes for every request of a phase at once, no warm
        passes (nothing here has a continuation), every other knob at its default."""
        return PolicyConfig(lanes=max(max(self.lanes), self.mixed_lanes + self.requests), warm_enabled=False)


@attrs.define
class NullState:
    """A stream's state on `NullBackend`: only its row count."""

    rows: int


@attrs.frozen
class NullPayload:
    """A kept state on `NullBackend`: its row count and the first K/V row it holds itself."""

    rows: int
    kv_from: int = 0
    ghost: bool = False


class NullBackend:
    """An `executor.backend.Backend` whose calls cost (almost) nothing.

    Every call returns logits that pick `token_id` (float32 rows of `width` entries, made once:
    picking one costs microseconds, not a vocabulary's worth) and appends (kind, perf_counter
    seconds at the call, lanes, reads logits) to `calls`; kind is "prefill", "decode",
    "snapshot" or "restore". States and payloads hold only their row counts.
    """

    def __init__(self, config: Qwen35Config, token_id: int, width: int = 1024) -> None:
        if not 0 <= token_id < width:
            raise ValueError(f"token_id: must be in [0, {width}), got {token_id}")
        self.width = width
        self.config, self.token_id = config, token_id
        self.calls: list[tuple[str, float, int, bool]] = []
        self._row = np.zeros(width, np.float32)
        self._row[token_id] = 1.0
        self._row.flags.writeable = False
        self._rounds: dict[int, np.ndarray] = {}

    def new_state(self) -> NullState:
        return NullState(0)

    def prefill(self, state: NullState, token_ids: Sequence[int], rows: tuple[int, int], want_logits: bool = True,
                tail_from: int | None = None) -> np.ndarray | None:
        self.calls.append(("prefill", time.perf_counter(), 0, want_logits))
        if state.rows != rows[0] or len(token_ids) < rows[1]:
            raise ValueError(f"rows: state holds {state.rows} rows, asked for {rows} of {len(token_ids)}")
        state.rows = rows[1]
        return self._row if want_logits else None

    def decode(self, states: Sequence[NullState], token_ids: Sequence[int]) -> np.ndarray:
        lanes = len(states)
        self.calls.append(("decode", time.perf_counter(), lanes, True))
        for state in states:
            state.rows += 1
        if lanes not in self._rounds:
            block = np.tile(self._row, (lanes, 1))
            block.flags.writeable = False
            self._rounds[lanes] = block
        return self._rounds[lanes]

    def snapshot(self, state: NullState, base: NullPayload | None = None) -> NullPayload:
        self.calls.append(("snapshot", time.perf_counter(), 0, False))
        if base is None:
            return NullPayload(state.rows, 0)
        return NullPayload(state.rows, base.kv_from if base.rows == state.rows else base.rows)

    def ghost(self, payload: NullPayload) -> NullPayload:
        return NullPayload(payload.rows, payload.kv_from, True)

    def restore(self, payload: NullPayload) -> NullState:
        self.calls.append(("restore", time.perf_counter(), 0, False))
        return NullState(payload.rows)

    def payload_bytes(self, payload: NullPayload) -> int:
        fixed = 0 if payload.ghost else self.config.state_bytes(0)
        return fixed + (payload.rows - payload.kv_from) * self.config.kv_bytes_per_row

    def state_bytes(self, state: NullState) -> int:
        return self.config.state_bytes(state.rows)

    def release(self, state: NullState) -> None:
        pass


@attrs.frozen(kw_only=True)
class HostMeasured:
    """Medians in seconds. round_s[i]: one decode round's cycle (backend call to backend call)
    at lanes[i], every lane decoding; chunk_s: a prefill-only step's cycle; mixed_s: a step of
    a chunk beside mixed_lanes decode lanes; token_s: one token's pick (on NullBackend's
    logits) and detokenization, timed alone (already in the profile's tables); wake_s: a
    request arriving at an idle loop to its first step's decision (trace clock)."""

    lanes: tuple[int, ...]
    round_s: tuple[float, ...]
    chunk_s: float
    chunk_token_share: float
    mixed_lanes: int
    mixed_s: float
    token_s: float
    wake_s: float
    wall_s: float

    @property
    def cost(self) -> HostCost:
        """The host terms: a least-squares line a + b x lanes through round_s gives step_s = a
        and lane_s = b - token_s; chunk_s = the prefill step's cycle - step_s - the share of
        its steps that take a first token x token_s. Each clipped at 0."""
        a, b = fit_line(self.lanes, self.round_s)
        step_s = max(0.0, a)
        return HostCost(step_s=step_s, lane_s=max(0.0, b - self.token_s),
                        chunk_s=max(0.0, self.chunk_s - step_s - self.chunk_token_share * self.token_s))

    def record(self) -> str:
        """The measured medians as one provenance string (microseconds)."""
        return (f"round us by lanes " + ",".join(f"{n}:{s * 1e6:.0f}" for n, s in zip(self.lanes, self.round_s))
                + f"; prefill step us {self.chunk_s * 1e6:.0f} (first token in {self.chunk_token_share:.2f})"
                + f"; chunk + {self.mixed_lanes} lanes us {self.mixed_s * 1e6:.0f}; token us {self.token_s * 1e6:.1f}"
                + f"; idle wake us {self.wake_s * 1e6:.0f}")

    def summary(self) -> str:
        """One line per measurement (microseconds)."""
        c = self.cost
        us = lambda s: f"{s * 1e6:.0f}"
        mixed = c.seconds(self.mixed_lanes, True) + self.chunk_token_share * self.token_s \
            + self.mixed_lanes * self.token_s
        return "\n".join([
            "  host round us by lanes: " + ", ".join(f"{n}: {us(s)}" for n, s in zip(self.lanes, self.round_s)),
            f"  host prefill step {us(self.chunk_s)} us; token pick + detokenize {us(self.token_s)} us; "
            f"idle wake {us(self.wake_s)} us",
            f"  host terms: step_s {us(c.step_s)} us, lane_s {us(c.lane_s)} us, chunk_s {us(c.chunk_s)} us; "
            f"chunk + {self.mixed_lanes} lanes measured {us(self.mixed_s)} us, model {us(mixed)} us "
            f"({self.wall_s:.1f} s)",
        ])


def fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b x; one point: (y, 0)."""
    if len(x) == 1:
        return float(y[0]), 0.0
    b, a = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(a), float(b)


def token_seconds(tokenizer: Any, token_id: int, width: int = 1024, count: int = 400) -> float:
    """Median seconds of one token's pick (greedy, on a NullBackend-width row) and push into a
    TextStream, as the stepper does per token (blocks of 20)."""
    row = np.zeros(width, np.float32)
    row[token_id] = 1.0
    greedy, rng = SamplingParams(), new_rng(0)
    times = []
    for _ in range(count // 20):
        stream = TextStream(tokenizer)
        t0 = time.perf_counter()
        for _ in range(20):
            stream.push(sample(row, greedy, rng))
        times.append((time.perf_counter() - t0) / 20)
    return statistics.median(times)


def _drain(conn: Any) -> None:
    """The API process's end of the pipe: read every message and drop it."""
    try:
        while True:
            conn.recv_bytes()
    except (EOFError, OSError):
        pass


async def _serve(runtime: Runtime, backend: NullBackend, batches: Sequence[Sequence[Job]]) -> list[int]:
    """Serve `batches` one after another as the engine process does, each sent at once over the
    pipe, the next once the loop is idle again; returns where each began in backend.calls."""
    api, engine_end = multiprocessing.Pipe(duplex=True)
    reader = threading.Thread(target=_drain, args=(api,), name="host-cost-drain", daemon=True)
    reader.start()
    info = EngineInfo(backend="null", context_rows=1 << 20, vocab_size=backend.config.vocab_size,
                      facts=runtime.facts)
    engine = asyncio.get_running_loop().create_task(serve_engine(engine_end, runtime, None, info))
    marks: list[int] = []
    try:
        await asyncio.sleep(0.01)
        for jobs in batches:
            marks.append(len(backend.calls))
            for token, job in enumerate(jobs):
                api.send(submit_message(token, job))
            while len(backend.calls) == marks[-1] or runtime.lanes_busy or runtime.waiting:
                await asyncio.sleep(0.002)
        api.send(("close",))
        await engine
    finally:
        engine_end.close()
        reader.join(5)
        api.close()
    return marks


Call = tuple[str, float, int, bool]


def periods(calls: Sequence[Call], anchor: str, accept: Callable[[Call, list[Call]], bool]) -> list[tuple[Call, float]]:
    """(call, seconds to the next `anchor`-kind call) for each `anchor`-kind call (one step's
    cycle, when every step makes one such call) where accept(call, the calls between) holds."""
    at = [i for i, c in enumerate(calls) if c[0] == anchor]
    return [(calls[i], calls[j][1] - calls[i][1]) for i, j in zip(at, at[1:]) if accept(calls[i], list(calls[i + 1:j]))]


def _run(backend: NullBackend, tokenizer: Any, cfg: PolicyConfig,
         batches: Sequence[Sequence[Job]]) -> tuple[list[int], list[dict[str, Any]]]:
    """`_serve` on a fresh event loop with a trace file opened as `serve --trace` opens it;
    returns the batch marks and the trace's events."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.jsonl"
        with path.open("w", encoding="utf-8", buffering=1) as trace:

            async def run() -> list[int]:
                return await _serve(Runtime(backend, tokenizer, cfg, trace=trace), backend, batches)

            marks = asyncio.run(run())
        return marks, [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _wake_s(events: Sequence[dict[str, Any]], requests: Sequence[str]) -> float:
    """Median seconds from each of `requests` arriving to its admission (the decision of its
    first step), on the trace clock."""
    arrived = {e["request"]: e["t"] for e in events if e["kind"] == "request_arrived"}
    admitted = {e["request"]: e["t"] for e in events if e["kind"] == "request_admitted"}
    return statistics.median(admitted[r] - arrived[r] for r in requests)


def measure_host(config: Qwen35Config, grid: HostGrid = HostGrid(), tokenizer: Any = None,
                 backend: NullBackend | None = None) -> HostMeasured:
    """Run the phases of `grid` through the serving loop on a NullBackend of `config` (see the
    module docstring) and take the medians. tokenizer: the server's (default: the built-in).
    backend: the NullBackend to run on (default: a new one; its `calls` stay for inspection).

    Phases, one after another: `wakes` single requests; then per sweep a request that keeps
    the sweep's prefix, at each lane count that many requests decoding together, and a batch of
    prefill-only requests; last, mixed_lanes decoding requests beside one more batch.
    """
    t_start = time.perf_counter()
    tokenizer = tokenizer or default_tokenizer()
    token_id = tokenizer.encode(" the").ids[0]
    backend = backend or NullBackend(config, token_id)
    rng = np.random.default_rng(grid.seed)
    ids = lambda n: tuple(int(t) for t in rng.integers(1000, min(config.vocab_size, 100_000), n))
    p, c = grid.prefix_rows, grid.chunk_rows
    short = lambda max_tokens: Job(prompt_ids=ids(16), starts=(), max_tokens=max_tokens)

    def prefill_batch(prefix: tuple[int, ...]) -> list[Job]:
        return [Job(prompt_ids=prefix + ids(2 * c), starts=(p, p + c), max_tokens=1) for _ in range(grid.requests)]

    batches: list[list[Job]] = []
    kinds: list[tuple[str, int]] = []  # (phase, lanes or requests) of each batch

    def add(kind: tuple[str, int], jobs: list[Job]) -> None:
        kinds.append(kind)
        batches.append(jobs)

    for _ in range(grid.wakes):
        add(("wake", 1), [short(1)])
    for sweep in range(grid.sweeps + 1):
        prefix = ids(p)
        add(("prefix", 1), [Job(prompt_ids=prefix, starts=(), max_tokens=1)])  # keeps it: the batch resumes there
        if sweep == grid.sweeps:
            decoders = [short(grid.mixed_lanes + 2 * grid.requests + 8) for _ in range(grid.mixed_lanes)]
            add(("mixed", grid.mixed_lanes), decoders + prefill_batch(prefix))
            break
        for n in grid.lanes:
            add(("decode", n), [short(grid.rounds + n) for _ in range(n)])
        add(("prefill", grid.requests), prefill_batch(prefix))
    gc.collect()
    gc.freeze()  # as the server does once it has loaded: what exists now leaves the collector's scans
    try:
        marks, events = _run(backend, tokenizer, grid.policy, batches)
    finally:
        gc.unfreeze()
    bounds = [*marks, len(backend.calls)]
    phases = lambda kind, n: [backend.calls[bounds[k]:bounds[k + 1]] for k, key in enumerate(kinds) if key == (kind, n)]
    median = lambda pairs: statistics.median(s for _, s in pairs)
    alone = lambda n: lambda a, between: a[2] == n and not between
    round_s = tuple(median([x for calls in phases("decode", n) for x in periods(calls, "decode", alone(n))])
                    for n in grid.lanes)
    no_decode = lambda a, between: all(b[0] != "decode" for b in between)
    chunks = [x for calls in phases("prefill", grid.requests) for x in periods(calls, "prefill", no_decode)]
    beside = lambda a, between: [b[2] for b in between if b[0] == "decode"] == [grid.mixed_lanes]
    mixed = periods(phases("mixed", grid.mixed_lanes)[0], "prefill", beside)
    wake_ids = [f"req-{i}" for i in range(1, 1 + grid.wakes)]  # the runtime numbers requests as they come
    return HostMeasured(lanes=grid.lanes, round_s=round_s, chunk_s=median(chunks),
                        chunk_token_share=sum(a[3] for a, _ in chunks) / len(chunks), mixed_lanes=grid.mixed_lanes,
                        mixed_s=median(mixed), token_s=token_seconds(tokenizer, token_id, backend.width),
                        wake_s=_wake_s(events, wake_ids), wall_s=time.perf_counter() - t_start)
