"""GPU GEMM and GEMV checks and timings at real Qwen3.5 shapes (random bf16 data made on the GPU).

For every (N, K) the numba-cuda backend multiplies by: pin a cuBLASLt algorithm
(executor.numba_cuda.gemm), then check that rows computed with other row counts equal the
same rows of an M = 2048 product bit for bit (`--sweep full`: M = 1..256 and several
larger; `--sweep probe`: a few small M), and that the first 2048 rows of M = 4096 and
M = 8192 products equal it too; time the GEMM at M = 4096 (TFLOP/s: the algorithm of the
range past the buckets, gemm.RANGES, which also gives the M = 2048 product; all bit-equal to
the pinned reference) and the
row-invariant decode GEMV at 1 / 4 / 16 rows (weight GB/s, against the device-to-device
copy bandwidth measured first). Times are device times (launches queued behind a spin
kernel, timed between events); small weights rotate over copies so the L2 cannot hold them.
Usage (on the GPU machine): python -m bench.gpu_kernels [--presets ...] [--sweep probe] [--out results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np

from executor.numba_cuda import gemv as gemv_module
from executor.numba_cuda.device import device_name, device_seconds, empty
from executor.numba_cuda.device_weights import fill_uniform
from executor.numba_cuda.gemm import REFERENCE_ROWS, Gemm
from executor.numba_cuda.gemv import gemv
from executor.presets import preset

FULL_SWEEP_ROWS = list(range(1, 257)) + [300, 511, 777, 1000, 1500, 2047]
PROBE_SWEEP_ROWS = [1, 2, 7, 16, 63, 64, 65, 100, 129, 333, 1000, 2047]
LARGE_ROWS = (4096, 8192)
ROTATE_BYTES = 512 << 20
"""Weights smaller than this are timed rotating over copies that together exceed it."""


def shapes(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each product the backend runs for a preset (fused as the backend fuses)."""
    c = preset(name)
    h = c.hidden_size
    return {
        "in_proj(qkv|z|b|a)": (c.conv_channels + c.linear_value_dim + 2 * c.linear_num_value_heads, h),
        "out_proj": (h, c.linear_value_dim),
        "q_proj": (2 * c.num_attention_heads * c.head_dim, h),
        "kv_proj": (2 * c.num_key_value_heads * c.head_dim, h),
        "o_proj": (h, c.num_attention_heads * c.head_dim),
        "gate_up": (2 * c.intermediate_size, h),
        "down": (h, c.intermediate_size),
        "lm_head": (c.vocab_size, h),
    }


def random_bf16(shape, seed: int):
    """A device bf16 (uint16) array of uniform values with std 1 (made on the GPU)."""
    array = empty(shape, np.uint16)
    fill_uniform(array, seed, 3 ** 0.5)
    return array


def copy_gbps(gigabytes: float = 4.0) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (GB/s)."""
    n = int(gigabytes * 1e9) // 2
    src, dst = random_bf16((n,), 1), empty((n,), np.uint16)
    seconds = device_seconds(lambda: dst.copy_to_device(src), repeat=10)
    return 2 * 2 * n / seconds / 1e9


def _rows_equal(gemm: Gemm, x, w, ref, sweep: list[int]) -> list[int]:
    """Row counts M whose rows differ from the same rows of the REFERENCE_ROWS product."""
    differ = [m for m in sweep if not np.array_equal(gemm.matmul(x[REFERENCE_ROWS - m :], w).copy_to_host(),
                                                      ref[REFERENCE_ROWS - m :])]
    for m in LARGE_ROWS:
        big = empty((m, x.shape[1]), np.uint16)
        big[:REFERENCE_ROWS].copy_to_device(x)
        fill_uniform(big[REFERENCE_ROWS:], m, 3 ** 0.5)
        if not np.array_equal(gemm.matmul(big, w)[:REFERENCE_ROWS].copy_to_host(), ref):
            differ.append(m)
    return differ


def check_shape(gemm: Gemm, n: int, k: int, seed: int, sweep: list[int], copy: float, with_gemm: bool) -> dict:
    w = random_bf16((n, k), seed)
    result: dict = {"n": n, "k": k, "weight_mb": round(n * k * 2 / 1e6, 1)}
    if with_gemm:
        x = random_bf16((REFERENCE_ROWS, k), seed + 1)
        t0 = time.perf_counter()
        gemm.pin(n, k)
        result["pin_s"] = round(time.perf_counter() - t0, 3)
        ref = gemm.matmul(x, w).copy_to_host()
        result["rows_differ_at_m"] = _rows_equal(gemm, x, w, ref, sweep)
        result.update(gemm.pinned[(n, k)])
        big = random_bf16((4096, k), seed + 2)
        result["gemm_m4096_tflops"] = round(2 * 4096 * n * k / device_seconds(lambda: gemm.matmul(big, w)) / 1e12, 1)
    copies = [w] + [random_bf16((n, k), seed + 10 + i) for i in range(min(31, ROTATE_BYTES // (n * k * 2)))]
    for rows in (1, 4, 16):
        xs = random_bf16((rows, k), seed + 3)
        cycle = itertools.cycle(copies)
        seconds = device_seconds(lambda: gemv(xs, next(cycle)), repeat=max(20, len(copies)))
        result[f"gemv_{rows}_gbps"] = round(n * k * 2 / seconds / 1e9, 1)
        result[f"gemv_{rows}_of_copy"] = round(n * k * 2 / seconds / 1e9 / copy, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="qwen3.5-27b,qwen3.5-9b,qwen3.5-2b")
    parser.add_argument("--sweep", choices=("full", "probe"), default="full")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sweep = FULL_SWEEP_ROWS if args.sweep == "full" else PROBE_SWEEP_ROWS
    copy = copy_gbps()
    print(f"device-to-device copy: {copy:.0f} GB/s (read + write); GEMV loads 16-byte: {gemv_module.VECTOR_LOADS}",
          flush=True)
    gemm = Gemm()
    results = {}
    for name in args.presets.split(","):
        for op, (n, k) in shapes(name).items():
            key = f"{name} {op}"
            if any(r["n"] == n and r["k"] == k for r in results.values()):
                continue
            results[key] = check_shape(gemm, n, k, len(results) * 100, sweep, copy, with_gemm=op != "lm_head")
            print(key, json.dumps(results[key]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device_name(), "copy_gbps": copy, "sweep": args.sweep,
                       "vector_loads": gemv_module.VECTOR_LOADS, "results": results}, f, indent=1)
    print("\n| shape | N | K | MB | row-invariant | GEMM M=4096 TFLOP/s | GEMV 1 row GB/s (of copy) | 4 rows | 16 rows |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key, r in results.items():
        inv = "-" if "rows_differ_at_m" not in r else ("yes" if not r["rows_differ_at_m"] else f"no {r['rows_differ_at_m']}")
        cells = [f"{r[f'gemv_{g}_gbps']:.0f} ({100 * r[f'gemv_{g}_of_copy']:.0f}%)" for g in (1, 4, 16)]
        print(f"| {key} | {r['n']} | {r['k']} | {r['weight_mb']} | {inv} | {r.get('gemm_m4096_tflops', '-')} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
