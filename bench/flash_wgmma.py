"""The backend's prefill attention walks side by side, and the wgmma experiments of
bench/flash_wgmma.cu: the mma.sync walk (`attention_flash.prefill(..., wgmma=False)`, 8 warps, not
split) against the backend's wgmma walk (`wgmma=True`: executor/numba_cuda/flash_wgmma.cu, K/V in
the 128-byte swizzle, copied by cp.async and by TMA, and its FlashAttention-3-order `lookahead` walk) and the
experiments named by --kernels
(`walk`, 8 warps, Q in registers, K/V as no-swizzle core matrices; `walk-late`, its copies after
P V; `walk-fixed`, also with fixed copy addresses; `pingpong`, walk with its warpgroups taking turns on the tensor cores; `swz-pingpong`,
the backend's walk taking turns so (session 28: 0.94x at the 9B's long chunks); `walk-heads`,
CTAs that run together on different K/V heads; `pairs`, 4 warps, Q in shared memory, S for two key
blocks at once; `halves`, two warpgroups splitting head_dim on the same 64 rows), on the same
inputs: every output bit compared with the mma.sync walk's, CUDA-event ms (median of 5) and
TFLOP/s (causal: 4 x head_dim x q_heads x the keys each row sees). `--clocks`: walk's and
walk-fixed's block time by phase. bench/RESULTS.md, sessions 26-29.

Usage (H200): python -m bench.flash_wgmma [--cases 27b:51@1984,9b:8192@24576] [--kernels walk,walk-heads]
[--clocks] [--compile-only]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from executor.numba_cuda import attention_wgmma
from executor.numba_cuda.nvrtc import Module, compile_cubin, wgmma_function
from executor.safetensors_file import f32_to_bf16

SOURCE = Path(__file__).with_name("flash_wgmma.cu")
PRODUCTION = Path(__file__).parent.parent / "executor" / "numba_cuda" / "flash_attention.cu"
HEADS = {"27b": (24, 4), "9b": (16, 4)}
"""(q_heads, kv_heads) of each model's attention layers (head_dim 256)."""
DEFAULT_CASES = "27b:51@1984,27b:2000@0,9b:4096@0,9b:8192@0,9b:8192@24576"
KERNELS = {
    "walk": ("flash_wgmma_walk_256", 256, 128, 3 * 2 * 32 * 256 * 2 + 8 * 16 * 256 * 4),
    "pingpong": ("flash_wgmma_pingpong_256", 256, 128, 3 * 2 * 32 * 256 * 2 + 8 * 16 * 256 * 4),
    "walk-late": ("flash_wgmma_walk_late_256", 256, 128, 3 * 2 * 32 * 256 * 2 + 8 * 16 * 256 * 4),
    "walk-fixed": ("flash_wgmma_walk_fixed_256", 256, 128, 3 * 2 * 32 * 256 * 2 + 8 * 16 * 256 * 4),
    "swz-pingpong": ("flash_wgmma_swz_pingpong_256", 256, 128, 3 * 2 * 32 * 256 * 2 + 8 * 16 * 256 * 4 + 1024),
    "walk-heads": ("flash_wgmma_walk_heads_256", 256, 128, 3 * 2 * 32 * 256 * 2 + 8 * 16 * 256 * 4),
    "pairs": ("flash_wgmma_pairs_256", 128, 64, 64 * 256 * 2 + 2 * 2 * 64 * 256 * 2 + 4 * 16 * 256 * 4),
    "halves": ("flash_wgmma_halves_256", 256, 64, 64 * 256 * 2 + 3 * 2 * 64 * 256 * 2),
}
"""name -> (kernel, threads a CTA, virtual rows a CTA, dynamic shared bytes). walk: 8 warps of 16
rows, a ring of 3 (K, V) blocks of 32 keys, 8 warps' running outputs (f32); pairs: 4 warps, Q
(bf16), a ring of 2 (K, V) pairs of 64 keys, 4 warps' running outputs; halves: 2 warpgroups on the
same 64 rows (head_dim split), Q, a ring of 3 pairs."""


HEADS_FAST = {"flash_wgmma_walk_heads_256"}
"""Kernels launched on a one-dimensional grid, the K/V head varying fastest (Tile's heads_fast)."""
CLOCKS_KERNELS = {"walk": "flash_wgmma_walk_clocks_256", "walk-fixed": "flash_wgmma_walk_fixed_clocks_256"}
"""`walk` and `walk-fixed` with their warps' cycles charged to phases (`--clocks`; one more
argument: u64 [10])."""
PHASES = ("copy wait + barrier", "S (with P V before)", "2nd barrier", "copy issue", "softmax + P V issue",
          "fold", "before the walk", "gated write")
