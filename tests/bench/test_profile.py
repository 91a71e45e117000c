"""bench/profile.py: the measurement loop on a fake backend with a fake clock (exact values),
the stepper's prefill keywords, the monotone clean-up, and the tiny model on the reference
backend end to end (the written profile loads and `python -m sim run` uses it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import numpy as np
import pytest

import bench.profile as profile_mod
from bench.host_cost import HostMeasured
from bench.profile import (
    ProfileGrid,
    Rig,
    main,
    measure,
    monotone,
    prefill_kwargs,
    table,
    to_profile,
)
from executor.model import tiny_config
from policy.shape import state_bytes
from sim.cost import HostCost, TableCost, load_profile

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tiny_config()


@attrs.define
class FakeState:
    rows: int


@attrs.frozen
class FakePayload:
    rows: int
    kv_from: int = 0


class FakeBackend:
    """Costs on a fake clock: prefill 1 ms + 10 us/row + 0.1 us/context row; decode 2 ms +
    0.5 ms/lane + 1 us per context row summed; snapshot 0.1 ms + 1 ns/byte; restore twice that."""

    def __init__(self, clock: list[float]) -> None:
        self.config, self.clock, self.prefills = CONFIG, clock, []
        self.logits = np.zeros(CONFIG.vocab_size, np.float32)

    def new_state(self):
        return FakeState(0)

    def prefill(self, state, token_ids, rows, want_logits=True, tail_from=None):
        a, b = rows
        assert state.rows == a and len(token_ids) >= b
        self.prefills.append((a, b, want_logits, tail_from))
        self.clock[0] += 1e-3 + 1e-5 * (b - a) + 1e-7 * a
        state.rows = b
        return self.logits

    def decode(self, states, token_ids):
        self.clock[0] += 2e-3 + 5e-4 * len(states) + 1e-6 * sum(s.rows for s in states)
        for s in states:
            s.rows += 1
        return np.zeros((len(states), CONFIG.vocab_size), np.float32)

    def snapshot(self, state, base=None):
        self.clock[0] += 1e-4 + 1e-9 * CONFIG.state_bytes(state.rows)
        return FakePayload(state.rows)

    def restore(self, payload):
        self.clock[0] += 2 * (1e-4 + 1e-9 * CONFIG.state_bytes(payload.rows))
        return FakeState(payload.rows)

    def payload_bytes(self, payload):
        return CONFIG.state_bytes(payload.rows)


def fake_rig() -> tuple[Rig, FakeBackend]:
    clock = [0.0]
    backend = FakeBackend(clock)
    rig = Rig(backend=backend, states_at=lambda ctx, n: [FakeState(ctx) for _ in range(n)], sync=lambda: None,
              decode=backend.decode, label="fake", device="Fake GPU 9000", model="fake", clock=lambda: clock[0])
    return rig, backend


def test_measure_times_every_point_as_the_stepper_calls_it():
    grid = ProfileGrid(prefill_rows=(1, 100, 300), contexts=(0, 1000), lanes=(1, 3), repeat=3, decode_rounds=2,
                       host=None)
    rig, backend = fake_rig()
    m = measure(rig, grid, log=lambda _: None)
    for i, rows in enumerate(grid.prefill_rows):
        for j, ctx in enumerate(grid.contexts):
            assert m.prefill[i][j] == pytest.approx(1e-3 + 1e-5 * rows + 1e-7 * ctx)
    # decode round r (0-based, after one untimed round) of `lanes` lanes at context c: each lane holds c + 1 + r rows;
    # the median of rounds 0 and 1 is at c + 1.5 rows per lane.
    for i, lanes in enumerate(grid.lanes):
        for j, ctx in enumerate(grid.contexts):
            assert m.decode[i][j] == pytest.approx(2e-3 + 5e-4 * lanes + 1e-6 * lanes * (ctx + 1.5))
    assert m.state_bytes == tuple(CONFIG.state_bytes(c) for c in grid.contexts)
    assert m.keep == pytest.approx([1e-4 + 1e-9 * b for b in m.state_bytes])
    assert m.restore == pytest.approx([2e-4 + 2e-9 * b for b in m.state_bytes])
    # every timed chunk reads its logits; over tail_rows (128) rows it takes the tail (rule 8)
    timed = [p for p in backend.prefills if p[0] == 1000]
    assert (1000, 1300, True, 1300 - 128) in timed and (1000, 1100, True, None) in timed
    # three runs of each prefill point after one warm-up run per row count at context 0
    assert len(backend.prefills) == 3 + 3 * 3 * 2

    profile = to_profile(m, rig, "fake-profile", "python -m bench.profile --test")
    assert profile.source == "measured" and profile.gpu == "Fake GPU 9000" and profile.shape == CONFIG.shape
    assert profile.prefill_s(100, 1000) == pytest.approx(m.prefill[1][1])
    assert profile.prefill_s(200, 500) == pytest.approx(1e-3 + 1e-5 * 200 + 1e-7 * 500)  # bilinear on a plane
    assert profile.decode_round_s(3, [0, 1000, 2000]) == pytest.approx(2e-3 + 1.5e-3 + 3e-6 * (1000 + 1.5))
    assert profile.keep_s(state_bytes(CONFIG.shape, 500)) == pytest.approx(1e-4 + 1e-9 * CONFIG.state_bytes(500))
    assert profile.restore_s(CONFIG.state_bytes(1000)) == pytest.approx(m.restore[1])
    assert dict(profile.provenance)["command"] == "python -m bench.profile --test"
    assert m.host is None and profile.cost.host is None and "host" not in dict(profile.provenance)

    host = HostMeasured(lanes=(1, 2), round_s=(3.2e-4, 3.4e-4), chunk_s=9e-4, chunk_token_share=0.5, mixed_lanes=2,
                        mixed_s=1.3e-3, token_s=1e-5, wake_s=2e-4, wall_s=1.0)
    with_host = to_profile(attrs.evolve(m, host=host), rig, "fake-profile", "python -m bench.profile --test")
    assert with_host.cost.host == HostCost(step_s=pytest.approx(3e-4), lane_s=pytest.approx(1e-5),
                                           chunk_s=pytest.approx(9e-4 - 3e-4 - 0.5e-5))
    assert dict(with_host.provenance)["host"] == host.record()
    assert with_host.prefill_s(100, 1000) == profile.prefill_s(100, 1000)
    assert "host: 300 us per step + 10.0 us per decode lane + 595 us per prefill chunk" in table(with_host)


def test_each_timed_keep_allocates_fresh_memory_and_keeps_logits():
    """A keep is timed as a server whose prompt cache grows pays it: the rig's cached device
    memory given back before each run (outside the timing), the snapshot with its logits."""
    grid = ProfileGrid(prefill_rows=(1,), contexts=(0, 1000), lanes=(1,), repeat=3, decode_rounds=1, host=None)
    rig, backend = fake_rig()
    calls = {"uncache": 0, "fresh": False}

    def uncache():
        calls["uncache"] += 1
        calls["fresh"] = True

    snapshot = backend.snapshot

    def fresh_snapshot(state, base=None):
        assert calls["fresh"], "a keep into memory the pool had cached"
        calls["fresh"] = False
        return snapshot(state, base)

    backend.snapshot = fresh_snapshot
    kept = []
    real = profile_mod.payloads.snapshot
    profile_mod.payloads.snapshot = lambda b, s, logits: kept.append(logits) or real(b, s, logits)
    try:
        m = measure(attrs.evolve(rig, uncache=uncache), grid, log=lambda _: None)
    finally:
        profile_mod.payloads.snapshot = real
    assert calls["uncache"] == len(grid.contexts) * grid.repeat
    assert len(kept) == len(grid.contexts) * grid.repeat and all(k.shape == (CONFIG.vocab_size,) for k in kept)
    assert m.keep == pytest.approx([1e-4 + 1e-9 * b for b in m.state_bytes])


def test_prefill_kwargs_follow_the_tail_rule():
    backend = FakeBackend([0.0])
    assert prefill_kwargs(backend, 0, 100, 128) == {"want_logits": True}
    assert prefill_kwargs(backend, 64, 64 + 129, 128) == {"want_logits": True, "tail_from": 64 + 1}
    backend.config = attrs.evolve(CONFIG, layer_types=("full_attention", "linear_attention", "linear_attention",
                                                       "linear_attention"))
    assert prefill_kwargs(backend, 0, 500, 128) == {"want_logits": True}  # last layer not attention: no tail

    class NoTail(FakeBackend):
        def prefill(self, state, token_ids, rows, want_logits=True):
            return super().prefill(state, token_ids, rows, want_logits)

    assert prefill_kwargs(NoTail([0.0]), 0, 500, 128) == {"want_logits": True}  # as the stepper: none passed


def test_monotone_raises_dips_to_the_running_maximum():
    assert monotone([[1.0, 3.0], [0.5, 4.0], [2.0, 1.0]]) == ((1.0, 3.0), (1.0, 4.0), (2.0, 4.0))
    assert monotone([[2.0, 1.0, 5.0]]) == ((2.0, 2.0, 5.0),)


def test_grid_errors_name_the_field():
    with pytest.raises(ValueError, match=r"^contexts: must be strictly ascending"):
        ProfileGrid(contexts=(0, 64, 32))
    with pytest.raises(ValueError, match=r"^lanes: must be strictly ascending integers >= 1"):
        ProfileGrid(lanes=(0, 1))
    with pytest.raises(ValueError, match=r"^repeat: must be >= 1"):
        ProfileGrid(repeat=0)


def test_tiny_reference_profile_runs_the_simulator(tmp_path, capsys):
    code = main(["--backend", "reference", "--out", str(tmp_path), "--rows", "1,16,64", "--contexts", "0,64",
                 "--lanes", "1,2", "--repeat", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    path = tmp_path / "tiny-qwen3_5-v1-reference.json"
    assert f"wrote {path}" in out and "prefill ms" in out
    p = load_profile(path)
    assert p.source == "measured" and p.invariant_rows is None and p.shape == CONFIG.shape
    c = p.cost
    assert isinstance(c, TableCost)
    assert (c.prefill.x, c.prefill.y, c.decode.x, c.decode.y) == ((1, 16, 64), (0, 64), (1, 2), (0, 64))
    assert c.keep is not None and c.keep.x == (CONFIG.state_bytes(0), CONFIG.state_bytes(64))
    for table in (c.prefill.seconds, c.decode.seconds):
        assert all(v > 0 for row in table for v in row) and monotone(table) == table
    assert {"backend", "command", "commit", "date", "decode", "host"} <= dict(p.provenance).keys()
    cost = json.loads(path.read_text())["cost"]
    assert cost["form"] == "table" and set(cost["host"]) == {"step_s", "lane_s", "chunk_s"}
    # the serving loop's own seconds on this host: a step costs something, none of it is a unit slip
    assert c.host is not None and 1e-6 < c.host.step_s < 0.05
    assert 0 <= c.host.lane_s < 0.01 and 0 <= c.host.chunk_s < 0.05
    assert "host:" in out and "us per decode lane" in out
    run = subprocess.run([sys.executable, "-m", "sim", "run", "--profile", str(path), "--workload", "chat"],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "profile tiny-qwen3_5-v1-reference (measured)" in run.stdout and "requests" in run.stdout


def test_no_host_leaves_the_host_terms_out(tmp_path, capsys):
    code = main(["--backend", "reference", "--out", str(tmp_path), "--rows", "1,16", "--contexts", "0",
                 "--lanes", "1", "--repeat", "1", "--no-host"])
    assert code == 0, capsys.readouterr().out
    p = load_profile(tmp_path / "tiny-qwen3_5-v1-reference.json")
    assert p.cost.host is None and p.host_s(4, True) == 0.0 and "host" not in dict(p.provenance)


def test_cli_errors_name_the_flag(capsys):
    from bench.profile import main

    assert main(["--backend", "reference", "--presets", "qwen3.5-2b"]) == 2
    assert "--presets is for --backend cuda" in capsys.readouterr().err
    assert main(["--backend", "reference", "--rows", "0,x"]) == 2
    assert "error:" in capsys.readouterr().err


def test_steep_raises_name_the_points_a_spike_lifted():
    """One 48 ms outlier at 8 rows lifts every larger point; the tool says so (a fresh-user
    review's CPU profile failed fidelity on such a table without a word)."""
    from bench.profile import STEEP_RAISE, noisy_note, steep_raises

    table = [[0.010, 0.011], [0.048, 0.012], [0.011, 0.013]]  # [rows][context]
    lines = steep_raises("prefill", table, (1, 8, 32), (0, 32), "rows")
    assert lines == ["prefill 8 rows at context 32: 12.00 -> 48.00 ms", "prefill 32 rows at context 0: 11.00 -> 48.00 ms",
                     "prefill 32 rows at context 32: 13.00 -> 48.00 ms"]
    assert STEEP_RAISE == 1.5 and steep_raises("decode", [[0.010, 0.014], [0.012, 0.015]], (1, 2), (0, 8), "lanes") == []
    assert steep_raises("decode", [[0.010, 0.009]], (1,), (0, 8), "lanes") == []  # 1.11x: ordinary noise
    note = noisy_note(lines)
    assert note.startswith("note: making the tables non-decreasing raised 3 points more than 1.5x") and "quiet" in note
    assert noisy_note([]) is None
    assert "(and 2 more)" in noisy_note(lines + lines[:2])
