"""Profiles and the cost model (sim/cost.py, bench/make_profiles.py)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.config import PolicyConfig
from policy.prefix import Prompt
from policy.shape import QWEN35_27B, ModelShape
from policy.usable import BackendFacts
from sim.api import simulate
from sim.cost import (
    DEFAULT_PROFILE,
    AnalyticCost,
    Grid,
    HostCost,
    Profile,
    TableCost,
    list_profiles,
    load_profile,
    profile_from_dict,
    profile_to_dict,
)
from sim.workload import Conversation, Turn, Workload

ROOT = Path(__file__).resolve().parents[2]
TINY_SHAPE = ModelShape(linear_layers=1, attention_layers=1, linear_num_key_heads=1, linear_key_head_dim=1,
                        linear_num_value_heads=1, linear_value_head_dim=1, linear_conv_kernel_dim=2,
                        num_key_value_heads=1, head_dim=1)
# row_bytes = 1 layer x K and V x 1 head x 1 dim x 2 bytes = 4; fixed = 1x1x1x4 + (2-1) x 3 channels x 2 = 10.
TINY_COST = AnalyticCost(matrix_flops_per_s=1e12, matrix_efficiency=0.5, copy_bytes_per_s=1e9, weight_bytes=1_000_000,
                         dense_flops_per_row=1000.0, logits_flops_per_row=500.0, attention_flops_per_pair=10.0,
                         linear_flops_per_row=0.0, chunk_overhead_s=0.01, round_overhead_s=0.001)
TINY = Profile(name="tiny", source="analytic", gpu="none", model="none", shape=TINY_SHAPE, invariant_rows=64,
               cost=TINY_COST)


HOST = {"step_s": 3e-4, "lane_s": 2e-5, "chunk_s": 5e-4}


def table_profile(host: bool = False) -> dict:
    d = profile_to_dict(TINY)
    d.update(name="tab", source="measured", cost={
        "form": "table", "copy_bytes_per_s": 2e9,
        "prefill": {"rows": [64, 128], "context": [0, 1000], "seconds": [[1.0, 3.0], [2.0, 6.0]]},
        "decode": {"lanes": [1, 9], "context": [100], "seconds": [[0.01], [0.05]]}})
    if host:
        d["cost"]["host"] = dict(HOST)
    return d


def test_tiny_analytic_by_hand():
    assert (TINY_SHAPE.row_bytes, TINY_SHAPE.fixed_bytes) == (4, 10)
    # prefill(100, 50): F = 100 x 1000 + 10 x 100 x (50 + 50) = 2e5 -> 4e-7 s at 5e11 FLOP/s;
    # B = 1e6 + 150 x 4 + 2 x 10 = 1_000_620 -> 1.00062e-3 s at 1e9 B/s: memory-bound.
    assert TINY.prefill_s(100, 50) == pytest.approx(1.00062e-3 + 0.01)
    # prefill(1e6, 0): F = 1e9 + 10 x 1e6 x 5e5 = 5.001e12 -> 10.002 s, compute-bound.
    assert TINY.prefill_s(1_000_000, 0) == pytest.approx(10.002 + 0.01)
    # decode 2 lanes at contexts 10 and 30: keys 42; B = 1e6 + 42 x 4 + 2 x 2 x 10 = 1_000_208.
    assert TINY.decode_round_s(2, [10, 30]) == pytest.approx(1.000208e-3 + 0.001)
    assert TINY.decode_round_s(0, []) == 0.0
    assert TINY.keep_s(2_000_000) == pytest.approx(2e-3)
    assert TINY.facts == BackendFacts(64)


@pytest.mark.parametrize("call, args", [("prefill_s", (0, 0)), ("prefill_s", (5, -1)), ("decode_round_s", (2, [1])),
                                        ("decode_round_s", (1, [-1])), ("keep_s", (-1,))],
                         ids=["zero-rows", "neg-context", "lanes-mismatch", "neg-lane-context", "neg-bytes"])
def test_bad_arguments(call, args):
    with pytest.raises(ValueError):
        getattr(TINY, call)(*args)


def make_profiles_module():
    spec = importlib.util.spec_from_file_location("make_profiles", ROOT / "bench" / "make_profiles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_profiles():
    """Shipped profiles are analytic (bench/make_profiles.py) or measured on the H200 (bench/profile.py)."""
    assert list_profiles() == ("qwen3.5-27b-h200", "qwen3.5-27b-h200-roofline", "qwen3.5-2b-h200",
                               "qwen3.5-2b-h200-roofline", "qwen3.5-2b-h200-served", "qwen3.5-9b-h200",
                               "qwen3.5-9b-h200-roofline")
    assert load_profile().name == DEFAULT_PROFILE == "qwen3.5-9b-h200-roofline"
    for size in ("2b", "9b", "27b"):
        assert load_profile(f"qwen3.5-{size}-h200").source == "measured"
        assert load_profile(f"qwen3.5-{size}-h200-roofline").source == "analytic"
    for name in list_profiles():
        p = load_profile(name)
        assert p.gpu.startswith("NVIDIA H200") and p.name == name
        if p.source == "analytic":
            assert p.invariant_rows is None and isinstance(p.cost, AnalyticCost)
        else:
            assert isinstance(p.cost, TableCost) and p.cost.keep is not None and p.cost.restore is not None
            assert {"commit", "command", "date"} <= dict(p.provenance).keys()
        assert profile_from_dict(profile_to_dict(p)) == p


def test_27b_by_hand():
    p = make_profiles_module().make_profile("qwen3.5-27b")
    assert p.shape == QWEN35_27B
    # Per layer: attention 5120 x 12288 (q + gate) + 2 x 5120 x 1024 + 6144 x 5120 + 2 x 256 = 104,858,112;
    # delta net 5120 x 10240 + 5120 x 6144 + 2 x 5120 x 48 + 10240 x 4 + 96 + 128 + 6144 x 5120 = 115,876,064;
    # MLP + norms 3 x 5120 x 17408 + 2 x 5120 = 267,397,120. 16 + 48 layers + final norm = 24,353,201,664;
    # LM head 5120 x 248320 = 1,271,398,400. bf16: 2 x 25,624,600,064 bytes.
    assert p.cost.weight_bytes == 51_249_200_128
    one_lane = (51_249_200_128 + 65_536 + 2 * 153_944_064) / 4.3e12 + 64 * 5e-6
    assert p.decode_round_s(1, [0]) == pytest.approx(one_lane)
    assert 1 / 90 < p.decode_round_s(1, [0]) < 1 / 75  # about 1/83 s: weights / 4.3 TB/s
    assert p.keep_s(153_944_064) == pytest.approx(153_944_064 / 4.3e12)


def test_9b_prefill_of_32k_rows():
    p = make_profiles_module().make_profile("qwen3.5-9b")
    assert 0.5 < p.prefill_s(32768, 0) < 1.5
    assert p.prefill_s(4096, 28672) > p.prefill_s(4096, 0)  # attention over the context


def test_sizes_order():
    small, mid, big = (load_profile(f"qwen3.5-{s}-h200") for s in ("2b", "9b", "27b"))
    for rows, ctx in [(1, 0), (4096, 0), (4096, 100_000)]:
        assert small.prefill_s(rows, ctx) < mid.prefill_s(rows, ctx) < big.prefill_s(rows, ctx)
    assert small.decode_round_s(8, [1000] * 8) < mid.decode_round_s(8, [1000] * 8) < big.decode_round_s(8, [1000] * 8)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(["qwen3.5-2b-h200", "qwen3.5-9b-h200", "qwen3.5-27b-h200", "qwen3.5-9b-h200-roofline"]),
       st.integers(1, 70_000), st.integers(0, 200_000), st.integers(1, 300))
def test_costs_grow_with_work(name, rows, context, lanes):
    p = load_profile(name)
    assert 0 < p.prefill_s(rows, context) <= p.prefill_s(rows + 1, context) <= p.prefill_s(rows + 1, context + 1)
    assert 0 < p.decode_round_s(lanes, [context] * lanes) <= p.decode_round_s(lanes + 1, [context] * (lanes + 1))


def test_table_keep_and_restore_curves():
    d = table_profile()
    d["cost"]["keep"] = {"bytes": [0, 1000, 3000], "seconds": [0.001, 0.002, 0.006]}
    d["cost"]["restore"] = {"bytes": [100], "seconds": [0.5]}
    d["provenance"] = {"commit": "abc1234", "command": "python -m bench.profile", "date": "2025-01-01T00:00:00Z"}
    p = profile_from_dict(d)
    assert p.keep_s(0) == 0.001 and p.keep_s(500) == pytest.approx(0.0015)
    assert p.keep_s(2000) == pytest.approx(0.004)  # between 1000 and 3000
    assert p.keep_s(5000) == pytest.approx(0.010)  # last segment extended: 2e-6 s per byte
    assert p.restore_s(0) == 0.5 and p.restore_s(10**9) == 0.5  # one point: held both ways
    assert dict(p.provenance)["commit"] == "abc1234"
    assert profile_from_dict(profile_to_dict(p)) == p and profile_to_dict(p)["provenance"] == d["provenance"]
    # without curves: keeps and restores at copy_bytes_per_s (2e9 B/s)
    plain = profile_from_dict(table_profile())
    assert plain.keep_s(4e9) == plain.restore_s(4e9) == pytest.approx(2.0)
    assert TINY.restore_s(2_000_000) == TINY.keep_s(2_000_000) == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="restore_s needs nbytes >= 0"):
        p.restore_s(-1)


def test_restores_are_charged_at_restore_s():
    """sim.loop charges a resumed pass's restore at restore_s, not keep_s."""
    d = table_profile()
    d["cost"]["restore"] = {"bytes": [0], "seconds": [0.25]}
    d["cost"]["keep"] = {"bytes": [0], "seconds": [0.0]}
    p = profile_from_dict(d)
    turns = (Turn(Prompt.synthetic([(1, 100)]), (0,), 1, None, (), 0.0, 0.0),
             Turn(Prompt.synthetic([(1, 100), (2, 50)]), (0, 100), 1, None, (), 0.0, 10.0))
    w = Workload("two", (Conversation("c", 0.0, turns),))
    cfg = PolicyConfig(warm_enabled=False)
    report = simulate(w, cfg, p, BackendFacts(None))
    assert report.cached_tokens == {"c/0": 0, "c/1": 100}
    # c/1: one chunk of 50 rows after 100 (prefill grid held at its 64-row edge: 1.0 s at context 0,
    # interpolated at context 100: 1.0 + 0.1 x 2.0 = 1.2 s) + the restore, 0.25 s.
    assert report.ttft_s["c/1"] == pytest.approx(1.2 + 0.25)


