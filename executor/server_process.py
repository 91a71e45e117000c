"""Start and stop a `python -m executor.serve` process, for the bench tools (warm_turns,
fidelity): a free port, stderr to a log file, and the `ready URL` line it prints once it
serves.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

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
