"""Measure a simulator cost profile (sim/README.md, "table" form) on an executor backend.

Writes `"source": "measured"` profile JSON: prefill chunk seconds over (chunk rows, context
rows before it), decode-round seconds over (lanes, context rows of each lane), and keep
(snapshot) and restore seconds over a kept state's bytes, all on the wall clock through the
calls the server's stepper makes (executor/stepper.py): a prefill chunk with its tail
(policy.tail) and the last row's logits brought to the host, then its first token picked and
detokenized; a decode round with every lane's logits on the host and each lane's token picked
and detokenized (executor.stops.TextStream with the real Qwen3.5 vocabulary, as the stepper);
payloads.snapshot / restore of a state with its last row's logits (as a kept row holds
them). On the GPU the rig reserves cache memory first (`NumbaCudaBackend.reserve_cache`,
KEEP_RESERVE_BYTES), as the server does since session 12, so keeps come from the reserved
pool as the server's do (`Rig.uncache` still gives the device pool's cached blocks back
before each keep, outside the timing; it matters where no cache memory is reserved: a
keep into memory the process never held cost 1.5-1.9 ms at 2B, RESULTS.md session 12). The device is synchronised before and after each timed call. A
state at a context comes from a real prefill on the reference backend, and on the GPU from
random K/V rows and recurrent states (bench/decode_prefill.py's `_fresh_states`: attention and
the delta rule cost the same whatever the values). After the warm-up the collector's objects
are frozen (`gc.freeze`), as `executor.serve` does after start-up: a collection inside a
short, host-bound chunk made it bimodal (2B: 12 or 19 ms), and the running maximum that
makes each table non-decreasing along both axes (more rows, lanes or context never cost
less) carried the slow mode to every larger point.

Then, in the same process (host speed differs between machines), the serving loop's own host
seconds per step, which those calls leave out (bench/host_cost.py): `executor.runtime.Runtime`
served as the engine process serves it, with a trace, on a backend whose calls cost nothing,
at 1 to 16 decoding lanes and with prefill chunks; written as the profile's `cost.host`
(`step_s` per step, `lane_s` per decode lane, `chunk_s` per prefill chunk; seconds), which the
simulator adds to every step. `--no-host` leaves them out.

Usage (GPU; all presets in one process so kernels compile once):
    python -m bench.profile --presets qwen3.5-2b,qwen3.5-9b,qwen3.5-27b --out sim/profiles
(CPU, the tiny model on the reference backend, a handful of points):
    python -m bench.profile --backend reference --out /tmp/profiles
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import platform
import re
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from bench.host_cost import HostGrid, HostMeasured, measure_host
from executor import payloads
from executor.backend import Backend
from executor.config import FULL
from executor.model import tiny_model_dir
from executor.reference.backend import ReferenceBackend
from executor.sampling import SamplingParams, new_rng, sample
from executor.stops import TextStream
from executor.tokenizer import default_tokenizer
from policy.plan import Chunk
from policy.tail import TailFacts, tail_from
from sim.api import git_commit, machine
from sim.cost import Curve, Profile, TableCost, profile_to_dict
from sim.cost import Grid as CostGrid

PROFILE_DIR = Path(__file__).resolve().parents[1] / "sim" / "profiles"


@attrs.frozen(kw_only=True)
class ProfileGrid:
    """Where to measure. Rows, contexts and lanes strictly ascending.

    prefill_rows: chunk sizes (rows), up to PolicyConfig.max_chunk_rows; log-spaced with
      the small sizes of resumed tails and warm ends. contexts: rows before a chunk, and the
      rows each decode lane holds (also the kept-state sizes of the keep/restore curves).
    lanes: decode lanes per round, up to PolicyConfig.lanes. repeat: timed runs per prefill,
      keep and restore point (median); one only when the first run takes over point_budget_s.
    decode_rounds: timed rounds per decode point (median), after one untimed round.
    tail_rows: PolicyConfig.tail_rows (rule 8). seed: random token ids and states.
    host: what bench/host_cost.py runs for the host terms, or None to leave them out.
    """

    prefill_rows: tuple[int, ...] = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096)
    contexts: tuple[int, ...] = (0, 2048, 8192, 16384, 32768)
    lanes: tuple[int, ...] = (1, 2, 4, 8, 16)
    repeat: int = 3
    point_budget_s: float = 0.3
    decode_rounds: int = 4
    tail_rows: int = 128
    seed: int = 0
    host: HostGrid | None = HostGrid()

    def __attrs_post_init__(self) -> None:
        for name in ("prefill_rows", "contexts", "lanes"):
            axis = getattr(self, name)
            low = 0 if name == "contexts" else 1
            if not axis or axis[0] < low or list(axis) != sorted(set(axis)):
                raise ValueError(f"{name}: must be strictly ascending integers >= {low}, got {axis!r}")
        for name in ("repeat", "decode_rounds", "tail_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


GRIDS = {
    "full": ProfileGrid(repeat=5),
    "quick": ProfileGrid(prefill_rows=(1, 64, 256, 1024, 4096), contexts=(0, 4096, 16384, 32768), lanes=(1, 4, 16),
                         repeat=2),
    "tiny": ProfileGrid(prefill_rows=(1, 16, 64, 256), contexts=(0, 64, 256), lanes=(1, 2, 4), repeat=3,
                        point_budget_s=10.0, decode_rounds=3),
}
"""`full`: the H200 presets (9 x 5 prefill, 5 x 5 decode points, median of 5; cost is about
linear in context between them). `quick`: under half the points, for when GPU time is short.
`tiny`: the reference backend in tests (seconds)."""


@attrs.define(eq=False)
class Rig:
    """A backend under measurement and what differs per backend.

    states_at(context, n): n live states holding `context` rows. sync(): wait for the
    device. decode(states, token_ids): one round as the server runs it (logits on the host).
    clock: seconds (time.perf_counter; tests pass a fake). label: backend name; device: the
    GPU (or CPU) name; model: what it runs, e.g. "Qwen/Qwen3.5-27B"; decode_mode: eager or graphs.
    close(): release what the rig holds besides the backend (captured graphs). uncache():
    give back device memory the backend keeps cached for reuse, so the next allocation is a
    fresh one (the GPU's device pool; nothing on the CPU).
    """

    backend: Backend
    states_at: Callable[[int, int], list]
    sync: Callable[[], None]
    decode: Callable[[Sequence[Any], Sequence[int]], np.ndarray]
    label: str
    device: str
    model: str
    decode_mode: str = "eager"
    clock: Callable[[], float] = time.perf_counter
    close: Callable[[], None] = lambda: None
    uncache: Callable[[], None] = lambda: None


@attrs.frozen(kw_only=True)
class Measured:
    """Seconds measured on a grid: prefill[i][j] at (prefill_rows[i], contexts[j]), decode[i][j]
    at (lanes[i], contexts[j]); keep[j] / restore[j] at state_bytes[j] (the state at contexts[j]);
    host: the serving loop's host seconds (bench/host_cost.py), None when not measured."""

    grid: ProfileGrid
    prefill: tuple[tuple[float, ...], ...]
    decode: tuple[tuple[float, ...], ...]
    state_bytes: tuple[int, ...]
    keep: tuple[float, ...]
    restore: tuple[float, ...]
    wall_s: float
    host: HostMeasured | None = None


def prefill_kwargs(backend: Backend, start: int, end: int, tail_rows: int) -> dict[str, Any]:
    """The backend.prefill keywords of a prompt's last chunk [start, end) as the stepper passes
    them: its logits read, and tail_from per rule 8 (policy.tail) when the model allows one and
    the backend's prefill takes it (executor/stepper.py)."""
    config = backend.config
    facts = TailFacts(tail_rows=tail_rows, last_layer_is_attention=config.layer_types[-1] == FULL,
                      even_head_grouping=config.num_attention_heads % config.num_key_value_heads == 0)
    tail = tail_from(Chunk(start, end, reads_logits=True), facts)
    takes_tail = "tail_from" in inspect.signature(backend.prefill).parameters
    return {"want_logits": True} | ({} if tail is None or not takes_tail else {"tail_from": tail})


def monotone(table: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    """`table` raised to be non-decreasing along rows then columns (a running maximum)."""
    out = [list(map(float, r)) for r in table]
    for i in range(len(out)):
        for j in range(len(out[i])):
            out[i][j] = max([out[i][j]] + ([out[i - 1][j]] if i else []) + ([out[i][j - 1]] if j else []))
    return tuple(tuple(r) for r in out)


STEEP_RAISE = 1.5
"""A point `monotone` raises by more than this factor marks a noisy run (`steep_raises`)."""


def steep_raises(name: str, table: Sequence[Sequence[float]], xs: Sequence[float], ys: Sequence[float],
                 x_unit: str) -> list[str]:
    """The points of `table` (seconds, [x][y]) that `monotone` raises by more than STEEP_RAISE
    times, as "NAME X UNIT at context Y: a -> b ms": a spike on a loaded machine spreads over
    every larger point (a fresh-user review's CPU profile priced 64 rows at 48 ms for one
    32-row outlier, and its fidelity run then failed). Empty when the run looks clean."""
    raised = monotone(table)
    return [f"{name} {x:g} {x_unit} at context {y:g}: {table[i][j] * 1e3:.2f} -> {raised[i][j] * 1e3:.2f} ms"
            for i, x in enumerate(xs) for j, y in enumerate(ys)
            if table[i][j] > 0 and raised[i][j] > STEEP_RAISE * table[i][j]]


def noisy_note(lines: list[str]) -> str | None:
    """One warning line for `steep_raises` results (None when there are none)."""
    if not lines:
        return None
    more = f" (and {len(lines) - 3} more)" if len(lines) > 3 else ""
    return (f"note: making the tables non-decreasing raised {len(lines)} points more than {STEEP_RAISE:g}x, "
            f"e.g. {'; '.join(lines[:3])}{more}: the run was noisy; measure again on a quiet machine")


def _median(values: list[float]) -> float:
    return float(np.median(values))


def _repeat(rig: Rig, grid: ProfileGrid, setup: Callable[[], Any], run: Callable[[Any], Any],
            teardown: Callable[[Any], None], repeat: int | None = None) -> float:
    """Median seconds of run(setup()) over `repeat` (default grid.repeat) runs; one when it
    takes over grid.point_budget_s."""
    times: list[float] = []
    while len(times) < (repeat or grid.repeat) and not (len(times) == 1 and times[0] > grid.point_budget_s):
        arg = setup()
        rig.sync()
        t0 = rig.clock()
        out = run(arg)
        rig.sync()
        times.append(rig.clock() - t0)
        teardown(out)
    return _median(times)


def measure(rig: Rig, grid: ProfileGrid, log: Callable[[str], None] = print) -> Measured:
    """Time every grid point on `rig`, then the host terms on this host when grid.host is set
    (see the module docstring)."""
    t_start = time.perf_counter()
    backend, config = rig.backend, rig.backend.config
    greedy = SamplingParams()
    rng = new_rng(grid.seed)
    top = max(grid.contexts) + max(grid.prefill_rows)
    ids = [int(t) for t in np.random.default_rng(grid.seed).integers(0, config.vocab_size, top)]
    release = lambda state: payloads.release(backend, state)
    tokenizer = default_tokenizer()

    def prefill_at(ctx: int, rows: int, repeat: int | None = None) -> float:
        kwargs = prefill_kwargs(backend, ctx, ctx + rows, grid.tail_rows)

        def run(state):
            TextStream(tokenizer).push(sample(backend.prefill(state, ids, (ctx, ctx + rows), **kwargs), greedy, rng))
            return state

        return _repeat(rig, grid, lambda: rig.states_at(ctx, 1)[0], run, release, repeat)

    for rows in grid.prefill_rows:  # compile kernels and pick GEMM algorithms per row count
        prefill_at(0, rows, repeat=1)
    log(f"  warm-up done ({time.perf_counter() - t_start:.1f} s)")
    gc.collect()
    gc.freeze()  # as executor.serve after start-up: weights, kernels and tokenizer leave the collector's scans
    prefill = []
    for rows in grid.prefill_rows:
        prefill.append(tuple(prefill_at(ctx, rows) for ctx in grid.contexts))
        log(f"  prefill {rows:>5} rows: " + " ".join(f"{s * 1e3:8.2f}" for s in prefill[-1]) + " ms")
    decode = []
    for lanes in grid.lanes:
        row = []
        for ctx in grid.contexts:
            states = rig.states_at(ctx, lanes)
            tokens = [int(t) for t in np.random.default_rng(grid.seed + lanes).integers(0, config.vocab_size, lanes)]
            rig.decode(states, tokens)  # untimed: the first round at a lane count captures its graph
            streams = [TextStream(tokenizer) for _ in range(lanes)]
            times = []
            for _ in range(grid.decode_rounds):
                rig.sync()
                t0 = rig.clock()
                logits = rig.decode(states, tokens)
                tokens = [sample(logits[i], greedy, rng) for i in range(lanes)]
                for stream, token in zip(streams, tokens):
                    stream.push(token)
                rig.sync()
                times.append(rig.clock() - t0)
            for state in states:
                release(state)
            row.append(_median(times))
        decode.append(tuple(row))
        log(f"  decode {lanes:>3} lanes: " + " ".join(f"{s * 1e3:8.2f}" for s in row) + " ms")
    keep, restore, sizes = [], [], []
    for ctx in grid.contexts:
        k, r, nbytes = _keep_and_restore(rig, grid, ctx)
        keep.append(k)
        restore.append(r)
        sizes.append(nbytes)
    log("  keep / restore: " + ", ".join(f"{b / 2**20:.1f} MiB {k * 1e3:.2f} / {r * 1e3:.2f} ms"
                                           for b, k, r in zip(sizes, keep, restore)))
    host = None
    if grid.host is not None:
        host = measure_host(config, grid.host, tokenizer)
        log(host.summary())
    gc.unfreeze()
    return Measured(grid=grid, prefill=tuple(prefill), decode=tuple(decode), state_bytes=tuple(sizes),
                    keep=tuple(keep), restore=tuple(restore), wall_s=time.perf_counter() - t_start, host=host)


def _keep_and_restore(rig: Rig, grid: ProfileGrid, ctx: int) -> tuple[float, float, int]:
    """(keep seconds, restore seconds, payload bytes) of a state holding `ctx` rows."""
    backend = rig.backend
    state = rig.states_at(ctx, 1)[0]
    logits = np.zeros(backend.config.vocab_size, np.float32)  # a kept row's logits (their values cost nothing)
    if hasattr(state, "logits"):
        state.logits = logits
    kept: list[payloads.Payload] = []

    def fresh_memory():
        rig.uncache()
        return state

    keep = _repeat(rig, grid, fresh_memory, lambda s: kept.append(payloads.snapshot(backend, s, logits)),
                   lambda _: None)
    restore = _repeat(rig, grid, lambda: kept[0], lambda p: payloads.restore(backend, p),
                      lambda s: payloads.release(backend, s))
    payloads.release(backend, state)
    return keep, restore, kept[0].bytes


def to_profile(m: Measured, rig: Rig, name: str, command: str) -> Profile:
    """The measured Profile (tables made non-decreasing; see the module docstring)."""
    g = m.grid
    keep, restore = monotone([m.keep])[0], monotone([m.restore])[0]
    big = max(range(len(m.state_bytes)), key=lambda j: m.state_bytes[j])
    copy_bps = m.state_bytes[big] / keep[big] if keep[big] > 0 and m.state_bytes[big] > 0 else 1e12
    cost = TableCost(
        prefill=CostGrid(x=tuple(map(float, g.prefill_rows)), y=tuple(map(float, g.contexts)), seconds=monotone(m.prefill)),
        decode=CostGrid(x=tuple(map(float, g.lanes)), y=tuple(map(float, g.contexts)), seconds=monotone(m.decode)),
        copy_bytes_per_s=copy_bps,
        keep=Curve(x=tuple(map(float, m.state_bytes)), seconds=keep),
        restore=Curve(x=tuple(map(float, m.state_bytes)), seconds=restore),
        host=None if m.host is None else m.host.cost,
    )
    notes = (f"measured by bench/profile.py on the {rig.label} backend ({rig.device}), {rig.model} "
             f"{'random weights' if rig.label == 'numba_cuda' else 'weights'}; decode {rig.decode_mode}; wall-clock "
             f"seconds of the stepper's calls (prefill with tail + logits to host + first token; decode round "
             f"+ each lane's token; payload snapshot / restore), median of up to {g.repeat} runs "
             f"({g.decode_rounds} rounds for decode), tables made non-decreasing"
             + ("" if m.host is None else "; host: the serving loop's own seconds per step, decode lane and "
                                         "prefill chunk on a backend that costs nothing (bench/host_cost.py)"))
    provenance = (("backend", rig.label), ("command", command), ("commit", git_commit()), ("machine", machine()),
                  ("date", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")),
                  ("decode", rig.decode_mode), ("wall_s", f"{m.wall_s:.1f}"))
    if m.host is not None:
        provenance += (("host", m.host.record()),)
    for path in ("prefill_delta", "prefill_attention"):  # the GPU backend's kernel paths (their bits and speed differ)
        if isinstance(getattr(type(rig.backend), path, None), property):
            provenance += ((path, str(getattr(rig.backend, path))),)
    if isinstance(getattr(type(rig.backend), "prefill_graphs", None), property):
        graphs = rig.backend.prefill_graphs
        provenance += (("prefill_graphs", "off" if graphs is None else ",".join(map(str, graphs.buckets))),)
    return Profile(name=name, source="measured", gpu=rig.device, model=rig.model, shape=rig.backend.config.shape,
                   invariant_rows=getattr(rig.backend, "invariant_rows", None), cost=cost, notes=notes,
                   provenance=provenance)


def table(profile: Profile) -> str:
    """The measured tables as text (milliseconds)."""
    c = profile.cost
    assert isinstance(c, TableCost)
    head = lambda what, axis: f"{what:>14} | " + " ".join(f"{int(v):>8}" for v in axis)
    lines = [f"{profile.name} ({profile.gpu}, {profile.model})", head("prefill ms", c.prefill.y) + "  <- context rows"]
    lines += [f"{int(x):>9} rows | " + " ".join(f"{s * 1e3:8.2f}" for s in r) for x, r in zip(c.prefill.x, c.prefill.seconds)]
    lines.append(head("decode ms", c.decode.y) + "  <- context rows per lane")
    lines += [f"{int(x):>8} lanes | " + " ".join(f"{s * 1e3:8.2f}" for s in r) for x, r in zip(c.decode.x, c.decode.seconds)]
    assert c.keep is not None and c.restore is not None
    lines.append("keep / restore: " + ", ".join(f"{b / 2**20:.1f} MiB {k * 1e3:.2f} / {r * 1e3:.2f} ms"
                                               for b, k, r in zip(c.keep.x, c.keep.seconds, c.restore.seconds)))
    if c.host is not None:
        lines.append(f"host: {c.host.step_s * 1e6:.0f} us per step + {c.host.lane_s * 1e6:.1f} us per decode lane "
                     f"+ {c.host.chunk_s * 1e6:.0f} us per prefill chunk")
    return "\n".join(lines)


# rigs -------------------------------------------------------------------------------------


def reference_rig(model_dir: Path) -> Rig:
    """The NumPy reference backend on a checkpoint; states at a context by a real prefill."""
    backend = ReferenceBackend.from_dir(model_dir)
    kept: dict[int, payloads.Payload] = {}

    def states_at(ctx: int, n: int) -> list:
        if ctx == 0:
            return [backend.new_state() for _ in range(n)]
        if ctx not in kept:
            ids = [int(t) for t in np.random.default_rng(ctx).integers(0, backend.config.vocab_size, ctx)]
            state = backend.new_state()
            backend.prefill(state, ids, (0, ctx), want_logits=False)
            kept[ctx] = payloads.snapshot(backend, state, None)
        return [payloads.restore(backend, kept[ctx]) for _ in range(n)]

    return Rig(backend=backend, states_at=states_at, sync=lambda: None, decode=backend.decode, label="reference",
               device=f"CPU {platform.machine()}", model=model_dir.name)


KEEP_RESERVE_BYTES = 16 << 30
"""Cache memory the GPU rig reserves for its timed keeps (each grid context keeps `repeat`
states; the 27B at 32K holds ~2.3 GB a state)."""


def cuda_rig(preset_name: str, grid: ProfileGrid, graphs: bool, prefill_graphs: bool = True) -> Rig:
    """The numba-cuda backend on seeded random weights at a preset's shape (made on the GPU);
    states at a context hold random K/V rows and recurrent states. graphs: decode rounds
    replay CUDA graphs; prefill_graphs: short chunks too (as the server does by default)."""
    from bench.decode_prefill import _fresh_states
    from executor.numba_cuda import device_weights
    from executor.numba_cuda.backend import NumbaCudaBackend
    from executor.numba_cuda.device import device_name, synchronize
    from executor.numba_cuda.graphs import DecodeGraphs
    from executor.presets import preset

    config = preset(preset_name)
    capacity = max(grid.contexts) + max(max(grid.prefill_rows), grid.decode_rounds + 2)
    weights = device_weights.random(config, grid.seed)
    backend = NumbaCudaBackend.from_device_weights(config, weights, slots=max(grid.lanes) + 1, capacity_rows=capacity)
    for i, array in enumerate((backend.pool.keys, backend.pool.values)):
        device_weights.fill_uniform(array, grid.seed + 90 + i, 2.0)
    captured = DecodeGraphs(backend) if graphs else None
    if captured is not None:
        captured.prepare(sorted(set(grid.lanes)))  # as the server does before it is ready
    if prefill_graphs:
        backend.enable_prefill_graphs()
    backend.reserve_cache(KEEP_RESERVE_BYTES)  # keeps from reserved cache memory, as the server's
    key = preset_name.rsplit("/", 1)[-1].lower()
    return Rig(backend=backend, states_at=lambda ctx, n: _fresh_states(backend, n, ctx, grid.seed), sync=synchronize,
               decode=captured.decode if captured else backend.decode, label="numba_cuda", device=device_name(),
               model=f"Qwen/Qwen3.5-{key.split('-', 1)[1].upper()}", decode_mode="graphs" if graphs else "eager",
               close=captured.close if captured else lambda: None, uncache=_uncache)


def _uncache() -> None:
    """Free the device pool's cached blocks (executor.numba_cuda.device.POOL), if it is on."""
    from executor.numba_cuda.device import POOL

    if POOL is not None:
        POOL.release()


def gpu_slug(device: str) -> str:
    """Short GPU tag of a profile name: "NVIDIA H200" -> "h200"."""
    words = [w for w in re.split(r"[^a-z0-9]+", device.lower()) if w and w not in ("nvidia", "tesla", "geforce")]
    return "-".join(words[:2]) or "gpu"


def _release_device() -> None:
    """Free the GPU memory of a finished preset (numba defers frees)."""
    from executor.numba_cuda.device import release_memory

    gc.collect()
    release_memory()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cuda", "reference"), default="cuda",
                    help="cuda: random weights at --presets shapes on the GPU; reference: NumPy on --model (default: cuda)")
    ap.add_argument("--presets", help="comma-separated executor.presets names, cuda only "
                                      "(default: qwen3.5-2b,qwen3.5-9b,qwen3.5-27b)")
    ap.add_argument("--model", type=Path, help="checkpoint directory, reference only (default: the built-in tiny model)")
    ap.add_argument("--grid", choices=sorted(GRIDS), help="grid preset (default: full on cuda, tiny on reference)")
    ap.add_argument("--rows", help="override the grid's prefill rows, e.g. 1,64,4096")
    ap.add_argument("--contexts", help="override the grid's contexts, e.g. 0,4096,32768")
    ap.add_argument("--lanes", help="override the grid's decode lanes, e.g. 1,4,16")
    ap.add_argument("--repeat", type=int, help="timed runs per point (default: the grid's)")
    ap.add_argument("--host", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the serving loop's host seconds per step into cost.host (default: %(default)s)")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="decode through CUDA graphs, as the server does unless --no-decode-graphs (default: %(default)s)")
    ap.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="short prefill chunks through CUDA graphs, as the server does unless --no-prefill-graphs "
                         "(default: %(default)s)")
    ap.add_argument("--name", help="profile name (one model only; default: PRESET-GPU, e.g. qwen3.5-27b-h200)")
    ap.add_argument("--out", type=Path, default=PROFILE_DIR, help="folder for NAME.json (default: sim/profiles)")
    args = ap.parse_args(argv)
    grid = GRIDS[args.grid or ("full" if args.backend == "cuda" else "tiny")]
    ints = lambda text: tuple(int(v) for v in text.split(","))
    try:
        changes = {k: ints(v) for k, v in (("prefill_rows", args.rows), ("contexts", args.contexts),
                                           ("lanes", args.lanes)) if v}
        if args.repeat:
            changes["repeat"] = args.repeat
        if not args.host:
            changes["host"] = None
        grid = attrs.evolve(grid, **changes)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.backend == "reference" and args.presets:
        print("error: --presets is for --backend cuda; the reference backend profiles --model", file=sys.stderr)
        return 2
    if args.backend == "cuda":
        from executor.numba_cuda.device import is_gpu_available

        if not is_gpu_available():
            print("error: --backend cuda needs an NVIDIA GPU with numba-cuda and nvmath-python "
                  "(pip install -e '.[cuda]'); on a CPU use --backend reference", file=sys.stderr)
            return 2
    presets = args.presets or "qwen3.5-2b,qwen3.5-9b,qwen3.5-27b"
    if args.backend == "reference":
        targets: list[tuple[str, Callable[[], Rig]]] = [
            (str(args.model or "tiny"), lambda: reference_rig(args.model or tiny_model_dir()))]
    else:
        targets = [(p, lambda p=p: cuda_rig(p, grid, args.graphs, args.prefill_graphs)) for p in presets.split(",")]
    if args.name and len(targets) > 1:
        print("error: --name needs a single model", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m bench.profile", *(argv if argv is not None else sys.argv[1:])])
    failed = 0
    for label, make in targets:
        t0 = time.perf_counter()
        print(f"{label}: building the {args.backend} backend", flush=True)
        rig = None
        try:
            rig = make()
            print(f"{label}: {rig.device}, {rig.model}, built in {time.perf_counter() - t0:.1f} s", flush=True)
            m = measure(rig, grid, log=lambda s: print(s, flush=True))
            default = (f"{label.rsplit('/', 1)[-1].lower()}-{gpu_slug(rig.device)}" if rig.label == "numba_cuda"
                       else f"{rig.model}-reference")
            profile = to_profile(m, rig, args.name or default, command)
            path = args.out / f"{profile.name}.json"
            path.write_text(json.dumps(profile_to_dict(profile), indent=2) + "\n", encoding="utf-8")
            print(table(profile))
            note = noisy_note(steep_raises("prefill", m.prefill, grid.prefill_rows, grid.contexts, "rows")
                              + steep_raises("decode", m.decode, grid.lanes, grid.contexts, "lanes"))
            if note:
                print(note, flush=True)
            print(f"{label}: wrote {path} ({time.perf_counter() - t0:.1f} s in all)", flush=True)
        except Exception:  # noqa: BLE001 - keep the other presets' profiles
            traceback.print_exc()
            failed += 1
        if rig is not None:
            rig.close()
        rig = m = None
        if args.backend == "cuda":
            _release_device()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
