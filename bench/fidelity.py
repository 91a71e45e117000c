"""Run one workload through the real server and the simulator, and compare them per request.

Compared: cached_tokens, TTFT, end-to-end latency and the scheduling decisions
(bench/fidelity_report.py).

1. A seeded plan of chat conversations (bench/fidelity_plan.py `make_plan`): a primer that
   leaves the shared system prompt in the prompt cache, bursts of concurrent users (more
   than the lanes, so requests queue; some send a follow-up at once), then multi-turn chats
   (some opening with a long document) on two closed-loop client streams, with think
   times long enough for each reply's warm pass to run before the next turn.
2. The plan runs against `python -m executor.serve --trace` (greedy, `ignore_eos`, so each
   reply has exactly its planned tokens); each turn sends the history with the server's own
   reply message, as a chat client does. The record keeps every request's messages and usage.
3. The simulator workload is built from that record: each turn's prompt and continuation
   are the very token ids the server saw, rendered client-side by the same ChatRenderer
   (checked against the server's prompt_tokens), so the prompt cache sees the same prefixes;
   output_rows are the server's completion tokens. A conversation's first turn arrives when
   it arrived at the server; each later turn arrives `think_s` after the simulated previous
   reply ends (closed loop), think_s being the gap the server saw (`--arrivals observed`:
   the planned think time plus client and HTTP overhead) or the planned think time
   (`planned`). The simulator runs under the server's resolved policy (its trace's meta).
4. Both traces are compared; exit 1 when any request's cached_tokens differ (or a request
   is missing or failed), 2 on a setup error.

Usage (GPU):  python -m bench.fidelity --profile qwen3.5-2b-h200 --out fid \\
                  --server-args "--random-weights qwen3.5-2b"
(CPU, tiny):  python -m bench.fidelity --plan tiny --backend reference --profile P.json --out fid
Re-run only the simulator against a recorded run: python -m bench.fidelity --replay --out fid --profile P
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from bench.fidelity_plan import (
    PLANS,
    Plan,
    Server,
    make_plan,
    plan_from_json,
    plan_to_json,
    request_body,
    run_plan,
)
from bench.fidelity_report import (
    Key,
    compare,
    read_trace,
    report_json,
    report_lines,
    keep_lines,
    step_split_lines,
    trace_facts,
)
from executor.api_schema import parse_chat
from executor.chat import ChatError, ChatRenderer, builtin_template, load_template
from executor.server_process import attach_server_args
from executor.tokenizer import default_tokenizer, load_tokenizer
from policy.config import format_policy, parse_policy, policy_from_dict
from policy.prefix import Prompt
from policy.usable import BackendFacts
from sim.api import facts_for, machine, simulate
from sim.cost import Profile, load_profile
from sim.workload import Conversation, Turn, Workload


def renderer_for(model: Path | None) -> ChatRenderer:
    """The server's chat renderer: the model's tokenizer and template, or (no model: the tiny
    model and --random-weights) the built-in tokenizer and template."""
    if model is None:
        return ChatRenderer(default_tokenizer(), builtin_template())
    return ChatRenderer(load_tokenizer(model) or default_tokenizer(), load_template(model))


@attrs.frozen(kw_only=True)
class Rendered:
    """A recorded request as token ids: its prompt and starts, its continuation (None when the
    reply cannot be rendered, as the server then runs no warm pass)."""

    key: Key
    prompt: tuple[int, ...]
    starts: tuple[int, ...]
    continuation: tuple[int, ...] | None
    continuation_starts: tuple[int, ...]
    output_rows: int


def render_records(plan: Plan, records: list[dict[str, Any]], renderer: ChatRenderer, thinking: bool) -> list[Rendered]:
    """Every successful request's token ids, rendered the way the server rendered them.

    Raises ValueError when a prompt's length differs from the server's prompt_tokens.
    """
    by_key = {(r["conversation"], r["turn"]): r for r in records if r.get("status") == 200}
    out = []
    for chat in plan.chats:
        messages: list[dict[str, Any]] = [{"role": "system", "content": plan.system}]
        for k, turn in enumerate(chat.turns):
            rec = by_key.get((chat.id, k))
            if rec is None:
                break
            messages.append({"role": "user", "content": turn.user})
            call = parse_chat(request_body(messages, turn.max_tokens, thinking))
            prompt = renderer.render(list(call.messages), add_generation_prompt=True, enable_thinking=thinking)
            if len(prompt.token_ids) != rec["usage"]["prompt_tokens"]:
                raise ValueError(f"{chat.id}/{k}: rendered {len(prompt.token_ids)} prompt tokens, the server "
                                 f"{rec['usage']['prompt_tokens']}: render with the server's tokenizer (--model)")
            try:
                cont = renderer.render_continuation(list(call.messages), rec["reply"])
                cont_ids, cont_starts = cont.token_ids, tuple(sorted(set(cont.starts)))
            except (ChatError, ValueError):
                cont_ids, cont_starts = None, ()
            out.append(Rendered(key=(chat.id, k), prompt=prompt.token_ids, starts=prompt.starts,
                                continuation=cont_ids or None, continuation_starts=cont_starts if cont_ids else (),
                                output_rows=rec["usage"]["completion_tokens"]))
            messages.append(rec["reply"])
    return out


def sim_workload(rendered: list[Rendered], records: list[dict[str, Any]], server_events: list[dict[str, Any]],
                 arrivals: str) -> Workload:
    """The simulator's workload of the recorded run (see the module docstring, step 3)."""
    rid = {r["server_request"]: (r["conversation"], r["turn"]) for r in records if "server_request" in r}
    arrived: dict[Key, float] = {}
    finished: dict[Key, float] = {}
    for e in server_events:
        key = rid.get(e.get("request") or "")
        if key is not None and e["kind"] == "request_arrived":
            arrived[key] = e["t"]
        elif key is not None and e["kind"] == "request_finished":
            finished[key] = e["t"]
    think = {(r["conversation"], r["turn"]): r["think_s"] for r in records}
    convs: dict[str, list[Turn]] = {}
    for r in rendered:
        conv, k = r.key
        prev = (conv, k - 1)
        for key, seen in ((r.key, arrived), (prev, finished)):
            if key not in seen and key[1] >= 0:
                what = "request_arrived" if seen is arrived else "request_finished"
                raise ValueError(f"{key[0]}/{key[1]}: no {what} event in the server trace")
        if k == 0:
            when = {"think_s": 0.0, "arrival_s": arrived[r.key]}
        elif arrivals == "observed":
            when = {"think_s": max(0.0, arrived[r.key] - finished[prev])}
        else:
            when = {"think_s": think[r.key]}
        cont = None if r.continuation is None else Prompt.from_tokens(r.continuation)
        convs.setdefault(conv, []).append(Turn(Prompt.from_tokens(r.prompt), r.starts, r.output_rows, cont,
                                               r.continuation_starts, **when))
    return Workload("fidelity", tuple(Conversation(c, 0.0, tuple(t)) for c, t in convs.items()))


