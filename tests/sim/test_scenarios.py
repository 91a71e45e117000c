"""Synthetic workload generators (sim/scenarios.py)."""

from __future__ import annotations

import random

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.prefix import Prompt, Run
from sim.scenarios import DEFAULT_SCENARIO, generate, grid_edges, scenarios
from sim.workload import Role, Workload, read_workload, write_workload

SMALL = {
    "chat": dict(conversations=4), "reasoning": dict(conversations=3), "agent": dict(conversations=2, max_steps=6),
    "concurrent": dict(users=6), "primers": dict(conversations=4), "grid_edges": dict(marks=(1,)),
    "mixed": dict(conversations=20), "day": dict(conversations=20),
}


def contract_problems(w: Workload) -> list[str]:
    """Every turn k followed by k+1: continuation is a prefix of k+1's prompt ending on one of
    its starts, and extends turn k's prompt (through the generation prompt)."""
    out = []
    for c in w.conversations:
        for k, (turn, nxt) in enumerate(zip(c.turns, c.turns[1:])):
            cont = turn.continuation
            if cont is None:
                continue
            n, p = len(cont), len(turn.prompt)
            if n > len(nxt.prompt) or cont.digest(n) != nxt.prompt.digest(n) or n not in nxt.starts:
                out.append(f"{c.id} turn {k}: continuation does not lead into the next prompt")
            if n <= p or cont.digest(p) != turn.prompt.digest(p):
                out.append(f"{c.id} turn {k}: continuation does not extend the prompt")
    return out


def test_registry_names_and_default():
    assert set(scenarios()) == set(SMALL) and DEFAULT_SCENARIO == "mixed"
    table = scenarios()
    table.clear()
    assert "chat" in scenarios()  # a fresh dict each call, no shared state


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(SMALL)), st.integers(0, 2**32))
def test_every_generator_keeps_the_continuation_contract(name, seed):
    w = generate(name, seed, **SMALL[name])
    assert w.name == name and w.conversations
    assert contract_problems(w) == []
    for c in w.conversations:
        assert c.id.startswith(f"{name}-") or name == "mixed"
        assert all(t.arrival_s is None for t in c.turns)  # closed loop


@pytest.mark.parametrize("plant", ["reasoning-rendered", "one-row-short", "other-content"])
def test_contract_check_catches_planted_bugs(plant):
    c = generate("reasoning", 1, conversations=1, min_turns=2).conversations[0]
    cont = c.turns[0].continuation
    wrong = {"reasoning-rendered": cont.extend([Run(99, 7)]), "one-row-short": cont.prefix(len(cont) - 1),
             "other-content": Prompt(cont.runs[:-2] + (Run(98, cont.runs[-2].rows), cont.runs[-1]))}[plant]
    turns = (attrs.evolve(c.turns[0], continuation=wrong), *c.turns[1:])
    assert contract_problems(Workload("planted", (attrs.evolve(c, turns=turns),)))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_deterministic_for_a_seed(name):
    assert generate(name, 7, **SMALL[name]) == generate(name, 7, **SMALL[name])
    assert generate(name, 7, **SMALL[name]) != generate(name, 8, **SMALL[name])


def test_jsonl_round_trip_of_a_generated_workload(tmp_path):
    w = generate("mixed", 3, conversations=30)
    write_workload(w, tmp_path / "m.jsonl")
    assert read_workload(tmp_path / "m.jsonl") == w
    assert "messages" in (tmp_path / "m.jsonl").read_text().splitlines()[1]


@pytest.mark.parametrize("grid", [4096, 1024])
def test_grid_edges_land_on_below_and_above_each_mark(grid):
    w = grid_edges(random.Random(1), grid_rows=grid, marks=(1, 2))
    by_id = {c.id: c for c in w.conversations}
    for target in (grid - 1, grid, grid + 1, 2 * grid - 1, 2 * grid, 2 * grid + 1):
        a, b = by_id[f"grid_edges-sys{target}a"], by_id[f"grid_edges-sys{target}b"]
        assert a.turns[0].starts[1] == target == b.turns[0].starts[1]  # the system cut
        assert a.turns[0].prompt.digest(target) == b.turns[0].prompt.digest(target)
        assert a.turns[0].prompt.digest(target + 4) != b.turns[0].prompt.digest(target + 4)
        first, second = by_id[f"grid_edges-reply{target}"].turns
        assert len(first.continuation) == target and target in second.starts
    assert len(w.conversations) == 18
    with pytest.raises(ValueError, match="grid_rows"):
        grid_edges(random.Random(1), grid_rows=512)


def test_primers_are_followed_by_the_same_prompt():
    w = generate("primers", 2, conversations=10, follow_up=0.5)
    for c in w.conversations:
        primer, real = c.turns[:2]
        assert primer.output_rows == 0 and primer.continuation is None
        assert real.prompt == primer.prompt and real.output_rows > 0 and real.think_s > 0
    assert {len(c.turns) for c in w.conversations} == {2, 3}


def test_reasoning_is_generated_but_not_rendered():
    w = generate("reasoning", 4, conversations=5)
    for c in w.conversations:
        for t in c.turns:
            reply_rows = len(t.continuation) - len(t.prompt) - 2
            assert t.output_rows > reply_rows >= 1


def test_agent_loops_grow_with_tool_results():
    w = generate("agent", 5, conversations=3, min_steps=5, max_steps=8)
    for c in w.conversations:
        lengths = [len(t.prompt) for t in c.turns]
        assert lengths == sorted(lengths) and len(c.turns) >= 3
        tool_turns = [t for t in c.turns[1:] if t.prompt.runs[-4].content_id == Role.TOOL.header_id]
        assert len(tool_turns) == len(c.turns) - 1 and all(0 < t.think_s < 60 for t in tool_turns)


def test_concurrent_arrivals_are_poisson_like():
    w = generate("concurrent", 11, users=400, duration_s=400.0)
    starts = [c.start_s for c in w.conversations]
    assert starts == sorted(starts) and 300 < starts[-1] < 500  # 400 arrivals at 1/s
    system = {c.turns[0].prompt.digest(c.turns[0].starts[1]) for c in w.conversations}
    assert len(system) == 1  # one shared system prompt


def test_mixed_default_size():
    # Generation speed is measured in bench/sim_speed.py ("load s"), not in a timed test.
    w = generate("mixed", 0)
    assert 140 <= len(w.conversations) <= 160
    kinds = {c.id.split("-")[0] for c in w.conversations}
    assert kinds == {"chat", "reasoning", "agent", "concurrent", "primers", "grid_edges"}
    starts = [c.start_s for c in w.conversations]
    assert starts == sorted(starts)


def test_day_has_a_diurnal_rate():
    w = generate("day", 5, conversations=400)
    middle = sum(0.25 <= c.start_s / 86400 < 0.75 for c in w.conversations) / 400
    assert middle > 0.6  # 0.69 expected for rate 1 - 0.6 cos(2 pi t / day)
    assert len(w.conversations) == 400


@pytest.mark.parametrize("name, knobs, match", [
    ("nope", {}, "unknown; known: chat"), ("chat", {"users": 3}, "users: unknown knob"),
    ("chat", {"min_turns": 5, "max_turns": 2}, "min_turns"),
], ids=["name", "knob", "range"])
def test_generate_errors(name, knobs, match):
    with pytest.raises(ValueError, match=match):
        generate(name, 0, **knobs)