def test_host_terms_round_trip():
    d = table_profile(host=True)
    p = profile_from_dict(d)
    assert isinstance(p.cost, TableCost) and p.cost.host == HostCost(step_s=3e-4, lane_s=2e-5, chunk_s=5e-4)
    assert profile_to_dict(p)["cost"]["host"] == HOST
    assert profile_from_dict(profile_to_dict(p)) == p
    assert profile_from_dict(json.loads(json.dumps(profile_to_dict(p)))) == p
    assert p.host_s(3, False) == pytest.approx(3e-4 + 3 * 2e-5)
    assert p.host_s(2, True) == pytest.approx(3e-4 + 2 * 2e-5 + 5e-4)
    assert p.host_s(0, True) == pytest.approx(8e-4)
    # integers are read as seconds too, and zero is allowed
    d["cost"]["host"] = {"step_s": 0, "lane_s": 0, "chunk_s": 1}
    assert profile_from_dict(d).cost.host == HostCost(step_s=0.0, lane_s=0.0, chunk_s=1.0)
    # the costs the tables give do not change with host terms
    plain = profile_from_dict(table_profile())
    assert plain.prefill_s(96, 500) == p.prefill_s(96, 500) and plain.decode_round_s(2, [5, 7]) == p.decode_round_s(2, [5, 7])


