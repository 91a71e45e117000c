"""Is wgmma reachable, how does it read shared memory, and does it give mma.sync's bits?
(issue 5, the road to the backend's flash attention walk on wgmma; bench/RESULTS.md, sessions 26
and 27)

NVRTC compiles bench/wgmma_probe.cu for sm_90a to a cubin (`executor.numba_cuda.nvrtc`); each case runs
in its own process (a descriptor that points outside shared memory is a fatal illegal address):

- one 64 x 64 x 64 product C = A B^T by chained mma.sync m16n8k16 (k-steps in order), the bits
  to match;
- the same product by wgmma m64n64k16, A from shared memory (ss) or registers (rs), B K-major or
  MN-major, for both assignments of the two core-matrix strides to the descriptor's leading and
  stride byte offsets: max error against float64 and whether the bits equal mma.sync's;
- `--loops`: TFLOP/s of wgmma m64n256k16 from shared memory and of mma.sync from registers on
  every SM, operands that never leave the SM (each instruction's ceiling, not a kernel's);
- `--chains`: clock cycles of a 16-step wgmma chain on one accumulator (S = Q K^T's shape at
  head_dim 256), waited, by N and A's source, and of the flash walk's products a key block.

Usage (H200): python -m bench.wgmma_probe [--loops] [--chains] [--compile-only]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import flash_wgmma
from executor.numba_cuda.nvrtc import Module, compile_cubin, wgmma_function
from executor.safetensors_file import bf16_to_f32, f32_to_bf16

SOURCE = Path(__file__).with_name("wgmma_probe.cu")
STRIDES = ((128, 1024), (1024, 128))
"""(leading, stride) byte offsets tried: the core matrices lie 128 B apart along one axis and
1024 B (8 cores) along the other."""


def source() -> str:
    """bench/flash_wgmma.py's source (its helpers), then the probe's with its wgmma functions generated in."""
    fns = [wgmma_function(f"wgmma_ss_n64_t{t}", 64, False, bool(t)) for t in (0, 1)]
    fns += [wgmma_function(f"wgmma_rs_n64_t{t}", 64, True, bool(t)) for t in (0, 1)]
    fns.append(wgmma_function("wgmma_ss_n256_t0", 256, False, False))
    fns += [wgmma_function(f"wgmma_{src}_n{n}_t{t}", n, src == "rs", bool(t))
            for src, n, t in (("rs", 32, 0), ("ss", 32, 0), ("rs", 128, 0), ("rs", 256, 0), ("rs", 256, 1))]
    return flash_wgmma.source() + SOURCE.read_text().replace("// @WGMMA_FUNCTIONS@", "\n".join(fns))


def run_case(case: str, cubin_path: str, out_dir: str) -> None:
    """One case in this process; prints `RESULT case max_error` and saves C to out_dir."""
    from numba import cuda

    module = Module(Path(cubin_path).read_bytes())
    rng = np.random.default_rng(26)
    a_bits, b_bits = f32_to_bf16(rng.standard_normal((64, 64))), f32_to_bf16(rng.standard_normal((64, 64)))
    da, db = cuda.to_device(a_bits), cuda.to_device(b_bits)
    dbt = cuda.to_device(np.ascontiguousarray(b_bits.T))  # [k, n]: B MN-major
    dc = cuda.device_array((64, 64), np.float32)
    kind, *nums = case.split(":")
    nums = [int(x) for x in nums]
    if kind == "mma":
        module.launch("gemm_mma", (1, 1), 128, 0, da, db, dc)
    elif kind == "ss":
        module.launch("gemm_ss", (1, 1), 128, 0, da, dbt if nums[4] else db, dc, *nums)
    else:
        module.launch("gemm_rs", (1, 1), 128, 0, da, dbt if nums[2] else db, dc, *nums)
    c = dc.copy_to_host()
    np.save(Path(out_dir) / f"{case.replace(':', '_')}.npy", c)
    a, b = bf16_to_f32(a_bits).astype(np.float64), bf16_to_f32(b_bits).astype(np.float64)
    print(f"RESULT {case} {float(np.abs(c - a @ b.T).max()):.3g}")


def loops(module: Module) -> None:
    """Print the two loops' TFLOP/s (best of 5, wall time around a synchronized launch)."""
    from numba import cuda

    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    out = cuda.device_array(sms * 256, np.float32)
    smem = (2 * 64 + 256) * 64 * 2
    print("\n| loop | CTAs x threads | ms | TFLOP/s |\n| --- | --- | --- | --- |")
    for name, iters, flops, shared in (("loop_wgmma", 4000, 2 * 4 * 2 * 64 * 256 * 16, smem),
                                        ("loop_mma", 8000, 8 * 16 * 2 * 16 * 8 * 16, 0)):
        module.launch(name, (sms, 1), 256, shared, out, 10)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            module.launch(name, (sms, 1), 256, shared, out, iters)
            best = min(best, time.perf_counter() - t0)
        print(f"| {name} | {sms} x 256 | {best * 1e3:.2f} | {sms * iters * flops / best / 1e12:.0f} |")


