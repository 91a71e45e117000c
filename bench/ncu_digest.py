"""A digest of Nsight Compute's per-kernel details: one table row per profiled launch.

Nsight Compute (`ncu`, in the GPU machine's image) reads the H200's hardware counters there;
`--csv --page details` writes every metric of every section as one CSV row. This turns that
into what decides a kernel's next step: its time, grid, how busy the schedulers were, how many
warps they had to choose from, occupancy and what limited it, registers and spills, DRAM
throughput, and the busiest pipe (from ncu's own HighPipeUtilization finding).

Usage (GPU machine; `--clock-control none` leaves the clocks alone, as the device tool's
METHOD.md asks):

    ncu --clock-control none --profile-from-start off --launch-count 56 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \\
        --csv --page details python -m bench.kernel_split --preset qwen3.5-27b --prefill 51@1984 \\
        --decode "" --ncu > ncu.csv
    python -m bench.ncu_digest ncu.csv [--kernel REGEX] [--rules]

ncu replays each kernel with the caches flushed (its default cache control), so short
kernels read a little slower than in a CUDA graph: bench/RESULTS.md, session 23, compares.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from pathlib import Path

from bench.kernel_split import kernel_label

_PIPE = re.compile(r"([A-Za-z][\w/ ]*?) is the highest-utilized pipeline \(([\d.]+)%\)")
_SECONDS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
"""Microseconds per unit of ncu's Duration."""


def number(text: str) -> float | None:
    """A metric value as a float ("30,144" -> 30144.0), or None when it is not a number
    ("no data", "", "PolicySpread")."""
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def parse(text: str) -> list[dict]:
    """The launches of an `ncu --csv --page details` output, in order: dicts with id, name,
    block and grid (ncu's "(x, y, z)" strings), metrics {metric name: (value text, unit)} and
    rules [(rule name, estimated speedup text, description)]. Lines before the CSV header
    (ncu's ==PROF== and ==WARNING== lines, the program's own output) are skipped. Raises
    ValueError when the text has no header row."""
    at = text.find('"ID","Process ID"')
    if at < 0:
        raise ValueError('no ncu CSV header ("ID","Process ID",...): was ncu run with --csv --page details?')
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO(text[at:])):
        kernel = kernels.setdefault(row["ID"], {"id": row["ID"], "name": row["Kernel Name"], "block": row["Block Size"],
                                                "grid": row["Grid Size"], "metrics": {}, "rules": []})
        if row.get("Metric Name"):
            kernel["metrics"][row["Metric Name"]] = (row.get("Metric Value") or "", row.get("Metric Unit") or "")
        if row.get("Rule Name") and row.get("Rule Description"):
            kernel["rules"].append((row["Rule Name"], row.get("Estimated Speedup") or "", row["Rule Description"]))
    return list(kernels.values())


def summary(kernel: dict) -> dict:
    """The digest of one launch from `parse`: label, grid and block (CTAs and threads a CTA),
    duration_us, issue_busy (%), warps and eligible (a scheduler's active and eligible warps),
    occupancy and theoretical (%), limit (what caps the CTAs an SM, "/"-joined when several
    cap it equally: Registers, Shared Mem, Warps, SM), registers, shared_kb (dynamic shared memory a CTA), spills (local memory
    spilling requests), dram (% of peak), pipe ("ALU 47.8%"). A metric the sections did not
    give is None."""
    m = kernel["metrics"]
    get = lambda name: number(m.get(name, ("", ""))[0])
    duration = m.get("Duration")
    us = None
    if duration is not None and number(duration[0]) is not None:
        us = number(duration[0]) * _SECONDS.get(duration[1], 1e-3)
    limits = {name: get(f"Block Limit {name}") for name in ("Registers", "Shared Mem", "Warps", "SM")}
    known = {k: v for k, v in limits.items() if v is not None}
    pipe = None
    for name, _, text in kernel["rules"]:
        found = _PIPE.search(text) if name == "HighPipeUtilization" else None
        if found:
            pipe = f"{found.group(1)} {found.group(2)}%"
            break
    shared = get("Dynamic Shared Memory Per Block")
    return {"label": kernel_label(kernel["name"]), "grid": get("Grid Size"), "block": get("Block Size"),
            "duration_us": us, "issue_busy": get("Issue Slots Busy"), "warps": get("Active Warps Per Scheduler"),
            "eligible": get("Eligible Warps Per Scheduler"), "occupancy": get("Achieved Occupancy"),
            "theoretical": get("Theoretical Occupancy"),
            "limit": "/".join(k for k, v in known.items() if v == min(known.values())) if known else None,
            "registers": get("Registers Per Thread"), "shared_kb": None if shared is None else shared / 1024,
            "spills": get("Local Memory Spilling Requests"), "dram": get("DRAM Throughput"), "pipe": pipe}


def _cell(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def table(kernels: list[dict], pattern: str | None = None, rules: bool = False) -> str:
    """A markdown table of `parse`'s launches whose label matches `pattern` (a regex; None:
    all), one row each; with `rules`, ncu's findings with an estimated speedup follow each row."""
    lines = ["| # | kernel | CTAs x threads | us | issue busy % | warps (eligible) a scheduler | occupancy % (limit) "
             "| registers | shared KB | spills | DRAM % | busiest pipe |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kernel in kernels:
        s = summary(kernel)
        if pattern is not None and not re.search(pattern, s["label"]):
            continue
        lines.append(f"| {kernel['id']} | {s['label']} | {_cell(s['grid'], 0)} x {_cell(s['block'], 0)} | "
                     f"{_cell(s['duration_us'])} | {_cell(s['issue_busy'])} | {_cell(s['warps'], 2)} "
                     f"({_cell(s['eligible'], 2)}) | {_cell(s['occupancy'])} ({s['limit'] or '-'}) | "
                     f"{_cell(s['registers'], 0)} | {_cell(s['shared_kb'])} | {_cell(s['spills'], 0)} | "
                     f"{_cell(s['dram'])} | {s['pipe'] or '-'} |")
        if rules:
            for name, speedup, text in kernel["rules"]:
                if number(speedup):
                    lines.append(f"|  | {name} (est. speedup {speedup}%): {' '.join(text.split())[:400]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path, help="the output of ncu --csv --page details")
    ap.add_argument("--kernel", default=None, help="only launches whose label matches this regex")
    ap.add_argument("--rules", action="store_true", help="also ncu's findings that estimate a speedup")
    args = ap.parse_args(argv)
    try:
        kernels = parse(args.csv.read_text(errors="replace"))
    except (OSError, ValueError) as exc:
        print(f"ncu_digest: {args.csv}: {exc}", file=sys.stderr)
        return 2
    print(table(kernels, args.kernel, args.rules))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
