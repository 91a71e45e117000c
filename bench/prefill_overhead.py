"""Host time of short prefill chunks on the numba-cuda backend: wall time against device time,
and where the host time goes (cProfile), at real Qwen3.5 shapes with random weights.

A continuation after a warm pass prefills a few dozen rows; on the GPU that is a read of
every weight (27B: ~12 ms at 4.3 TB/s) plus hundreds of launches, and the wall time is what
the receipt's TTFT ratio sees. For each rows in --rows at context --context: wall seconds of
`backend.prefill` (logits on the host); the device seconds of the same chunk launched by
`backend.prefill_step` from inputs already on the device, queued behind a spin kernel (so the
host's launch time is hidden: `prefill` itself copies its inputs from pageable host memory,
which waits for the spin, so it cannot be timed this way); and the top functions of one call
under cProfile by own time.
Usage (GPU machine): python -m bench.prefill_overhead [--presets qwen3.5-2b,qwen3.5-27b]
    [--rows 1,16,64,256] [--context 4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import numpy as np

from bench.decode_prefill import _fresh_states
from executor.numba_cuda import device_weights
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


def measure(name: str, rows_list: list[int], context: int, repeat: int, seed: int = 0) -> dict:
    """Wall and device seconds per chunk for each rows at `context`, and a cProfile digest."""
    config = preset(name)
    capacity = context + max(rows_list) + 64
    backend = NumbaCudaBackend.from_device_weights(config, device_weights.random(config, seed), slots=2,
                                                   capacity_rows=capacity)
    for i, array in enumerate((backend.pool.keys, backend.pool.values)):
        device_weights.fill_uniform(array, seed + 90 + i, 2.0)
    (state,) = _fresh_states(backend, 1, context, seed)
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(0, config.vocab_size, capacity)]
    _prefill(backend, state, ids[: context + 64], context)  # compile and pin everything once
    out = {"preset": name, "context": context, "pool": POOL is not None, "rows": []}
    for rows in rows_list:
        chunk = ids[: context + rows]
        walls = []
        for _ in range(repeat):
            synchronize()
            t0 = time.perf_counter()
            _prefill(backend, state, chunk, context)
            walls.append(time.perf_counter() - t0)
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
        prof.enable()
        _prefill(backend, state, chunk, context)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        out["rows"].append({"rows": rows, "wall_s": float(np.median(walls)), "device_s": device,
                            "profile": text.getvalue()})
        print(f"{name} ctx {context} rows {rows}: wall {np.median(walls) * 1e3:.1f} ms, device "
              f"{device * 1e3:.1f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="qwen3.5-2b,qwen3.5-27b")
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="folder for prefill_overhead.json")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    results = {"device": device_name(), "runs": []}
    for name in args.presets.split(","):
        results["runs"].append(measure(name, rows, args.context, args.repeat))
    print("\n| model | pool | ctx | rows | wall ms | device ms | host share |\n| --- | --- | --- | --- | --- | --- | --- |")
    for run in results["runs"]:
        for r in run["rows"]:
            print(f"| {run['preset']} | {'on' if run['pool'] else 'off'} | {run['context']} | {r['rows']} | "
                  f"{r['wall_s'] * 1e3:.1f} | {r['device_s'] * 1e3:.1f} | {1 - r['device_s'] / r['wall_s']:.0%} |")
    last = results["runs"][-1]["rows"][-1]
    print(f"\ncProfile of one {results['runs'][-1]['preset']} chunk of {last['rows']} rows (own time):\n{last['profile']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefill_overhead.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
