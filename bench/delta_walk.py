"""The prefill delta rule's walk (phase 2 of executor/numba_cuda/delta_mma.py) on mma.sync against
the same walk on wgmma (delta_wgmma.py), side by side in one process: device ms of a whole
delta_mma call (phase 1 included, median of --runs, CUDA events) at Qwen3.5's linear-attention
shapes (16 key heads of 128; 32 value heads for the 9B, 48 for the 27B), and a digest of the
output and the final state of each, which must be equal (the two walks give the same bits).

Usage (H100/H200): python -m bench.delta_walk [--value-heads 32,48] [--chunks 8192@24576,32768@0]
"""

from __future__ import annotations

import argparse
import hashlib

import numpy as np

KEY_HEADS, DIM = 16, 128


def parse_chunks(text: str) -> list[tuple[int, int]]:
    """'ROWS@START,...' as [(rows, start)]. Raises ValueError naming the item."""
    chunks = []
    for item in text.split(","):
        rows, _, start = item.strip().partition("@")
        try:
            chunks.append((int(rows), int(start or 0)))
        except ValueError:
            raise ValueError(f"--chunks item {item!r} is not ROWS@START") from None
        if chunks[-1][0] < 1 or chunks[-1][1] < 0:
            raise ValueError(f"--chunks item {item!r}: rows must be >= 1 and start >= 0")
    return chunks


def inputs(value_heads: int, rows: int) -> tuple[np.ndarray, ...]:
    """Host inputs of one chunk (qn, k, mixed with v from column 4, g, beta, state0), f32: the random
    inputs of `ops.random_delta_inputs` (seed 7, as the tests draw them) with the gates slowed 100x, so the carried state
    reaches the outputs; the recipe session 40's run used (digests in bench/RESULTS.md)."""
    from executor.reference import ops

    r = np.random.default_rng(7)
    q, k, v, g, beta = ops.random_delta_inputs(r, rows, KEY_HEADS, value_heads, DIM, DIM)
    g = (g * np.float32(0.01)).astype(np.float32)
    qn = (q * np.float32(DIM**-0.5)).astype(np.float32)
    mixed = np.concatenate([np.zeros((rows, 4), np.float32), v.reshape(rows, -1)], axis=1)
    state0 = (r.normal(size=(1, value_heads, DIM, DIM)) * 0.3).astype(np.float32)
    return qn, k, mixed, g, beta, state0


def timed_walks(value_heads: int, rows: int, start: int, runs: int, walk=None) -> dict:
    """{wgmma: (median ms, digest)} of delta_mma over one chunk at this shape, walk on mma.sync
    (False) and wgmma (True); walk: (BV, warps) or None (delta_mma's own)."""
    from numba import cuda

    from executor.numba_cuda import delta_mma
    from executor.numba_cuda.device import median_seconds, to_device

    *host, state0 = inputs(value_heads, rows)
    args = [to_device(x) for x in host]
    states = to_device(state0)
    out = cuda.device_array((rows, value_heads, DIM), np.float32)
    result = {}
    for wgmma in (False, True):
        def run(wgmma=wgmma):
            delta_mma.delta_mma(args[0], args[1], args[2], 4, args[3], args[4], start, 0, states, out=out,
                                wgmma=wgmma, walk=walk)
        states.copy_to_device(state0)
        run()
        cuda.synchronize()
        digest = hashlib.sha256(out.copy_to_host().tobytes() + states.copy_to_host().tobytes()).hexdigest()[:16]
        result[wgmma] = (median_seconds(run, runs) * 1e3, digest)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--value-heads", default="32,48", help="value heads a shape, comma-separated (9B 32, 27B 48)")
    parser.add_argument("--chunks", default="8192@24576,32768@0", help="ROWS@START chunks, comma-separated")
    parser.add_argument("--runs", type=int, default=5, help="timed runs a cell (the median is printed)")
    args = parser.parse_args(argv)
    heads = [int(h) for h in args.value_heads.split(",")]
    chunks = parse_chunks(args.chunks)
    if args.runs < 1:
        parser.error("--runs must be >= 1")

    from executor.numba_cuda import delta_mma, delta_wgmma
    from executor.numba_cuda.device import device_name

    print(f"{device_name()}; wgmma walk status: {delta_wgmma.status() or 'ok (bits equal to mma.sync)'}")
    print("\n| value heads | walk (BV, warps) | chunk | mma.sync ms | wgmma ms | wgmma / mma.sync | digests |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    same = True
    for h in heads:
        shape = delta_mma.walk_shape(DIM, h, delta_mma.multiprocessors())
        for rows, start in chunks:
            got = timed_walks(h, rows, start, args.runs)
            equal = got[False][1] == got[True][1]
            same &= equal
            print(f"| {h} | {shape} | {rows} from {start} | {got[False][0]:.3f} | {got[True][0]:.3f} | "
                  f"{got[True][0] / got[False][0]:.3f} | {got[False][1]} {'=' if equal else '!='} {got[True][1]} |",
                  flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
