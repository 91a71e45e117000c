"""Short-chunk GEMMs at real Qwen3.5 shapes, bits and device time: cuBLASLt against our own.

The pinned cuBLASLt bucket algorithm the backend runs, against the streaming GEMM of our own
(executor.numba_cuda.gemm_stream), for every (N, K) the backend multiplies by (the LM head
aside: prefill reads it through the GEMV). First the rows of each streaming variant at every
row count of CHECK_ROWS and `--rows` are compared bit for bit with the same rows of the pinned
reference algorithm's M = 2048 product (what chunk invariance would need before the backend
could use a variant); then at every `--rows` M each is timed (device time, weights rotating over
copies larger than the L2) beside the bucket algorithm and the weight-bandwidth floor (weight
bytes over the measured device-to-device copy rate, the roofline convention of
bench/RESULTS.md). The last table sums one forward of each preset at each M (every layer's
products): cuBLASLt, the best streaming variant per shape, and the faster bit-equal of the two.
Usage (on the GPU machine): python -m bench.gemm_short [--presets ...] [--rows 1,16,51,64] [--out results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np

from bench.gpu_kernels import copy_gbps, random_bf16, shapes
from executor.numba_cuda import gemm_stream
from executor.numba_cuda.device import device_name, device_seconds
from executor.numba_cuda.gemm import REFERENCE_ROWS, Gemm
from executor.presets import preset

ROTATE_BYTES = 512 << 20
"""Weights smaller than this are timed rotating over copies that together exceed it."""
CHECK_ROWS = (1, 2, 15, 16, 17, 33, 51, 63, 64)
"""Row counts whose rows are compared with the reference product's for every variant."""


def per_forward(name: str) -> dict[str, int]:
    """How many times one forward of the preset runs each product of `shapes`."""
    c = preset(name)
    full = sum(1 for t in c.layer_types if t == "full_attention")
    linear = len(c.layer_types) - full
    layers = len(c.layer_types)
    return {"in_proj(qkv|z|b|a)": linear, "out_proj": linear, "q_proj": full, "kv_proj": full, "o_proj": full,
            "gate_up": layers, "down": layers}


