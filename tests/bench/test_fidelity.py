"""bench/fidelity.py and bench/fidelity_report.py: the plan, the comparison on hand-made
traces (values by hand), the simulator workload built from a record, and the whole loop on
CPU against a real server (the tiny model on the reference backend), with a planted
simulator change that must make cached_tokens differ and the run exit 1."""

from __future__ import annotations

import json
import math
import os

import attrs

import pytest

from bench.fidelity import Rendered, grid_rows, machine_lines, main, sim_workload
from bench.fidelity_plan import PLANS, make_plan
from bench.fidelity_report import (
    ACTIVE_BUCKETS,
    active_bucket,
    compare,
    median,
    report_lines,
    keep_lines,
    step_split_lines,
    trace_facts,
)
from executor.model import tiny_config
from sim.api import machine
from sim.cost import Grid, HostCost, Profile, TableCost, profile_to_dict


def ev(kind: str, t: float, **fields) -> dict:
    return {"kind": kind, "t": t, **fields}


def two_turns(conv: str, rid, ttft0: float, ttft1: float, chunk0: float, chunk1: float, end0: float, end1: float,
              yielded: bool = False) -> list[dict]:
    """A conversation of two requests: turn 0 cold [0, 100), a warm pass [64, 120) after it,
    turn 1 resumed at 120 from the store."""
    r0, r1 = rid(0), rid(1)
    out = [
        ev("request_arrived", 1.0, request=r0, conversation=conv, rows=100, max_tokens=5),
        ev("request_admitted", 1.0, request=r0, conversation=conv, stream=1, rows=100, cached_tokens=0, source="none"),
        ev("chunk_started", 1.0, stream=1, request=r0, conversation=conv, pass_kind="cold", start=0, end=100,
           tail_from=None, restore_row=None),
        ev("chunk_done", 1.0 + chunk0, stream=1, request=r0, conversation=conv, pass_kind="cold", start=0, end=100),
        ev("state_kept", 1.0 + chunk0, stream=1, conversation=conv, entry=1, row=64, bytes=10, logits=False),
        ev("first_token", 1.0 + ttft0, request=r0, conversation=conv, stream=1, ttft_s=ttft0),
        ev("request_finished", end0, request=r0, conversation=conv, reason="length", rows=100, cached_tokens=0,
           output_rows=5),
        ev("warm_scheduled", end0, conversation=conv, after=r0, rows=120),
        ev("warm_started", 1.7, conversation=conv, stream=2, resume=64, end=120),
    ]
    if yielded:
        out.append(ev("warm_yielded", 1.7, conversation=conv, stream=2, row=64))
    out += [
        ev("chunk_started", 1.7, stream=2, request=None, conversation=conv, pass_kind="warm", start=64, end=120,
           tail_from=120, restore_row=64),
        ev("chunk_done", 1.75, stream=2, request=None, conversation=conv, pass_kind="warm", start=64, end=120),
        ev("state_kept", 1.75, stream=2, conversation=conv, entry=2, row=120, bytes=12, logits=False),
        ev("warm_finished", 1.75, conversation=conv, stream=2, row=120),
        ev("request_arrived", 3.0, request=r1, conversation=conv, rows=130, max_tokens=3),
        ev("request_admitted", 3.0, request=r1, conversation=conv, stream=1, rows=130, cached_tokens=120,
           source="store"),
        ev("chunk_started", 3.0, stream=1, request=r1, conversation=conv, pass_kind="cold", start=120, end=130,
           tail_from=None, restore_row=120),
        ev("chunk_done", 3.0 + chunk1, stream=1, request=r1, conversation=conv, pass_kind="cold", start=120, end=130),
        ev("first_token", 3.0 + ttft1, request=r1, conversation=conv, stream=1, ttft_s=ttft1),
        ev("request_finished", end1, request=r1, conversation=conv, reason="length", rows=130, cached_tokens=120,
           output_rows=3),
    ]
    return out


