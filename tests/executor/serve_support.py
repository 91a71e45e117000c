"""A real `python -m executor.serve` process on 127.0.0.1 for tests (no fixtures here).

`ServerProcess(*flags)` starts it with `--port 0`, reads the port from its `ready URL`
line, and `stop()` sends SIGTERM and checks it exits 0. Its stderr (structlog) goes to a
file whose tail is shown when it fails.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

from executor.model import tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"^ready (http://127\.0\.0\.1:(\d+))$")


class ServerProcess:
    """One server process; `url` is http://127.0.0.1:PORT, `base_url` its /v1."""

    def __init__(self, *flags: str, timeout_s: float = 60.0) -> None:
        tiny_model_dir()  # generate the tiny model once, before servers race for it
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "executor.serve", "--host", "127.0.0.1", "--port", "0", *flags],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self._log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = lines.get(timeout=0.1).rstrip("\n")
            except queue.Empty:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.kill()
                    raise RuntimeError(f"server did not get ready: {self.lines}\n{self.stderr_tail()}") from None
                continue
            self.lines.append(line)
            match = READY.match(line)
            if match:
                self.url, self.port = match.group(1), int(match.group(2))
                break
        self.base_url = self.url + "/v1"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=60)

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def post(self, path: str, body: bytes | str | dict, content_type: str = "application/json") -> tuple[int, dict]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body.encode() if isinstance(body, str) else body
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of /metrics (0.0 when absent)."""
        _, text = self.get("/metrics")
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        for line in text.decode().splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0

    def wait_metric(self, name: str, at_least: float, timeout_s: float = 30.0, **labels: str) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.metric(name, **labels)
            if value >= at_least:
                return value
            time.sleep(0.02)
        raise AssertionError(f"{name}{labels} stayed below {at_least}\n{self.stderr_tail()}")

    def stderr_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "".join(Path(self._log.name).read_text().splitlines(keepends=True)[-lines:])

    def stop(self) -> int:
        """SIGTERM, then wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        os.unlink(self._log.name)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
