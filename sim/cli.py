"""`python -m sim run|diff|fuzz|sweep`: parse arguments, build configs, call the library.

Defaults live in PolicyConfig and the library functions, not here. Each verb that writes
files writes the resolved policy, seed and commit beside them (`*.meta.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import IO

from policy.config import policy_to_dict
from sim.api import (
    DEFAULT_WORKLOAD,
    facts_for,
    git_commit,
    load_policy_file,
    load_workload,
    simulate,
)
from sim.cost import coverage_note, load_profile
from sim.invariants import InvariantBroken
from sim.summary import format_table, format_value, summary_table
from sim.trace import name_error

DEFAULT_PROFILE = "qwen3.5-9b-h200-roofline"


TTFT_SAME_S = 1e-9
"""`sim diff` counts a request's TTFT as changed only beyond this many seconds: the same
schedule summed in another order differs by ~1e-13 s (a review counted 77 such "changes"
among 112 in mixed, short_first on against off)."""


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (0 examples would report success having run nothing, 0 jobs
    would mean no worker)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _count(text: str) -> int:
    """argparse type: an integer >= 0 (-1 would slice all but one off a list)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _positive_minutes(text: str) -> float:
    """argparse type: a finite number of minutes > 0 (0 would run nothing and report success)."""
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of minutes > 0, got {text}")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default=DEFAULT_WORKLOAD,
                   help="scenario name (chat, reasoning, agent, concurrent, primers, grid_edges, "
                        "mixed, day), mooncake:PATH, or a workload .jsonl (default: %(default)s)")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help="cost profile: a shipped name or a JSON file (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    p.add_argument("--invariant-rows", default="profile", metavar="N|none|profile",
                   help="the backend's invariant grid: rows, 'none', or the profile's own (default: %(default)s)")
    p.add_argument("--no-check", action="store_true", help="skip the invariant checks")
    p.add_argument("--no-fast-forward", action="store_true",
                   help="commit decode rounds one by one (same trace, slower)")


def _output_file(path: str | None, flag: str) -> Path | None:
    """The file `flag` writes, checked before anything runs (None when not given).

    Raises ValueError `FLAG 'PATH': ...` when PATH is empty or a directory, or its folder is missing.
    """
    if path is None:
        return None
    out = Path(path)
    if not path or out.is_dir():
        raise ValueError(f"{flag} {path!r}: want a file to write, not {'a directory' if path else 'an empty path'}")
    if not out.parent.is_dir():
        raise ValueError(f"{flag} {path!r}: folder {str(out.parent)!r} does not exist")
    return out