def hand_comparison():
    server_events = [ev("request_arrived", 0.5, request="req-99", conversation="conv-9", rows=7, max_tokens=1)]
    server_events += two_turns("conv-1", lambda k: f"req-{k + 1}", 0.1, 0.02, 0.1, 0.02, 1.5, 3.2)
    server_events.append(ev("state_evicted", 3.3, entry=1, row=64, bytes=10, how="freed"))
    sim_events = two_turns("c", lambda k: f"c/{k}", 0.08, 0.025, 0.09, 0.025, 1.45, 3.25, yielded=True)
    server_key = {"req-1": ("c", 0), "req-2": ("c", 1)}.get
    sim_key = lambda rid: (rid.split("/")[0], int(rid.split("/")[1]))
    return compare(trace_facts(server_events, server_key), trace_facts(sim_events, sim_key))


def test_comparison_by_hand():
    c = hand_comparison()
    assert [r.key for r in c.rows] == [("c", 0), ("c", 1)]
    assert c.all_cached_equal and c.cached_equal == 2
    assert c.server.unkeyed_requests == 1 and (c.server.evictions, c.sim.evictions) == (1, 0)
    # TTFT: |0.08 - 0.1| / 0.1 = 20%, |0.025 - 0.02| / 0.02 = 25%: median 22.5%; signed -20% and +25%: 2.5%
    assert c.ttft_mdape == pytest.approx(0.225) and c.ttft_bias == pytest.approx(0.025)
    # end to end: server 0.5 and 0.2 s, sim 0.45 and 0.25 s: 10% and 25%
    assert c.e2e_mdape == pytest.approx(0.175)
    # prefill steps matched by (pass, start, end): cold [0, 100) -10%, warm [64, 120) 0%, cold [120, 130) +25%
    assert c.chunk_mdape == pytest.approx(0.1) and c.chunk_bias == pytest.approx(0.0)
    # server / sim per step: 0.1 / 0.09, 0.05 / 0.05, 0.02 / 0.025; one request in flight at each
    # (req-99 never admitted): all in "0-2", median 1.0
    assert c.chunk_ratio_by_active == (("0-2", pytest.approx(1.0), 3),)
    # seconds per token after the first: server 0.1 and 0.09, sim 0.0925 and 0.1125: -7.5% and +25%
    assert c.token_mdape == pytest.approx(0.1625) and c.token_bias == pytest.approx(0.0875)
    # the warm pass after turn 0 belongs to turn 0; the sim's extra yield is its first difference
    turn0 = c.rows[0].server.decisions
    assert turn0[:4] == ("admit cached=0 source=none", "chunk cold [0,100) tail=None restore=None", "keep 64",
                         "finish length out=5")
    assert turn0[4:] == ("warm_scheduled 120", "warm_started [64,120)", "chunk warm [64,120) tail=120 restore=64",
                         "keep 120", "warm_finished 120")
    assert c.rows[0].first_diff == (6, "chunk warm [64,120) tail=120 restore=64", "warm_yielded 64")
    assert c.rows[1].first_diff is None and c.decisions_equal == 1
    assert c.kind_counts == {"warm_yielded": (0, 1)}
    text = "\n".join(report_lines(c))
    assert "cached_tokens identical: 2/2" in text and "TTFT median absolute error: 22.5%" in text
    assert "c/0" in text and "srv 'chunk warm [64,120) tail=120 restore=64' sim 'warm_yielded 64'" in text
    assert "prefill step server / sim by requests in flight: 0-2: 1.00x (3)" in text


def test_active_buckets():
    assert [active_bucket(n) for n in (0, 2, 3, 5, 6, 9, 11, 12, 40)] == [
        "0-2", "0-2", "3-5", "3-5", "6-8", "9-11", "9-11", "12+", "12+"]
    assert ACTIVE_BUCKETS[-1] == "12+"