def run_sim(workload: Workload, policy_dict: dict[str, Any], profile: Profile, facts: BackendFacts,
            trace_path: Path) -> list[dict[str, Any]]:
    """Simulate `workload` under the policy; writes and returns the trace events."""
    with trace_path.open("w", encoding="utf-8") as f:
        simulate(workload, policy_from_dict(policy_dict), profile, facts, trace=f)
    return read_trace(trace_path)


def grid_rows(choice: str, profile: Profile, meta: dict[str, Any]) -> int | None:
    """The invariant grid (rows; None: no grid) the simulator resumes on: choice "server" (the
    server's own, from its trace meta; the profile's when the meta predates that field),
    "profile", "none", or a row count. Raises ValueError on anything else."""
    if choice == "server":
        return meta.get("invariant_rows", profile.invariant_rows)
    try:
        return facts_for(profile, choice).invariant_rows
    except ValueError as exc:
        raise ValueError(f"--invariant-rows (server, profile, none or a row count): {exc}") from None


def compare_run(out: Path, profile: Profile, invariant_rows: str, arrivals: str, model: Path | None,
                log) -> tuple[int, dict[str, Any]]:
    """Build the sim workload from the record in `out`, simulate, compare, write the report.
    Returns (exit code, report JSON)."""
    plan = plan_from_json(json.loads((out / "plan.json").read_text()))
    run = json.loads((out / "run.json").read_text())
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line.strip()]
    meta = json.loads((out / "server_trace.jsonl.meta.json").read_text())
    server_events = read_trace(out / "server_trace.jsonl")
    rendered = render_records(plan, records, renderer_for(model), run["thinking"])
    facts, notes = BackendFacts(grid_rows(invariant_rows, profile, meta)), []
    if invariant_rows == "server" and "invariant_rows" not in meta:
        notes.append(f"note: the server's trace meta has no invariant_rows (recorded before it did); the "
                     f"simulator uses the profile's ({profile.invariant_rows})")
    elif meta.get("invariant_rows", facts.invariant_rows) != facts.invariant_rows:
        notes.append(f"note: the simulator resumes on invariant_rows {facts.invariant_rows}, the server on "
                     f"{meta['invariant_rows']}: cached_tokens will differ where they disagree")
    elif profile.invariant_rows != facts.invariant_rows:
        notes.append(f"note: the profile was measured with invariant_rows {profile.invariant_rows}; the server "
                     f"and the simulator use {facts.invariant_rows}")
    workload = sim_workload(rendered, records, server_events, arrivals)
    policy = dict(meta["policy"])
    if "short_first" not in policy:  # a server from before the field ran first come, first served
        policy["short_first"] = False
        notes.append("note: the server's policy has no short_first (recorded before it existed); the simulator "
                     "runs it off, as that server did")
    sim_events = run_sim(workload, policy, profile, facts, out / "sim_trace.jsonl")
    rid = {r["server_request"]: (r["conversation"], r["turn"]) for r in records if "server_request" in r}
    sim_key = lambda request: (request.rsplit("/", 1)[0], int(request.rsplit("/", 1)[1]))
    comparison = compare(trace_facts(server_events, rid.get), trace_facts(sim_events, sim_key))
    gaps = [(arr - fin - think) for arr, fin, think in _gaps(records, server_events)]
    lines = report_lines(comparison)
    lines[:0] = [f"server {meta['backend']} {meta['model']} commit {meta['commit']}; profile {profile.name} "
                 f"({profile.source}, {profile.gpu}); invariant_rows {facts.invariant_rows}; arrivals {arrivals}",
                 *machine_lines(run.get("machine"), dict(profile.provenance).get("machine")), *notes]
    if gaps:
        gaps.sort()
        lines.append(f"client + HTTP overhead per closed-loop turn (server gap - planned think): median "
                     f"{gaps[len(gaps) // 2] * 1e3:.1f} ms, max {gaps[-1] * 1e3:.1f} ms")
    steps_path = out / "server_trace.jsonl.steps.jsonl"
    if steps_path.is_file():
        steps = read_trace(steps_path)
        lines += step_split_lines(steps, profile) + keep_lines(steps, profile)
    failed = [r for r in records if r.get("status") != 200]
    missing = [r for r in comparison.rows if r.server is None or r.sim is None]
    code = 0 if comparison.all_cached_equal and not failed and not missing else 1
    lines.append(f"failed requests {len(failed)}, requests missing on one side {len(missing)}; "
                 f"{'OK' if code == 0 else 'FAIL'}: cached_tokens {'identical' if comparison.all_cached_equal else 'differ'}")
    (out / "report.txt").write_text("\n".join(lines) + "\n")
    report = report_json(comparison) | {"profile": profile.name, "arrivals": arrivals, "exit": code}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    for line in lines:
        log(line)
    return code, report


