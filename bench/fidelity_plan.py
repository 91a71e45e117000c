"""The fidelity run's workload plan and the client that runs it against a server.

`make_plan(PLANS[name])` draws a seeded plan (see PlanConfig); `run_plan` drives a running
`python -m executor.serve` through it and records every request; `Server` starts and stops
one with its trace. bench/fidelity.py turns the record into the simulator's workload.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import attrs

from executor.server_process import start_server, stop_server

_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community "
    "name president team minute idea kid body information back parent face others level office door "
    "health person art war history party result change morning reason research girl guy moment air "
    "teacher force education good new first last long great little own other old right big high different "
    "small large next early young important few public bad same able make know think take see come want "
    "look use find give tell ask seem feel try leave call keep let begin show hear play run move like "
    "live believe hold bring happen write provide sit stand lose pay meet include continue set learn lead "
    "understand watch follow stop create speak read allow add spend grow open walk win offer remember "
    "love consider appear buy wait serve die send expect build stay fall cut reach kill remain suggest "
    "raise pass sell require report"
)
WORDS = tuple(_WORD_TEXT.split())
"""The vocabulary of the plan's text (common English words, mostly one token each)."""


@attrs.frozen(kw_only=True)
class PlanConfig:
    """The workload's shape. Word counts are words of plain English-like text (~1.3 tokens a
    word); reply lengths are tokens; times are seconds.

    bursts x users_per_burst users arrive (uniformly) within burst_window_s, bursts
    burst_gap_s apart; follow_up: the fraction who send a second message as soon as the
    reply comes (think 0: no warm pass can run). streams closed-loop clients each run
    chats_per_stream chats back to back (chat_gap_s between chats); a chat has min_turns to
    max_turns turns, think_s uniform in think_range_s; doc_fraction of chats open with a
    document of doc_words words. Everyone shares one system prompt of system_words words.
    """

    system_words: int = 500
    bursts: int = 7
    users_per_burst: int = 20
    burst_window_s: float = 1.0
    burst_gap_s: float = 4.0
    follow_up: float = 0.25
    streams: int = 2
    chats_per_stream: int = 5
    min_turns: int = 3
    max_turns: int = 7
    think_range_s: tuple[float, float] = (2.5, 4.0)
    chat_gap_s: float = 1.0
    user_words: tuple[int, int] = (15, 150)
    doc_fraction: float = 0.25
    doc_words: tuple[int, int] = (1500, 4000)
    reply_tokens: tuple[int, int] = (8, 24)
    seed: int = 0


PLANS = {
    "gpu": PlanConfig(),
    "tiny": PlanConfig(system_words=60, bursts=1, users_per_burst=5, burst_window_s=0.2, follow_up=0.4, streams=2,
                       chats_per_stream=2, min_turns=2, max_turns=3, think_range_s=(1.0, 1.5), chat_gap_s=0.3,
                       user_words=(5, 40), doc_fraction=0.5, doc_words=(150, 300), reply_tokens=(4, 12)),
}
"""gpu: 214 requests; about 2.5 minutes on the 2B shape with eager decode (~70 ms a round), under
two with CUDA-graph decode. Two chat streams keep the server idle often enough that every warm
pass finds its quiet window well inside the think time: simulated at 0.85x, 1x and 1.15x those
costs (and at graph speed), every request's cached_tokens came out the same; with more streams
or shorter think times some did not. tiny: 19 requests on the reference backend, ~15 s."""


@attrs.frozen(kw_only=True)
class PlannedTurn:
    """user: the message text; max_tokens: reply tokens; think_s: seconds after the previous
    reply (first turn: after the conversation is released)."""

    user: str
    max_tokens: int
    think_s: float


@attrs.frozen(kw_only=True)
class PlannedChat:
    """A conversation: phase "primer", "burst" (released at offset_s after the burst phase
    starts) or "chat" (run by client `stream`, in order)."""

    id: str
    phase: str
    offset_s: float
    stream: int
    turns: tuple[PlannedTurn, ...]


@attrs.frozen(kw_only=True)
class Plan:
    """The workload as the client runs it: the shared system prompt and the conversations,
    primer first, then the burst users, then the chats."""

    system: str
    chats: tuple[PlannedChat, ...]

    @property
    def requests(self) -> int:
        """Requests the plan sends (one per turn)."""
        return sum(len(c.turns) for c in self.chats)


def _lognormal(rng: random.Random, lo_hi: tuple[int, int]) -> int:
    """An integer in [lo, hi], lognormal around their geometric mean (sigma 0.6)."""
    lo, hi = lo_hi
    return round(min(hi, max(lo, rng.lognormvariate((math.log(lo) + math.log(hi)) / 2, 0.6))))