def test_cached_difference_is_flagged():
    server = [e | ({"cached_tokens": 64} if e["kind"] == "request_admitted" and e["request"] == "r/1" else {})
              for e in two_turns("x", lambda k: f"r/{k}", 0.1, 0.02, 0.1, 0.02, 1.5, 3.2)]
    sim = two_turns("x", lambda k: f"r/{k}", 0.1, 0.02, 0.1, 0.02, 1.5, 3.2)
    key = lambda rid: (rid.split("/")[0], int(rid.split("/")[1]))
    c = compare(trace_facts(server, key), trace_facts(sim, key))
    assert c.cached_equal == 1 and not c.all_cached_equal and not c.rows[1].cached_equal
    assert c.ttft_mdape == 0.0 and "CACHED DIFFERS" in "\n".join(report_lines(c))


def test_median():
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([4.0, 1.0]) == 2.5 and math.isnan(median([]))


def test_plans_are_seeded_and_sized():
    gpu = make_plan(PLANS["gpu"])
    assert gpu == make_plan(PLANS["gpu"]) and gpu != make_plan(PLANS["gpu"].__class__(seed=1))
    assert gpu.requests >= 200
    phases = [c.phase for c in gpu.chats]
    assert phases[0] == "primer" and phases.count("burst") == 140 and phases == sorted(phases, key=["primer", "burst", "chat"].index)
    assert all(t.think_s == 0 for c in gpu.chats if c.phase == "burst" for t in c.turns)
    assert all(2.5 <= t.think_s <= 4.0 for c in gpu.chats if c.phase == "chat" for t in c.turns[1:])
    assert all(8 <= t.max_tokens <= 24 for c in gpu.chats for t in c.turns)
    assert any(t.user.startswith("Read this document.") for c in gpu.chats for t in c.turns)
    assert 10 <= make_plan(PLANS["tiny"]).requests <= 30


def test_sim_workload_replays_the_record():
    rendered = [Rendered(key=("c", 0), prompt=tuple(range(100)), starts=(0, 64), continuation=tuple(range(120)),
                         continuation_starts=(0, 64, 100), output_rows=5),
                Rendered(key=("c", 1), prompt=tuple(range(130)), starts=(0, 64, 100, 120), continuation=None,
                         continuation_starts=(), output_rows=3)]
    records = [{"conversation": "c", "turn": 0, "think_s": 0.0, "server_request": "req-1"},
               {"conversation": "c", "turn": 1, "think_s": 1.25, "server_request": "req-2"}]
    events = two_turns("conv-1", lambda k: f"req-{k + 1}", 0.1, 0.02, 0.1, 0.02, 1.5, 3.2)
    observed = sim_workload(rendered, records, events, "observed")
    (conv,) = observed.conversations
    t0, t1 = conv.turns
    assert conv.id == "c" and (t0.arrival_s, t0.think_s, t0.output_rows) == (1.0, 0.0, 5)
    assert len(t0.prompt) == 100 and len(t0.continuation) == 120 and t0.continuation_starts == (0, 64, 100)
    assert t0.continuation.digest(100) == t1.prompt.digest(100)  # same tokens, same prefix digests
    assert (t1.arrival_s, t1.think_s, t1.continuation) == (None, pytest.approx(3.0 - 1.5), None)
    planned = sim_workload(rendered, records, events, "planned")
    assert planned.conversations[0].turns[1].think_s == 1.25


def tiny_profile(path, invariant_rows: int | None = None) -> str:
    """A fixed table profile of the tiny model, about as fast as the reference backend on an idle
    CPU. Not measured here: on a shared CPU a profile measured during a load spike is many times
    too slow, and the simulated warm passes then miss their quiet windows (bench/profile.py's own
    tests measure one)."""
    cost = TableCost(prefill=Grid(x=(1.0, 4096.0), y=(0.0, 4096.0), seconds=((0.004, 0.005), (0.4, 0.5))),
                     decode=Grid(x=(1.0, 16.0), y=(0.0, 4096.0), seconds=((0.005, 0.006), (0.06, 0.07))),
                     copy_bytes_per_s=1e9)
    profile = Profile(name="tiny-fixed", source="measured", gpu="CPU", model="tiny-qwen3_5-v1",
                      shape=tiny_config().shape, invariant_rows=invariant_rows, cost=cost)
    path.write_text(json.dumps(profile_to_dict(profile)))
    return str(path)


