"""The warm-turns receipt: multi-turn chats around the prompt cache's grid through real
servers, checked against a server without a prompt cache (issue #7 item 1).

Cases (one conversation each, `--turns` turns, thinking off, greedy, `ignore_eos` so
every reply has exactly `--max-tokens` tokens):
- on-grid: the first prompt just under `--grid-rows` (4096), built so that the next turn's
  shared prefix (history + the reply rendered as the next request renders it) ends exactly
  on the mark: the first pass crosses no mark, only the warm pass can keep that row. The
  reply is the model's, so the first user message is padded until that prefix lands on
  the mark; each attempt is a fresh conversation and the one that lands is turn 1.
- off-grid: a `--off-grid-rows` (2,000) row first prompt; the warm pass must keep the
  next turn's message start (request starts on, the server default), or with the server's
  starts snapped to its invariant grid (policy snap_starts, the `start_grid` of its ready
  log line) the grid row at or below it; a warm pass cancelled because the cold pass already
  kept that row counts as started when the next turn resumes there.

Named assertions: client_render_matches_server, first_turn_cold, first_prompt_under_grid
and continuation_on_grid (on-grid), warm_pass_started and warm_pass_finished (/metrics),
continuation_cached (cached_tokens >= the previous turn's continuation rows, and >= the
grid row on-grid), reference_never_cached, hashes_equal_cache_off, and with
--max-ttft-ratio, continuation_ttft_ratio (median turn-2 TTFT cache-on / cache-off).
token_sha256: the reply's token ids as ASCII decimals joined by ","; output_sha256: the
UTF-8 JSON `[reasoning, content]` as streamed; prompt_sha256: the client-rendered prompt
ids. TTFT: request sent to the first SSE chunk carrying a token id, on one HTTP/1.1
connection a server kept alive between requests (as pooled clients do). publish_s: the request's
arrival at the engine to its first token leaving the engine's worker (trace and steps file;
TTFT less publish is the client, HTTP, API process and pipe time). prefill_s: first
chunk_started to last chunk_done of the request in the trace (servers started here only).
phases_ms: host ms the server's steps spent in each phase while the turn ran (/metrics'
warmstate_step_phase_seconds_total: restore, forward, keep, decode, sample, release),
printed as a second table: where a turn's prefill time goes.

    python bench/warm_turns.py --server-args "--random-weights qwen3.5-27b --backend cuda" \\
        --repeat 2 --json out.json     # cache-on (A) and cache-off (B) servers, A B B A
    python bench/warm_turns.py --url http://127.0.0.1:8000 [--url-off http://127.0.0.1:8001]

Exit status: 0 when every assertion holds, 1 when one fails, 2 when a server or request
fails.

One file, over 400 lines on purpose: the receipt's logic reads top to bottom (servers,
client, conversations, checks, table).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import http.client
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from executor.chat import ChatRenderer, builtin_template, load_template
from executor.metrics import STEP_PHASES
from executor.server_process import attach_server_args, ready_fields, served_model, start_server, stop_server
from executor.tokenizer import default_tokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FILLER = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "was", "on", "with", "as", "at", "by")
"""Words that are one token each after a space in the Qwen3.5 vocabulary: padding grows a
prompt by exactly one row per word (checked at start)."""
CASES = ("on-grid", "off-grid")
WARM_EVENTS = ("scheduled", "started", "finished", "cancelled", "adopted")


class BenchError(RuntimeError):
    """A server or request failed (exit 2), as opposed to a failed assertion (exit 1)."""


@attrs.frozen(kw_only=True)
class Settings:
    """What the conversations look like (defaults live here).

    grid_rows: the servers' grid_rows (their --policy); the on-grid case lands on this
    row. off_grid_rows: rows of the off-grid first prompt. turns: per case (>= 2).
    max_tokens: tokens per reply. warm_timeout_s: longest wait for a warm pass to settle.
    calibration_attempts: on-grid conversations tried before giving up on landing.
    warmup_rows: first-prompt rows of a discarded 2-turn conversation each server runs
    first, so no measured turn pays for a first use (kernel compiles); 0: none.
    """

    grid_rows: int = 4096
    off_grid_rows: int = 2000
    turns: int = 2
    max_tokens: int = 16
    warm_timeout_s: float = 120.0
    calibration_attempts: int = 16
    warmup_rows: int = 512
    cases: tuple[str, ...] = CASES

    def __attrs_post_init__(self) -> None:
        least = {"grid_rows": 1, "off_grid_rows": 1, "turns": 2, "max_tokens": 1, "calibration_attempts": 1,
                 "warmup_rows": 0}
        for name, low in least.items():
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if unknown := set(self.cases) - set(CASES):
            raise ValueError(f"cases: unknown {sorted(unknown)}; known: {', '.join(CASES)}")


# --- servers ------------------------------------------------------------------------------------
class Server:
    """A server to drive: one started here (`start`, with a trace), or a running one's URL."""

    def __init__(self, url: str, cache_on: bool, proc: subprocess.Popen | None = None, trace: Path | None = None,
                 command: list[str] | None = None, start_grid: int = 1) -> None:
        self.url, self.cache_on, self.proc, self.trace, self.command = url, cache_on, proc, trace, command
        self.start_grid = start_grid
        self._conn: http.client.HTTPConnection | None = None
        self.model = served_model(url)

    @classmethod
    def start(cls, server_args: list[str], cache_on: bool, workdir: Path, name: str, timeout_s: float) -> Server:
        """`python -m executor.serve SERVER_ARGS --port 0 --trace DIR/NAME.trace.jsonl`
        (cache-off: plus `--prompt-cache-gib 0`), stderr to DIR/NAME.log; returns once it
        prints `ready URL`. Raises BenchError with the log's tail when it does not."""
        trace, log = workdir / f"{name}.trace.jsonl", workdir / f"{name}.log"
        args = [*server_args, "--trace", str(trace), *([] if cache_on else ["--prompt-cache-gib", "0"])]
        try:
            proc, url, command = start_server(args, log, timeout_s)
        except RuntimeError as exc:
            raise BenchError(f"server {name}: {exc}") from None
        try:
            return cls(url, cache_on, proc, trace, command, ready_start_grid(log))
        except OSError:
            stop_server(proc)
            raise

    def stop(self) -> None:
        self.drop_connection()
        if self.proc is not None:
            stop_server(self.proc)

    def connection(self) -> http.client.HTTPConnection:
        """The chat requests' HTTP/1.1 connection, kept alive between requests as the clients
        people use do (the openai SDK's httpx pool, vLLM's benchmark_serving's aiohttp
        session): a turn's TTFT then holds no TCP connect or new-connection setup in the
        server, except the first request's (it opens it)."""
        if self._conn is None:
            url = urllib.parse.urlsplit(self.url)
            self._conn = http.client.HTTPConnection(url.hostname, url.port, timeout=3600)
        return self._conn

    def drop_connection(self) -> None:
        """Close the chat connection (after a failed request: the next one opens a new one)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _samples(self) -> dict[str, str]:
        """/metrics as {sample name with labels: value text}."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            lines = resp.read().decode().splitlines()
        return dict(line.rpartition(" ")[::2] for line in lines if line and not line.startswith("#"))

    def phase_seconds(self) -> dict[str, float]:
        """Host seconds the server's steps spent in each phase so far (/metrics'
        warmstate_step_phase_seconds_total: restore, forward, keep, decode, sample, release)."""
        samples = self._samples()
        return {p: float(samples.get(f'warmstate_step_phase_seconds_total{{phase="{p}"}}', 0)) for p in STEP_PHASES}

    def warm_counts(self) -> dict[str, float]:
        """Warm pass events so far (/metrics), and `rows`: rows warm passes pre-filled."""
        samples = self._samples()
        out = {e: float(samples.get(f'warmstate_warm_passes_total{{event="{e}"}}', 0)) for e in WARM_EVENTS}
        return out | {"rows": float(samples.get("warmstate_warm_rows_total", 0))}

    def wait_warm_settled(self, scheduled_before: float, timeout_s: float) -> bool:
        """Poll /metrics until a warm pass was scheduled after `scheduled_before` and every
        scheduled pass finished, was cancelled or adopted; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            w = self.warm_counts()
            if w["scheduled"] > scheduled_before and w["finished"] + w["cancelled"] + w["adopted"] >= w["scheduled"]:
                return True
            time.sleep(0.01)
        return False


def ready_start_grid(log: Path) -> int:
    """The `start_grid` of a started server's `ready` log line: the row grid its request
    starts cut and keep on (its backend's invariant grid with snap_starts on, else 1)."""
    try:
        return int(ready_fields(log).get("start_grid") or 1)
    except (ValueError, TypeError):
        return 1


# --- one turn -------------------------------------------------------------------------------------
def ids_sha256(ids: list[int] | tuple[int, ...]) -> str:
    """sha256 of token ids as ASCII decimals joined by "," (e.g. `printf 1,2,3 | sha256sum`)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def output_sha256(reasoning: str, content: str) -> str:
    """sha256 of the UTF-8 JSON `[reasoning, content]` (json.dumps, ensure_ascii=False)."""
    return hashlib.sha256(json.dumps([reasoning, content], ensure_ascii=False).encode()).hexdigest()


def chat_stream(server: Server, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat request: its request id, TTFT and end-to-end seconds, token
    ids, reasoning and content, prompt_tokens and cached_tokens. BenchError on an error."""
    body = {"model": server.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 1234,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True,
            "chat_template_kwargs": {"enable_thinking": False}}
    conn = server.connection()
    ids: list[int] = []
    parts: dict[str, list[str]] = {"reasoning_content": [], "content": []}
    ttft = usage = rid = None
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise BenchError(f"{server.url}: HTTP {resp.status}: {resp.read()[:500]!r}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise BenchError(f"{server.url}: {chunk['error']}")
            rid = rid or chunk["id"].split("-", 2)[-1]  # chatcmpl-PREFIX-req-N: the trace's request id
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", ()):
                if choice.get("token_ids") and ttft is None:
                    ttft = time.perf_counter() - t0
                ids.extend(choice.get("token_ids") or ())
                for key, part in parts.items():
                    part.append(choice["delta"].get(key) or "")
    except BaseException:
        server.drop_connection()
        raise
    if usage is None:
        raise BenchError(f"{server.url}: the stream ended without usage")
    return {"request": rid, "ttft_s": ttft, "total_s": time.perf_counter() - t0, "token_ids": ids,
            "reasoning": "".join(parts["reasoning_content"]), "content": "".join(parts["content"]),
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def reply_message(turn: dict) -> dict:
    """The assistant message a client sends back (the server renders the continuation from it)."""
    msg = {"role": "assistant", "content": turn["content"]}
    return msg | ({"reasoning_content": turn["reasoning"]} if turn["reasoning"] else {})


def run_turn(server: Server, renderer: ChatRenderer, history: list[dict], s: Settings) -> dict[str, Any]:
    """Send `history`, wait for the warm pass its reply scheduled (cache-on), measure the turn.
    continuation_rows: the next request's shared prefix, rendered here as the server does."""
    rendered = renderer.render(history, enable_thinking=False)
    before = server.warm_counts() if server.cache_on else None
    phases = server.phase_seconds()
    turn = chat_stream(server, history, s.max_tokens)
    done = server.phase_seconds()  # before the reply's warm pass (it waits for a quiet spell)
    turn["phases_ms"] = {p: round(1e3 * (done[p] - phases[p]), 3) for p in STEP_PHASES}
    cont = renderer.render_continuation(history, reply_message(turn))
    turn |= {"rendered_rows": len(rendered.token_ids), "continuation_rows": len(cont.token_ids),
             "prompt_sha256": ids_sha256(rendered.token_ids), "token_sha256": ids_sha256(turn["token_ids"]),
             "output_sha256": output_sha256(turn["reasoning"], turn["content"])}
    if before is not None:
        turn["warm_settled"] = server.wait_warm_settled(before["scheduled"], s.warm_timeout_s)
        after = server.warm_counts()
        turn["warm"] = {k: after[k] - before[k] for k in after}
    return turn


# --- conversations --------------------------------------------------------------------------------
def first_messages(case: str, salt: str, pad_words: int) -> list[dict]:
    """Turn 1: a system message opening with the salt (no two conversations share a kept
    state) and a user message padded with `pad_words` one-token words."""
    filler = "".join(" " + FILLER[i % len(FILLER)] for i in range(pad_words))
    return [{"role": "system", "content": f"Session {salt} ({case}). You are a terse assistant."},
            {"role": "user", "content": "Read this and reply:" + filler}]


def padded_first_turn(renderer: ChatRenderer, case: str, salt: str, rows: int) -> list[dict]:
    """Turn 1 whose rendered prompt has exactly `rows` rows; BenchError when it cannot."""
    def rows_of(pad: int) -> int:
        return len(renderer.render(first_messages(case, salt, pad), enable_thinking=False).token_ids)

    base = rows_of(0)
    if rows < base or rows_of(rows - base) != rows:
        raise BenchError(f"cannot pad a first prompt to {rows} rows (it has {base} unpadded)")
    return first_messages(case, salt, rows - base)


def land_on_grid(server: Server, renderer: ChatRenderer, salt: str, s: Settings) -> tuple[list[dict], dict, int]:
    """Turn 1 of the on-grid case, run on `server`: (messages, its turn, attempts). Each
    attempt pads a fresh conversation to grid_rows minus the most often seen continuation
    growth (continuation rows - prompt rows; first guessed from max_tokens)."""
    probe = first_messages("on-grid", salt, 0)
    frame = len(renderer.render_continuation(probe, {"role": "assistant", "content": "x"}).token_ids)
    rows = len(renderer.render(probe, enable_thinking=False).token_ids)
    growth = collections.Counter({frame - 1 + s.max_tokens - rows: 1})
    for attempt in range(s.calibration_attempts):
        guess = max(growth.most_common(1)[0][0], 1)
        messages = padded_first_turn(renderer, "on-grid", f"{salt}.{attempt}", s.grid_rows - guess)
        turn = run_turn(server, renderer, messages, s)
        if turn["continuation_rows"] == s.grid_rows:
            return messages, turn, attempt + 1
        growth[turn["continuation_rows"] - turn["rendered_rows"]] += 2
    raise BenchError(f"on-grid: no first turn landed on row {s.grid_rows} in {s.calibration_attempts} attempts "
                     f"(growths seen: {dict(growth)})")


def run_case(server: Server, renderer: ChatRenderer, case: str, salt: str, s: Settings,
             first: list[dict] | None) -> dict[str, Any]:
    """One conversation of `case`. first: turn 1's messages, or None to build them (on-grid:
    landed on this server, whose landing attempt is turn 1)."""
    attempts, turns = 0, []
    if first is None and case == "on-grid":
        first, turn, attempts = land_on_grid(server, renderer, salt, s)
        turns.append(turn)
    history = list(first or padded_first_turn(renderer, case, salt, s.off_grid_rows))
    if not turns:
        turns.append(run_turn(server, renderer, history, s))
    for k in range(1, s.turns):
        history += [reply_message(turns[-1]), {"role": "user", "content": f"Turn {k + 1}: go on, briefly."}]
        turns.append(run_turn(server, renderer, history, s))
    return {"case": case, "server": "A" if server.cache_on else "B", "url": server.url, "salt": salt,
            "start_grid": server.start_grid, "first": history[:2], "calibration_attempts": attempts, "turns": turns}


def add_trace_times(run: dict[str, Any], trace: Path | None) -> None:
    """prefill_s (first chunk_started to last chunk_done), the server's ttft_s (arrival to the
    commit of the first token's step) and publish_s per turn (`publish_seconds`)."""
    if trace is None or not trace.is_file():
        return
    started, last_started, done, first, arrived = {}, {}, {}, {}, {}
    for e in map(json.loads, trace.read_text().splitlines()):
        rid = e.get("request")
        if e["kind"] == "chunk_started" and rid:
            started.setdefault(rid, e["t"])
            last_started[rid] = e["t"]
        elif e["kind"] == "chunk_done" and rid:
            done[rid] = e["t"]
        elif e["kind"] == "first_token":
            first[rid] = e["ttft_s"]
        elif e["kind"] == "request_arrived":
            arrived[rid] = e["t"]
    steps_file = trace.with_name(trace.name + ".steps.jsonl")
    steps = [json.loads(line) for line in steps_file.read_text().splitlines()] if steps_file.is_file() else []
    for turn in run["turns"]:
        rid = turn["request"]
        turn["prefill_s"] = done[rid] - started[rid] if rid in started and rid in done else None
        turn["server_ttft_s"] = first.get(rid)
        turn["publish_s"] = publish_seconds(arrived.get(rid), last_started.get(rid), first.get(rid), steps)


def publish_seconds(arrived: float | None, last_chunk: float | None, ttft_s: float | None,
                    steps: list[dict]) -> float | None:
    """Seconds from a request's arrival at the engine to its first token leaving the engine's
    worker. Its first token comes from its last chunk (started at `last_chunk`, trace time),
    which runs in the first step recorded after it (steps run one at a time; a step's record,
    written at its commit, has t and ran_s: its hand-off to the worker was at t - ran_s). When
    that step published the token early (published_s), the publish is at t - ran_s +
    published_s; else the commit delivered it, at the first_token event's ttft_s. The client's
    TTFT less this is the time spent in HTTP, the API process and the pipes. None when the
    trace lacks the request's arrival, chunk or first token."""
    if arrived is None or last_chunk is None or ttft_s is None:
        return None
    after = [s for s in steps if s.get("kind") == "step" and s["t"] >= last_chunk]
    step = min(after, key=lambda s: s["t"]) if after else None
    if step is None or step.get("published_s") is None:
        return ttft_s
    return step["t"] - step["ran_s"] + step["published_s"] - arrived


# --- checks and the receipt -------------------------------------------------------------------------
def ttft_ratio(on: list[dict], off: list[dict], k: int = 1) -> float | None:
    """Median TTFT of turn k+1 on cache-on runs over that on cache-off runs."""
    a = [r["turns"][k]["ttft_s"] for r in on if r["turns"][k]["ttft_s"] is not None]
    b = [r["turns"][k]["ttft_s"] for r in off if r["turns"][k]["ttft_s"] is not None]
    return round(statistics.median(a) / statistics.median(b), 4) if a and b else None


def expected_row(run: dict[str, Any], k: int, s: Settings) -> int:
    """The least cached_tokens of turn k+1 (k >= 1) on a cache-on server: the previous
    turn's continuation rows (the message start its warm pass kept), or with the server's
    starts snapped to a grid g (`start_grid`, policy snap_starts) the multiple of g at or
    below them; on-grid turn 2 also the grid row."""
    g = int(run.get("start_grid") or 1)
    row = run["turns"][k - 1]["continuation_rows"] // g * g
    return max(row, s.grid_rows) if run["case"] == "on-grid" and k == 1 else row


def hashes_agree(turns: list[dict], salts: list[str]) -> bool:
    """One (token_sha256, output_sha256) per conversation (salt) among these turns."""
    seen: dict[str, set[tuple[str, str]]] = collections.defaultdict(set)
    for turn, salt in zip(turns, salts):
        seen[salt].add((turn["token_sha256"], turn["output_sha256"]))
    return all(len(v) == 1 for v in seen.values())


def check(runs: list[dict[str, Any]], s: Settings, max_ttft_ratio: float | None) -> list[dict[str, Any]]:
    """Every named assertion over all runs: [{name, case, ok, detail}]."""
    out: list[dict[str, Any]] = []

    def claim(name: str, case: str, ok: bool, detail: str) -> None:
        out.append({"name": name, "case": case, "ok": bool(ok), "detail": detail})

    for case in s.cases:
        mine = [r for r in runs if r["case"] == case]
        on, off = [r for r in mine if r["server"] == "A"], [r for r in mine if r["server"] == "B"]
        if not mine:
            continue
        bad = [(r["server"], k + 1) for r in mine for k, t in enumerate(r["turns"])
               if t["prompt_tokens"] != t["rendered_rows"]]
        claim("client_render_matches_server", case, not bad, f"usage.prompt_tokens == client-rendered rows; off: {bad}")
        cold = [r["turns"][0]["cached_tokens"] for r in mine]
        claim("first_turn_cold", case, not any(cold), f"turn 1 cached_tokens per run: {cold}")
        if case == "on-grid":
            first = sorted({r["turns"][0]["rendered_rows"] for r in mine})
            cont = sorted({r["turns"][0]["continuation_rows"] for r in mine})
            claim("first_prompt_under_grid", case, first[-1] < s.grid_rows, f"turn 1 prompt rows {first} < {s.grid_rows}")
            claim("continuation_on_grid", case, cont == [s.grid_rows],
                  f"turn 2 shared prefix (history + rendered reply) rows {cont} == {s.grid_rows}")
        # A warm pass is excused only when it was cancelled and the next turn still resumed at
        # its expected row: with starts snapped to a grid, the cold pass may already have kept
        # the grid row the warm pass would have kept (it then has nothing to add).
        warm = [(t["warm"]["started"], t["warm"]["finished"], t["warm_settled"],
                 t["warm"]["cancelled"] >= 1 and r["turns"][k + 1]["cached_tokens"] >= expected_row(r, k + 1, s))
                for r in on for k, t in enumerate(r["turns"][:-1])]
        claim("warm_pass_started", case, warm and all(w[0] >= 1 or w[3] for w in warm),
              f"/metrics warm passes started after each turn: {[w[0] for w in warm]}; cancelled with its row "
              f"already kept: {[w[3] for w in warm]}")
        claim("warm_pass_finished", case, warm and all((w[1] >= 1 or w[3]) and w[2] for w in warm),
              f"warm passes finished (and all settled) after each turn: {[w[1:3] for w in warm]}")
        short = [(k + 1, r["turns"][k]["cached_tokens"], expected_row(r, k, s)) for r in on
                 for k in range(1, len(r["turns"])) if r["turns"][k]["cached_tokens"] < expected_row(r, k, s)]
        claim("continuation_cached", case, on and not short,
              "cached_tokens >= the previous turn's continuation rows" + (", >= the grid row on turn 2"
              if case == "on-grid" else "") + f"; short (turn, cached, expected): {short}")
        if off:
            cached = [t["cached_tokens"] for r in off for t in r["turns"]]
            claim("reference_never_cached", case, not any(cached), f"cache-off cached_tokens: {cached}")
            differ = [k + 1 for k in range(s.turns) if not hashes_agree([r["turns"][k] for r in mine],
                                                                         [r["salt"] for r in mine])]
            unpaired = sorted({r["salt"] for r in mine} - {r["salt"] for r in on} & {r["salt"] for r in off})
            claim("hashes_equal_cache_off", case, not differ and not unpaired, f"token_sha256 and output_sha256 equal "
                  f"over {len(on)} cache-on and {len(off)} cache-off runs of each conversation; turns that differ: "
                  f"{differ}; conversations without both: {unpaired}")
        if max_ttft_ratio is not None and on and off:
            ratio = ttft_ratio(on, off)
            claim("continuation_ttft_ratio", case, ratio is not None and ratio <= max_ttft_ratio,
                  f"median turn-2 TTFT cache-on / cache-off = {ratio} <= {max_ttft_ratio}")
    return out


def _spread(values: list[float | None]) -> str:
    """Seconds as ms: the median [min-max] over repeats."""
    ms = [v * 1e3 for v in values if v is not None]
    if len(ms) < 2:
        return f"{ms[0]:.1f}" if ms else "n/a"
    return f"{statistics.median(ms):.1f} [{min(ms):.1f}-{max(ms):.1f}]"


def _same(values: list[Any]) -> str:
    return "/".join(sorted({str(v) for v in values}, key=lambda v: (len(v), v)))


def _hash(turns: list[dict], salts: list[str], key: str) -> str:
    """The first 12 hex digits when every run agrees; "DIFFER" when one conversation's do not."""
    if not hashes_agree(turns, salts):
        return "DIFFER"
    distinct = {t[key] for t in turns}
    return next(iter(distinct))[:12] if len(distinct) == 1 else f"{len(distinct)} convs, each equal"


def receipt_table(runs: list[dict[str, Any]], s: Settings) -> str:
    """Per case, turn and server: prompt rows, expected and cached rows, prefill, publish and
    TTFT ms (median [min-max] over repeats), hashes (first 12 hex digits)."""
    rows = [("case", "turn", "srv", "runs", "prompt", "expect>=", "cached", "prefill ms", "publish ms", "TTFT ms",
             "token_sha256", "output_sha256")]
    for case in s.cases:
        for k in range(s.turns):
            for srv in "AB":
                group = [r for r in runs if r["case"] == case and r["server"] == srv]
                turns, salts = [r["turns"][k] for r in group], [r["salt"] for r in group]
                if not turns:
                    continue
                expect = _same([expected_row(r, k, s) for r in group]) if k and srv == "A" else "-"
                rows.append((case, str(k + 1), srv, str(len(group)), _same([t["prompt_tokens"] for t in turns]), expect,
                             _same([t["cached_tokens"] for t in turns]), _spread([t.get("prefill_s") for t in turns]),
                             _spread([t.get("publish_s") for t in turns]), _spread([t["ttft_s"] for t in turns]),
                             _hash(turns, salts, "token_sha256"),
                             _hash(turns, salts, "output_sha256")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def phase_table(runs: list[dict[str, Any]], s: Settings) -> str:
    """Per case, turn and server: host ms of each step phase during the turn (from
    /metrics; median [min-max] over repeats): where a turn's prefill time goes."""
    shown = [p for p in STEP_PHASES if p != "release"]
    rows = [("case", "turn", "srv", *(f"{p} ms" for p in shown))]
    for case in s.cases:
        for k in range(s.turns):
            for srv in "AB":
                turns = [r["turns"][k] for r in runs if r["case"] == case and r["server"] == srv]
                if turns and all("phases_ms" in t for t in turns):
                    rows.append((case, str(k + 1), srv,
                                 *(_spread([t["phases_ms"][p] / 1e3 for t in turns]) for p in shown)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def _run(*cmd: str, root: Path = ROOT, env: dict[str, str] | None = None) -> str | None:
    """A command's stripped stdout in `root`; None when it cannot run or fails."""
    try:
        out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=20, check=False, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def tree_hash(root: Path = ROOT) -> str | None:
    """git's tree hash of the files a commit of `root` would hold now (tracked ones as they are on
    disk, and untracked ones git does not ignore), made through a temporary index (the checkout's
    own index is left alone; blobs are written to its object store). It equals
    `git rev-parse C^{tree}` when the files are exactly commit C's, whatever HEAD says: a copy
    whose .git is older than its files (the GPU machine's, RESULTS.md session 26) still names the
    code that ran (`git log --all --format='%H %T' | grep TREE`). None outside git."""
    with tempfile.TemporaryDirectory(prefix="tree_hash.") as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, "index"))
        if _run("git", "add", "-A", root=root, env=env) is None:
            return None
        return _run("git", "write-tree", root=root, env=env)


def environment() -> dict[str, Any]:
    """HEAD's commit, whether the files differ from it, their tree hash (`tree_hash`), and the
    GPU name, when known."""
    gpu = _run("nvidia-smi", "--query-gpu=name", "--format=csv,noheader") if shutil.which("nvidia-smi") else None
    return {"commit": _run("git", "rev-parse", "HEAD"), "dirty": bool(_run("git", "status", "--porcelain")),
            "tree": tree_hash(), "gpu": gpu.splitlines()[0] if gpu else None}


# --- the CLI --------------------------------------------------------------------------------------------
def sequence(repeat: int) -> list[bool]:
    """Cache-on (True) and cache-off (False) servers in A B B A order, `repeat` of each."""
    return [(r % 2 == 0) == (i == 0) for r in range(repeat) for i in range(2)]


def run_all(args: argparse.Namespace, s: Settings, renderer: ChatRenderer, workdir: Path,
            runs: list[dict[str, Any]], save: Callable[[], None]) -> None:
    """Append every run to `runs` and `save()` after each server (or repeat): started
    servers in A B B A order, each first running a discarded warm-up conversation (turn 1
    of each case found on the first server, then replayed); or the given URLs (each repeat
    a fresh salt, landed on the cache-on one). Raises BenchError; the runs so far stay."""
    def one_server(server: Server, salt: str, firsts: dict[str, list[dict]]) -> None:
        if s.warmup_rows:
            small = attrs.evolve(s, off_grid_rows=s.warmup_rows, turns=2)
            run_case(server, renderer, "off-grid", f"warmup.{salt}", small, None)
        for case in s.cases:
            run = run_case(server, renderer, case, salt, s, firsts.get(case))
            firsts[case] = run["first"]
            runs.append(run | {"command": server.command})

    if args.url:
        base = args.salt or f"t{time.time_ns()}"
        for r in range(args.repeat):
            firsts: dict[str, list[dict]] = {}
            servers = [Server(args.url, True, start_grid=args.start_grid)]
            for server in servers + ([Server(args.url_off, False)] if args.url_off else []):
                one_server(server, f"{base}.{r}", firsts)
            save()
        return
    firsts = {}
    for i, cache_on in enumerate(sequence(args.repeat)):
        name = f"{i + 1}-{'A' if cache_on else 'B'}"
        print(f"starting server {name} ({'cache on' if cache_on else 'cache off'})", file=sys.stderr, flush=True)
        server = Server.start(shlex.split(args.server_args), cache_on, workdir, name, args.start_timeout_s)
        try:
            one_server(server, args.salt or "0", firsts)
        finally:
            server.stop()
        for run in runs[-len(s.cases):]:
            add_trace_times(run, server.trace)
            cached = ", ".join(str(t["cached_tokens"]) for t in run["turns"])
            print(f"  {name} {run['case']}: cached_tokens {cached}", file=sys.stderr, flush=True)
        save()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = Settings()
    ap = argparse.ArgumentParser(prog="python bench/warm_turns.py", description=" ".join(__doc__.splitlines()[:2]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:-3]))
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--server-args", metavar="ARGS", help="start servers: `python -m executor.serve ARGS --port 0` "
                       "as cache-on (A) and, plus --prompt-cache-gib 0, as cache-off (B): A B B A ...")
    where.add_argument("--url", help="drive this running cache-on server instead")
    ap.add_argument("--url-off", help="with --url: a running server with --prompt-cache-gib 0 to compare against")
    ap.add_argument("--start-grid", type=int, default=1, metavar="ROWS",
                    help="with --url: the row grid the server's request starts snap to (its ready log's "
                    "start_grid: 64 for a numba-cuda server with snap_starts on; default: 1, exact starts)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N", help="runs of A and of B each (default: 1)")
    ap.add_argument("--grid-rows", type=int, default=d.grid_rows, metavar="ROWS",
                    help=f"the servers' grid_rows; on-grid lands on this row (default: {d.grid_rows})")
    ap.add_argument("--off-grid-rows", type=int, default=d.off_grid_rows, metavar="ROWS",
                    help=f"off-grid first prompt rows (default: {d.off_grid_rows})")
    ap.add_argument("--turns", type=int, default=d.turns, help=f"turns per case (default: {d.turns})")
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"tokens per reply (default: {d.max_tokens})")
    ap.add_argument("--cases", default=",".join(d.cases), help=f"comma-separated (default: {','.join(d.cases)})")
    ap.add_argument("--max-ttft-ratio", type=float, metavar="R",
                    help="also assert median turn-2 TTFT cache-on / cache-off <= R (e.g. 0.1)")
    ap.add_argument("--salt", help="conversation salt (default: 0 for started servers, the time for --url)")
    ap.add_argument("--tokenizer-dir", type=Path, metavar="DIR", help="checkpoint whose tokenizer and chat template "
                    "the servers use (default: the embedded Qwen3.5 ones: the tiny model's, --random-weights')")
    ap.add_argument("--warm-timeout-s", type=float, default=d.warm_timeout_s, metavar="S",
                    help=f"longest wait for a warm pass to settle (default: {d.warm_timeout_s:g})")
    ap.add_argument("--warmup-rows", type=int, default=d.warmup_rows, metavar="ROWS",
                    help=f"rows of each server's discarded warm-up conversation; 0: none (default: {d.warmup_rows})")
    ap.add_argument("--start-timeout-s", type=float, default=900, metavar="S",
                    help="longest wait for a started server's ready line (default: 900)")
    ap.add_argument("--trace-dir", type=Path, metavar="DIR", help="keep the started servers' traces and logs here")
    ap.add_argument("--json", type=Path, metavar="PATH", help="write the receipt as JSON (also after each server)")
    return ap.parse_args(attach_server_args(argv))


def write_receipt(path: Path, args: argparse.Namespace, s: Settings, env: dict[str, Any],
                  runs: list[dict[str, Any]], error: str | None, complete: bool) -> None:
    """The receipt JSON: command, commit, GPU, settings, hash definitions, assertions, runs."""
    assertions = check(runs, s, args.max_ttft_ratio)
    receipt = {"command": [sys.executable, *sys.argv], "environment": env, "settings": attrs.asdict(s),
               "server_args": args.server_args, "url": args.url, "url_off": args.url_off, "repeat": args.repeat,
               "hashes": {"token_sha256": ids_sha256.__doc__, "output_sha256": output_sha256.__doc__,
                          "prompt_sha256": "the client-rendered prompt ids, as token_sha256"},
               "qualified": complete and error is None and all(a["ok"] for a in assertions), "complete": complete,
               "error": error, "assertions": assertions, "runs": runs}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(receipt, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        s = Settings(grid_rows=args.grid_rows, off_grid_rows=args.off_grid_rows, turns=args.turns,
                     max_tokens=args.max_tokens, warm_timeout_s=args.warm_timeout_s, warmup_rows=args.warmup_rows,
                     cases=tuple(c.strip() for c in args.cases.split(",") if c.strip()))
        if args.repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
        if args.url_off and not args.url:
            raise ValueError("--url-off needs --url (the cache-on server it is compared with)")
        if args.max_ttft_ratio is not None and not args.max_ttft_ratio > 0:
            raise ValueError(f"--max-ttft-ratio must be > 0, got {args.max_ttft_ratio}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokenizer = (load_tokenizer(args.tokenizer_dir) if args.tokenizer_dir else None) or default_tokenizer()
    renderer = ChatRenderer(tokenizer, load_template(args.tokenizer_dir) if args.tokenizer_dir else builtin_template())
    if any(len(tokenizer.encode(" " + w, add_special_tokens=False).ids) != 1 for w in FILLER):
        print("error: this tokenizer splits a padding word; padding needs one token per word", file=sys.stderr)
        return 2
    env, runs, error = environment(), [], None

    def save(complete: bool = False) -> None:
        if args.json:
            write_receipt(args.json, args, s, env, runs, error, complete)

    with tempfile.TemporaryDirectory(prefix="warm_turns.") as tmp:
        workdir = args.trace_dir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            run_all(args, s, renderer, workdir, runs, save)
        except (BenchError, OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            print(f"error: {error}", file=sys.stderr)
    save(complete=True)
    assertions = check(runs, s, args.max_ttft_ratio)
    print(receipt_table(runs, s))
    print("host ms per step phase during each turn (/metrics):")
    print(phase_table(runs, s))
    for case in s.cases:
        on, off = ([r for r in runs if r["case"] == case and r["server"] == srv] for srv in "AB")
        if on and off:
            print(f"{case}: median turn-2 TTFT cache-on / cache-off = {ttft_ratio(on, off)}")
    for a in assertions:
        print(f"{'PASS' if a['ok'] else 'FAIL'}  {a['name']:<29} {a['case']:<9} {a['detail']}")
    ok = error is None and all(a["ok"] for a in assertions)
    print(f"qualified: {str(ok).lower()} ({sum(a['ok'] for a in assertions)}/{len(assertions)} assertions hold"
          + (f"; stopped early: {error}" if error else "") + ")")
    return 2 if error else 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
