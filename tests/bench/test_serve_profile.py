"""bench/serve_profile.py: which step records price which point, the grid's checks, the
profile it writes, and a whole run against the built-in tiny model's server on the CPU."""

from __future__ import annotations

import json

import attrs
import pytest

from bench.serve_profile import (
    GRIDS,
    PREFILL_TOKENS,
    Served,
    ServeGrid,
    decode_steps,
    handoff_s,
    host_terms,
    main,
    prefill_steps,
    to_profile,
)
from executor.model import tiny_config
from sim.api import machine
from sim.cost import Curve, Grid, HostCost, Profile, TableCost, load_profile, profile_to_dict


def step(ran_s, rows=0, start=None, decode=0, restores=0, t=1.0, phases=None):
    return {"kind": "step", "t": t, "ran_s": ran_s, "phases": phases or {}, "prefill_rows": rows,
            "prefill_start": start, "restores": restores, "decode": decode}


def base_profile(path=None) -> Profile:
    cost = TableCost(prefill=Grid(x=(1.0, 4096.0), y=(0.0, 4096.0), seconds=((0.004, 0.005), (0.4, 0.5))),
                     decode=Grid(x=(1.0, 16.0), y=(0.0, 4096.0), seconds=((0.005, 0.006), (0.06, 0.07))),
                     copy_bytes_per_s=1e9, keep=Curve(x=(1.0, 1e9), seconds=(1e-4, 2e-3)),
                     restore=Curve(x=(1.0, 1e9), seconds=(1e-4, 1e-3)))
    profile = Profile(name="tiny-base", source="measured", gpu="CPU", model="tiny", shape=tiny_config().shape,
                      invariant_rows=64, cost=cost)
    if path is not None:
        path.write_text(json.dumps(profile_to_dict(profile)))
    return profile


def test_only_pure_steps_price_a_point():
    steps = [step(0.010, rows=8, start=32), step(0.011, rows=8, start=32, decode=1),  # mixed: neither
             step(0.012, rows=8, start=0), step(0.013, rows=8, start=32, restores=1),  # other context; a restore
             step(0.003, decode=2), step(0.004, decode=2, restores=1), step(0.005, decode=1)]
    assert prefill_steps(steps, 8, 32) == [0.010]
    assert prefill_steps(steps, 8, 0) == [0.012]
    assert decode_steps(steps, 2) == [0.003]
    assert decode_steps(steps, 1) == [0.005]


def test_a_prefill_point_leaves_out_the_keep_and_the_base_restore():
    """A resumed chunk's step: 10 ms in all, with a keep phase of 2 ms and a restore phase
    of 0.2 ms (the launch; the copies' device time sits in forward): the table gets 10 - 2
    - the base profile's restore (1.5 ms here), not 10 - 2 - 0.2. A chunk from row 0 (no
    restore) loses only its keep."""
    steps = [step(0.010, rows=8, start=32, phases={"restore": 0.0002, "forward": 0.0075, "keep": 0.002,
                                                   "sample": 0.0002}),
             step(0.009, rows=8, start=0, phases={"forward": 0.007, "keep": 0.001})]
    assert prefill_steps(steps, 8, 32, restore_s=0.0015) == [pytest.approx(0.0065)]
    assert prefill_steps(steps, 8, 0, restore_s=0.0015) == [pytest.approx(0.008)]


def test_handoff_is_the_median_time_beyond_the_phases():
    steps = [step(0.010, phases={"forward": 0.009}), step(0.005, phases={"decode": 0.0045}),
             step(0.004, phases={"decode": 0.0036})]
    assert handoff_s(steps) == pytest.approx(0.0005)  # of 1.0, 0.5 and 0.4 ms
    assert handoff_s([]) == 0.0
    assert handoff_s([step(0.001, phases={"forward": 0.002})]) == 0.0  # never negative


def test_host_terms_fit_the_gaps_by_what_ran_before_them():
    """Gaps after decode-only steps: 300 us + 20 us a lane; after a prefill-only step 450 us:
    step_s = 300 us + the hand-off, lane_s = 20 us, chunk_s = 150 us. A gap across batches
    (a client's round trip) and one past BUSY_GAP_S are not the loop's."""
    def chain(kinds, gaps, t0=1.0):
        out, t = [], t0
        for (rows, lanes), gap in zip(kinds, gaps + [0.0]):
            out.append(step(0.004, rows=rows, start=0 if rows else None, decode=lanes, t=t))
            t += gap + 0.004
        return out

    lanes_2 = chain([(0, 2), (0, 2), (8, 0), (0, 2)], [0.00034, 0.00034, 0.00045])
    lanes_4 = chain([(0, 4), (0, 4), (0, 4)], [0.00038, 0.5])  # the second gap is idle
    host = host_terms([lanes_2, lanes_4, chain([(0, 1)], [])], handoff=0.0001)
    assert host.lane_s == pytest.approx(2e-5) and host.step_s == pytest.approx(3e-4 + 1e-4)
    assert host.chunk_s == pytest.approx(1.5e-4)
    # one lane count only: no slope to fit, its gap is the step's
    assert host_terms([chain([(0, 3), (0, 3)], [0.0005])], 0.0).step_s == pytest.approx(5e-4)
    assert host_terms([], 0.0).step_s == 0.0


@pytest.mark.parametrize("fields, word", [({"rows": (0, 8)}, "rows"), ({"rows": (8, 64)}, "rows"),
                                          ({"contexts": (0, 30)}, "contexts"), ({"lanes": (2, 1)}, "lanes"),
                                          ({"repeat": 0}, "repeat")])