def test_step_split_against_the_profile(tmp_path):
    """The server's step records, split by kind, beside the profile's seconds for them."""
    from sim.cost import load_profile

    profile = load_profile(tiny_profile(tmp_path / "tiny.json"))
    host = HostCost(step_s=1e-3, lane_s=2e-3, chunk_s=0.0)
    profile = attrs.evolve(profile, cost=attrs.evolve(profile.cost, host=host))
    steps = [ev("step", 1.0, ran_s=0.010, phases={"forward": 0.008, "sample": 0.001}, prefill_rows=1,
                prefill_start=0, restores=0, decode=0),
             ev("step", 1.1, ran_s=0.020, phases={"forward": 0.018, "keep": 0.001}, prefill_rows=1, prefill_start=0,
                restores=1, decode=0),
             ev("step", 1.2, ran_s=0.012, phases={"decode": 0.011}, prefill_rows=0, prefill_start=None, restores=0,
                decode=2),
             ev("step", 1.3, ran_s=0.050, phases={}, prefill_rows=1, prefill_start=0, restores=0, decode=2),  # mixed
             ev("chunk_done", 1.3, stream=1)]
    lines = step_split_lines(steps, profile)
    # prefill-only: server median 15 ms against the profile's 4 ms (1 row at context 0) + 1 ms a
    # step + 2 ms a restored lane, as sim.loop charges them: 5 and 7 ms, median 6 ms
    assert "prefill-only steps (2): server 15.00, profile 6.00" in lines[1]
    assert "2.43x" in lines[1] and "forward 13.00" in lines[1] and "keep 0.50" in lines[1]
    # decode-only, 2 lanes: the profile's round at 2 lanes, context 0 (5 ms + (60-5)/15 ms) + 1 + 2 x 2 ms
    # the mixed step: 50 ms against the profile's chunk (1 row at context 0) + round (2 lanes at
    # context 0) + host (1 ms a step + 2 lanes x 2 ms), as sim.loop charges such a step
    mixed = profile.prefill_s(1, 0) + profile.decode_round_s(2, [0, 0]) + profile.host_s(2, True)
    assert lines[2] == (f"  steps with a chunk and decode lanes (1), less keep and restore: server 50.00, "
                        f"profile {mixed * 1e3:.2f} (chunk + round at context 0 + host); in all "
                        f"{0.050 / mixed:.2f}x")
    assert lines[3].startswith("  decode-only steps, 2 lanes (1): server 12.00, profile at context 0 13.67")
    # gaps between steps: 80, 88 and 50 ms: idle waits, no loop line
    assert len(lines) == 4
    busy = [ev("step", 2.0, ran_s=0.002, phases={}, prefill_rows=0, prefill_start=None, restores=0, decode=1),
            ev("step", 2.0025, ran_s=0.002, phases={}, prefill_rows=0, prefill_start=None, restores=0, decode=1),
            ev("step", 2.0053, ran_s=0.002, phases={}, prefill_rows=0, prefill_start=None, restores=0, decode=1)]
    gap = [line for line in step_split_lines(busy, profile) if "between steps" in line]
    assert gap == ["  between steps while busy (gap < 2 ms, 2): loop median 650 us; the profile's host terms charge "
                   "1000 us a step (step_s, with the steps' worker hand-off)"]
    assert step_split_lines([ev("chunk_done", 1.0, stream=1)], profile) == []


