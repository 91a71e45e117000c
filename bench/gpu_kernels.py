"""GPU GEMM checks and timings at real Qwen3.5 shapes (random bf16 data made on the GPU).

For every (N, K) the numba-cuda backend multiplies by: pin a cuBLASLt algorithm
(executor.numba_cuda.gemm), then check that rows computed with M from 1 to 256 and
several larger M equal the same rows of an M = 2048 product bit for bit; time the pinned
GEMM at M = 4096 (TFLOP/s) and the row-invariant GEMV at 1 / 4 / 16 rows (weight GB/s).
Usage (on the GPU machine): python -m bench.gpu_kernels [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from executor.numba_cuda.device import device_name, median_seconds, to_device
from executor.numba_cuda.gemm import REFERENCE_ROWS, Gemm
from executor.numba_cuda.gemv import gemv
from executor.presets import preset

SWEEP_ROWS = list(range(1, 257)) + [300, 511, 777, 1000, 1500, 2047]


def shapes(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each GEMM the backend runs for a preset (fused as the backend fuses)."""
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
    }


def _random_bf16(shape, seed):
    rng = np.random.default_rng(seed)
    return to_device((rng.standard_normal(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16))


def check_shape(gemm: Gemm, n: int, k: int, seed: int) -> dict:
    w = _random_bf16((n, k), seed)
    x = _random_bf16((REFERENCE_ROWS, k), seed + 1)
    t0 = time.perf_counter()
    gemm.pin(n, k)
    pin_s = time.perf_counter() - t0
    ref = gemm.matmul(x, w).copy_to_host()
    differ = [m for m in SWEEP_ROWS if not np.array_equal(gemm.matmul(x[REFERENCE_ROWS - m :], w).copy_to_host(), ref[REFERENCE_ROWS - m :])]
    big = _random_bf16((4096, k), seed + 2)
    gemm_s = median_seconds(lambda: gemm.matmul(big, w))
    result = {"n": n, "k": k, "pin_s": round(pin_s, 3), "rows_differ_at_m": differ, **gemm.pinned[(n, k)],
              "gemm_m4096_tflops": round(2 * 4096 * n * k / gemm_s / 1e12, 1)}
    for rows in (1, 4, 16):
        xs = _random_bf16((rows, k), seed + 3)
        s = median_seconds(lambda: gemv(xs, w))
        result[f"gemv_{rows}_gbps"] = round(n * k * 2 / s / 1e9, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="qwen3.5-27b,qwen3.5-9b,qwen3.5-2b")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gemm = Gemm()
    results = {}
    for name in args.presets.split(","):
        for op, (n, k) in shapes(name).items():
            key = f"{name} {op}"
            if any(r["n"] == n and r["k"] == k for r in results.values()):
                continue
            results[key] = check_shape(gemm, n, k, len(results))
            print(key, json.dumps(results[key]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device_name(), "results": results}, f, indent=1)
    print(f"{'shape':34} {'N':>6} {'K':>6} {'invariant':>9} {'TFLOP/s':>8} {'gemv1':>7} {'gemv16':>7}")
    for key, r in results.items():
        print(f"{key:34} {r['n']:6} {r['k']:6} {str(not r['rows_differ_at_m']):>9} {r['gemm_m4096_tflops']:8} "
              f"{r['gemv_1_gbps']:7} {r['gemv_16_gbps']:7}")


if __name__ == "__main__":
    main()
