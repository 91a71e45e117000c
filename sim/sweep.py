"""`python -m sim sweep`: a grid of policies over one workload, in parallel processes.

Writes `sweep.csv` (one row per policy: the grid fields, then every summary metric), one
PNG plot per metric (matplotlib), and `sweep.meta.json` (command, commit, seed, grid).
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import sys
import tomllib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from tqdm import tqdm

from policy.config import policy_fields, policy_to_dict
from sim.api import facts_for, git_commit, load_policy_file, load_workload, simulate
from sim.cost import load_profile


def parse_grid(specs: list[str]) -> dict[str, list[Any]]:
    """`['grid_rows=2048,4096', 'warm_quiet_ms=0,150']` -> {field: [values]} (TOML literals).

    Raises ValueError naming the spec: no `=`, an unknown PolicyConfig field, a repeated
    field, no values, or a value that is not a TOML literal.
    """
    grid: dict[str, list[Any]] = {}
    known = set(policy_fields())
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not values.strip():
            raise ValueError(f"--grid {spec!r}: want FIELD=V1,V2,...")
        if name not in known:
            raise ValueError(f"--grid {spec!r}: unknown policy field {name!r}; known: {', '.join(sorted(known))}")
        if name in grid:
            raise ValueError(f"--grid {spec!r}: field {name!r} given twice")
        grid[name] = []
        for v in values.split(","):
            try:
                grid[name].append(tomllib.loads(f"v = {v.strip()}")["v"])
            except tomllib.TOMLDecodeError:
                raise ValueError(f"--grid {spec!r}: {name} value {v.strip()!r} is not a TOML literal "
                                 "(a number, true/false, or a quoted string)") from None
    if not grid:
        raise ValueError("sweep needs at least one --grid FIELD=V1,V2")
    return grid


def _run_one(job: tuple[dict[str, Any], dict[str, Any], str, str, int, Any, bool, bool]) -> dict[str, Any]:
    changes, base, workload_spec, profile_name, seed, invariant_rows, check, fast_forward = job
    cfg = load_policy_file(None).with_changes(**{**base, **changes})
    profile = load_profile(profile_name)
    report = simulate(load_workload(workload_spec, seed), cfg, profile, facts_for(profile, invariant_rows),
                      check=check, fast_forward=fast_forward)
    return {**changes, **report.metrics}


def sweep(grid: dict[str, list[Any]], *, base_policy: str | None, workload: str, profile: str, seed: int,
          invariant_rows: Any, out_dir: Path, jobs: int | None, check: bool, fast_forward: bool) -> int:
    """Run every combination of `grid` over the workload (`check` and `fast_forward` as in
    sim.api.simulate) in `jobs` processes (None: one per CPU, at most one per policy); write
    CSV + plots under out_dir.

    Raises ValueError `jobs: ...` when jobs < 1, and ValueError for a bad grid value (before any run).
    """
    if jobs is not None and jobs < 1:
        raise ValueError(f"jobs: must be at least 1, got {jobs}")
    base = policy_to_dict(load_policy_file(base_policy))
    names = list(grid)
    combos = [dict(zip(names, values)) for values in itertools.product(*grid.values())]
    for c in combos:
        load_policy_file(None).with_changes(**{**base, **c})  # fail fast on a bad value
    out_dir.mkdir(parents=True, exist_ok=True)
    work = [(c, base, workload, profile, seed, invariant_rows, check, fast_forward) for c in combos]
    jobs = jobs if jobs is not None else min(len(work), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        rows = list(tqdm(pool.map(_run_one, work), total=len(work), desc="sweep", unit="policy",
                         file=sys.stderr))
    csv_path = out_dir / "sweep.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plots = _plot(rows, names, out_dir)
    meta = {"command": sys.argv, "commit": git_commit(), "seed": seed, "workload": workload,
            "profile": profile, "invariant_rows": invariant_rows, "grid": grid, "base_policy": base}
    (out_dir / "sweep.meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    print(f"sweep: {len(rows)} policies over {workload} (seed {seed}); wrote {csv_path} and {len(plots)} plots "
          f"in {out_dir}")
    return 0


def _plot(rows: list[dict[str, Any]], names: list[str], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_name, others = names[0], names[1:]
    metrics = [k for k in rows[0] if k not in names]
    out = []
    for metric in metrics:
        fig, ax = plt.subplots(figsize=(6, 4))
        groups: dict[tuple, list[tuple[Any, float]]] = {}
        for r in rows:
            groups.setdefault(tuple(r[o] for o in others), []).append((r[x_name], r[metric]))
        for key, pts in groups.items():
            pts.sort(key=lambda p: (str(type(p[0])), p[0]))
            xs = [str(p[0]) if isinstance(p[0], bool) else p[0] for p in pts]
            ys = [p[1] if p[1] == p[1] and not math.isinf(p[1]) else float("nan") for p in pts]
            label = ", ".join(f"{o}={v}" for o, v in zip(others, key)) or metric
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xlabel(x_name)
        ax.set_ylabel(metric)
        ax.set_title(metric)
        if others:
            ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / f"{metric}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        out.append(path)
    return out
