"""bench/host_cost.py: the host terms from medians (by hand), step cycles from a hand-made call
log, the null backend, and the serving loop driven at the planned lane counts on the tiny config."""

from __future__ import annotations

import numpy as np
import pytest

from bench.host_cost import HostGrid, HostMeasured, NullBackend, NullState, fit_line, measure_host, periods
from executor.model import tiny_config
from executor.tokenizer import default_tokenizer
from sim.cost import HostCost

CONFIG = tiny_config()


def measured(**changes) -> HostMeasured:
    values = dict(lanes=(1, 2, 4, 8), round_s=tuple(300e-6 + 25e-6 * n for n in (1, 2, 4, 8)), chunk_s=900e-6,
                  chunk_token_share=0.5, mixed_lanes=8, mixed_s=1.5e-3, token_s=10e-6, wake_s=150e-6, wall_s=2.0)
    return HostMeasured(**(values | changes))


def test_host_terms_from_medians_by_hand():
    c = measured().cost
    # round = 300 us + 25 us per lane, of which 10 us per lane is the token pick and detokenization
    # the profile's decode table already holds; the prefill step 900 us = 300 us + chunk_s + half a token
    assert c.step_s == pytest.approx(300e-6) and c.lane_s == pytest.approx(15e-6)
    assert c.chunk_s == pytest.approx(900e-6 - 300e-6 - 0.5 * 10e-6)
    assert c.seconds(8, True) == pytest.approx(300e-6 + 8 * 15e-6 + 595e-6)
    # clipped at zero: a per-lane slope below the token's own cost, a prefill step below step_s
    low = measured(round_s=tuple(300e-6 + 5e-6 * n for n in (1, 2, 4, 8)), chunk_s=100e-6).cost
    assert low == HostCost(step_s=pytest.approx(300e-6), lane_s=0.0, chunk_s=0.0)
    assert measured(lanes=(4,), round_s=(400e-6,)).cost.step_s == pytest.approx(400e-6)  # one point: no slope
    text = measured().record()
    assert "round us by lanes 1:325,2:350,4:400,8:500" in text and "token us 10.0" in text


def test_fit_line():
    assert fit_line((1, 2, 4), (3.0, 5.0, 9.0)) == pytest.approx((1.0, 2.0))
    assert fit_line((5,), (2.5,)) == (2.5, 0.0)


def test_periods_from_a_call_log():
    calls = [("prefill", 0.0, 0, False), ("snapshot", 0.1, 0, False), ("prefill", 1.0, 0, True),
             ("decode", 1.2, 2, True), ("restore", 2.9, 0, False), ("prefill", 3.0, 0, False),
             ("decode", 4.0, 2, True), ("decode", 4.5, 2, True), ("decode", 5.5, 3, True)]
    got = periods(calls, "prefill", lambda a, between: all(b[0] != "decode" for b in between))
    assert got == [(calls[0], 1.0)]
    got = periods(calls, "prefill", lambda a, between: True)
    assert [s for _, s in got] == [1.0, 2.0]
    alone = periods(calls, "decode", lambda a, between: a[2] == 2 and not between)
    assert [s for _, s in alone] == [pytest.approx(0.5), pytest.approx(1.0)]  # 4.0 -> 4.5 and 4.5 -> 5.5


def test_null_backend_keeps_rows_and_logs_calls():
    backend = NullBackend(CONFIG, token_id=279)
    state = backend.new_state()
    logits = backend.prefill(state, list(range(10)), (0, 10), want_logits=True)
    assert state.rows == 10 and logits.shape == (1024,) and int(np.argmax(logits)) == 279
    assert backend.prefill(state, list(range(12)), (10, 12), want_logits=False, tail_from=12) is None
    with pytest.raises(ValueError, match="rows: state holds 12 rows"):
        backend.prefill(state, list(range(20)), (0, 20))
    lanes = [state, NullState(3)]
    out = backend.decode(lanes, [1, 2])
    assert out.shape == (2, 1024) and [s.rows for s in lanes] == [13, 4] and not out.flags.writeable
    payload = backend.snapshot(state)
    assert backend.restore(payload).rows == 13 and backend.payload_bytes(payload) == CONFIG.state_bytes(13)
    assert [c[0] for c in backend.calls] == ["prefill", "prefill", "prefill", "decode", "snapshot", "restore"]
    assert [c[2:] for c in backend.calls[:4]] == [(0, True), (0, False), (0, True), (2, True)]
    with pytest.raises(ValueError, match=r"token_id: must be in \[0, 1024\)"):
        NullBackend(CONFIG, token_id=5000)


def test_grid_errors_name_the_field():
    with pytest.raises(ValueError, match=r"^lanes: must be strictly ascending"):
        HostGrid(lanes=(4, 2))
    with pytest.raises(ValueError, match=r"^rounds: must be >= 1"):
        HostGrid(rounds=0)
    with pytest.raises(ValueError, match=r"^sweeps: must be >= 1"):
        HostGrid(sweeps=0)
    assert HostGrid(lanes=(1, 16), mixed_lanes=8, requests=16).policy.lanes == 24


def test_the_serving_loop_runs_the_planned_steps():
    grid = HostGrid(lanes=(1, 3), rounds=6, sweeps=2, requests=4, mixed_lanes=2, prefix_rows=64, chunk_rows=8,
                    wakes=2)
    tokenizer = default_tokenizer()
    backend = NullBackend(CONFIG, tokenizer.encode(" the").ids[0])
    m = measure_host(CONFIG, grid, tokenizer, backend=backend)
    kinds = [c[0] for c in backend.calls]
    # one chunk each for the wakes, the 3 prefix primers and the decoders (2 sweeps of 1 + 3, then 2 beside the
    # last batch); two per prefill-only request (a batch per sweep, one in the mixed run), each of those
    # restoring its batch's prefix and keeping two states; every other request keeps its end
    assert kinds.count("prefill") == 2 + 3 + 2 * (1 + 3) + 2 + 2 * 4 * 3
    assert kinds.count("restore") == 4 * 3
    assert kinds.count("snapshot") == 2 + 3 + 2 * (1 + 3) + 2 + 2 * 4 * 3
    assert sum(1 for c in backend.calls if c[0] == "decode" and c[2] == 3) == 2 * grid.rounds  # all three decoding
    assert sum(1 for c in backend.calls if c[0] == "decode" and c[2] == 2) >= 2 * 4  # beside the mixed chunks
    assert m.lanes == (1, 3) and len(m.round_s) == 2 and m.mixed_lanes == 2
    assert all(0 < s < 0.1 for s in (*m.round_s, m.chunk_s, m.mixed_s, m.wake_s))
    assert 0 < m.token_s < 1e-3 and 0 < m.chunk_token_share < 1
    c = m.cost
    # the host terms are the line through the two round medians, clipped at 0 (whether the
    # intercept is positive is a timing, not a rule: under CPU load it came out <= 0 once)
    a, b = fit_line(m.lanes, m.round_s)
    assert a + b * 1 == pytest.approx(m.round_s[0]) and a + b * 3 == pytest.approx(m.round_s[1])
    assert c.step_s == max(0.0, a) and c.lane_s == max(0.0, b - m.token_s)
    assert 0 <= c.step_s < 0.1 and 0 <= c.lane_s < 0.01 and 0 <= c.chunk_s < 0.1