def machine_lines(server: str | None, profile: str | None) -> list[str]:
    """Where the server ran and where the profile was measured (`sim.api.machine`), and a note
    when they differ: two calls' H200 machines ran the same 2B server ~15% apart, and a profile
    from the other call put the simulator's TTFT 15.6-15.8% off where one from the same call
    gave 9.3-10.0% (bench/RESULTS.md, session 13)."""
    lines = [f"server machine: {server or 'not recorded'}; profile machine: {profile or 'not recorded'}"]
    if server and profile and server != profile:
        lines.append("note: the profile was measured on another machine; the machine alone moved TTFT ~15% "
                     "between two H200 machines (bench/RESULTS.md, session 13)")
    return lines


def _gaps(records: list[dict[str, Any]], events: list[dict[str, Any]]):
    """(arrival of turn k, finish of turn k - 1, planned think of turn k) on the server clock."""
    rid = {r["server_request"]: (r["conversation"], r["turn"]) for r in records if "server_request" in r}
    t = {(rid[e["request"]], e["kind"]): e["t"] for e in events
         if e.get("request") in rid and e["kind"] in ("request_arrived", "request_finished")}
    for r in records:
        key, prev = (r["conversation"], r["turn"]), (r["conversation"], r["turn"] - 1)
        if r["turn"] and (key, "request_arrived") in t and (prev, "request_finished") in t:
            yield t[(key, "request_arrived")], t[(prev, "request_finished")], r["think_s"]


