"""Measure a simulator profile through the real server's own steps.

What the serving loop costs, not the backend's calls alone.

Why: bench/profile.py times the backend's calls in-process and adds host terms measured on a
backend that costs nothing; on the H200 a 2B server's steps still took 1.1-1.3x what that
profile charges (the worker hand-off, the loop's time between steps, keeps under the GIL
the loop shares), and a replay of the same run with the server's own step costs (a what-if
fitted to that run) brought the simulator's TTFT error from 22.9% to 10.0% (bench/RESULTS.md,
session 10).

How: start `python -m executor.serve ARGS --trace DIR/trace.jsonl` with a policy whose marks
and chunks are `chunk_rows` apart and whose prompt cache is PROMPT_CACHE_GIB (a
--prompt-cache-gib in ARGS overrides it), and read the step file it writes beside the trace
(`trace.jsonl.steps.jsonl`: each step's seconds in the backend worker, `ran_s`, and its phases):
- prefill (R rows after C rows): one request at a time, PREFILL_TOKENS (2) tokens out, so
  the reply goes on past the chunk's first token, as a served chat's does (its second token
  is the 1-lane decode step right after the chunk's). C = 0: a prompt of R
  random token ids. C > 0: first a prompt of C + 1 random ids (untimed; it keeps its state at
  the mark C), then prompts of those C ids plus R new ones, which resume at C
  (`cached_tokens` == C is checked) and run exactly the chunk [C, C + R) with its logits read,
  as the simulator's prefill_s prices it. Its step's ran_s less its keep phase and less the
  base profile's restore of C rows (the simulator charges both by bytes; the restore's copies
  run on the device inside the forward phase), median over `repeat` requests. Why not a
  cold prompt of C + R rows: its chunk [C, C + R) would follow a chunk that reads no
  logits, whose step returns once its kernels are queued, so the step after it also waits
  out the earlier chunk's device time (2B: 30 ms instead of ~6 ms for one row after 4096;
  bench/RESULTS.md, session 11).
- decode (L lanes, C rows each): L concurrent requests with prompts of C rows and
  `reply_tokens(L, C)` tokens out (enough that the first reply still decodes when the last
  prompt is in: each step that prefills a chunk also decodes the lanes already in); the
  median ran_s of the steps that decoded exactly L lanes and did nothing else.
- host: a step's hand-off (its ran_s beyond its phases: to the worker and back, median) is
  taken out of every table point and charged once a step, since the simulator prices a step
  that runs a chunk and decode lanes as the sum of both points plus the host terms; the
  loop's time between steps while busy (the next step's start minus the last one's end,
  under bench.fidelity_report.BUSY_GAP_S, within one request batch so a client's round trip
  never counts) is fitted by what the step before it ran: a line over the decode lanes
  (lane_s, and its intercept plus the hand-off as step_s), and the median excess after a
  prefill-only step (chunk_s).
- keep, restore, copy_bytes_per_s and shape come from a base profile (--base:
  bench/profile.py measures those in-process), not from this server's own keeps: its
  grid's keeps took 2.9x the base curve, the fidelity workload's 1.4x at the same bytes
  (allocation and idle-then-busy patterns differ), so they do not carry over
  (bench/RESULTS.md, session 11). invariant_rows is the server's own (its `ready` log
  line), since the simulator must resume where this server does.
Before timing, one untimed request of each row count and one short reply (kernels and GEMM
algorithms are picked per shape on first use). Tables are made non-decreasing
(bench.profile.monotone), as bench/profile.py's are.

Usage (GPU): python -m bench.serve_profile --server-args "--random-weights qwen3.5-2b" \\
                 --base qwen3.5-2b-h200 --name qwen3.5-2b-h200-served --out sim/profiles
(CPU, tiny): python -m bench.serve_profile --grid tiny --base P.json --out DIR --name tiny-served
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import shlex
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from bench.fidelity_report import BUSY_GAP_S
from bench.profile import monotone, noisy_note, steep_raises
from executor.server_process import attach_server_args, running_server
from policy.config import format_policy, policy_from_dict
from sim.api import git_commit, machine
from policy.shape import state_bytes
from sim.cost import Grid, HostCost, Profile, TableCost, load_profile, profile_to_dict

PROMPT_CACHE_GIB = 4
"""The server policy's prompt cache budget, GiB (--server-args may override it): room for the longest
context's kept prefix and a few points, and a small reserve of cache memory at start-up
(`NumbaCudaBackend.reserve_cache`) beside the 64 GiB default."""

SETTLE_S = 0.03
"""Seconds between two reads of the step file that must agree before a batch is taken (the
server idle): longer than the loop's time between two steps of one batch."""