def test_profiles_without_host_terms_charge_none():
    plain = profile_from_dict(table_profile())
    assert isinstance(plain.cost, TableCost) and plain.cost.host is None
    assert "host" not in profile_to_dict(plain)["cost"]
    assert plain.host_s(16, True) == 0.0 and TINY.host_s(16, True) == 0.0
    for name in list_profiles():  # the shipped analytic ones have none; measured ones carry theirs
        p = load_profile(name)
        if p.source == "analytic":
            assert p.host_s(4, True) == 0.0 and "host" not in profile_to_dict(p)["cost"]
        else:
            host = p.cost.host
            assert p.host_s(4, True) == host.step_s + 4 * host.lane_s + host.chunk_s > 0.0


def _one_request(p: Profile):
    """One request of 100 rows, message starts at 0 and 60 (chunks [0, 60) and [60, 100)), 4 tokens."""
    turn = Turn(Prompt.synthetic([(1, 100)]), (0, 60), 4, None, (), 0.0, 0.0)
    return simulate(Workload("one", (Conversation("c", 0.0, (turn,)),)), PolicyConfig(warm_enabled=False), p,
                    BackendFacts(None))


def test_host_terms_delay_the_request_by_hand():
    base, host = table_profile(), table_profile(host=True)
    for d in (base, host):
        d["cost"]["keep"] = {"bytes": [0], "seconds": [0.0]}
    plain, timed = _one_request(profile_from_dict(base)), _one_request(profile_from_dict(host))
    # chunk [0, 60): held at the 64-row edge, context 0: 1.0 s; chunk [60, 100): 64-row edge at context 60:
    # 1.0 + 0.06 x (3.0 - 1.0) = 1.12 s; keeps free. The first token comes with the second chunk's commit.
    assert plain.ttft_s["c/0"] == pytest.approx(2.12, abs=1e-12)
    # each chunk is a step of its own: + step_s + chunk_s, twice
    assert timed.ttft_s["c/0"] == pytest.approx(2.12 + 2 * (3e-4 + 5e-4), abs=1e-12)
    # then 3 decode rounds of 1 lane (0.01 s each): + step_s + lane_s each
    assert plain.result.end_s == pytest.approx(2.12 + 3 * 0.01, abs=1e-12)
    assert timed.result.end_s == pytest.approx(2.12 + 2 * 8e-4 + 3 * (0.01 + 3e-4 + 2e-5), abs=1e-12)