def measure(gemm: Gemm, n: int, k: int, rows: list[int], copy: float, seed: int) -> dict:
    """Bits and device times of the bucket algorithm and every streaming variant at (N, K)."""
    w = random_bf16((n, k), seed)
    x = random_bf16((REFERENCE_ROWS, k), seed + 1)
    gemm.pin(n, k)
    ref = gemm.matmul(x, w).copy_to_host()  # M = 2048: the range past the buckets' pick, the reference's bits
    copies = [w] + [random_bf16((n, k), seed + 10 + i) for i in range(min(31, ROTATE_BYTES // (n * k * 2)))]
    floor_us = n * k * 2 / (copy * 1e9) * 1e6  # the roofline's convention (RESULTS.md): bytes over the copy rate
    result: dict = {"n": n, "k": k, "floor_us": round(floor_us, 2), "variants": {}}
    for variant in gemm_stream.VARIANTS:
        if not variant.fits(n, k):
            continue
        differ = []
        for m in sorted(set(CHECK_ROWS) | set(rows)):
            got = gemm_stream.matmul(x[REFERENCE_ROWS - m :], w, variant).copy_to_host()
            if not np.array_equal(got, ref[REFERENCE_ROWS - m :]):
                differ.append(m)
        result["variants"][variant.label()] = {"rows_differ": differ}
    for m in rows:
        xs = x[REFERENCE_ROWS - m :]
        cycle = itertools.cycle(copies)
        repeat = max(20, len(copies))
        entry = {"bucket_us": round(device_seconds(lambda: gemm.matmul(xs, next(cycle)), repeat=repeat) * 1e6, 2)}
        for variant in gemm_stream.VARIANTS:
            if variant.fits(n, k):
                seconds = device_seconds(lambda: gemm_stream.matmul(xs, next(cycle), variant), repeat=repeat)
                entry[variant.label()] = round(seconds * 1e6, 2)
        result[f"m{m}"] = entry
    return result


def best_streaming(result: dict, m: int) -> tuple[str, float]:
    """(label, us) of the fastest streaming variant at M, bit-equal or not ("-", inf when none fits)."""
    entry = result[f"m{m}"]
    times = [(entry[label], label) for label in result["variants"] if label in entry]
    return min(times)[::-1] if times else ("-", float("inf"))


def best_equal(result: dict, m: int) -> tuple[str, float]:
    """(label, us) of the fastest bit-equal choice at M: a streaming variant or the bucket algorithm."""
    entry = result[f"m{m}"]
    best = ("cuBLASLt bucket", entry["bucket_us"])
    for label, check in result["variants"].items():
        if not check["rows_differ"] and entry.get(label, float("inf")) < best[1]:
            best = (label, entry[label])
    return best


def parse_rows(text: str) -> list[int]:
    """`--rows` as a list of row counts, each in [1, gemm_stream.MAX_ROWS]; raises
    argparse.ArgumentTypeError naming the bad entry."""
    try:
        rows = [int(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rows must be comma-separated integers, got {text!r}") from None
    bad = [r for r in rows if not 1 <= r <= gemm_stream.MAX_ROWS]
    if bad or not rows:
        raise argparse.ArgumentTypeError(f"--rows must be in [1, {gemm_stream.MAX_ROWS}], got {bad or text!r}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="qwen3.5-27b,qwen3.5-9b,qwen3.5-2b",
                        help="comma-separated model presets whose shapes are measured (default: %(default)s)")
    parser.add_argument("--rows", type=parse_rows, default=parse_rows("16,51,64"),
                        help=f"comma-separated row counts M to time, 1 to {gemm_stream.MAX_ROWS} (default: 16,51,64)")
    parser.add_argument("--out", default=None, help="JSON file for every measurement, rewritten after each shape")
    args = parser.parse_args(argv)
    for name in args.presets.split(","):
        preset(name)  # an unknown preset fails here, before the GPU work
    from executor.numba_cuda.device import is_gpu_available

    if not is_gpu_available():
        print("bench.gemm_short needs an NVIDIA GPU with numba-cuda and nvmath-python", flush=True)
        return 2
    rows = args.rows
    copy = copy_gbps()
    print(f"device: {device_name()}; device-to-device copy {copy:.0f} GB/s (read + write)", flush=True)
    gemm = Gemm()
    results: dict = {}
    for name in args.presets.split(","):
        for op, (n, k) in shapes(name).items():
            if op == "lm_head":
                continue
            key = f"{name} {op}"
            results[key] = measure(gemm, n, k, rows, copy, len(results) * 100)
            print(key, json.dumps(results[key]), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"device": device_name(), "copy_gbps": copy, "rows": rows, "results": results}, f,
                              indent=1)
    print("\n| shape | N x K | M | floor us | cuBLASLt bucket us | best streaming | us | best bit-equal | us | "
          "variants bit-equal |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key, r in results.items():
        equal = sum(1 for c in r["variants"].values() if not c["rows_differ"])
        for m in rows:
            stream_label, stream_us = best_streaming(r, m)
            label, us = best_equal(r, m)
            print(f"| {key} | {r['n']} x {r['k']} | {m} | {r['floor_us']} | {r[f'm{m}']['bucket_us']} | "
                  f"{stream_label} | {stream_us} | {label} | {us} | {equal}/{len(r['variants'])} |")
    print("\n| preset | M | GEMMs per forward | cuBLASLt bucket ms | best streaming ms | best bit-equal ms | floor ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.presets.split(","):
        counts = per_forward(name)
        for m in rows:
            bucket = streaming = best = floor = 0.0
            for op, count in counts.items():
                r = results[f"{name} {op}"]
                bucket += count * r[f"m{m}"]["bucket_us"]
                streaming += count * best_streaming(r, m)[1]
                best += count * best_equal(r, m)[1]
                floor += count * r["floor_us"]
            print(f"| {name} | {m} | {sum(counts.values())} | {bucket / 1e3:.2f} | {streaming / 1e3:.2f} | "
                  f"{best / 1e3:.2f} | {floor / 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
