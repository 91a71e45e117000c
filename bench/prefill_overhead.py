"""Host time of short prefill chunks on the numba-cuda backend: wall time against device time,
and where the host time goes (cProfile), at real Qwen3.5 shapes with random weights.

A continuation after a warm pass prefills a few dozen rows; on the GPU that is a read of
every weight (27B: ~12 ms at 4.3 TB/s) plus hundreds of launches, and the wall time is what
the receipt's TTFT ratio sees. For each rows in --rows at context --context: wall seconds of
`backend.prefill` (logits on the host); the device seconds of the same chunk launched by
`backend.prefill_step` from inputs already on the device, queued behind a spin kernel (so the
host's launch time is hidden: `prefill` itself copies its inputs from pageable host memory,
which waits for the spin, so it cannot be timed this way); and the top functions of one call
under cProfile by own time. The wall time is taken up to three times in the same run,
interleaved: with numba's own kernel launches (`launch.numba_launches()`), with the fast
launch path (executor/numba_cuda/launch.py), with the kernel launches per chunk counted, and
(with --prefill-graphs, the default, for chunks a bucket holds) replayed as the captured
chunk of its bucket (graphs.PrefillGraphs, as the server runs them).
Usage (GPU machine): python -m bench.prefill_overhead [--presets qwen3.5-2b,qwen3.5-27b]
    [--rows 1,16,64,256] [--context 4096] [--no-prefill-graphs] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import numpy as np

from bench.decode_prefill import _fresh_states, _profile
from executor.numba_cuda import device_weights, launch
from executor.numba_cuda.backend import NumbaCudaBackend
from executor.numba_cuda.device import (
    POOL,
    device_name,
    elapsed_seconds,
    new_event,
    spin,
    synchronize,
    to_device,
)
from executor.presets import preset


def _prefill(backend: NumbaCudaBackend, state, ids: list[int], start: int) -> None:
    state.rows = start
    backend.prefill(state, ids, (start, len(ids)))


def measure(name: str, rows_list: list[int], context: int, repeat: int, seed: int = 0, kernels: bool = False,
            graphs: bool = True) -> dict:
    """Wall and device seconds per chunk for each rows at `context`, and a cProfile digest
    (with `kernels`, also the device ms of each kernel function, bench.decode_prefill._profile;
    with `graphs`, also the wall seconds of the captured chunk where a bucket holds it)."""
    config = preset(name)
    capacity = context + max(rows_list) + 64
    backend = NumbaCudaBackend.from_device_weights(config, device_weights.random(config, seed), slots=2,
                                                   capacity_rows=capacity)
    for i, array in enumerate((backend.pool.keys, backend.pool.values)):
        device_weights.fill_uniform(array, seed + 90 + i, 2.0)
    (state,) = _fresh_states(backend, 1, context, seed)
    if graphs and not backend.enable_prefill_graphs():
        print(f"{name}: no prefill graphs: {backend.prefill_graphs_off}", flush=True)
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(0, config.vocab_size, capacity)]
    with backend.eager_prefill():
        _prefill(backend, state, ids[: context + 64], context)  # compile and pin everything once
    synchronize()
    start, stop = new_event(), new_event()
    start.record()
    spin(1000.0)
    stop.record()
    spin_s = elapsed_seconds(start, stop)  # the device times below hold only if this outlasts the host's launches
    out = {"preset": name, "context": context, "pool": POOL is not None, "spin_s": spin_s, "rows": []}
    print(f"{name}: a 1000 ms spin took {spin_s * 1e3:.0f} ms on the device", flush=True)
    for rows in rows_list:
        chunk = ids[: context + rows]
        walls = {"numba": [], "fast": []}
        if backend.prefill_graphs is not None and backend.prefill_graphs.serves(context, context + rows):
            walls["graph"] = []
        counted = sum(k.fast_launches + k.numba_launches for k in launch.KERNELS)
        with backend.eager_prefill():
            _prefill(backend, state, chunk, context)
        launches = sum(k.fast_launches + k.numba_launches for k in launch.KERNELS) - counted
        for _ in range(repeat):
            for mode in walls:
                synchronize()
                with (launch.numba_launches() if mode == "numba" else contextlib.nullcontext(),
                      backend.eager_prefill() if mode != "graph" else contextlib.nullcontext()):
                    t0 = time.perf_counter()
                    _prefill(backend, state, chunk, context)
                    walls[mode].append(time.perf_counter() - t0)
        args = [to_device(np.asarray(a, np.int32)) for a in
                (ids[context : context + rows], np.arange(context, context + rows), np.full(rows, state.slot),
                 [state.slot], [0, rows])]
        synchronize()
        spin(1000.0)
        start, stop = new_event(), new_event()
        start.record()
        backend.prefill_step(*args, context + rows - 1, slot=state.slot)
        stop.record()
        device = elapsed_seconds(start, stop)
        prof = cProfile.Profile()
        with backend.eager_prefill():
            prof.enable()
            _prefill(backend, state, chunk, context)
            prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        split = _profile(backend, lambda: backend.prefill_step(*args, context + rows - 1, slot=state.slot), 1000.0,
                         False) if kernels else None
        wall = {mode: float(np.median(times)) for mode, times in walls.items()}
        out["rows"].append({"rows": rows, "wall_s": wall["fast"], "wall_numba_launch_s": wall["numba"],
                            "wall_graph_s": wall.get("graph"), "device_s": device, "launches": launches,
                            "profile": text.getvalue(), "kernels": split})
        graph = "" if "graph" not in wall else f" {wall['graph'] * 1e3:.1f} ms (graph)"
        print(f"{name} ctx {context} rows {rows}: wall {wall['numba'] * 1e3:.1f} ms (numba launches) "
              f"{wall['fast'] * 1e3:.1f} ms (fast){graph}, device {device * 1e3:.1f} ms, {launches} kernel launches",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="qwen3.5-2b,qwen3.5-27b")
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--kernels", action="store_true", help="also split each chunk's device time by kernel")
    ap.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="also time chunks replayed as captured graphs (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="folder for prefill_overhead.json")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    results = {"device": device_name(), "runs": []}
    for name in args.presets.split(","):
        results["runs"].append(measure(name, rows, args.context, args.repeat, kernels=args.kernels,
                                       graphs=args.prefill_graphs))
    print("\n| model | pool | ctx | rows | kernel launches | wall ms, numba launches | wall ms, fast launches | "
          "fast / numba | device ms | host share (fast) | wall ms, graph | graph / fast |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in results["runs"]:
        for r in run["rows"]:
            g = r["wall_graph_s"]
            graph = "- | -" if g is None else f"{g * 1e3:.1f} | {g / r['wall_s']:.2f}"
            print(f"| {run['preset']} | {'on' if run['pool'] else 'off'} | {run['context']} | {r['rows']} | "
                  f"{r['launches']} | {r['wall_numba_launch_s'] * 1e3:.1f} | {r['wall_s'] * 1e3:.1f} | "
                  f"{r['wall_s'] / r['wall_numba_launch_s']:.2f} | {r['device_s'] * 1e3:.1f} | "
                  f"{max(0.0, 1 - r['device_s'] / r['wall_s']):.0%} | {graph} |")
    for run in results["runs"] if args.kernels else ():
        for r in run["rows"]:
            split = ", ".join(f"{k} {v['ms']:.1f} ({v['calls']})" for k, v in r["kernels"]["kernels"].items())
            print(f"{run['preset']} rows {r['rows']}: device ms by kernel (calls): {split}")
    last = results["runs"][-1]["rows"][-1]
    print(f"\ncProfile of one {results['runs'][-1]['preset']} chunk of {last['rows']} rows (own time):\n{last['profile']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefill_overhead.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
