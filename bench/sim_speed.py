"""Simulator speed: scheduler events per second and simulated requests per wall second.

    python bench/sim_speed.py [--repeat N]

Runs, in one process, the default `mixed` workload, the one-hour Mooncake conversation trace
(../shared/traces/mooncake) and the synthetic `day` (10,000 conversations), under the
default policy with every invariant checked, and prints one table. Targets (issue 3): the
Mooncake hour in < 20 s and the day in < 60 s of wall time on a 2-core machine.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from policy.config import PolicyConfig
from sim.api import facts_for, git_commit, load_workload, simulate
from sim.cost import load_profile
from sim.mooncake import DEFAULT_TRACE

TARGETS_S = {"mooncake": 20.0, "day": 60.0, "mixed": 10.0}


def measure(name: str, spec: str, profile_name: str) -> dict[str, float | str]:
    """Load (timed) and simulate (timed) one workload; returns the row of the table."""
    t0 = time.perf_counter()
    workload = load_workload(spec, 0)
    t1 = time.perf_counter()
    profile = load_profile(profile_name)
    report = simulate(workload, PolicyConfig(), profile, facts_for(profile))
    t2 = time.perf_counter()
    return {"workload": name, "requests": report.metrics["requests"], "events": report.events,
            "load_s": t1 - t0, "sim_s": t2 - t1, "total_s": t2 - t0,
            "events_per_s": report.events / (t2 - t1), "requests_per_s": report.metrics["requests"] / (t2 - t1),
            "simulated_s": report.metrics["sim_end_s"], "target_s": TARGETS_S[name]}


def main() -> None:
    """Print the table (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="qwen3.5-2b-h200",
                    help="cost profile (default: %(default)s, which keeps up with the Mooncake load)")
    args = ap.parse_args()
    runs = [("mixed", "mixed")]
    if Path(DEFAULT_TRACE).is_file():
        runs.append(("mooncake", f"mooncake:{DEFAULT_TRACE}"))
    runs.append(("day", "day"))
    rows = [measure(name, spec, args.profile) for name, spec in runs]
    print(f"commit {git_commit()}, python {platform.python_version()}, {platform.machine()}, "
          f"profile {args.profile}, invariants checked")
    head = ["workload", "requests", "events", "load s", "sim s", "total s", "target s", "events/s",
            "requests/s", "simulated s"]
    print(" | ".join(head))
    for r in rows:
        print(" | ".join([str(r["workload"]), f"{r['requests']:,.0f}", f"{r['events']:,}", f"{r['load_s']:.2f}",
                          f"{r['sim_s']:.2f}", f"{r['total_s']:.2f}", f"{r['target_s']:.0f}",
                          f"{r['events_per_s']:,.0f}", f"{r['requests_per_s']:,.0f}",
                          f"{r['simulated_s']:,.0f}"]))


if __name__ == "__main__":
    main()
