"""Measure a simulator profile through the real server's own steps (the serving loop's costs,
not the backend's calls alone).

Why: bench/profile.py times the backend's calls in-process and adds host terms measured on a
backend that costs nothing; on the H200 a 2B server's steps still took 1.1-1.3x what that
profile charges (the worker hand-off, the loop's time between steps, keeps under the GIL
the loop shares), and a replay of the same run with the server's own step costs brought the
simulator's TTFT error from 22.9% to 10.0% (bench/RESULTS.md, session 10).

How: start `python -m executor.serve ARGS --prompt-cache-gib 0 --trace DIR/trace.jsonl` with a
policy whose marks and chunks are `chunk_rows` apart, and read the step file it writes beside
the trace (`trace.jsonl.steps.jsonl`: each step's seconds in the backend worker, `ran_s`):
- prefill (R rows after C rows): one request at a time, a prompt of C + R random token ids,
  one token out. C is a multiple of chunk_rows and R at most chunk_rows, so the prompt's last
  chunk is exactly [C, C + R), its logits read, as the simulator's prefill_s prices it; its
  step's ran_s (median over `repeat` requests).
- decode (L lanes, C rows each): L concurrent requests with prompts of C rows and
  `reply_tokens(L, C)` tokens out (enough that the first reply still decodes when the last
  prompt is in: each step that prefills a chunk also decodes the lanes already in); the
  median ran_s of the steps that decoded exactly L lanes and did nothing else.
- host: step_s is the loop's median time between steps while busy (the next step's start
  minus the last one's end, under bench.fidelity_report.BUSY_GAP_S); lane_s and chunk_s are
  0, since ran_s already holds the worker's per-lane and per-chunk work.
- keep, restore, copy_bytes_per_s, shape and invariant_rows come from a base profile
  (--base: with the cache off the server keeps nothing); bench/profile.py measures those.
Tables are made non-decreasing (bench.profile.monotone), as bench/profile.py's are.

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

from bench.fidelity_report import busy_gaps
from bench.profile import monotone
from executor.server_process import start_server, stop_server
from policy.config import format_policy, policy_from_dict
from sim.api import git_commit
from sim.cost import Grid, HostCost, Profile, TableCost, load_profile, profile_to_dict

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
        """The server's --context: the longest prompt plus the longest reply."""
        reply = max(self.reply_tokens(lanes, ctx) for lanes in self.lanes for ctx in self.contexts)
        return max(max(self.contexts) + self.rows[-1], max(self.contexts) + reply) + 1


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


def prefill_steps(steps: Sequence[dict[str, Any]], rows: int, context: int) -> list[float]:
    """ran_s of the steps that ran exactly a chunk of `rows` rows from row `context` and
    nothing else (no decode lane, no restore)."""
    return [s["ran_s"] for s in steps if s["prefill_rows"] == rows and s["prefill_start"] == context
            and not s["decode"] and not s["restores"]]


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


@attrs.frozen(kw_only=True)
class Served:
    """What a server measured: prefill[i][j] at (rows[i], contexts[j]), decode[i][j] at
    (lanes[i], contexts[j]) (median seconds, not yet non-decreasing), step_s (the loop's
    median time between steps while busy; None when no gap was seen), steps (records used)."""

    prefill: tuple[tuple[float, ...], ...]
    decode: tuple[tuple[float, ...], ...]
    step_s: float | None
    steps: int


def measure(client: Client, steps_path: Path, grid: ServeGrid, log: Callable[[str], None] = print) -> Served:
    """Drive the server through every grid point and read its step file (module docstring).
    Raises RuntimeError naming the point when the server ran no step of it."""
    rng = np.random.default_rng(grid.seed)
    ids = lambda n: rng.integers(*IDS, n).tolist()  # noqa: E731
    seen = len(read_steps(steps_path))

    def new_steps() -> list[dict[str, Any]]:
        nonlocal seen
        steps = read_steps(steps_path)
        out, seen = steps[seen:], len(steps)
        return out

    client.complete(ids(grid.rows[0]), 1)  # a first request: anything lazy happens here, untimed
    new_steps()
    used: list[dict[str, Any]] = []
    prefill = []
    for rows in grid.rows:
        line = []
        for ctx in grid.contexts:
            times = []
            for _ in range(grid.repeat):
                client.complete(ids(ctx + rows), 1)
                got = new_steps()
                used += got
                times += prefill_steps(got, rows, ctx)
            if not times:
                raise RuntimeError(f"no prefill step of {rows} rows at context {ctx} in {steps_path}")
            line.append(float(np.median(times)))
        prefill.append(tuple(line))
        log(f"  prefill {rows:>5} rows: " + " ".join(f"{s * 1e3:8.2f}" for s in line) + " ms")
    decode = []
    with concurrent.futures.ThreadPoolExecutor(max(grid.lanes)) as pool:
        for lanes in grid.lanes:
            line = []
            for ctx in grid.contexts:
                prompts = [ids(max(ctx, 1)) for _ in range(lanes)]
                tokens = grid.reply_tokens(lanes, ctx)
                list(pool.map(lambda p: client.complete(p, tokens), prompts))
                got = new_steps()
                used += got
                times = decode_steps(got, lanes)
                if not times:
                    raise RuntimeError(f"no decode step of {lanes} lanes at context {ctx} in {steps_path}")
                line.append(float(np.median(times)))
            decode.append(tuple(line))
            log(f"  decode  {lanes:>2} lanes: " + " ".join(f"{s * 1e3:8.2f}" for s in line) + " ms")
    gaps = busy_gaps(used)
    return Served(prefill=tuple(prefill), decode=tuple(decode), step_s=float(np.median(gaps)) if gaps else None,
                  steps=len(used))


