"""`python -m sim` verbs as a user runs them: help, run, traces, diff, sweep, errors."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from policy.config import PolicyConfig, parse_policy
from sim.cli import build_parser, changed_requests, main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("verb", ["run", "diff", "fuzz", "sweep"])
def test_every_verb_has_help(verb, capsys):
    with pytest.raises(SystemExit) as ex:
        build_parser().parse_args([verb, "--help"])
    assert ex.value.code == 0
    assert verb in capsys.readouterr().out


def test_shipped_policies_parse_and_default_equals_the_config_class():
    assert parse_policy((ROOT / "policies/default.toml").read_text()) == PolicyConfig()
    assert parse_policy((ROOT / "policies/grid-only.toml").read_text()) == PolicyConfig(request_starts=False)
    assert parse_policy((ROOT / "policies/no-warm.toml").read_text()) == PolicyConfig(warm_enabled=False)
    assert parse_policy((ROOT / "policies/no-cache.toml").read_text()) == PolicyConfig(prompt_cache_bytes=0)
    assert parse_policy((ROOT / "policies/exact-starts.toml").read_text()) == PolicyConfig(snap_starts=False)
    assert parse_policy((ROOT / "policies/fcfs.toml").read_text()) == PolicyConfig(short_first=False)


def test_main_job_with_no_flags_runs_as_a_new_user_would():
    out = subprocess.run([sys.executable, "-m", "sim"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "workload mixed (seed 0, 150 conversations)" in out.stdout
    assert "invariants (DESIGN rules 1-8): held" in out.stdout
    lines = dict(line.split(None, 1) for line in out.stdout.splitlines()[2:] if line and not line.startswith("inv"))
    assert lines["requests"].strip() == lines["finished"].strip() == "605"


def test_run_writes_trace_perfetto_and_meta(tmp_path, capsys):
    trace, pf = tmp_path / "t.jsonl", tmp_path / "p.json"
    assert main(["run", "--workload", "chat", "--trace", str(trace), "--perfetto", str(pf)]) == 0
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    kinds = {e["kind"] for e in events}
    assert {"request_arrived", "chunk_started", "state_kept", "warm_started", "request_finished"} <= kinds
    assert all(list(e)[:2] == ["kind", "t"] for e in events)
    perfetto = json.loads(pf.read_text())
    names = {e["args"]["name"] for e in perfetto["traceEvents"] if e["ph"] == "M"}
    assert "warm passes" in names and "lane 1" in names
    spans = [e for e in perfetto["traceEvents"] if e["ph"] == "X"]
    assert any(e["tid"] == 0 for e in spans) and any(e["tid"] >= 1 for e in spans)
    meta = json.loads((tmp_path / "t.jsonl.meta.json").read_text())
    assert meta["seed"] == 0 and meta["policies"]["policy"]["grid_rows"] == 4096 and meta["commit"]


def test_diff_prints_side_by_side(capsys):
    assert main(["diff", str(ROOT / "policies/grid-only.toml"), str(ROOT / "policies/default.toml"),
                 "--workload", "chat", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "policy fields changed: request_starts False -> True" in out
    row = next(line for line in out.splitlines() if line.startswith("cached_fraction"))
    base, change = row.split()[1:3]
    assert float(base.rstrip("%")) < float(change.rstrip("%"))
    assert "held in both runs" in out


def test_diff_counts_a_ttft_change_only_beyond_float_noise():
    """The same schedule summed in another order moves a TTFT by ~1e-13 s: not a change (a
    review counted 77 such among 112 "changed" requests)."""
    cached = {"a": 10, "b": 10, "c": 10, "d": 10, "e": 0}
    base = {"a": 0.010, "b": 0.010, "c": 0.010, "d": 0.010}
    change = {"a": 0.010 + 6e-13, "b": 0.0125, "c": 0.010, "e": 0.004}
    moved = changed_requests(cached, {**cached, "c": 64}, base, change)
    assert [m[2] for m in moved] == ["c", "b", "d", "e"]  # cached first; then by TTFT; a first token in one run only
    assert moved[1][:2] == (0, pytest.approx(0.0025))


def test_sweep_writes_csv_and_plots(tmp_path):
    assert main(["sweep", "--grid", "grid_rows=2048,4096", "--grid", "warm_enabled=true,false",
                 "--workload", "chat", "--out", str(tmp_path), "--jobs", "2"]) == 0
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert len(rows) == 4
    assert {(r["grid_rows"], r["warm_enabled"]) for r in rows} == {("2048", "True"), ("2048", "False"),
                                                                   ("4096", "True"), ("4096", "False")}
    assert (tmp_path / "cached_tokens.png").stat().st_size > 1000
    warm = {r["warm_enabled"]: int(float(r["warm_finished"])) for r in rows if r["grid_rows"] == "4096"}
    assert warm["False"] == 0 and warm["True"] > 0


@pytest.mark.parametrize("argv, needle", [
    (["run", "--workload", "nope"], "unknown workload 'nope'"),
    (["run", "--profile", "nope"], "nope"),
    (["sweep", "--grid", "gird_rows=1,2"], "unknown policy field 'gird_rows'"),
    (["sweep", "--grid", "grid_rows=abc"], "grid_rows value 'abc' is not a TOML literal"),
], ids=["workload", "profile", "grid-field", "grid-value"])
def test_bad_input_is_a_clear_error(argv, needle, capsys, tmp_path):
    assert main(argv + (["--out", str(tmp_path)] if argv[0] == "sweep" else [])) == 2
    assert needle in capsys.readouterr().err


def test_bad_policy_key_names_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("grid_row = 4096\n")
    assert main(["run", "--policy", str(bad), "--workload", "chat"]) == 2
    assert "unknown policy key 'grid_row'" in capsys.readouterr().err


def test_bad_counts_and_invariant_rows_name_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fuzz", "--examples", "0"])
    assert exc.value.code == 2 and "--examples: must be at least 1, got 0" in capsys.readouterr().err
    for minutes in ("0", "-1", "nan", "inf"):  # none would run an example and still report success
        with pytest.raises(SystemExit) as exc:
            main(["fuzz", "--minutes", minutes])
        assert exc.value.code == 2 and f"--minutes: must be a number of minutes > 0, got {minutes}" in \
            capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # one budget or the other, not both silently
        main(["fuzz", "--minutes", "1", "--examples", "3"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert main(["run", "--invariant-rows", "abc"]) == 2
    assert "invariant_rows: must be a positive integer, 'none' or 'profile', got 'abc'" in capsys.readouterr().err


def test_a_reader_that_goes_away_is_not_a_crash():
    """`python -m sim run | head -1` ends quietly (no BrokenPipeError traceback)."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "sim", "run"], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err, err


def test_malformed_policy_toml_names_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("lanes = \n")
    assert main(["run", "--policy", str(bad)]) == 2
    assert f"{bad}: not valid TOML" in capsys.readouterr().err


@pytest.mark.parametrize("status, want", [("", "abc1234"), (" M policy/store.py\n", "abc1234+dirty")])
def test_the_recorded_commit_says_when_tracked_files_changed(monkeypatch, status, want):
    """Traces, profiles and sweeps record `git_commit()`: numbers from uncommitted code
    must not pass for the commit's (`git describe --dirty` marks them the same way)."""
    from sim import api

    def run(argv, **kw):
        out = "abc1234\n" if argv[1] == "rev-parse" else status
        return subprocess.CompletedProcess(argv, 0, stdout=out, stderr="")

    monkeypatch.setattr(api.subprocess, "run", run)
    assert api.git_commit() == want
