"""Start and stop a `python -m executor.serve` process, for the bench tools (warm_turns,
fidelity): a free port, stderr to a log file, and the `ready URL` line it prints once it
serves.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"^ready (http://\S+)$")


def start_server(args: Sequence[str], log_path: Path, timeout_s: float) -> tuple[subprocess.Popen, str, list[str]]:
    """Start `python -m executor.serve --host 127.0.0.1 --port 0 ARGS` (cwd: the repository,
    stderr into `log_path`); returns (process, base URL, command) once it prints `ready URL`.

    Raises RuntimeError with the command and the log's last 20 lines when the process exits
    or `timeout_s` seconds pass first (the process is stopped).
    """
    command = [sys.executable, "-m", "executor.serve", "--host", "127.0.0.1", "--port", "0", *args]
    with log_path.open("w") as err:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            match = READY.match(lines.get(timeout=0.2).strip())
        except queue.Empty:
            if time.monotonic() > deadline or proc.poll() is not None:
                stop_server(proc)
                tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-20:])
                raise RuntimeError(f"the server did not get ready: {' '.join(command)}\n{tail}") from None
            continue
        if match:
            return proc, match.group(1), command


def attach_server_args(argv: Sequence[str] | None) -> list[str]:
    """argv (default: sys.argv[1:]) with each `--server-args VALUE` (or an abbreviation of
    at least `--serv`, as argparse allows) written as `--server-args=VALUE`, so that a VALUE
    that is one flag (`--no-engine-process`) is taken as the value: argparse reads a lone
    word starting with "-" as an option of its own."""
    args = list(sys.argv[1:] if argv is None else argv)
    out: list[str] = []
    i = 0
    while i < len(args):
        if len(args[i]) >= 6 and "--server-args".startswith(args[i]) and i + 1 < len(args):
            out.append(f"--server-args={args[i + 1]}")
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


def ready_fields(log_path: Path) -> dict[str, Any]:
    """The fields of the `ready` line a started server logged (structlog JSON in its stderr
    log: url, model, backend, context_rows, policy, invariant_rows, start_grid,
    engine_process); {} when the log has no such line or it is not JSON."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return {}
    for line in text.splitlines():
        if '"ready"' not in line:
            continue
        try:
            fields = json.loads(line)
        except ValueError:
            continue
        if isinstance(fields, dict) and fields.get("event") == "ready":
            return fields
    return {}


def stop_server(proc: subprocess.Popen, grace_s: float = 60.0) -> int | None:
    """SIGTERM, then SIGKILL after `grace_s` seconds; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def served_model(url: str, timeout_s: float = 30.0) -> str:
    """The id of the model a started server at `url` serves (the first of its /v1/models).
    Raises OSError (urllib's URLError and HTTPError are ones) when the server does not answer."""
    with urllib.request.urlopen(url + "/v1/models", timeout=timeout_s) as resp:
        return json.loads(resp.read())["data"][0]["id"]


@contextmanager
def running_server(args: Sequence[str], log_path: Path, timeout_s: float,
                   grace_s: float = 30.0) -> Iterator[tuple[str, dict[str, Any], str]]:
    """`start_server`, then (base URL, `ready_fields` of its log, `served_model`) for the block; the
    server is stopped (`stop_server` with `grace_s`) when the block ends, however it ends. Raises
    what `start_server` and `served_model` raise (RuntimeError, OSError)."""
    proc, url, _ = start_server(args, log_path, timeout_s)
    try:
        yield url, ready_fields(log_path), served_model(url)
    finally:
        stop_server(proc, grace_s)
