"""`python -m sim` verbs as a user runs them: help, run, traces, diff, sweep, errors."""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from policy.config import PolicyConfig, parse_policy
from sim import cli, sweep
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


UNUSABLE_PATHS = [  # argv, the exact error; {d} is a folder d.jsonl, {f} a file, {t} the folder they are in
    (["run", "--workload", "chat", "--trace", "{d}"], "--trace '{d}': want a file to write, not a directory"),
    (["run", "--workload", "chat", "--perfetto", "{d}"], "--perfetto '{d}': want a file to write, not a directory"),
    (["run", "--workload", "chat", "--trace", ""], "--trace '': want a file to write, not an empty path"),
    (["run", "--workload", "chat", "--perfetto", "{t}/no/p.json"],
     "--perfetto '{t}/no/p.json': folder '{t}/no' does not exist"),
    (["run", "--workload", "chat", "--policy", "{d}"], "{d}: Is a directory"),
    (["run", "--workload", "{d}"], "{d}: Is a directory"),
    (["run", "--workload", "mooncake:"], "--workload 'mooncake:': want mooncake:PATH, got no PATH"),
    (["run", "--workload", "mooncake:{t}/no.jsonl"], "{t}/no.jsonl: No such file or directory"),
    (["sweep", "--grid", "lanes=1,2", "--out", "{f}"], "--out '{f}': exists and is not a directory"),
    (["fuzz", "--examples", "1", "--out", "{f}"], "--out '{f}': exists and is not a directory"),
    (["fuzz", "--examples", "1", "--out", "{f}/sub"], "--out '{f}/sub': '{f}' is not a directory"),
]


@pytest.mark.parametrize("argv, want", UNUSABLE_PATHS, ids=[
    "trace-dir", "perfetto-dir", "trace-empty", "perfetto-no-folder", "policy-dir", "workload-dir",
    "mooncake-no-path", "mooncake-missing", "sweep-out-file", "fuzz-out-file", "fuzz-out-under-a-file"])
def test_a_path_that_cannot_be_used_is_an_error_before_any_run(argv, want, tmp_path, capsys):
    """`error: PATH: reason` and exit 2, before anything is simulated, not a traceback (exit 1)."""
    (tmp_path / "d.jsonl").mkdir()
    (tmp_path / "f").write_text("")
    names = dict(d=tmp_path / "d.jsonl", f=tmp_path / "f", t=tmp_path)
    assert main([a.format(**names) for a in argv]) == 2
    out = capsys.readouterr()
    assert out.err == f"error: {want.format(**names)}\n" and out.out == ""


class _FullDevice(io.RawIOBase):
    """A file that takes no byte, as /dev/full (every write: ENOSPC)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("flag", ["--trace", "--perfetto"])
def test_a_full_disk_names_the_file(flag, tmp_path, monkeypatch, capsys):
    """A write that fails (`--trace /dev/full`) names its file: writes name none."""
    full = str(tmp_path / "full")
    real_open = open
    monkeypatch.setattr(cli, "open", lambda path, mode="r", *a, **kw: io.TextIOWrapper(io.BufferedWriter(
        _FullDevice(str(path)))) if str(path) == full else real_open(path, mode, *a, **kw), raising=False)
    assert main(["run", "--workload", "chat", flag, full]) == 2
    out = capsys.readouterr()
    assert out.err == f"error: {full}: No space left on device\n" and out.out == ""


def test_a_broken_rule_is_reported_even_when_the_trace_cannot_be_closed(tmp_path, monkeypatch, capsys):
    """A run that breaks a rule exits 3 with the rule's report, though closing the trace then
    fails too (its last write on a full disk): the close's OSError is not the error reported."""
    from sim.invariants import InvariantBroken

    full = str(tmp_path / "full")
    real_open = open
    monkeypatch.setattr(cli, "open", lambda path, mode="r", *a, **kw: io.TextIOWrapper(io.BufferedWriter(
        _FullDevice(str(path)))) if str(path) == full else real_open(path, mode, *a, **kw), raising=False)

    def broken(*args, trace=None, **kw):
        trace.write("x")  # buffered: the close's flush fails
        raise InvariantBroken("rule 1", "planted", None, [])

    monkeypatch.setattr(cli, "simulate", broken)
    assert main(["run", "--workload", "chat", "--trace", full]) == 3
    assert "planted" in capsys.readouterr().err


