"""Host time of one sampled token: `executor.sampling.sample` against a stable sort of the
whole vocabulary (the definition it keeps), side by side in one run, on random logits at
the Qwen3.5 vocabulary size; every draw's pick compared.

    python -m bench.sampling [--vocab 248320] [--draws 30] [--scales 1,4,12]

`--scales`: standard deviations of the random logits (1: a flat distribution whose nucleus
is most of the vocabulary, the worst case; 12: a peaked one, like a trained model's).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from executor.sampling import SamplingParams, sample


class FixedDraw:
    """An rng stand-in whose one uniform is `u` (the same draw for both ways)."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


def full_sort_sample(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """The token `executor.sampling.sample` must pick for draw u, by its definition: the
    nucleus from a stable sort of every token (ties by lower id); top_p = 1 in id order.
    The reference of bench.sampling and of tests/executor/test_token_sampling.py."""
    scaled = np.asarray(logits, np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())
    if params.top_p >= 1.0:
        cumulative = np.cumsum(probs)
        return int(min(np.searchsorted(cumulative, u * cumulative[-1], side="right"), probs.size - 1))
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    keep = min(int(np.searchsorted(cumulative, params.top_p * probs.sum(), side="left")) + 1, probs.size)
    kept = cumulative[:keep] / cumulative[keep - 1]
    return int(order[min(int(np.searchsorted(kept, u, side="right")), keep - 1)])


def run(vocab: int, draws: int, scales: tuple[float, ...], seed: int = 0) -> list[dict]:
    """One row per (scale, params): median ms a draw of each way and how many picks agree."""
    rng = np.random.default_rng(seed)
    rows = []
    for scale in scales:
        logits = (rng.standard_normal(vocab) * scale).astype(np.float32)
        for params in (SamplingParams(0.7, 0.8), SamplingParams(0.7, 0.95), SamplingParams(1.0, 1.0)):
            us = rng.random(draws)
            times = {"full": [], "ours": []}
            same = 0
            for u in us:
                t0 = time.perf_counter()
                a = full_sort_sample(logits, params, u)
                t1 = time.perf_counter()
                b = sample(logits, params, FixedDraw(u))
                t2 = time.perf_counter()
                times["full"].append(t1 - t0)
                times["ours"].append(t2 - t1)
                same += a == b
            full, ours = (float(np.median(times[k])) * 1e3 for k in ("full", "ours"))
            rows.append({"scale": scale, "temperature": params.temperature, "top_p": params.top_p,
                         "full_ms": full, "ours_ms": ours, "same": same, "draws": draws})
    return rows


def table(rows: list[dict], vocab: int) -> str:
    lines = [f"vocab {vocab}", "| logit std | temperature | top_p | full sort ms | ours ms | full / ours | same picks |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['scale']:g} | {r['temperature']:g} | {r['top_p']:g} | {r['full_ms']:.2f} | "
                     f"{r['ours_ms']:.2f} | {r['full_ms'] / r['ours_ms']:.1f}x | {r['same']}/{r['draws']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=248_320, help="vocabulary size (default: Qwen3.5's 248320)")
    parser.add_argument("--draws", type=int, default=30, help="draws per row (default: 30)")
    parser.add_argument("--scales", default="1,4,12", help="logit standard deviations, comma-separated")
    args = parser.parse_args(argv)
    if args.vocab < 1 or args.draws < 1:
        parser.error("--vocab and --draws must be >= 1")
    scales = tuple(float(v) for v in args.scales.split(","))
    rows = run(args.vocab, args.draws, scales)
    print(table(rows, args.vocab))
    return 0 if all(r["same"] == r["draws"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
