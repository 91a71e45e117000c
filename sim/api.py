"""One library call per CLI verb's unit of work: load inputs, simulate a run, report it."""

from __future__ import annotations

import os
import platform
import random
import subprocess
import tomllib
from pathlib import Path
from typing import IO

import attrs

from policy.config import PolicyConfig, parse_policy
from policy.usable import BackendFacts
from sim.cost import Profile
from sim.invariants import Checker
from sim.loop import SimResult, Simulation
from sim.mooncake import read_mooncake
from sim.scenarios import scenarios
from sim.summary import Summary
from sim.trace import JsonlTrace, PerfettoTrace
from sim.workload import Workload, read_workload, utf8_text

DEFAULT_WORKLOAD = "mixed"


def load_policy_file(path: str | Path | None) -> PolicyConfig:
    """PolicyConfig from a TOML file of its fields; None gives the defaults (policies/default.toml).

    Raises ValueError `PATH: ...` (or `PATH:LINE: ...`) for text that is not UTF-8 or not TOML,
    ValueError for a bad field, OSError when unreadable.
    """
    if path is None:
        return PolicyConfig()
    text = utf8_text(Path(path).read_bytes(), path)
    try:
        return parse_policy(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None


def load_workload(spec: str, seed: int) -> Workload:
    """A workload by spec: a scenario NAME (generated from `seed`), `mooncake:PATH`, or a JSONL path.

    Raises ValueError naming the spec when it matches none or names no path (`mooncake:`),
    ValueError `PATH: no requests` for a file with none, OSError when a file is unreadable.
    """
    mooncake = spec.startswith("mooncake:")
    if mooncake or spec.endswith(".jsonl") or Path(spec).is_file():
        path = spec.removeprefix("mooncake:")
        if not path:
            raise ValueError(f"--workload {spec!r}: want mooncake:PATH, got no PATH")
        workload = read_mooncake(path) if mooncake else read_workload(path)
        if not workload.conversations:
            raise ValueError(f"{path}: no requests")
        return workload
    gens = scenarios()
    if spec not in gens:
        raise ValueError(f"unknown workload {spec!r}: give one of {', '.join(sorted(gens))}, "
                         "mooncake:PATH, or a .jsonl file")
    return gens[spec](random.Random(seed))


def facts_for(profile: Profile, invariant_rows: str | int | None = "profile") -> BackendFacts:
    """Backend facts: the profile's, or `invariant_rows` (an int, or "none") when given."""
    if invariant_rows == "profile":
        return BackendFacts(profile.invariant_rows)
    if invariant_rows is None or str(invariant_rows).lower() == "none":
        return BackendFacts(None)
    try:
        rows = int(invariant_rows)
    except ValueError:
        raise ValueError(f"invariant_rows: must be a positive integer, 'none' or 'profile', got {invariant_rows!r}") from None
    return BackendFacts(rows)


@attrs.frozen
class RunReport:
    """A finished run: metrics by name, the result, per-request TTFT and cached tokens."""

    metrics: dict[str, float]
    result: SimResult
    ttft_s: dict[str, float]
    cached_tokens: dict[str, int]
    events: int


def simulate(
    workload: Workload,
    cfg: PolicyConfig,
    profile: Profile,
    facts: BackendFacts,
    *,
    trace: IO[str] | None = None,
    perfetto: IO[str] | None = None,
    check: bool = True,
    fast_forward: bool = True,
) -> RunReport:
    """Run the scheduler over `workload` on the virtual clock; check invariants when `check`.

    Raises sim.invariants.InvariantBroken when a DESIGN rule breaks.
    """
    summary = Summary()
    sinks = [summary.event]
    if trace is not None:
        sinks.append(JsonlTrace(trace).event)
    pf = PerfettoTrace() if perfetto is not None else None
    if pf is not None:
        sinks.append(pf.event)
    requests: dict = {}
    checker = Checker(cfg, facts, requests) if check else None
    if checker is not None:
        sinks.insert(0, checker.event)

    def emit(e) -> None:
        for sink in sinks:
            sink(e)

    sim = Simulation(workload, cfg, profile, facts, emit=emit, requests=requests,
                     on_step=checker.step if checker is not None else None,
                     fast_forward=fast_forward)
    if checker is not None:
        checker.store = sim.scheduler.store
    result = sim.run()
    if checker is not None:
        checker.finish()
    if pf is not None:
        pf.write(perfetto)
    return RunReport(summary.metrics(result.store_bytes_peak), result,
                     dict(summary.ttft_by_request), dict(summary.cached_by_request), summary.events)


def machine(cpuinfo: Path = Path("/proc/cpuinfo"), boot_id: Path = Path("/proc/sys/kernel/random/boot_id")) -> str:
    """This machine as a profile's provenance names it: "HOSTNAME (CPU MODEL, N CPUs, boot
    B)", the CPU model read from `cpuinfo` ("unknown CPU" where it cannot be read) and B the
    first 8 characters of the kernel's `boot_id` (left out where it cannot be read). Why: two
    calls' H200 machines ran the same 2B server ~15% apart (bench/RESULTS.md, session 13), and
    lent machines share a hostname and a CPU model (a fresh-user review, session 19): the boot
    tells one machine, or one start of it, from another."""
    model = "unknown CPU"
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        boot = boot_id.read_text().strip()[:8]
    except OSError:
        boot = ""
    return f"{platform.node() or 'unknown host'} ({model}, {os.cpu_count()} CPUs{f', boot {boot}' if boot else ''})"


def git_commit() -> str:
    """The checkout's commit (short), with "+dirty" when tracked files differ
    from it (as `git describe --dirty` marks them: results from uncommitted code say so), or
    "unknown" outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=here)
        commit = out.stdout.strip()
        if not commit:
            return "unknown"
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, timeout=5, cwd=here)
        return commit + ("+dirty" if changed.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
