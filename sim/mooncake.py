"""Replay of the Mooncake conversation trace (FAST'25 release) as an open-loop Workload.

One JSON object a line: `timestamp` (ms), `input_length`, `output_length` (tokens), `hash_ids`
(one id per 512-token block; equal leading ids = equal leading blocks). The mapping to
Turns (runs, starts, ideal_reuse) is documented in sim/README.md. Not here: JSONL workloads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from policy.prefix import Prompt, Run
from sim.workload import MAX_TIME_S, Conversation, Turn, Workload, utf8_text

BLOCK_ROWS = 512
"""Rows (tokens) per Mooncake hash block."""
DEFAULT_TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
"""The trace beside a checkout: <checkout>/../shared/traces/mooncake/conversation_trace.jsonl."""


def _field(record: Any, key: str, lineno: int, path: Path) -> Any:
    value = record.get(key) if isinstance(record, dict) else None
    ok = isinstance(value, list) if key == "hash_ids" else isinstance(value, int) and not isinstance(value, bool)
    top = MAX_TIME_S * 1000 if key == "timestamp" else math.inf
    if not ok or (key != "hash_ids" and not 0 <= value <= top):
        need = "a list of integers" if key == "hash_ids" else "an integer >= 0"
        need = "an integer of ms in [0, 1e10] (1e7 s, MAX_TIME_S)" if key == "timestamp" else need
        raise ValueError(f"{path}:{lineno}: {key}: must be {need}, got {value!r}")
    return value


def _parse(path: Path, limit: int | None) -> list[tuple[int, int, int, list[int], int]]:
    """(timestamp_ms, input_length, output_length, hash_ids, lineno) of the first `limit` lines."""
    out = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            line = utf8_text(raw, path, lineno)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e.msg}") from None
            ts, rows, out_rows, ids = (_field(record, k, lineno, path)
                                       for k in ("timestamp", "input_length", "output_length", "hash_ids"))
            blocks = -(-rows // BLOCK_ROWS)
            if rows == 0 or len(ids) != blocks or not set(map(type, ids)) <= {int}:
                raise ValueError(f"{path}:{lineno}: hash_ids: must be {blocks} integers for input_length {rows} "
                                 f"(one per {BLOCK_ROWS}-row block), got {len(ids)} ids")
            out.append((ts, rows, out_rows, ids, lineno))
    out.sort(key=lambda r: r[0])
    return out


def read_mooncake(path: str | Path = DEFAULT_TRACE, limit: int | None = None) -> Workload:
    """The trace as a Workload named "mooncake": one single-turn Conversation per request.

    path: the trace JSONL. limit: read only the first `limit` requests of the file.
    Each request, in arrival order (stable sort on timestamp), becomes a Turn with
      prompt: one run per hash id, content_id = hash_id, 512 rows (the last one
        input_length - 512 * (n - 1));
      starts: 0 plus, for every earlier request whose hash_ids are a prefix of this one's, the
        row where it ended (the longest per chain node); an end at or past this prompt's last
        row is rounded down to a multiple of 512 (dropped when that is 0);
      output_rows = output_length, continuation None (no reply text: no warm passes),
      arrival_s = timestamp / 1000, think_s 0.
    ideal_reuse: prompt rows reusable with an unlimited cache at 512-row granularity (each
    request reuses its leading blocks already seen in a first-seen prefix chain), over all
    prompt rows: 0.374 on the shipped trace.

    Raises:
      ValueError `PATH:LINE: field: problem` for a malformed line (not UTF-8, not JSON, a bad
      field, a timestamp past 1e10 ms = sim.workload.MAX_TIME_S); OSError when unreadable.
    """
    path = Path(path)
    children: dict[tuple[int, int], int] = {}
    ends: dict[int, int] = {}
    runs: dict[int, Run] = {}
    reused = total = 0
    conversations = []
    for ts, rows, out_rows, ids, lineno in _parse(path, limit):
        node, depth, starts = 0, 0, {0}
        for h in ids:
            child = children.get((node, h))
            if child is None:
                break
            node, depth = child, depth + 1
            end = ends.get(node)
            if end is not None:
                starts.add(end if end < rows else (rows - 1) // BLOCK_ROWS * BLOCK_ROWS)
        for h in ids[depth:]:
            child = len(children) + 1
            children[(node, h)] = child
            node = child
        ends[node] = max(ends.get(node, 0), rows)
        reused += min(depth * BLOCK_ROWS, rows)
        total += rows
        last = rows - BLOCK_ROWS * (len(ids) - 1)
        pieces = [runs[h] if h in runs else runs.setdefault(h, Run(h, BLOCK_ROWS)) for h in ids[:-1]]
        pieces.append(Run(ids[-1], last))
        turn = Turn(Prompt(tuple(pieces)), tuple(sorted(starts)), out_rows, None, (), 0.0, ts / 1000)
        conversations.append(Conversation(f"mooncake-{lineno:05d}", ts / 1000, (turn,)))
    return Workload("mooncake", tuple(conversations), reused / total if total else None)
