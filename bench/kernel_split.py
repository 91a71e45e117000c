"""Device time of one prefill chunk or one decode round, kernel by kernel, from CUPTI.

Where a step's device time goes, without the events-around-each-call method's inflation
(bench.decode_prefill._profile: an event pair per call adds a gap per kernel, which on a
short chunk of ~800 launches doubles the total). torch.profiler's CUDA activity (Kineto on
CUPTI) records every kernel the process launches, numba's and cuBLASLt's too, and those a
CUDA graph replays, with its device start and end. For each case: the wall time of the
call, the host time to launch it (prefill: `prefill_step` from device inputs, returning
before the device finishes), the sum of kernel durations, the span from the first kernel's
start to the last one's end, and the kernels grouped by name (numba's mangled names cut to
the Python function; cuBLASLt's to their first 80 characters) with calls and share.

Usage (GPU machine; torch with CUDA must be importable):
    python -m bench.kernel_split --preset qwen3.5-27b --prefill 51@1984,8192@0 --decode 1@4096
    [--out DIR] (writes kernel_split.json)
    [--ncu] (each case once inside a profiler range, for Nsight Compute: bench/ncu_digest.py)
Cases: prefill ROWS@CONTEXT (a chunk of ROWS rows after CONTEXT rows of random state),
decode LANES@CONTEXT (one CUDA-graph round, as the server replays it).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

_MANGLED = re.compile(r"(\d+)")
_PACKAGE_WORDS = ("cudapy", "executor", "numba_cuda")


def kernel_label(name: str) -> str:
    """A short, stable label for a kernel's device name. CUPTI gives numba kernels
    demangled (`executor::numba_cuda::norms::_add_rms_norm_kernel[abi:v14]...`; Nsight
    Compute: `prepare_kernel::delta_prepare[v1,cw51...](long long, ...)`) or, on
    some drivers, mangled (`_ZN8executor10numba_cuda5norms...`): either is cut to the
    module and function (`norms._add_rms_norm_kernel`; a kernel made by a factory keeps
    the factory's name, `delta_chunked._subchunk_kernel.kernel`); any other name (cuBLASLt's
    `nvjet_sm90_tss_128x128_64x6_2x1_v_bz_TNN` keep their tile shape) to 80 characters."""
    if name.startswith("_ZN"):
        words, i = [], 3
        while i < len(name):
            tag = name[i] == "B"  # an ABI tag: B<len><tag>
            m = _MANGLED.match(name, i + tag)
            if m is None:
                break
            n = int(m.group(1))
            if not tag:
                words.append(name[m.end() : m.end() + n])
            i = m.end() + n
    elif "::" in name:
        words = re.sub(r"\[[^\]]*\]", "", name).split("(")[0].split("::")
    else:
        return name[:80]
    words = [w for w in words if w and w not in _PACKAGE_WORDS and not w.startswith("_3c")]
    return ".".join(words) if words else name[:80]


def split_events(events) -> dict:
    """Group CUPTI kernel records ((name, start_us, end_us), any order) by `kernel_label`:
    {"kernel_ms": sum of durations, "span_ms": first start to last end, "kernels": count,
    "by_label": {label: {"ms", "calls"}} sorted by time, largest first}."""
    events = list(events)
    if not events:
        return {"kernel_ms": 0.0, "span_ms": 0.0, "kernels": 0, "by_label": {}}
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, start, end in events:
        g = groups[kernel_label(name)]
        g[0] += end - start
        g[1] += 1
    total = sum(end - start for _, start, end in events)
    span = max(e for _, _, e in events) - min(s for _, s, _ in events)
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {"kernel_ms": total / 1e3, "span_ms": span / 1e3, "kernels": len(events),
            "by_label": {k: {"ms": round(v[0] / 1e3, 4), "calls": v[1]} for k, v in ranked}}


def _cupti(fn) -> list[tuple[str, float, float]]:
    """Run fn() once under torch.profiler's CUDA activity; its kernels as (name, start us, end us)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and "memcpy" not in e.name.lower() and "memset" not in e.name.lower():
            out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return out


def prefill_case(backend, rows: int, context: int, seed: int, cprofile: int = 0, collect=_cupti) -> dict:
    """Wall, host-launch and CUPTI split of a `rows`-row chunk after `context` rows (with
    `cprofile`, also that many lines of a cProfile digest of one `prefill_step`, by own time;
    collect=_ncu_range: the chunk once for Nsight Compute instead of CUPTI)."""
    from bench.decode_prefill import _fresh_states
    from executor.numba_cuda.device import synchronize, to_device

    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(0, backend.config.vocab_size, context + rows)]
    (state,) = _fresh_states(backend, 1, context, seed)

    def run():
        state.rows = context
        backend.prefill(state, ids, (context, context + rows))

    run()  # compile, pin, pool warm
    synchronize()
    walls = []
    for _ in range(5):
        synchronize()
        t0 = time.perf_counter()
        run()
        walls.append(time.perf_counter() - t0)
    args = [to_device(np.asarray(a, np.int32)) for a in
            (ids[context:], np.arange(context, context + rows), np.full(rows, state.slot), [state.slot], [0, rows])]
    hosts = []
    for _ in range(5):
        synchronize()
        t0 = time.perf_counter()
        backend.prefill_step(*args, context + rows - 1, slot=state.slot)
        hosts.append(time.perf_counter() - t0)
        synchronize()
    split = split_events(collect(lambda: backend.prefill_step(*args, context + rows - 1, slot=state.slot)))
    digest = None
    if cprofile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        backend.prefill_step(*args, context + rows - 1, slot=state.slot)
        prof.disable()
        synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(cprofile)
        digest = text.getvalue()
    backend.release(state)
    return {"case": f"prefill {rows}@{context}", "wall_ms": float(np.median(walls)) * 1e3,
            "host_ms": float(np.median(hosts)) * 1e3, **split, "cprofile": digest}