def test_keep_lines_price_every_keep_at_its_chunk_end_by_bytes(tmp_path):
    """Keeps at the ends of chunks [0, 64) and [64, 128) (one may have found its state kept
    already: the simulator charges it all the same): keep phases 1 + 2 ms beside the
    profile's keep_s at rows 64 and 128; a step without a keep does not count."""
    from policy.shape import state_bytes
    from sim.cost import load_profile

    profile = load_profile(tiny_profile(tmp_path / "tiny.json"))
    steps = [ev("step", 1.0, ran_s=0.01, phases={"forward": 0.008, "keep": 0.001}, prefill_rows=64,
                prefill_start=0, restores=0, decode=0),
             ev("step", 2.0, ran_s=0.01, phases={"forward": 0.007, "keep": 0.002}, prefill_rows=64,
                prefill_start=64, restores=0, decode=0),
             ev("step", 3.0, ran_s=0.01, phases={"decode": 0.009}, prefill_rows=0, prefill_start=None,
                restores=0, decode=1)]
    model = sum(profile.keep_s(state_bytes(profile.shape, r)) for r in (64, 128))
    assert keep_lines(steps, profile) == [
        f"  keeps (2): server 3.0 ms in all (median 1.50), profile {model * 1e3:.1f} ms by bytes; "
        f"server / profile {0.003 / model:.2f}x"]
    assert keep_lines(steps[2:], profile) == []
    # with keep_bytes (the runtime's records now): priced at the bytes copied; 0 bytes left out
    steps[0]["keep_bytes"], steps[1]["keep_bytes"] = 5000, 0
    assert keep_lines(steps, profile) == [
        f"  keeps (1): server 1.0 ms in all (median 1.00), profile {profile.keep_s(5000) * 1e3:.1f} ms by bytes; "
        f"server / profile {0.001 / profile.keep_s(5000):.2f}x"]