def run_server(out: Path, plan: Plan, server_args: list[str], thinking: bool, timeout_s: float, log,
               drain_s: float = 2.0) -> None:
    """Start the server, run the plan, wait drain_s for the last warm passes, stop it; writes
    plan.json, run.json, records.jsonl and server_trace.jsonl (+ .meta.json, .steps.jsonl) into `out`."""
    (out / "plan.json").write_text(json.dumps(plan_to_json(plan)) + "\n")
    t0 = time.monotonic()
    server = Server(out, [*server_args, "--trace", str(out / "server_trace.jsonl")], timeout_s)
    log(f"server ready at {server.url} after {time.monotonic() - t0:.1f} s: {shlex.join(server.command[1:])}")
    try:
        records = asyncio.run(asyncio.wait_for(run_plan(server.url, plan, thinking, log), timeout_s))
        time.sleep(drain_s)
    finally:
        code = server.stop()
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "run.json").write_text(json.dumps({"server_command": server.command, "server_exit": code,
                                              "thinking": thinking, "wall_s": time.monotonic() - t0,
                                              "machine": machine()}) + "\n")
    log(f"{len(records)} requests in {time.monotonic() - t0:.1f} s; server exit {code}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="simulator profile: a shipped name or a JSON file")
    ap.add_argument("--out", type=Path, default=Path("fidelity"), help="folder for every output (default: fidelity)")
    ap.add_argument("--plan", choices=sorted(PLANS), default="gpu", help="workload plan (default: gpu)")
    ap.add_argument("--seed", type=int, help="plan seed (default: the plan's)")
    ap.add_argument("--backend", choices=("auto", "cuda", "reference"), default="auto", help="server backend")
    ap.add_argument("--model", type=Path, help="server checkpoint (also the client's tokenizer and template)")
    ap.add_argument("--policy", type=Path, help="PolicyConfig TOML for the server (default: the defaults)")
    ap.add_argument("--server-args", default="", help="more server flags, e.g. \"--random-weights qwen3.5-2b\"")
    ap.add_argument("--thinking", action="store_true", help="enable_thinking on every request (default: off)")
    ap.add_argument("--arrivals", choices=("observed", "planned"), default="observed",
                    help="think time of later turns in the simulator (default: observed)")
    ap.add_argument("--invariant-rows", default="server",
                    help="the simulator's invariant grid: server (the server's own, from its trace meta), profile, "
                         "none, or N rows (default: server)")
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="server start and run limit (default: 1200)")
    ap.add_argument("--replay", action="store_true", help="skip the server: compare the run recorded in --out")
    args = ap.parse_args(attach_server_args(argv))
    log = lambda s: print(s, flush=True)
    try:
        profile = load_profile(args.profile)
        if args.invariant_rows != "server":
            grid_rows(args.invariant_rows, profile, {})  # refused now, not after the server's run
        if not args.timeout_s > 0:
            raise ValueError(f"--timeout-s must be > 0, got {args.timeout_s:g}")
        if not args.replay:
            args.out.mkdir(parents=True, exist_ok=True)
            policy = parse_policy(args.policy.read_text()) if args.policy else policy_from_dict({})
            (args.out / "policy.toml").write_text(format_policy(policy))
            plan_cfg = PLANS[args.plan] if args.seed is None else attrs.evolve(PLANS[args.plan], seed=args.seed)
            plan = make_plan(plan_cfg)
            log(f"plan {args.plan}: {plan.requests} requests in {len(plan.chats)} conversations")
            server_args = ["--backend", args.backend, "--policy", str(args.out / "policy.toml")]
            server_args += ["--model", str(args.model)] if args.model else []
            run_server(args.out, plan, server_args + shlex.split(args.server_args), args.thinking, args.timeout_s, log)
        code, _ = compare_run(args.out, profile, args.invariant_rows, args.arrivals, args.model, log)
    except (ValueError, OSError, RuntimeError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