def test_grid_errors_name_the_field(fields, word):
    with pytest.raises(ValueError, match=word):
        ServeGrid(**{"rows": (1, 8), "contexts": (0, 32), "lanes": (1, 2), "chunk_rows": 32, **fields})


def test_grid_context_rows_hold_the_longest_request():
    tiny = GRIDS["tiny"]
    assert tiny.reply_tokens(2, 32) == 2 * 2 + 6  # two prompts of one chunk each (+1), then 6 rounds
    assert tiny.context_rows == 32 + 32 + PREFILL_TOKENS + 1  # the longest prefill point and its reply
    full = GRIDS["full"]
    assert full.reply_tokens(16, 24576) == 16 * 7 + 24
    assert full.context_rows == 24576 + 4096 + 2 + 1 <= 32768  # under the GPU's cap


def test_profile_takes_the_server_tables_and_the_base_copies():
    grid = ServeGrid(rows=(1, 8), contexts=(0, 32), lanes=(1, 2), chunk_rows=32)
    served = Served(prefill=((0.010, 0.009), (0.012, 0.015)), decode=((0.004, 0.005), (0.006, 0.007)),
                    host=HostCost(step_s=2.5e-4, lane_s=1e-5, chunk_s=2e-4), handoff_s=1e-4, steps=40)
    base = base_profile()
    p = to_profile(served, grid, base, "tiny-served", "python -m bench.serve_profile --test", ["--x"])
    assert p.cost.prefill.seconds == ((0.010, 0.010), (0.012, 0.015))  # non-decreasing in context
    assert p.prefill_s(8, 32) == pytest.approx(0.015) and p.decode_round_s(2, [0, 0]) == pytest.approx(0.006)
    assert p.cost.host == HostCost(step_s=2.5e-4, lane_s=1e-5, chunk_s=2e-4)
    assert "hand-off, 100 us" in p.notes
    assert p.cost.keep == base.cost.keep and p.cost.restore == base.cost.restore and p.shape == base.shape
    assert p.invariant_rows == 64 and p.source == "measured"  # "base" by default
    assert to_profile(served, grid, base, "t", "c", [], invariant_rows=None).invariant_rows is None
    assert to_profile(served, grid, base, "t", "c", [], invariant_rows=64).notes == p.notes
    assert dict(p.provenance)["base"] == "tiny-base" and dict(p.provenance)["server_args"] == "--x"
    assert dict(p.provenance)["machine"] == machine()
    analytic = load_profile("qwen3.5-2b-h200-roofline")
    with pytest.raises(ValueError, match="--base"):
        to_profile(served, grid, analytic, "x", "c", [])


def test_a_tiny_server_run_writes_a_profile_the_simulator_loads(tmp_path, capsys):
    base = tmp_path / "base.json"
    base_profile(base)
    out = tmp_path / "sp"
    assert main(["--grid", "tiny", "--base", str(base), "--out", str(out), "--name", "tiny-served",
                 "--timeout-s", "120", "--repeat", "3"]) == 0
    text = capsys.readouterr().out
    p = load_profile(out / "tiny-served.json")
    grid = attrs.evolve(GRIDS["tiny"], repeat=3)  # --repeat 3 over the tiny grid's 2
    # the reference server has no invariant grid: the profile takes the server's, not the base's 64
    assert load_profile(base).invariant_rows == 64 and p.invariant_rows is None
    assert "note: the server resumes on invariant_rows None, --base tiny-base on 64" in text
    assert "invariant_rows None: the server's (the base's: 64)" in p.notes
    assert p.gpu == "CPU (reference backend)"  # not the base's GPU
    assert "median of 3 requests a prefill point" in p.notes
    assert p.cost.prefill.x == tuple(map(float, grid.rows)) and p.cost.decode.x == tuple(map(float, grid.lanes))
    assert all(s > 0 for row in p.cost.prefill.seconds for s in row)
    assert all(s > 0 for row in p.cost.decode.seconds for s in row)
    assert p.cost.host.step_s > 0 and "hand-off" in text
    steps = [json.loads(line) for line in (out / "trace.jsonl.steps.jsonl").read_text().splitlines()]
    # all but the untimed: a chunk of each row count, a 1-row prompt's 3 tokens (a chunk, 2 rounds), and
    # context 32's prefix of 33 rows (two chunks)
    assert dict(p.provenance)["steps"] == str(len(steps) - len(grid.rows) - 3 - 2)
    # every point after context 32 resumed there: a restore in its step, none in a step from row 0
    at_32 = [s for s in steps if s["prefill_start"] == 32 and s["prefill_rows"] in grid.rows and not s["decode"]]
    assert len(at_32) >= len(grid.rows) * grid.repeat
    assert sum("restore" in s["phases"] for s in at_32) == len(grid.rows) * grid.repeat
    assert not any("restore" in s["phases"] for s in steps if s["prefill_start"] == 0)
    # a timed point's reply goes on past its first token: its second is a 1-lane round of its own
    lone = [s for s in steps if s["decode"] == 1 and not s["prefill_rows"]]
    assert PREFILL_TOKENS == 2 and len(lone) >= len(grid.rows) * len(grid.contexts) * grid.repeat


def test_cli_errors_name_the_flag(tmp_path, capsys):
    assert main(["--base", "qwen3.5-2b-h200-roofline", "--out", str(tmp_path), "--name", "x"]) == 2
    assert "--base" in capsys.readouterr().err
    assert main(["--base", str(tmp_path / "missing.json"), "--out", str(tmp_path), "--name", "x"]) == 2
    assert "--base" in capsys.readouterr().err
    assert main(["--base", "qwen3.5-2b-h200", "--out", str(tmp_path), "--name", "x", "--repeat", "0"]) == 2
    assert "--repeat must be >= 1, got 0" in capsys.readouterr().err