def test_fidelity_against_the_tiny_server(tmp_path, capsys):
    out = tmp_path / "fid"
    profile = tiny_profile(tmp_path / "tiny.json")
    code = main(["--plan", "tiny", "--backend", "reference", "--profile", profile, "--out", str(out)])
    text = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    n = make_plan(PLANS["tiny"]).requests
    assert code == 0, text
    assert report["requests"] == report["cached_equal"] == n and f"cached_tokens identical: {n}/{n}" in text
    rows = report["rows"]
    assert all(r["server"]["cached_tokens"] == r["sim"]["cached_tokens"] for r in rows)
    assert sum(r["server"]["cached_tokens"] > 0 for r in rows) >= n - 2  # the system prompt and warm passes
    ttft = [abs(r["sim"]["ttft_s"] - r["server"]["ttft_s"]) / r["server"]["ttft_s"] for r in rows]
    assert report["ttft_mdape"] == pytest.approx(median(ttft))
    assert all(r["server"]["output_rows"] == r["sim"]["output_rows"] for r in rows)
    for name in ("plan.json", "records.jsonl", "server_trace.jsonl", "sim_trace.jsonl", "report.txt", "policy.toml"):
        assert (out / name).is_file(), name
    steps = [json.loads(line) for line in (out / "server_trace.jsonl.steps.jsonl").read_text().splitlines()]
    assert steps and all(e["ran_s"] > 0 and "forward" in e["phases"] for e in steps if e["prefill_rows"])
    assert "server steps against the profile" in text and "prefill-only steps" in text
    here = json.loads((out / "run.json").read_text())["machine"]
    assert here == machine() and f"server machine: {here}; profile machine: not recorded" in text

    # replay: the same comparison without a server; then a planted policy change in the recorded
    # meta (the simulator takes the server's policy from it): without request starts nothing under
    # the 4096-row grid is kept, so cached_tokens must differ and the run exit 1
    assert main(["--replay", "--profile", profile, "--out", str(out)]) == 0
    assert json.loads((out / "report.json").read_text())["cached_equal"] == n
    meta_path = out / "server_trace.jsonl.meta.json"
    meta = json.loads(meta_path.read_text())
    assert "invariant_rows" in meta and meta["invariant_rows"] is None  # the reference backend has no grid

    # a profile measured on a 64-row grid (a GPU base, say): the simulator still resumes where
    # this server does (the default, --invariant-rows server) and says so; forced onto the
    # profile's grid it keeps other rows than the server, and the run fails
    gridded = tiny_profile(tmp_path / "tiny64.json", invariant_rows=64)
    capsys.readouterr()
    assert main(["--replay", "--profile", gridded, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "invariant_rows None" in text and "note: the profile was measured with invariant_rows 64" in text
    assert main(["--replay", "--profile", gridded, "--out", str(out), "--invariant-rows", "profile"]) == 1
    text = capsys.readouterr().out
    assert "note: the simulator resumes on invariant_rows 64, the server on None" in text
    assert json.loads((out / "report.json").read_text())["cached_equal"] < n

    # a run recorded before the meta had invariant_rows and the policy short_first: the
    # profile's grid, and first come, first served (as those servers ran), each with a note
    old = {**meta, "policy": {k: v for k, v in meta["policy"].items() if k != "short_first"}}
    del old["invariant_rows"]
    meta_path.write_text(json.dumps(old))
    capsys.readouterr()
    assert main(["--replay", "--profile", profile, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "note: the server's policy has no short_first" in text and "has no invariant_rows" in text
    meta["policy"]["request_starts"] = False
    meta_path.write_text(json.dumps(meta))
    assert main(["--replay", "--profile", profile, "--out", str(out)]) == 1
    planted = json.loads((out / "report.json").read_text())
    assert planted["cached_equal"] < n and "CACHED DIFFERS" in (out / "report.txt").read_text()


def test_grid_rows_by_choice():
    p = Profile(name="p", source="measured", gpu="CPU", model="m", shape=tiny_config().shape, invariant_rows=64,
                cost=TableCost(prefill=Grid(x=(1.0,), y=(0.0,), seconds=((0.001,),)),
                               decode=Grid(x=(1.0,), y=(0.0,), seconds=((0.001,),)), copy_bytes_per_s=1e9))
    assert grid_rows("server", p, {"invariant_rows": None}) is None
    assert grid_rows("server", p, {"invariant_rows": 32}) == 32
    assert grid_rows("server", p, {}) == 64  # a meta recorded before the field: the profile's
    assert grid_rows("profile", p, {"invariant_rows": None}) == 64
    assert grid_rows("none", p, {"invariant_rows": 64}) is None
    assert grid_rows("128", p, {}) == 128
    for bad in ("0", "grid", "-64"):
        with pytest.raises(ValueError, match="--invariant-rows"):
            grid_rows(bad, p, {})


def test_machine_lines_note_a_profile_from_another_machine():
    assert machine_lines("a (x, 16 CPUs)", "a (x, 16 CPUs)") == [
        "server machine: a (x, 16 CPUs); profile machine: a (x, 16 CPUs)"]
    other = machine_lines("a (x, 16 CPUs)", "b (y, 16 CPUs)")
    assert len(other) == 2 and other[1].startswith("note: the profile was measured on another machine")
    assert machine_lines(None, "b") == ["server machine: not recorded; profile machine: b"]


def test_machine_names_host_cpu_model_and_count(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t: x\n")
    boot = tmp_path / "boot_id"
    boot.write_text("0123abcd-4567-89ef-0123-456789abcdef\n")
    assert machine(info, boot).endswith(f"(Test CPU 9000, {os.cpu_count()} CPUs, boot 0123abcd)")
    assert machine(info, tmp_path / "no-boot").endswith(f"(Test CPU 9000, {os.cpu_count()} CPUs)")
    assert "(unknown CPU," in machine(tmp_path / "missing")
    # two starts of one host with one CPU model are two machines
    other = tmp_path / "boot_id2"
    other.write_text("ffff0000-0000-0000-0000-000000000000\n")
    assert machine(info, boot) != machine(info, other)
    assert len(machine_lines(machine(info, boot), machine(info, other))) == 2


def test_bad_grid_and_timeout_are_refused_before_the_server_starts(tmp_path, capsys):
    """A fresh-user review: --invariant-rows -5 was refused only after the whole server run,
    and --timeout-s -1 read as "the server did not get ready". Nothing is written to --out."""
    out = tmp_path / "run"
    for flags, message in ((["--invariant-rows", "-5"], "--invariant-rows"),
                           (["--invariant-rows", "bogus"], "--invariant-rows"),
                           (["--timeout-s", "-1"], "--timeout-s must be > 0, got -1")):
        assert main(["--plan", "tiny", "--backend", "reference", "--profile", "qwen3.5-2b-h200", "--out", str(out),
                     *flags]) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()