def decode_case(backend, lanes: int, context: int, seed: int, collect=_cupti) -> dict:
    """Wall and CUPTI split of one CUDA-graph decode round of `lanes` lanes at `context`
    (collect=_ncu_range: the round once for Nsight Compute instead)."""
    from bench.decode_prefill import _fresh_states
    from executor.numba_cuda.graphs import DecodeGraphs

    states = _fresh_states(backend, lanes, context, seed)
    tokens = [int(t) for t in np.random.default_rng(seed).integers(0, backend.config.vocab_size, lanes)]
    graphs = DecodeGraphs(backend)
    try:
        graphs.decode(states, tokens)
        walls = []
        for _ in range(8):
            for s in states:
                s.rows = context
            t0 = time.perf_counter()
            graphs.decode(states, tokens)
            walls.append(time.perf_counter() - t0)
        for s in states:
            s.rows = context
        split = split_events(collect(lambda: graphs.decode(states, tokens)))
    finally:
        graphs.close()
        for s in states:
            backend.release(s)
    return {"case": f"decode {lanes}@{context}", "wall_ms": float(np.median(walls)) * 1e3, "host_ms": None, **split}


def _pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        a, _, b = item.partition("@")
        out.append((int(a), int(b or 0)))
    return out


def _ncu_range(fn) -> list[tuple[str, float, float]]:
    """Run fn() once between `cuda.profile_start()` and `profile_stop()`, for Nsight Compute
    started with `--profile-from-start off` (`bench.ncu_digest` reads its CSV); returns no
    events: ncu collects the kernels."""
    from numba import cuda

    cuda.synchronize()
    cuda.profile_start()
    try:
        fn()
        cuda.synchronize()
    finally:
        cuda.profile_stop()
    return []


def table(results: list[dict], top: int) -> str:
    """Markdown: one summary row per case, then each case's `top` labels."""
    lines = ["| case | wall ms | host launch ms | kernel ms (sum) | span ms | kernels |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        host = "-" if r["host_ms"] is None else f"{r['host_ms']:.1f}"
        lines.append(f"| {r['case']} | {r['wall_ms']:.2f} | {host} | {r['kernel_ms']:.2f} | {r['span_ms']:.2f} | "
                     f"{r['kernels']} |")
    for r in results:
        lines += ["", f"{r['case']}: kernel | ms | calls | share", "| --- | --- | --- | --- |"]
        for label, v in list(r["by_label"].items())[:top]:
            share = v["ms"] / r["kernel_ms"] if r["kernel_ms"] else 0.0
            lines.append(f"| {label} | {v['ms']:.3f} | {v['calls']} | {share:.1%} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-27b")
    ap.add_argument("--prefill", default="51@1984", help="ROWS@CONTEXT,... (empty: none)")
    ap.add_argument("--decode", default="1@4096", help="LANES@CONTEXT,... (empty: none)")
    ap.add_argument("--top", type=int, default=14, help="labels printed per case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cprofile", type=int, default=0, help="print this many lines of a cProfile digest of the "
                    "first prefill case's host work")
    ap.add_argument("--out", type=Path, default=None, help="folder for kernel_split.json")
    ap.add_argument("--ncu", action="store_true", help="run each case once between cuda.profile_start() and "
                    "profile_stop() for `ncu --profile-from-start off`, instead of CUPTI (bench.ncu_digest)")
    args = ap.parse_args()
    from executor.numba_cuda import device_weights
    from executor.numba_cuda.backend import NumbaCudaBackend
    from executor.numba_cuda.device import device_name
    from executor.presets import preset

    prefill, decode = _pairs(args.prefill), _pairs(args.decode)
    config = preset(args.preset)
    capacity = max([r + c for r, c in prefill] + [c + 64 for _, c in decode] + [64]) + 64
    lanes = max([n for n, _ in decode] + [1])
    backend = NumbaCudaBackend.from_device_weights(config, device_weights.random(config, args.seed),
                                                   slots=lanes + 1, capacity_rows=capacity)
    for i, array in enumerate((backend.pool.keys, backend.pool.values)):
        device_weights.fill_uniform(array, args.seed + 90 + i, 2.0)
    collect = _ncu_range if args.ncu else _cupti
    results = [prefill_case(backend, r, c, args.seed, args.cprofile if i == 0 else 0, collect)
               for i, (r, c) in enumerate(prefill)]
    results += [decode_case(backend, n, c, args.seed, collect) for n, c in decode]
    if args.ncu:
        print(f"{args.preset} on {device_name()}: {', '.join(r['case'] for r in results)} ran once each in the "
              "profiler range; digest ncu's CSV with python -m bench.ncu_digest", flush=True)
        return
    text = table(results, args.top)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernel_split.json").write_text(json.dumps({"device": device_name(), "preset": args.preset,
                                                                "results": results}, indent=1))
    for r in results:
        if r.get("cprofile"):
            print(f"cProfile of one {r['case']} (own time):\n{r['cprofile']}")
    print(f"{args.preset} on {device_name()}\n{text}", flush=True)


if __name__ == "__main__":
    main()