def to_profile(served: Served, grid: ServeGrid, base: Profile, name: str, command: str,
               server_args: Sequence[str]) -> Profile:
    """The measured Profile: the server's tables and loop time, the base profile's keep,
    restore, copy rate, shape and invariant rows. Raises ValueError when the base profile
    has no measured table cost (keep and restore curves)."""
    if not isinstance(base.cost, TableCost):
        raise ValueError(f"--base {base.name}: needs a measured (table) profile for its keep and restore curves")
    rows, ctx, lanes = (tuple(map(float, v)) for v in (grid.rows, grid.contexts, grid.lanes))
    host = HostCost(step_s=served.step_s or 0.0, lane_s=0.0, chunk_s=0.0)
    cost = attrs.evolve(base.cost, prefill=Grid(x=rows, y=ctx, seconds=monotone(served.prefill)),
                        decode=Grid(x=lanes, y=ctx, seconds=monotone(served.decode)), host=host)
    notes = (f"measured through the server's steps by bench/serve_profile.py (ran_s of its step file, median of "
             f"{grid.repeat} requests a prefill point; decode: steps of exactly L lanes), tables made "
             f"non-decreasing; host: the loop's median time between steps while busy; keep, restore, copy rate: "
             f"from {base.name}")
    provenance = (("backend", "server"), ("command", command), ("server_args", " ".join(server_args)),
                  ("commit", git_commit()), ("date", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")),
                  ("base", base.name), ("steps", str(served.steps)))
    return Profile(name=name, source="measured", gpu=base.gpu, model=base.model, shape=base.shape,
                   invariant_rows=base.invariant_rows, cost=cost, notes=notes, provenance=provenance)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--server-args", default="", help="more server flags, e.g. \"--random-weights qwen3.5-2b\" "
                                                       "(default: the built-in tiny model)")
    ap.add_argument("--base", required=True, help="measured profile (name or JSON) for keep, restore, shape")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="full", help="grid preset (default: full)")
    ap.add_argument("--name", required=True, help="the new profile's name (its file: NAME.json)")
    ap.add_argument("--out", type=Path, required=True, help="folder for NAME.json, the trace and the server log")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="server start limit (default: 900)")
    args = ap.parse_args(argv)
    try:
        base = load_profile(args.base)
        grid = GRIDS[args.grid]
        if not isinstance(base.cost, TableCost):
            raise ValueError(f"--base {base.name}: needs a measured (table) profile for its keep and restore curves")
    except (ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    policy = args.out / "policy.toml"
    policy.write_text(format_policy(policy_from_dict({"max_chunk_rows": grid.chunk_rows, "grid_rows": grid.chunk_rows,
                                                      "lanes": max(grid.lanes)})))
    trace = args.out / "trace.jsonl"
    server_args = [*shlex.split(args.server_args), "--policy", str(policy), "--prompt-cache-gib", "0",
                   "--context", str(grid.context_rows), "--trace", str(trace)]
    command = " ".join(["python -m bench.serve_profile", *(argv if argv is not None else sys.argv[1:])])
    t0 = time.perf_counter()
    proc, url, _ = start_server(server_args, args.out / "server.log", args.timeout_s)
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        print(f"{args.name}: server ready at {url} ({time.perf_counter() - t0:.1f} s)", flush=True)
        served = measure(Client(url, model), trace.with_name(trace.name + ".steps.jsonl"), grid)
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_server(proc, 30.0)
    profile = to_profile(served, grid, base, args.name, command, server_args)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(profile_to_dict(profile), indent=2) + "\n")
    step = "none seen" if served.step_s is None else f"{served.step_s * 1e6:.0f} us"
    print(f"{args.name}: {served.steps} steps; loop between steps {step}; wrote {path} "
          f"({time.perf_counter() - t0:.1f} s in all)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