def test_diff_top_and_sweep_jobs_name_the_flag(capsys, tmp_path):
    """`--top -1` listed every request but one; `--jobs 0` meant the default, `--jobs -1` failed
    with `max_workers must be greater than 0`."""
    for argv, want in [(["diff", "a.toml", "b.toml", "--top", "-1"], "--top: must be at least 0, got -1"),
                       (["sweep", "--grid", "lanes=1,2", "--jobs", "0"], "--jobs: must be at least 1, got 0"),
                       (["sweep", "--grid", "lanes=1,2", "--jobs", "-1"], "--jobs: must be at least 1, got -1")]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and capsys.readouterr().err.endswith(f"error: argument {want}\n")
    assert build_parser().parse_args(["diff", "a.toml", "b.toml", "--top", "0"]).top == 0
    with pytest.raises(ValueError, match=r"^jobs: must be at least 1, got 0$"):
        sweep.sweep({"lanes": [1]}, base_policy=None, workload="chat", profile=cli.DEFAULT_PROFILE, seed=0,
                    invariant_rows="profile", out_dir=tmp_path, jobs=0, check=True, fast_forward=True)


class _InProcess:
    """ProcessPoolExecutor's `map` in this process, so a test sees every run's arguments."""

    def __init__(self, max_workers: int) -> None:
        assert max_workers >= 1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def map(self, fn, items):
        return map(fn, items)


@pytest.mark.parametrize("flags, want", [([], True), (["--no-fast-forward"], False)], ids=["default", "no-ff"])
def test_sweep_runs_honour_no_fast_forward(flags, want, tmp_path, monkeypatch):
    """`sweep --no-fast-forward` was accepted and ignored: every run must get fast_forward=False."""
    seen = []
    real = sweep.simulate
    monkeypatch.setattr(sweep, "ProcessPoolExecutor", _InProcess)
    monkeypatch.setattr(sweep, "_plot", lambda rows, names, out_dir: [])
    monkeypatch.setattr(sweep, "simulate", lambda *a, **kw: seen.append(kw["fast_forward"]) or real(*a, **kw))
    assert main(["sweep", "--grid", "lanes=1,2", "--workload", "chat", "--out", str(tmp_path)] + flags) == 0
    assert seen == [want, want]


BAD_FILES = [  # run's flags, the file's bytes, the exact error; {p} is the file
    (["--workload", "{p}"], b'{"id": "a", "messages": [{"role": "user", "rows": 9, "arrival_s": 1e308}, '
     b'{"role": "assistant", "rows": 5}]}\n',
     "{p}:1: messages[0].arrival_s: must be a finite number of seconds in [0, 1e7] (~115 days), got 1e+308"),
    (["--workload", "{p}"], b"", "{p}: no requests"),
    (["--workload", "{p}"], b'{"workload": "h"}\n\n', "{p}: no requests"),
    (["--workload", "mooncake:{p}"], b"\n", "{p}: no requests"),
    (["--workload", "{p}"], b'{"workload": "h"}\n{"id": "caf\xe9"}\n', "{p}:2: not UTF-8: byte 0xe9 at column 12"),
    (["--workload", "mooncake:{p}"], b"\xff\n", "{p}:1: not UTF-8: byte 0xff at column 1"),
    (["--workload", "chat", "--policy", "{p}"], b"lanes = 2\n# caf\xe9\n", "{p}:2: not UTF-8: byte 0xe9 at column 6"),
]


@pytest.mark.parametrize("flags, data, want", BAD_FILES, ids=[
    "arrival-1e308", "empty", "header-only", "mooncake-empty", "workload-utf8", "mooncake-utf8", "policy-utf8"])
def test_bad_workload_and_policy_files_name_the_file(flags, data, want, tmp_path, capsys):
    """Arrival times past 1e7 s (sim_end_s printed 309 digits), files with no request (were
    "held on all 0 events", exit 0), bytes that are not UTF-8 (named no file): `error: PATH...`."""
    path = tmp_path / "bad.jsonl"
    path.write_bytes(data)
    assert main(["run"] + [f.format(p=path) for f in flags]) == 2
    out = capsys.readouterr()
    assert out.err == f"error: {want.format(p=path)}\n" and out.out == ""


class _NoSpace(io.StringIO):
    name = "out.trace"

    def write(self, s):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_trace_writers_name_their_file_on_a_write_error():
    """A failed write (ENOSPC names no file) raises naming the trace's file, from the writers
    themselves (the CLI's closing would name it too, and hid a writer that did not)."""
    from policy import events as ev
    from sim.trace import JsonlTrace, PerfettoTrace

    with pytest.raises(OSError) as err:
        JsonlTrace(_NoSpace()).event(ev.Event(t=0.0))
    assert err.value.filename == "out.trace"
    with pytest.raises(OSError) as err:
        PerfettoTrace().write(_NoSpace())
    assert err.value.filename == "out.trace"