def _output_dir(path: str, flag: str) -> Path:
    """The folder `flag` writes into (made when missing), checked before anything runs: fuzz
    writes there only when a case fails, and that case must not be lost to a bad path.

    Raises ValueError `FLAG 'PATH': ...` when PATH or the nearest folder above it that exists
    is not a directory, or that folder is not writable.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {path!r}: exists and is not a directory")
    above = out.absolute()
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise ValueError(f"{flag} {path!r}: {str(above)!r} is not a directory")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r}: {str(above)!r} is not writable")
    return out


def _close(files: list[IO[str]], quiet: bool = False) -> None:
    """Close every file; raises the first close's OSError (a last write that failed), naming its
    file, unless quiet (closing after another error, which is the one to report)."""
    failed = None
    for f in files:
        try:
            f.close()
        except OSError as err:
            failed = failed or name_error(err, f)
    if failed is not None and not quiet:
        raise failed


def _write_meta(path: Path, args: argparse.Namespace, policies: dict[str, dict]) -> None:
    meta = {"command": sys.argv, "commit": git_commit(), "seed": args.seed,
            "workload": args.workload, "profile": args.profile,
            "invariant_rows": args.invariant_rows, "policies": policies}
    path.with_name(path.name + ".meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def cmd_run(args: argparse.Namespace) -> int:
    cfg = load_policy_file(args.policy)
    profile = load_profile(args.profile)
    facts = facts_for(profile, args.invariant_rows)
    workload = load_workload(args.workload, args.seed)
    trace_path, perfetto_path = _output_file(args.trace, "--trace"), _output_file(args.perfetto, "--perfetto")
    outputs = [p for p in (trace_path, perfetto_path) if p is not None]
    trace = open(trace_path, "w") if trace_path else None  # before the run: an unwritable path fails at once
    perfetto = open(perfetto_path, "w") if perfetto_path else None
    for path in outputs:
        _write_meta(path, args, {"policy": policy_to_dict(cfg)})
    t0 = time.perf_counter()
    files = [f for f in (trace, perfetto) if f is not None]
    try:
        report = simulate(workload, cfg, profile, facts, trace=trace, perfetto=perfetto,
                          check=not args.no_check, fast_forward=not args.no_fast_forward)
    except BaseException:
        _close(files, quiet=True)  # the run's own error (a broken rule: exit 3) is the one reported
        raise
    _close(files)
    wall = time.perf_counter() - t0
    print(f"workload {args.workload} (seed {args.seed}, {len(workload.conversations)} conversations), "
          f"policy {args.policy or 'default'}, profile {profile.name} ({profile.source}), "
          f"invariant_rows {facts.invariant_rows}")
    print(summary_table(report.metrics))
    longest = max((len(t.prompt) for c in workload.conversations for t in c.turns), default=0)
    note = coverage_note(profile, cfg.max_chunk_rows, longest)
    if note:
        print(note)
    if workload.ideal_reuse is not None:
        print(f"ideal reuse of this trace (unlimited cache, 512-row blocks): {workload.ideal_reuse:.1%}")
    checked = "skipped" if args.no_check else f"held on all {report.events:,} events"
    print(f"invariants (DESIGN rules 1-8): {checked}; wall {wall:.2f} s")
    for path in outputs:
        print(f"wrote {path}")
    return 0


def changed_requests(cached_base: dict[str, int], cached_change: dict[str, int], ttft_base: dict[str, float],
                     ttft_change: dict[str, float]) -> list[tuple]:
    """Requests whose cached_tokens differ, whose TTFT differs by more than TTFT_SAME_S
    seconds, or that have a first token in one run only, as (|cached delta|, |TTFT delta| s,
    request, cached base, cached change, TTFT base, TTFT change), the largest cached change
    first, then the largest TTFT change, then by request id."""
    moved = []
    for rid in cached_base.keys() | cached_change.keys():
        cb, cc = cached_base.get(rid, 0), cached_change.get(rid, 0)
        tb, tc = ttft_base.get(rid), ttft_change.get(rid)
        dt = (tc - tb) if tb is not None and tc is not None else 0.0
        if cb != cc or abs(dt) > TTFT_SAME_S or (tb is None) != (tc is None):
            moved.append((abs(cc - cb), abs(dt), rid, cb, cc, tb, tc))
    moved.sort(key=lambda m: (-m[0], -m[1], m[2]))
    return moved


def cmd_diff(args: argparse.Namespace) -> int:
    base_cfg, change_cfg = load_policy_file(args.base), load_policy_file(args.change)
    profile = load_profile(args.profile)
    facts = facts_for(profile, args.invariant_rows)
    workload = load_workload(args.workload, args.seed)
    check, ff = not args.no_check, not args.no_fast_forward
    base = simulate(workload, base_cfg, profile, facts, check=check, fast_forward=ff)
    change = simulate(workload, change_cfg, profile, facts, check=check, fast_forward=ff)
    print(f"workload {args.workload} (seed {args.seed}), profile {profile.name}, "
          f"invariant_rows {facts.invariant_rows}")
    print(f"BASE   {args.base}\nCHANGE {args.change}")
    changed = {k: (getattr(base_cfg, k), getattr(change_cfg, k)) for k in policy_to_dict(base_cfg)
               if getattr(base_cfg, k) != getattr(change_cfg, k)}
    print("policy fields changed: " + (", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()) or "none"))
    rows = [["metric", "base", "change", "delta", "ratio"]]
    for name, b in base.metrics.items():
        c = change.metrics.get(name, float("nan"))
        delta = c - b
        ratio = f"{c / b:.3f}" if b not in (0, 0.0) and b == b and c == c else "-"
        sign = "+" if delta > 0 else ""
        rows.append([name, format_value(name, b), format_value(name, c),
                     sign + format_value(name, delta) if delta == delta else "-", ratio])
    print(format_table(rows))
    moved = changed_requests(base.cached_tokens, change.cached_tokens, base.ttft_s, change.ttft_s)
    print(f"\nrequests whose cached_tokens or TTFT changed most ({len(moved)} changed, top {args.top}):")
    table = [["request", "cached base", "cached change", "TTFT base", "TTFT change"]]
    for _, _, rid, cb, cc, tb, tc in moved[: args.top]:
        table.append([rid, f"{cb:,}", f"{cc:,}", format_value("ttft_s", tb if tb is not None else float("nan")),
                      format_value("ttft_s", tc if tc is not None else float("nan"))])
    print(format_table(table))
    if check:
        print(f"\ninvariants (DESIGN rules 1-8, incl. plan consistency of every resumed request): "
              f"held in both runs ({base.events:,} and {change.events:,} events)")
    return 0


def cmd_fuzz(args: argparse.Namespace) -> int:
    from sim.fuzz import fuzz

    return fuzz(examples=args.examples, minutes=args.minutes, seed=args.seed,
                out_dir=_output_dir(args.out, "--out"), profile_name=args.profile)


def cmd_sweep(args: argparse.Namespace) -> int:
    from sim.sweep import parse_grid, sweep

    grid = parse_grid(args.grid)
    return sweep(grid, base_policy=args.policy, workload=args.workload, profile=args.profile,
                 seed=args.seed, invariant_rows=args.invariant_rows, out_dir=_output_dir(args.out, "--out"),
                 jobs=args.jobs, check=not args.no_check, fast_forward=not args.no_fast_forward)


def build_parser() -> argparse.ArgumentParser:
    """The `python -m sim` argument parser (one sub-command per verb)."""
    p = argparse.ArgumentParser(prog="python -m sim", description=(
        "Simulate the warmstate scheduler on a virtual clock: prompt cache, warm passes and "
        "chunk plans for Qwen3.5, with every DESIGN rule checked as an invariant."))
    sub = p.add_subparsers(dest="verb")
    run = sub.add_parser("run", help="simulate one policy over a workload and print a summary")
    run.add_argument("--policy", metavar="FILE.toml", help="PolicyConfig fields (default: the defaults, "
                     "= policies/default.toml)")
    _common(run)
    run.add_argument("--trace", metavar="OUT.jsonl", help="write every trace event as JSONL")
    run.add_argument("--perfetto", metavar="OUT.json", help="write a Chrome/Perfetto trace")
    run.set_defaults(fn=cmd_run)
    diff = sub.add_parser("diff", help="simulate two policies on one workload, side by side")
    diff.add_argument("base", metavar="BASE.toml")
    diff.add_argument("change", metavar="CHANGE.toml")
    _common(diff)
    diff.add_argument("--top", type=_count, default=10, help="requests to list, >= 0 (default: %(default)s)")
    diff.set_defaults(fn=cmd_diff)
    fz = sub.add_parser("fuzz", help="random workloads and policies under every invariant (Hypothesis)")
    budget = fz.add_mutually_exclusive_group()
    budget.add_argument("--examples", type=_positive_int, default=200, help="examples to try (default: %(default)s)")
    budget.add_argument("--minutes", type=_positive_minutes, default=None,
                        help="run for this many minutes instead of a number of examples")
    fz.add_argument("--seed", type=int, default=0, help="Hypothesis seed (default: %(default)s)")
    fz.add_argument("--profile", default=DEFAULT_PROFILE, help="cost profile (default: %(default)s)")
    fz.add_argument("--out", default="fuzz-out", help="where a failing case is written (default: %(default)s)")
    fz.set_defaults(fn=cmd_fuzz)
    sw = sub.add_parser("sweep", help="a grid of policies over one workload: CSV + one PNG per metric")
    sw.add_argument("--grid", action="append", default=[], metavar="FIELD=V1,V2",
                    help="a PolicyConfig field and its values; repeat for more fields")
    sw.add_argument("--policy", metavar="FILE.toml", help="base policy the grid changes")
    _common(sw)
    sw.add_argument("--jobs", type=_positive_int, default=None,
                    help="worker processes, >= 1 (default: CPU count, at most one per policy)")
    sw.add_argument("--out", default="sweep-out", help="output folder (default: %(default)s)")
    sw.set_defaults(fn=cmd_sweep)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; with no verb it runs `run` with every default."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["run"]
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    try:
        return args.fn(args)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except InvariantBroken as err:
        print(err, file=sys.stderr)
        return 3
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a file that cannot be read or written: `error: PATH: reason`
        where = f"{err.filename}: " if err.filename is not None else ""
        print(f"error: {where}{err.strerror or err}", file=sys.stderr)
        return 2
