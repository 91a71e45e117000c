"""`python -m sim fuzz`: random workloads and policies (Hypothesis) under every invariant.

A failing case is shrunk by Hypothesis and written as a workload JSONL, a policy TOML and
the command that replays it with `python -m sim run`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import HealthCheck, Phase, given, seed as hyp_seed, settings

from policy.config import GIB, PolicyConfig, format_policy
from policy.usable import BackendFacts
from sim.api import simulate
from sim.cost import Profile, load_profile
from sim.workload import Message, Role, Workload, render_conversation, write_workload

SHARED_SYSTEM_ID = 11
BATCH = 50


def policies(profile: Profile) -> st.SearchStrategy[PolicyConfig]:
    """Random PolicyConfigs, dense in the edges: tiny grids and chunks, budgets of a few states."""
    state = profile.shape.fixed_bytes + 4096 * profile.shape.row_bytes
    return st.builds(
        PolicyConfig,
        grid_rows=st.sampled_from([64, 128, 1000, 4096]),
        request_starts=st.booleans(),
        max_chunk_rows=st.sampled_from([32, 100, 512, 4096]),
        tail_rows=st.sampled_from([8, 128]),
        warm_enabled=st.booleans(),
        warm_quiet_ms=st.sampled_from([0.0, 150.0, 2000.0]),
        prompt_cache_bytes=st.sampled_from([0, state, 3 * state, 64 * GIB]),
        lanes=st.integers(1, 6),
        queue_rows=st.sampled_from([1, 4, 1024]),
        idle_half_life_s=st.sampled_from([1.0, 600.0]),
    )


def backend_facts() -> st.SearchStrategy[BackendFacts]:
    """None (no proven grid) or a small invariant grid."""
    return st.builds(BackendFacts, st.sampled_from([None, 16, 64]))


@st.composite
def conversation_messages(draw: st.DrawFn) -> list[Message]:
    """One conversation: optional shared system prompt, 1-5 requests of user/tool messages,
    replies with optional reasoning, primers, think times."""
    out: list[Message] = []
    if draw(st.booleans()):
        shared = draw(st.booleans())
        out.append(Message(role=Role.SYSTEM, rows=draw(st.integers(1, 5000)),
                           content_id=SHARED_SYSTEM_ID if shared else None))
    for k in range(draw(st.integers(1, 5))):
        role = draw(st.sampled_from([Role.USER, Role.USER, Role.TOOL]))
        think = draw(st.sampled_from([None, 0.0, 0.1, 3.0])) if k else None
        out.append(Message(role=role, rows=draw(st.integers(1, 4200)), think_s=think))
        if draw(st.integers(0, 9)) == 0:
            out.append(Message(role=Role.ASSISTANT, max_tokens=0))
        out.append(Message(role=Role.ASSISTANT, rows=draw(st.integers(1, 60)),
                           reasoning_rows=draw(st.sampled_from([0, 0, 40]))))
    return out


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    """A few conversations with random start times."""
    convs = []
    for i in range(draw(st.integers(1, 5))):
        start = draw(st.sampled_from([0.0, 0.05, 1.0, 10.0]))
        convs.append(render_conversation(f"f{i}", start, draw(conversation_messages())))
    return Workload("fuzz", tuple(convs))


def fuzz(examples: int, minutes: float | None, seed: int, out_dir: Path, profile_name: str) -> int:
    """Run the fuzzer; 0 when nothing broke, 1 with the failing case written under out_dir."""
    profile = load_profile(profile_name)
    deadline = None if minutes is None else time.monotonic() + 60 * minutes
    failing: dict[str, object] = {}

    def batch_test(batch_seed: int, size: int):
        @hyp_seed(batch_seed)
        @settings(max_examples=size, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])
        @given(cfg=policies(profile), facts=backend_facts(), workload=workloads())
        def one(cfg: PolicyConfig, facts: BackendFacts, workload: Workload) -> None:
            try:
                simulate(workload, cfg, profile, facts)
            except Exception:
                failing.update(cfg=cfg, facts=facts, workload=workload)
                raise
        return one

    done = batch = 0
    t0 = time.monotonic()
    while (deadline is None and done < examples) or (deadline is not None and time.monotonic() < deadline):
        size = BATCH if deadline is not None else min(BATCH, examples - done)
        try:
            batch_test(seed * 100_003 + batch, size)()
        except Exception as err:
            _write_failure(out_dir, failing, profile, err)
            return 1
        done += size
        batch += 1
    print(f"fuzz: {done} examples in {batch} batches (seed {seed}), profile {profile.name}, "
          f"{time.monotonic() - t0:.1f} s: every invariant held")
    return 0


def _write_failure(out_dir: Path, failing: dict[str, object], profile: Profile, err: Exception) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg, facts, workload = failing["cfg"], failing["facts"], failing["workload"]
    wl, pol = out_dir / "failing.jsonl", out_dir / "failing.toml"
    write_workload(workload, wl)
    pol.write_text(format_policy(cfg))
    g = facts.invariant_rows
    cmd = (f"python -m sim run --workload {wl} --policy {pol} --profile {profile.name} "
           f"--invariant-rows {'none' if g is None else g}")
    (out_dir / "replay.json").write_text(json.dumps({"command": cmd, "error": str(err)}, indent=2) + "\n")
    print(f"fuzz: FAILED\n{err}\n\nsmallest failing case: {wl}, {pol}\nreplay: {cmd}")