PREFILL_TOKENS = 2
"""Tokens a timed prefill point's request asks for. Not 1: the loop's time after a chunk
step (chunk_s) is measured only where a busy step follows it, and a reply that ended at
its first token left the next step to the client's next request, so chunk_s came from the
decode points' long prompts alone. H200, 2B (bench/RESULTS.md, session 18): chunk_s 747 us
with 1 token, 373 us with 2 (a served first-token step is followed by 384 us of loop time
in the fidelity run), and the fidelity workload's TTFT error 10.6% -> 8.7%."""

IDS = (1000, 30000)
"""Random prompt token ids are drawn from [IDS[0], IDS[1]) (inside every Qwen3.5 vocabulary)."""


@attrs.frozen(kw_only=True)
class ServeGrid:
    """The points a server profile measures.

    rows: prefill chunk rows, each in [1, chunk_rows]; contexts: rows before a chunk and
    each decode lane's prompt rows, multiples of chunk_rows; lanes: decode lane counts
    (the server runs max(lanes) lanes); repeat: requests per prefill point; decode_tokens:
    the pure L-lane decode rounds a decode point aims for (`reply_tokens`); chunk_rows: the
    server policy's max_chunk_rows and grid_rows. Raises ValueError naming the field."""

    rows: tuple[int, ...]
    contexts: tuple[int, ...]
    lanes: tuple[int, ...]
    repeat: int = 3
    decode_tokens: int = 24
    chunk_rows: int = 4096
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if self.chunk_rows < 1 or self.repeat < 1 or self.decode_tokens < 1:
            raise ValueError("chunk_rows, repeat and decode_tokens must be >= 1")
        for name, values in (("rows", self.rows), ("contexts", self.contexts), ("lanes", self.lanes)):
            if not values or list(values) != sorted(set(values)):
                raise ValueError(f"{name} must be ascending and distinct, got {values}")
        if self.rows[0] < 1 or self.rows[-1] > self.chunk_rows:
            raise ValueError(f"rows {self.rows} must lie in [1, chunk_rows={self.chunk_rows}]")
        if any(c < 0 or c % self.chunk_rows for c in self.contexts):
            raise ValueError(f"contexts {self.contexts} must be multiples of chunk_rows={self.chunk_rows}")
        if self.lanes[0] < 1:
            raise ValueError(f"lanes {self.lanes} must be >= 1")

    def reply_tokens(self, lanes: int, context: int) -> int:
        """Tokens each reply of a decode point gives: the lanes' prompts take up to
        lanes x (context / chunk_rows + 1) steps, each of which also decodes the lanes
        already in, then decode_tokens more rounds run all `lanes` lanes."""
        return lanes * (context // self.chunk_rows + 1) + self.decode_tokens

    @property
    def context_rows(self) -> int:
        """The server's --context: the longest prompt plus its reply (a prefill point's
        PREFILL_TOKENS or a decode point's `reply_tokens`), plus one."""
        reply = max(self.reply_tokens(lanes, ctx) for lanes in self.lanes for ctx in self.contexts)
        return max(max(self.contexts) + self.rows[-1] + PREFILL_TOKENS, max(self.contexts) + reply) + 1


GRIDS = {
    "full": ServeGrid(rows=(1, 16, 64, 128, 256, 512, 1024, 2048, 4096), contexts=(0, 4096, 12288, 24576),
                      lanes=(1, 2, 4, 8, 16)),
    "quick": ServeGrid(rows=(1, 64, 256, 1024, 4096), contexts=(0, 4096, 24576), lanes=(1, 4, 16), repeat=2),
    "tiny": ServeGrid(rows=(1, 8, 32), contexts=(0, 32), lanes=(1, 2), repeat=2, decode_tokens=6, chunk_rows=32),
}
"""`full` and `quick` for the H200 presets (contexts stay under the GPU's 32768-row cap);
`tiny` for the built-in tiny model on the CPU (tests)."""


def read_steps(path: Path) -> list[dict[str, Any]]:
    """The step records of a step file (executor.runtime's `steps`), in file order."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prefill_steps(steps: Sequence[dict[str, Any]], rows: int, context: int, restore_s: float = 0.0) -> list[float]:
    """Of the steps that ran exactly a chunk of `rows` rows from row `context` and nothing
    else (no decode lane, no full-hit restore): ran_s less the keep phase and, when the step
    restored its pass's state, less `restore_s` (the base profile's restore of a state at
    `context` rows). Not less the restore phase: that is the host's launch of the copies,
    whose device time lands in the forward phase (it waits for the logits), and the
    simulator charges a restore's whole time from the base profile."""
    return [s["ran_s"] - s["phases"].get("keep", 0.0) - (restore_s if "restore" in s["phases"] else 0.0)
            for s in steps
            if s["prefill_rows"] == rows and s["prefill_start"] == context and not s["decode"] and not s["restores"]]