def make_plan(cfg: PlanConfig) -> Plan:
    """The seeded plan of `cfg` (see PlanConfig)."""
    rng = random.Random(cfg.seed)
    text = lambda n: " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."
    words = lambda lo_hi: _lognormal(rng, lo_hi)
    reply = lambda: rng.randint(*cfg.reply_tokens)
    system = "You are a careful assistant. " + text(cfg.system_words)
    chats = [PlannedChat(id="primer", phase="primer", offset_s=0.0, stream=0,
                         turns=(PlannedTurn(user=text(8), max_tokens=reply(), think_s=0.0),))]
    for b in range(cfg.bursts):
        for u in range(cfg.users_per_burst):
            turns = [PlannedTurn(user=text(words(cfg.user_words)), max_tokens=reply(), think_s=0.0)]
            if rng.random() < cfg.follow_up:
                turns.append(PlannedTurn(user=text(words(cfg.user_words)), max_tokens=reply(), think_s=0.0))
            chats.append(PlannedChat(id=f"user-{b}-{u:02d}", phase="burst", stream=0, turns=tuple(turns),
                                     offset_s=round(b * cfg.burst_gap_s + rng.uniform(0, cfg.burst_window_s), 3)))
    for s in range(cfg.streams):
        for j in range(cfg.chats_per_stream):
            turns = []
            for k in range(rng.randint(cfg.min_turns, cfg.max_turns)):
                body = text(words(cfg.user_words))
                if k == 0 and rng.random() < cfg.doc_fraction:
                    body = "Read this document. " + text(rng.randint(*cfg.doc_words)) + " " + body
                think = cfg.chat_gap_s if k == 0 else round(rng.uniform(*cfg.think_range_s), 3)
                turns.append(PlannedTurn(user=body, max_tokens=reply(), think_s=think))
            chats.append(PlannedChat(id=f"chat-{s}-{j}", phase="chat", offset_s=0.0, stream=s, turns=tuple(turns)))
    return Plan(system=system, chats=tuple(chats))


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The plan as JSON (plan.json); plan_from_json reads it back equal."""
    return attrs.asdict(plan)


def plan_from_json(obj: dict[str, Any]) -> Plan:
    """The plan of a plan.json object."""
    chats = tuple(PlannedChat(**{**c, "turns": tuple(PlannedTurn(**t) for t in c["turns"])}) for c in obj["chats"])
    return Plan(system=obj["system"], chats=chats)


# the client -------------------------------------------------------------------------------


def request_body(messages: list[dict[str, Any]], max_tokens: int, thinking: bool) -> dict[str, Any]:
    """The chat request of one turn: greedy, exactly max_tokens tokens (ignore_eos)."""
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "seed": 0,
            "chat_template_kwargs": {"enable_thinking": thinking}}


async def run_plan(url: str, plan: Plan, thinking: bool, log) -> list[dict[str, Any]]:
    """Drive the server through the plan; one record per request, in completion order."""
    records: list[dict[str, Any]] = []
    t0 = time.monotonic()
    clock = lambda: time.monotonic() - t0

    async def converse(session, chat: PlannedChat) -> bool:
        messages = [{"role": "system", "content": plan.system}]
        for k, turn in enumerate(chat.turns):
            if k or chat.phase == "chat":
                await asyncio.sleep(turn.think_s)
            messages.append({"role": "user", "content": turn.user})
            rec = {"conversation": chat.id, "turn": k, "sent_s": clock(), "think_s": turn.think_s}
            async with session.post(url + "/v1/chat/completions",
                                    json=request_body(messages, turn.max_tokens, thinking)) as resp:
                data = await resp.json(content_type=None)
                rec.update(status=resp.status, done_s=clock())
            records.append(rec)
            if resp.status != 200:
                rec["error"] = data.get("error", data)
                log(f"{chat.id}/{k}: HTTP {resp.status}: {rec['error']}")
                return False
            reply = data["choices"][0]["message"]
            rec.update(server_request="req-" + data["id"].rsplit("-", 1)[1], usage=data["usage"], reply=reply,
                       finish_reason=data["choices"][0]["finish_reason"])
            messages.append(reply)
        return True

    async def burst_user(session, chat: PlannedChat, start: float) -> bool:
        await asyncio.sleep(max(0.0, start + chat.offset_s - clock()))
        return await converse(session, chat)

    async def stream(session, chats: list[PlannedChat]) -> bool:
        for chat in chats:
            if not await converse(session, chat):
                return False
        return True

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        ok = [await converse(session, c) for c in plan.chats if c.phase == "primer"]
        log(f"primer done at {clock():.1f} s")
        start = clock()
        ok += await asyncio.gather(*(burst_user(session, c, start) for c in plan.chats if c.phase == "burst"))
        log(f"bursts done at {clock():.1f} s ({len(records)} requests)")
        streams = sorted({c.stream for c in plan.chats if c.phase == "chat"})
        ok += await asyncio.gather(*(stream(session, [c for c in plan.chats if c.phase == "chat" and c.stream == s])
                                     for s in streams))
        log(f"chats done at {clock():.1f} s ({len(records)} requests)")
    return records


class Server:
    """A `python -m executor.serve` process on a free port, its log in `out` (server.log)."""

    def __init__(self, out: Path, args: Sequence[str], timeout_s: float) -> None:
        self.log_path = out / "server.log"
        self.proc, self.url, self.command = start_server(args, self.log_path, timeout_s)

    def stop(self) -> int | None:
        """SIGTERM, then kill after 30 s; returns the exit code."""
        return stop_server(self.proc, 30.0)
