"""Where the GPU server's device memory goes at start-up, stage by stage.

Builds the backend exactly as `python -m executor.serve --random-weights PRESET` does
(`executor.serve.load_backend`: weights, the state pool of lanes + 2 slots at full context,
decode graphs, prefill graphs), runs the server's warm-up, then reserves the prompt cache
(`NumbaCudaBackend.reserve_cache`, headroom measured from one `max_chunk_rows` chunk) and
prints, per stage, the device's free memory, what the stage took, what it was expected to
take (weights: their bytes; state pool: `Qwen35Config.state_bytes` per slot) and
`device.POOL`'s cached and live blocks. The receipt for "the 27B server holds a prompt
cache" (bench/RESULTS.md, sessions 14-15).

Usage (GPU machine):
    python -m bench.memory --preset qwen3.5-27b [--prompt-cache-gib 64] [--lanes 16]
        [--context 32768] [--no-graphs] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

GIB = 1 << 30


def weight_bytes(config) -> int:
    """Bytes of the dense weights at `config`'s shape as the GPU backend holds them (bf16
    matrices and embeddings, f32 vectors; device_weights.matrix_shapes / vector_shapes)."""
    from executor.numba_cuda.device_weights import matrix_shapes, vector_shapes

    n = 2 * config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2) + 4 * config.hidden_size
    for kind in config.layer_types:
        n += sum(2 * math.prod(s) for s in matrix_shapes(config, kind).values())
        n += sum(4 * math.prod(s) for s in vector_shapes(config, kind).values())
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-27b", help="model shape (default: qwen3.5-27b)")
    ap.add_argument("--prompt-cache-gib", type=float, default=64.0, help="budget asked (default: 64, the server's)")
    ap.add_argument("--lanes", type=int, default=16, help="policy lanes (default: 16, the server's)")
    ap.add_argument("--context", type=int, default=None, help="context rows (default: the server's, 32768 cap)")
    ap.add_argument("--no-graphs", action="store_true", help="skip decode and prefill graphs (faster)")
    ap.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = ap.parse_args(argv)

    from numba import cuda

    from executor.numba_cuda import device
    from executor.presets import preset
    from executor.serve import ServeConfig, load_backend, warm_up
    from policy.config import PolicyConfig

    config = preset(args.preset)
    policy = PolicyConfig(lanes=args.lanes, prompt_cache_bytes=int(args.prompt_cache_gib * GIB))
    cfg = ServeConfig(random_weights=args.preset, backend="cuda", context_rows=args.context,
                      decode_graphs=not args.no_graphs, prefill_graphs=not args.no_graphs, policy=policy)
    rows = cfg.context_rows or min(config.max_position_embeddings, cfg.gpu_context_rows)
    slots = policy.lanes + 2
    expected = {"weights": weight_bytes(config), "state_pool": slots * config.state_bytes(rows)}
    cuda.current_context()
    free0, total = cuda.current_context().get_memory_info()
    table: list[dict] = []
    last = [free0]

    def stage(name: str) -> None:
        cuda.synchronize()
        free, _ = cuda.current_context().get_memory_info()
        pool = device.POOL
        table.append({"stage": name, "free": int(free), "took": int(last[0] - free), "expected": expected.get(name),
                      "pool_cached": pool.cached_bytes if pool else 0, "pool_live": pool.live_bytes if pool else 0})
        last[0] = free

    table.append({"stage": "context", "free": int(free0), "took": int(total - free0), "expected": None,
                  "pool_cached": 0, "pool_live": 0})
    backend, _, _ = load_backend("cuda", None, cfg, config, stage=stage)
    warm_up(backend)
    stage("warm_up")
    got = backend.reserve_cache(policy.prompt_cache_bytes, chunk_rows=policy.max_chunk_rows)
    stage("reserve_cache")
    table[-1]["reserved"] = int(got)

    print(f"{args.preset}: {slots} slots x {rows} rows, asked {args.prompt_cache_gib:g} GiB of prompt cache, "
          f"device {total / GIB:.1f} GiB")
    print(f"{'stage':<16}{'free GiB':>10}{'took GiB':>10}{'expected':>10}{'pool cached':>13}{'pool live':>11}")
    for r in table:
        exp = "" if r["expected"] is None else f"{r['expected'] / GIB:.2f}"
        print(f"{r['stage']:<16}{r['free'] / GIB:>10.2f}{r['took'] / GIB:>10.2f}{exp:>10}"
              f"{r['pool_cached'] / GIB:>13.2f}{r['pool_live'] / GIB:>11.2f}")
    print(f"prompt cache reserved: {got / GIB:.2f} GiB of {args.prompt_cache_gib:g}")
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "slots": slots, "rows": rows, "total": int(total),
                                         "asked": policy.prompt_cache_bytes, "reserved": int(got), "stages": table},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