def test_table_form_interpolates():
    p = profile_from_dict(table_profile())
    assert p.prefill_s(64, 0) == 1.0 and p.prefill_s(128, 1000) == 6.0
    assert p.prefill_s(96, 500) == pytest.approx(3.0)  # bilinear: mean of the four corners
    assert p.prefill_s(1, 0) == 1.0  # below the grid: held at the edge
    assert p.prefill_s(256, 0) == pytest.approx(4.0)  # above: the last segment extended
    assert p.decode_round_s(5, [0, 200, 100, 100, 100]) == pytest.approx(0.03)  # mean context 100
    assert p.keep_s(4e9) == pytest.approx(2.0)
    assert profile_from_dict(profile_to_dict(p)) == p


def test_grid_past_the_last_context_stays_non_decreasing_in_rows():
    """A larger chunk can have the smaller context slope (the shipped 9B profile's 256-row row
    grows 9.7 ms over the last 16,384 context rows, its 64-row row 10.5 ms): extended past the
    last context, the 256-row value would fall under the 64-row one. Found by
    test_costs_grow_with_work at (64 rows, 41,535 context) with that profile."""
    grid = Grid(x=(64.0, 256.0), y=(16384.0, 32768.0), seconds=((21.53, 32.02), (22.76, 32.44)))
    y = 41535.0
    at_64 = 21.53 + (y - 16384) / 16384 * (32.02 - 21.53)
    assert grid.at(64, y) == pytest.approx(at_64)
    assert grid.at(256, y) == pytest.approx(at_64)  # held at the 64-row value, not 37.62
    assert grid.at(65, y) >= grid.at(64, y) and grid.at(300, y) >= grid.at(256, y)
    assert grid.at(256, 32768) == 32.44  # inside the grid nothing changes
    p = load_profile("qwen3.5-9b-h200")
    assert p.prefill_s(64, 41535) <= p.prefill_s(65, 41535)


def mutate(d: dict, path: str, value: object) -> dict:
    d = copy.deepcopy(d)
    *keys, last = path.split(".")
    target = d
    for k in keys:
        target = target[k]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return d


