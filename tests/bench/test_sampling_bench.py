"""bench/sampling.py: runs, prints its table, and every pick agrees with the full sort."""

from __future__ import annotations

from bench import sampling


def test_sampling_bench_small(capsys):
    assert sampling.main(["--vocab", "5000", "--draws", "5", "--scales", "1,12"]) == 0
    out = capsys.readouterr().out
    assert "| full sort ms | ours ms |" in out and out.count("5/5 |") == 6
