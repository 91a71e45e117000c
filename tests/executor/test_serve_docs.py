"""The README's "Serve" section: its curl and `openai` examples run against a live server,
as written (only the port differs)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from tests.executor.serve_support import ROOT, ServerProcess

README = ROOT / "README.md"


def _section() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## Serve\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", _section(), re.DOTALL)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess()
    yield srv
    assert srv.stop() == 0


def _local(code: str, server) -> str:
    assert "127.0.0.1:8000" in code
    return code.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_example(server):
    (code,) = [b for b in _blocks("bash") if "curl" in b]
    out = subprocess.run(["bash", "-c", _local(code, server)], capture_output=True, text=True, timeout=120, check=True)
    body = json.loads(out.stdout)
    assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_openai_example(server, tmp_path):
    (code,) = _blocks("python")
    script = tmp_path / "example.py"
    script.write_text(_local(code, server))
    out = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cached = [int(m) for m in re.findall(r"cached (\d+)", out.stdout)]
    assert len(cached) == 2 and cached[1] > 0  # the second turn resumed a kept state
    assert "usage:" in out.stdout


def test_flag_table_matches_the_cli():
    help_text = subprocess.run([sys.executable, "-m", "executor.serve", "--help"], capture_output=True, text=True,
                               cwd=ROOT, check=True).stdout
    for flag in re.findall(r"`(--[a-z-]+)", _section()):
        assert flag in help_text, flag
