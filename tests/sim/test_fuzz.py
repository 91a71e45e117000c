"""`sim fuzz`: nothing found on the shipped policies; a planted bug is found, shrunk, written
and replayable."""

from __future__ import annotations

import json

import policy.scheduler as sched_mod
from sim.cli import main
from sim.fuzz import fuzz


def test_fuzz_finds_nothing_on_the_real_policy(tmp_path, capsys):
    assert fuzz(examples=150, minutes=None, seed=1, out_dir=tmp_path, profile_name="qwen3.5-2b-h200") == 0
    assert "every invariant held" in capsys.readouterr().out
    assert not (tmp_path / "failing.jsonl").exists()


def test_fuzz_catches_a_planted_plan_bug_and_writes_a_replay(tmp_path, monkeypatch, capsys):
    real = sched_mod.plan_chunks

    def forgetful(rows, starts, resume, cfg, **kw):
        return real(rows, [s for s in starts if s <= resume], resume, cfg, **kw)

    monkeypatch.setattr(sched_mod, "plan_chunks", forgetful)
    assert fuzz(examples=300, minutes=None, seed=0, out_dir=tmp_path, profile_name="qwen3.5-2b-h200") == 1
    out = capsys.readouterr().out
    assert "rule 1 (plan consistency)" in out
    replay = json.loads((tmp_path / "replay.json").read_text())
    argv = replay["command"].split()[3:]
    assert argv[0] == "run"
    # The written case replays: still red while the bug is planted ...
    assert main(argv) == 3
    monkeypatch.setattr(sched_mod, "plan_chunks", real)
    # ... and green once it is gone.
    assert main(argv) == 0