@pytest.mark.parametrize("base, path, value, match", [
    ("analytic", "cost.matrix_efficiency", 2.0, r"^cost.matrix_efficiency: must be a number in \(0"),
    ("analytic", "cost.weight_bytes", KeyError, r"^cost.weight_bytes: missing"),
    ("analytic", "cost.weight_bytes", 1.5, r"^cost.weight_bytes: must be an integer"),
    ("analytic", "cost.form", "guess", r"^cost.form"),
    ("analytic", "cost.colour", 1, r"^cost.colour: unknown key"),
    ("analytic", "source", "dreamt", r"^source"),
    ("analytic", "invariant_rows", 0, r"^invariant_rows"),
    ("analytic", "shape.head_dim", 0, r"^shape.head_dim"),
    ("analytic", "shape.head_dim", KeyError, r"^shape.head_dim: missing"),
    ("analytic", "gpu", 3, r"^gpu"),
    ("table", "cost.prefill.rows", [128, 64], r"^cost.prefill.rows: must be a non-empty, strictly ascending"),
    ("table", "cost.prefill.seconds", [[1.0, 3.0], [2.0]], r"^cost.prefill.seconds\[1\]"),
    ("table", "cost.decode.seconds", [[0.1]], r"^cost.decode.seconds: must be a list of 2 rows"),
    ("table", "cost.decode.lanes", KeyError, r"^cost.decode.lanes: missing"),
    ("table", "cost.keep", {"bytes": [0, 10], "seconds": [1.0]}, r"^cost.keep.seconds: must be 2 numbers"),
    ("table", "cost.restore", {"bytes": [10, 0], "seconds": [1.0, 2.0]}, r"^cost.restore.bytes: must be a non-empty"),
    ("table", "cost.keep", {"bytes": [0], "seconds": [1.0], "x": 1}, r"^cost.keep.x: unknown key"),
    ("table", "provenance", {"commit": 3}, r"^provenance: must be a JSON object of strings"),
    ("host", "cost.host.step_s", -1e-6, r"^cost.host.step_s: must be a number in \[0.0, 1.0\], got -1e-06$"),
    ("host", "cost.host.lane_s", "2e-5", r"^cost.host.lane_s: must be a number in \[0.0, 1.0\], got '2e-5'$"),
    ("host", "cost.host.chunk_s", 300.0, r"^cost.host.chunk_s: must be a number in \[0.0, 1.0\], got 300.0$"),
    ("host", "cost.host.lane_s", float("nan"), r"^cost.host.lane_s: must be a number"),
    ("host", "cost.host.chunk_s", KeyError, r"^cost.host.chunk_s: missing$"),
    ("host", "cost.host.round_s", 1e-4, r"^cost.host.round_s: unknown key; known: step_s, lane_s, chunk_s$"),
    ("host", "cost.host", [3e-4, 2e-5, 5e-4], r"^cost.host: must be a JSON object"),
], ids=["efficiency", "missing", "float-bytes", "form", "unknown", "source", "grid", "shape", "shape-missing", "gpu",
        "axis-order", "row-length", "row-count", "axis-missing", "keep-length", "restore-order", "keep-unknown",
        "provenance", "host-negative", "host-string", "host-unit-slip", "host-nan", "host-missing", "host-unknown",
        "host-not-object"])
def test_profile_errors_name_the_field(base, path, value, match):
    d = profile_to_dict(TINY) if base == "analytic" else table_profile(host=base == "host")
    with pytest.raises(ValueError, match=match):
        profile_from_dict(mutate(d, path, value))


def test_load_profile_errors(tmp_path):
    with pytest.raises(ValueError, match="not a shipped profile"):
        load_profile("qwen9-typo")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="bad.json: not JSON"):
        load_profile(bad)
    bad.write_text(json.dumps(mutate(profile_to_dict(TINY), "cost.copy_bytes_per_s", 0)))
    with pytest.raises(ValueError, match=r"bad.json: cost.copy_bytes_per_s"):
        load_profile(str(bad))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(profile_to_dict(TINY)))
    assert load_profile(good) == TINY


def test_shipped_analytic_files_are_what_make_profiles_writes(tmp_path):
    make_profiles_module().main(tmp_path)
    for name in list_profiles():
        shipped = json.loads((ROOT / "sim" / "profiles" / f"{name}.json").read_text())
        if shipped["source"] == "analytic":
            assert json.loads((tmp_path / f"{name}.json").read_text()) == shipped


def test_a_shape_field_of_the_wrong_type_is_named(tmp_path):
    d = json.loads((ROOT / "sim" / "profiles" / "qwen3.5-2b-h200.json").read_text())
    d["shape"]["linear_layers"] = "x"
    with pytest.raises(ValueError, match=r"^shape\.linear_layers: must be an integer, got 'x'$"):
        profile_from_dict(d)


def test_coverage_note_names_what_a_run_takes_past_a_table():
    from sim.cost import coverage_note

    table = load_profile("qwen3.5-2b-h200")  # rows to 4096, context to 32768
    assert coverage_note(table, 4096, 32768 + 4096) is None
    note = coverage_note(table, 8192, 40000)
    assert "chunks of up to 8,192 rows (measured: 4,096)" in note
    assert "prompts of up to 40,000 rows (measured: context 32,768 + a chunk)" in note
    assert coverage_note(table, 4096, 40000).count("up to") == 1
    assert coverage_note(load_profile("qwen3.5-2b-h200-roofline"), 10**6, 10**7) is None  # analytic: no points