"""flash_wgmma_walk's CLOCKS phases 0-7, in order (bench/flash_wgmma.cu)."""
DEFAULT_KERNELS = "walk"
"""The experiment shown by default besides the backend's two walks (the others: --kernels)."""


def source() -> str:
    """The backend's wgmma walk source (attention_wgmma.source: flash_attention.cu, then
    executor/numba_cuda/flash_wgmma.cu), then flash_wgmma.cu's with its two more wgmma functions."""
    fns = wgmma_function("wgmma_s64", 64, False, False) + wgmma_function("wgmma_o128", 128, True, True)
    return attention_wgmma.source() + SOURCE.read_text().replace("// @WGMMA_FUNCTIONS@", fns)


def parse_cases(text: str) -> list[tuple[str, int, int]]:
    """'27b:51@1984,...' -> [(model, rows, start), ...]; ValueError naming a bad item."""
    cases = []
    for item in text.split(","):
        try:
            model, rest = item.split(":")
            rows, start = (int(x) for x in rest.split("@"))
        except ValueError:
            raise ValueError(f"--cases item {item!r} is not MODEL:ROWS@START") from None
        if model not in HEADS or rows < 1 or start < 0:
            raise ValueError(f"--cases item {item!r}: model one of {sorted(HEADS)}, rows >= 1, start >= 0")
        cases.append((model, rows, start))
    return cases


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.flash_wgmma", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"MODEL:ROWS@START, comma-separated ({DEFAULT_CASES})")
    parser.add_argument("--kernels", default=DEFAULT_KERNELS,
                        help=f"comma-separated, of {', '.join(KERNELS)} (default: {DEFAULT_KERNELS})")
    parser.add_argument("--clocks", action="store_true",
                        help="also run walk and walk-fixed with their warps' clock cycles charged to phases "
                             "(where a block's time goes)")
    parser.add_argument("--compile-only", action="store_true", help="compile, print ptxas' report, stop")
    args = parser.parse_args(argv)
    try:
        cases = parse_cases(args.cases)
        kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
        if not kernels or any(k not in KERNELS for k in kernels):
            raise ValueError(f"--kernels {args.kernels!r}: one or more of {', '.join(KERNELS)}")
    except ValueError as e:
        parser.error(str(e))
    try:
        cubin, log = compile_cubin(source(), "flash_wgmma.cu")
    except RuntimeError as e:
        parser.error(str(e))
    lines = log.splitlines()
    print("\n".join(x for x in lines if "C75" in x or "Compiling" in x or "Used" in x or "spill" in x))
    if args.compile_only:
        return
    from numba import cuda

    from executor.numba_cuda import attention_flash
    from executor.numba_cuda.device import chunk_meta

    module = Module(cubin)
    walk_shared = KERNELS["walk"][3]
    for kernel in CLOCKS_KERNELS.values():
        module.function(kernel, walk_shared)
    for kernel, threads, _, shared in KERNELS.values():
        module.function(kernel, shared)
        regs, local = module.attributes(kernel)
        print(f"{kernel}: {regs} registers, {local} B local, {shared} B shared, {threads} threads")

    def timed(f) -> float:
        f()
        times = []
        for _ in range(5):
            e0, e1 = cuda.event(), cuda.event()
            e0.record()
            f()
            e1.record()
            e1.synchronize()
            times.append(cuda.event_elapsed_time(e0, e1))
        return sorted(times)[2]

    clock_rows = []
    rng = np.random.default_rng(26)
    d = 256
    print("\n| model | rows at start | kernel | ms | speed-up | TFLOP/s | bits equal to the mma.sync walk |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for model, rows, start in cases:
        q_heads, kv_heads = HEADS[model]
        capacity = -(-(start + rows) // 32) * 32
        q = cuda.to_device((rng.standard_normal((rows, q_heads, d)) * 2).astype(np.float32))
        qg = cuda.to_device(rng.standard_normal((rows, q_heads * 2 * d)).astype(np.float32))
        kv = np.zeros((2, capacity, kv_heads, d), np.float32)  # keys past start + rows stay 0, as in the pool
        kv[:, :start + rows] = rng.standard_normal((2, start + rows, kv_heads, d))
        kc, vc = cuda.to_device(f32_to_bf16(kv[:1])), cuda.to_device(f32_to_bf16(kv[1:]))
        ref = cuda.device_array((rows, q_heads * d), np.uint16)
        flops = 4 * d * q_heads * (rows * start + rows * (rows + 1) // 2)
        meta = chunk_meta(None, rows, start, 0)  # uploaded once, as the backend passes its own
        t_ref = timed(lambda: attention_flash.prefill(q, qg, kc, vc, 0, start, out=ref, warps=8, split=False,
                                                      wgmma=False, meta=meta))
        a = ref.copy_to_host()
        print(f"| {model} | {rows} at {start} | mma.sync walk | {t_ref:.3f} | 1 | {flops / t_ref / 1e9:.0f} | |")
        for label, tma, lookahead in (("cp.async", False, False), ("TMA", True, False), ("lookahead", False, True)):
            out = cuda.device_array((rows, q_heads * d), np.uint16)
            t_new = timed(lambda: attention_flash.prefill(q, qg, kc, vc, 0, start, out=out, split=False, wgmma=True,
                                                          meta=meta, tma=tma, lookahead=lookahead))
            diff = int((a != out.copy_to_host()).sum())
            kind = "backend, opt-in" if tma or lookahead else "backend"
            print(f"| {model} | {rows} at {start} | **wgmma walk, {label} ({kind})** | {t_new:.3f} | "
                  f"{t_ref / t_new:.2f}x | {flops / t_new / 1e9:.0f} | "
                  f"{'yes' if diff == 0 else f'no: {diff} of {a.size} differ'} |")
        for label in kernels:
            kernel, threads, tile_rows, shared = KERNELS[label]
            out = cuda.device_array((rows, q_heads * d), np.uint16)
            tiles = -(-rows * (q_heads // kv_heads) // tile_rows)
            kargs = (q, qg, kc, vc, out, rows, start, q_heads, kv_heads, float(1.0 / np.sqrt(d)))
            grid = (tiles * kv_heads, 1) if kernel in HEADS_FAST else (tiles, kv_heads)
            t_new = timed(lambda: module.launch(kernel, grid, threads, shared, *kargs, wait=False))
            cuda.synchronize()
            diff = int((a != out.copy_to_host()).sum())
            print(f"| {model} | {rows} at {start} | wgmma {label} | {t_new:.3f} | {t_ref / t_new:.2f}x | "
                  f"{flops / t_new / 1e9:.0f} | {'yes' if diff == 0 else f'no: {diff} of {a.size} differ'} |")
        for label, kernel in CLOCKS_KERNELS.items() if args.clocks else ():
            out = cuda.device_array((rows, q_heads * d), np.uint16)
            clocks = cuda.to_device(np.zeros(10, np.uint64))
            tiles = -(-rows * (q_heads // kv_heads) // 128)
            kargs = (q, qg, kc, vc, out, rows, start, q_heads, kv_heads, float(1.0 / np.sqrt(d)), clocks)
            module.launch(kernel, (tiles, kv_heads), 256, walk_shared, *kargs)
            clocks.copy_to_device(np.zeros(10, np.uint64))
            t_clk = timed(lambda: module.launch(kernel, (tiles, kv_heads), 256, walk_shared, *kargs, wait=False))
            cuda.synchronize()
            clock_rows.append((model, rows, start, label, t_clk, clocks.copy_to_host() / 6,
                               int((a != out.copy_to_host()).sum())))
    if args.clocks:
        print_clocks(clock_rows)


def print_clocks(clock_rows: list) -> None:
    """The walks' phases (flash_wgmma.cu's flash_wgmma_walk, CLOCKS): each phase's share of its
    warps' cycles and the cycles a warp spent a key block (all phases over the blocks walked)."""
    print("\n| model | rows at start | kernel (with clocks) | ms | cycles a block (a warp) | "
          + " | ".join(PHASES) + " | bits equal |")
    print("| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in PHASES) + " | --- |")
    for model, rows, start, label, ms, c, diff in clock_rows:
        shares = " | ".join(f"{100 * x / c[8]:.1f}%" for x in c[:8])
        print(f"| {model} | {rows} at {start} | {label} | {ms:.3f} | {c[8] / c[9]:.0f} | {shares} | "
              f"{'yes' if diff == 0 else f'no: {diff} differ'} |")


if __name__ == "__main__":
    main()