def decode_steps(steps: Sequence[dict[str, Any]], lanes: int) -> list[float]:
    """ran_s of the steps that decoded exactly `lanes` lanes and did nothing else."""
    return [s["ran_s"] for s in steps if s["decode"] == lanes and not s["prefill_rows"] and not s["restores"]]


class Client:
    """Greedy /v1/completions requests of token ids to a server at `url` (model `model`)."""

    def __init__(self, url: str, model: str, timeout_s: float = 600.0) -> None:
        self.url, self.model, self.timeout_s = url, model, timeout_s

    def complete(self, ids: Sequence[int], max_tokens: int) -> dict[str, Any]:
        """One request; returns the response JSON. Raises RuntimeError on a non-200 answer."""
        body = json.dumps({"model": self.model, "prompt": list(map(int, ids)), "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"/v1/completions answered {exc.code}: {exc.read()[:300]!r}") from None


def handoff_s(steps: Sequence[dict[str, Any]]) -> float:
    """Median seconds of a step beyond its phases (ran_s - sum of phases: the hand-off to the
    worker and back), at least 0; 0 without steps."""
    extra = [s["ran_s"] - sum(s["phases"].values()) for s in steps]
    return max(0.0, float(np.median(extra))) if extra else 0.0


def host_terms(batches: Sequence[Sequence[dict[str, Any]]], handoff: float) -> HostCost:
    """The serving loop's host seconds as the simulator charges them (module docstring):
    gaps between consecutive steps of one batch, each credited to the step before it; a
    least-squares line over the decode lanes of decode-only steps (the median gap per lane
    count) gives lane_s and an intercept, step_s = intercept + handoff, and chunk_s is the
    median gap after a prefill-only step beyond the intercept. Negative fits become 0."""
    after_decode: dict[int, list[float]] = {}
    after_chunk: list[float] = []
    for batch in batches:
        for a, b in zip(batch, batch[1:]):
            gap = b["t"] - b["ran_s"] - a["t"]
            if not 0 <= gap < BUSY_GAP_S or a["restores"]:
                continue
            if a["decode"] and not a["prefill_rows"]:
                after_decode.setdefault(a["decode"], []).append(gap)
            elif a["prefill_rows"] and not a["decode"]:
                after_chunk.append(gap)
    points = sorted((lanes, float(np.median(g))) for lanes, g in after_decode.items())
    if len(points) >= 2:
        slope, intercept = np.polyfit([x for x, _ in points], [y for _, y in points], 1)
    elif points:
        slope, intercept = 0.0, points[0][1]
    else:
        slope, intercept = 0.0, float(np.median(after_chunk)) if after_chunk else 0.0
    lane_s, base = max(0.0, float(slope)), max(0.0, float(intercept))
    if len(points) == 1:  # one lane count: its gap is the step's plus its lanes', unsplit
        lane_s = 0.0
    chunk_s = max(0.0, float(np.median(after_chunk)) - base) if after_chunk and points else 0.0
    return HostCost(step_s=base + handoff, lane_s=lane_s, chunk_s=chunk_s)


@attrs.frozen(kw_only=True)
class Served:
    """What a server measured: prefill[i][j] at (rows[i], contexts[j]), decode[i][j] at
    (lanes[i], contexts[j]) (median seconds without the hand-off, not yet non-decreasing),
    host (the loop's terms, `host_terms`), handoff_s, steps (records used)."""

    prefill: tuple[tuple[float, ...], ...]
    decode: tuple[tuple[float, ...], ...]
    host: HostCost
    handoff_s: float
    steps: int


def measure(client: Client, steps_path: Path, grid: ServeGrid, log: Callable[[str], None] = print,
            restore_s: Callable[[int], float] = lambda rows: 0.0) -> Served:
    """Drive the server through every grid point and read its step file (module docstring).
    restore_s(rows): seconds the simulator charges to restore a state at `rows` rows (the
    base profile's), taken out of the resumed prefill points. Raises RuntimeError naming the
    point when the server ran no step of it, or did not resume where it should."""
    rng = np.random.default_rng(grid.seed)
    ids = lambda n: rng.integers(*IDS, n).tolist()  # noqa: E731
    seen = len(read_steps(steps_path))

    def new_steps() -> list[dict[str, Any]]:
        """The steps since the last call, once the server is idle: the file read again every
        SETTLE_S until it stops growing (a reply can reach the client before the step that
        ends its request is written, or before a step that request caused runs: without the
        wait such a step went to the next batch, as a fresh CI run found in session 24)."""
        nonlocal seen
        steps = read_steps(steps_path)
        while True:
            time.sleep(SETTLE_S)
            again = read_steps(steps_path)
            if len(again) == len(steps):
                break
            steps = again
        out, seen = steps[seen:], len(steps)
        return out

    # untimed: a chunk of every row count (kernels, GEMM algorithms per shape) and a decode round
    for rows in grid.rows:
        client.complete(ids(rows), 1)
    client.complete(ids(1), 3)
    new_steps()
    batches: list[list[dict[str, Any]]] = []
    prefill_raw: list[list[tuple[int, int, int]]] = [[] for _ in grid.rows]
    for ctx in grid.contexts:
        prefix = ids(ctx)
        if ctx:  # untimed: keeps the state at the mark ctx (the extra row puts the mark inside the
            # prompt; its id lies outside IDS, so no point's prompt equals this one)
            client.complete(prefix + [IDS[0] - 1], 1)
            new_steps()
        firsts: set[int] = set()  # no two points at ctx share their first new id: none repeats another
        for i, rows in enumerate(grid.rows):
            for _ in range(grid.repeat):
                suffix = ids(rows)
                while suffix[0] in firsts:
                    suffix[0] = ids(1)[0]
                firsts.add(suffix[0])
                reply = client.complete(prefix + suffix, PREFILL_TOKENS)
                cached = reply.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens")
                if cached != ctx:
                    raise RuntimeError(f"prefill point of {rows} rows at context {ctx}: the server resumed at "
                                       f"{cached} (cached_tokens), not at {ctx}; is its prompt cache on, with "
                                       f"room for a state of {ctx} rows?")
                batches.append(new_steps())
            prefill_raw[i].append((rows, ctx, len(batches) - grid.repeat))
    decode_raw = []
    with concurrent.futures.ThreadPoolExecutor(max(grid.lanes)) as pool:
        for lanes in grid.lanes:
            line = []
            for ctx in grid.contexts:
                tokens = grid.reply_tokens(lanes, ctx)
                for _ in range(2):  # a second try when the replies did not overlap (requests arrive as they may)
                    list(pool.map(lambda p: client.complete(p, tokens), [ids(max(ctx, 1)) for _ in range(lanes)]))
                    batches.append(new_steps())
                    if decode_steps(batches[-1], lanes):
                        break
                line.append((lanes, ctx, len(batches) - 1))
            decode_raw.append(line)
    used = [s for batch in batches for s in batch]
    handoff = handoff_s(used)

    def point(select, first: int, count: int, label: str) -> float:
        times = [t - handoff for batch in batches[first:first + count] for t in select(batch)]
        if not times:
            raise RuntimeError(f"no {label} in {steps_path}")
        return float(np.median(times))

    prefill = tuple(tuple(point(lambda b, r=r, c=c: prefill_steps(b, r, c, restore_s(c)), i, grid.repeat,
                                f"prefill step of {r} rows at context {c}") for r, c, i in line)
                    for line in prefill_raw)
    decode = tuple(tuple(point(lambda b, n=n: decode_steps(b, n), i, 1, f"decode step of {n} lanes at context {c}")
                         for n, c, i in line) for line in decode_raw)
    log("  ms at context " + " ".join(f"{c:>8}" for c in grid.contexts)
        + "  (as measured; the profile's tables are made non-decreasing)")
    for name, values, table in (("prefill", grid.rows, prefill), ("decode", grid.lanes, decode)):
        unit = "rows" if name == "prefill" else "lanes"
        for v, line in zip(values, table):
            log(f"  {name} {v:>5} {unit}: " + " ".join(f"{s * 1e3:8.2f}" for s in line))
    return Served(prefill=prefill, decode=decode, host=host_terms(batches, handoff), handoff_s=handoff,
                  steps=len(used))


def to_profile(served: Served, grid: ServeGrid, base: Profile, name: str, command: str,
               server_args: Sequence[str], served_model: str = "",
               invariant_rows: int | None | str = "base", gpu: str | None = None) -> Profile:
    """The measured Profile: the server's tables and loop time, the base profile's keep,
    restore, copy rate and shape. invariant_rows: the server's (rows, or None for no grid;
    "base": the base profile's). Raises ValueError when the base profile has no measured
    table cost (keep and restore curves). The gpu, model and shape are the base's too:
    measure against the base's model shape on the base's GPU (the server's own model id
    goes to the provenance as served_model). gpu: the server's device where it is not the
    base's (a CPU server measured against a GPU base: "CPU (reference backend)")."""
    if not isinstance(base.cost, TableCost):
        raise ValueError(f"--base {base.name}: needs a measured (table) profile for its keep and restore curves")
    rows, ctx, lanes = (tuple(map(float, v)) for v in (grid.rows, grid.contexts, grid.lanes))
    cost = attrs.evolve(base.cost, prefill=Grid(x=rows, y=ctx, seconds=monotone(served.prefill)),
                        decode=Grid(x=lanes, y=ctx, seconds=monotone(served.decode)), host=served.host)
    notes = (f"measured through the server's steps by bench/serve_profile.py (ran_s of its step file less the "
             f"median hand-off, {served.handoff_s * 1e6:.0f} us, less the step's keep and the base profile's "
             f"restore; median of {grid.repeat} requests a prefill point; decode: steps of exactly L lanes), "
             f"tables made non-decreasing; host: the hand-off plus the loop's time between busy steps, fitted over "
             f"lanes and chunks; keep, restore, copy rate: from {base.name}")
    provenance = (("backend", "server"), ("command", command), ("server_args", " ".join(server_args)),
                  ("commit", git_commit()), ("date", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")),
                  ("base", base.name), ("served_model", served_model), ("steps", str(served.steps)),
                  ("machine", machine()))
    grid_rows = base.invariant_rows if invariant_rows == "base" else invariant_rows
    if grid_rows != base.invariant_rows:
        notes += f"; invariant_rows {grid_rows}: the server's (the base's: {base.invariant_rows})"
    return Profile(name=name, source="measured", gpu=gpu or base.gpu, model=base.model, shape=base.shape,
                   invariant_rows=grid_rows, cost=cost, notes=notes, provenance=provenance)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--server-args", default="", help="more server flags, e.g. \"--random-weights qwen3.5-2b\" "
                                                       "(default: the built-in tiny model)")
    ap.add_argument("--base", required=True, help="measured profile (name or JSON) for keep, restore, shape")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="full", help="grid preset (default: full)")
    ap.add_argument("--name", required=True, help="the new profile's name (its file: NAME.json)")
    ap.add_argument("--out", type=Path, required=True, help="folder for NAME.json, the trace and the server log")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="server start limit (default: 900)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="requests a prefill point, their median its time (default: the grid's: full 3, quick 2, "
                         "tiny 2; 5 fitted no better than 3 on the 2B: bench/RESULTS.md session 17)")
    args = ap.parse_args(attach_server_args(argv))
    try:
        try:
            base = load_profile(args.base)
        except (ValueError, OSError, KeyError) as exc:
            raise ValueError(f"--base: {exc}") from None
        grid = GRIDS[args.grid]
        if args.repeat is not None:
            if args.repeat < 1:
                raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
            grid = attrs.evolve(grid, repeat=args.repeat)
        if not isinstance(base.cost, TableCost):
            raise ValueError(f"--base {base.name}: needs a measured (table) profile for its keep and restore curves")
    except (ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    policy = args.out / "policy.toml"
    policy.write_text(format_policy(policy_from_dict({"max_chunk_rows": grid.chunk_rows, "grid_rows": grid.chunk_rows,
                                                      "lanes": max(grid.lanes),
                                                      "prompt_cache_bytes": PROMPT_CACHE_GIB << 30})))
    trace = args.out / "trace.jsonl"
    server_args = [*shlex.split(args.server_args), "--policy", str(policy), "--context", str(grid.context_rows),
                   "--trace", str(trace)]
    command = " ".join(["python -m bench.serve_profile", *(argv if argv is not None else sys.argv[1:])])
    t0 = time.perf_counter()
    try:
        with running_server(server_args, args.out / "server.log", args.timeout_s) as (url, ready, model):
            if "invariant_rows" not in ready:
                raise RuntimeError(f"no invariant_rows in the server's ready line ({args.out / 'server.log'})")
            grid_rows = ready["invariant_rows"]
            if grid_rows != base.invariant_rows:
                print(f"note: the server resumes on invariant_rows {grid_rows}, --base {base.name} on "
                      f"{base.invariant_rows}: the profile takes the server's", flush=True)
            print(f"{args.name}: server ready at {url} ({time.perf_counter() - t0:.1f} s)", flush=True)
            served = measure(Client(url, model), trace.with_name(trace.name + ".steps.jsonl"), grid,
                             restore_s=lambda rows: base.restore_s(state_bytes(base.shape, rows)))
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    gpu = "CPU (reference backend)" if ready.get("backend") == "reference" else None
    profile = to_profile(served, grid, base, args.name, command, server_args, model, grid_rows, gpu)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(profile_to_dict(profile), indent=2) + "\n")
    note = noisy_note(steep_raises("prefill", served.prefill, grid.rows, grid.contexts, "rows")
                      + steep_raises("decode", served.decode, grid.lanes, grid.contexts, "lanes"))
    if note:
        print(note, flush=True)
    h = served.host
    print(f"{args.name}: {served.steps} steps; hand-off {served.handoff_s * 1e6:.0f} us; host {h.step_s * 1e6:.0f} us "
          f"a step + {h.lane_s * 1e6:.1f} us a lane + {h.chunk_s * 1e6:.0f} us a chunk; wrote {path} "
          f"({time.perf_counter() - t0:.1f} s in all)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
