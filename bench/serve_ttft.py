"""TTFT of cold prompts through the real server, as its client sees it.

Why: `bench.decode_prefill` times the backend's `prefill` call in-process; a user times the
server. This starts `python -m executor.serve ARGS` with a policy whose marks and chunks are
`--chunk-rows` apart (a prompt of at most that many rows runs as one chunk, with the tail the
scheduler gives its last chunk: DESIGN rule 8), sends `--warmup` prompts and then `--repeat`
prompts of `--rows` random token ids each, one at a time, streamed (`stream: true`,
`max_tokens: 1`, greedy), and takes TTFT = from sending the request to the first SSE event that
carries a token. Every prompt begins with other ids, so none resumes a kept state; the usage
each reports (`cached_tokens` 0) is checked. The server's trace (`--trace`) gives each request's
chunks and the tail the scheduler passed. Prints one table row and writes serve_ttft.json into
`--out` (with the seed, commit, machine and date). `--server-args` may set `--context` (default:
the prompt's rows + 16), not `--policy` or `--trace`, which are the bench's own.

Usage (GPU machine): python -m bench.serve_ttft --server-args "--random-weights qwen3.5-9b"
  [--rows 32768] [--chunk-rows 32768] [--repeat 3] [--warmup 1] --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from executor.server_process import attach_server_args, running_server
from policy.config import format_policy, policy_from_dict
from sim.api import git_commit, machine

IDS = (1000, 30000)
"""Prompt token ids are drawn from [IDS[0], IDS[1]) (inside every Qwen3.5 vocabulary)."""


def prompts(count: int, rows: int, seed: int) -> list[list[int]]:
    """`count` prompts of `rows` random ids; prompt i starts with id IDS[0] + i (distinct first
    rows, so no two share a prefix the prompt cache could resume)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        ids = [int(t) for t in rng.integers(IDS[0], IDS[1], rows)]
        ids[0] = IDS[0] + i
        out.append(ids)
    return out


def first_token_s(url: str, model: str, ids: Sequence[int], timeout_s: float = 600.0) -> tuple[float, dict[str, Any]]:
    """One streamed greedy request of `ids` with max_tokens 1: (seconds from sending it to the first
    SSE event with a token, the usage of its last event). Raises RuntimeError on a non-200 answer
    or a stream without a token or usage."""
    body = json.dumps({"model": model, "prompt": list(map(int, ids)), "max_tokens": 1, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, usage = None, None
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if ttft is None and event.get("choices") and event["choices"][0].get("text") is not None:
                    ttft = time.perf_counter() - t0
                usage = event.get("usage") or usage
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"/v1/completions answered {exc.code}: {exc.read()[:300]!r}") from None
    if ttft is None or usage is None:
        raise RuntimeError(f"the stream had {'no token' if ttft is None else 'no usage'}")
    return ttft, usage


def measure(url: str, model: str, rows: int, repeat: int, warmup: int, seed: int) -> dict[str, Any]:
    """TTFTs of `warmup` then `repeat` prompts of `rows` rows; the warm-up ones are kept apart.
    Raises RuntimeError when a prompt reports cached tokens or other prompt rows."""
    runs, warm = [], []
    for i, ids in enumerate(prompts(warmup + repeat, rows, seed)):
        ttft, usage = first_token_s(url, model, ids)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if usage.get("prompt_tokens") != rows or cached:
            raise RuntimeError(f"prompt {i}: usage {usage}, expected {rows} prompt tokens and none cached")
        (warm if i < warmup else runs).append(round(ttft, 4))
    return {"rows": rows, "ttft_s": float(np.median(runs)), "ttft_runs_s": runs, "warmup_s": warm}


def cold_chunks(trace: Path) -> list[list[tuple[int, int, int | None]]]:
    """Each cold request's chunks as the scheduler started them, from the server's trace: a list per
    request, in order, of (start, end, tail_from) (`policy.events.ChunkStarted`)."""
    by_request: dict[str, list] = {}
    for line in trace.read_text().splitlines():
        event = json.loads(line)
        if event.get("kind") == "chunk_started" and event.get("pass_kind") == "cold":
            by_request.setdefault(event["request"], []).append((event["start"], event["end"], event["tail_from"]))
    return list(by_request.values())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_ttft", description=__doc__.splitlines()[0])
    ap.add_argument("--server-args", default="", help="more server flags, e.g. \"--random-weights qwen3.5-9b\" "
                                                       "(default: the built-in tiny model)")
    ap.add_argument("--rows", type=int, default=32768, help="prompt rows (default: 32768)")
    ap.add_argument("--chunk-rows", type=int, default=None,
                    help="the policy's grid_rows and max_chunk_rows (default: --rows, one chunk a prompt; "
                         "the server's own defaults are 4096)")
    ap.add_argument("--repeat", type=int, default=3, help="timed prompts, TTFT their median (default: 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed prompts first (default: 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts' ids (default: 0)")
    ap.add_argument("--out", type=Path, required=True, help="folder for serve_ttft.json, the policy and the server log")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="server start limit (default: 900)")
    args = ap.parse_args(attach_server_args(argv))
    for name in ("rows", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup: must be at least 0, got {args.warmup}")
    chunk = args.chunk_rows if args.chunk_rows is not None else args.rows
    if chunk < 1:
        ap.error(f"--chunk-rows: must be at least 1, got {chunk}")
    args.out.mkdir(parents=True, exist_ok=True)
    policy = args.out / "policy.toml"
    policy.write_text(format_policy(policy_from_dict({"grid_rows": chunk, "max_chunk_rows": chunk})))
    given = shlex.split(args.server_args)
    for flag in ("--policy", "--trace"):
        if any(a == flag or a.startswith(flag + "=") for a in given):
            ap.error(f"--server-args: {flag} is this bench's own (from --chunk-rows and --out)")
    trace = args.out / "trace.jsonl"
    server_args = [*given, "--policy", str(policy), "--trace", str(trace)]
    if not any(a == "--context" or a.startswith("--context=") for a in given):
        server_args += ["--context", str(args.rows + 16)]
    command = " ".join(["python -m bench.serve_ttft", *(argv if argv is not None else sys.argv[1:])])
    t0 = time.perf_counter()
    try:
        with running_server(server_args, args.out / "server.log", args.timeout_s) as (url, ready, model):
            print(f"server ready at {url} ({time.perf_counter() - t0:.1f} s)", flush=True)
            result = measure(url, model, args.rows, args.repeat, args.warmup, args.seed)
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    result["chunks"] = cold_chunks(trace)
    result |= {"command": command, "server_args": server_args, "chunk_rows": chunk, "model": model,
               "backend": ready.get("backend"), "seed": args.seed, "commit": git_commit(), "machine": machine(),
               "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    (args.out / "serve_ttft.json").write_text(json.dumps(result, indent=1) + "\n")
    last = result["chunks"][-1] if result["chunks"] else []
    tail = "-" if not last or last[-1][2] is None else f"from row {last[-1][2]}"
    print("| model | prompt rows | chunks | last chunk's tail | TTFT s (median) | runs s | warm-up s |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {model} | {args.rows} | {len(last)} (at most {chunk} rows each) | {tail} | {result['ttft_s']:.3f} | "
          f"{', '.join(map(str, result['ttft_runs_s']))} | {', '.join(map(str, result['warmup_s']))} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