CHAINS = (("chain_rs_n32", 32, "registers"), ("chain_ss_n32", 32, "shared"), ("chain_rs_n64", 64, "registers"),
          ("chain_ss_n64", 64, "shared"), ("chain_rs_n128", 128, "registers"), ("chain_rs_n256", 256, "registers"))
"""(kernel, N, where A is) of `--chains` (wgmma_probe.cu's chain_loop)."""


def chains(module: Module, iters: int = 2000) -> None:
    """Print each 16-step chain's clock cycles (the median warpgroup's, two warpgroups an SM on
    every SM; `iters` chains each), the multiply-adds an SM did a cycle (the tensor cores' dense
    bf16 peak is 2048: 989 TFLOP/s over 132 SMs at 1.83 GHz) and TFLOP/s by wall time; then the
    same for the walk's products a key block (`chain_walk`)."""
    from numba import cuda

    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    out = cuda.device_array(sms * 256, np.float32)
    cycles = cuda.device_array(2 * sms, np.int64)
    rows = [(name, n, a, "each", (2 * 64 + n) * 256 * 2, 16 * 64 * n * 16) for name, n, a in CHAINS]
    rows.append(("chain_walk", "32 + 2 x 256", "registers", "S each, P V in flight", 2 * 32 * 256 * 2,
                 16 * 64 * 32 * 16 + 2 * 64 * 256 * 16))
    print("\n| kernel | N | A | waited | cycles a chain (a warpgroup) | MACs an SM a cycle | TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, n, a, wait, shared, macs in rows:
        module.function(name, shared)
        module.launch(name, (sms, 1), 256, shared, out, cycles, 10)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            module.launch(name, (sms, 1), 256, shared, out, cycles, iters)
            best = min(best, time.perf_counter() - t0)
        per_chain = float(np.median(cycles.copy_to_host())) / iters
        print(f"| {name} | {n} | {a} | {wait} | {per_chain:.0f} | {2 * macs / per_chain:.0f} | "
              f"{sms * 2 * iters * 2 * macs / best / 1e12:.0f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.wgmma_probe", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loops", action="store_true", help="also time the wgmma and mma.sync loops")
    parser.add_argument("--chains", action="store_true",
                        help="also time 16-step wgmma chains by N and operand source (S's shape) and the walk's products")
    parser.add_argument("--no-layouts", action="store_true",
                        help="skip the descriptor-layout and bit cases (with --loops or --chains: timing only)")
    parser.add_argument("--compile-only", action="store_true", help="compile, print ptxas' report, stop")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--cubin", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.no_layouts and not (args.loops or args.chains or args.compile_only):
        parser.error("--no-layouts leaves nothing to run without --loops or --chains")
    if args.case:
        return run_case(args.case, args.cubin, args.out)
    try:
        cubin, log = compile_cubin(source(), "wgmma_probe.cu")
    except RuntimeError as e:
        parser.error(str(e))
    print(f"sm_90a cubin, {len(cubin)} bytes")
    print("\n".join(x for x in log.splitlines() if "Used" in x or "spill" in x or "C75" in x))
    if args.compile_only:
        return
    if not args.no_layouts:
        layouts(cubin)
    if args.loops or args.chains:
        module = Module(cubin)
        if args.loops:
            loops(module)
        if args.chains:
            chains(module)


def layouts(cubin: bytes) -> None:
    """Run every descriptor-layout case in its own process and print max error and bits against
    chained mma.sync."""
    tmp = tempfile.mkdtemp(prefix="wgmma_probe")
    cubin_path = os.path.join(tmp, "probe.cubin")
    Path(cubin_path).write_bytes(cubin)
    cases = ["mma"] + [f"ss:{la}:{sa}:{lb}:{sb}:{m}" for la, sa in STRIDES for lb, sb in STRIDES for m in (0, 1)]
    cases += [f"rs:{lb}:{sb}:{m}" for lb, sb in STRIDES for m in (0, 1)]
    results = {}
    for case in cases:
        p = subprocess.run([sys.executable, "-m", "bench.wgmma_probe", "--case", case, "--cubin", cubin_path,
                            "--out", tmp], capture_output=True, text=True, timeout=120)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT")]
        results[case] = float(line[0].split()[-1]) if line and not p.returncode else \
            "failed: " + ((p.stderr.strip().splitlines() or ["?"])[-1])[-70:]
    mma = np.load(os.path.join(tmp, "mma.npy")).view(np.uint32) if isinstance(results["mma"], float) else None
    print("\n| case (A, B: leading / stride bytes; B k or mn major) | max abs error vs float64 | bits of mma.sync |")
    print("| --- | --- | --- |")
    for case, r in results.items():
        bits = "-"
        if case != "mma" and mma is not None and isinstance(r, float) and r < 1e-2:
            diff = int((np.load(os.path.join(tmp, case.replace(":", "_") + ".npy")).view(np.uint32) != mma).sum())
            bits = "equal" if diff == 0 else f"{diff} of 4096 differ"
        print(f"| {case} | {r if isinstance(r, str) else f'{r:.3g}'} | {bits} |")


if __name__ == "__main__":
    main()
