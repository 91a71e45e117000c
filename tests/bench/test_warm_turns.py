"""bench/warm_turns.py end to end on CPU: real servers (the tiny model on the reference
backend, a 128-row grid) through both cases in A B B A order, its receipt's values; and
planted breaks (a cache-off server posing as the cache-on one, a server with other weights
as the reference) that must turn the named assertions red."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from executor.model import random_checkpoint, tiny_config
from tests.executor.serve_support import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "warm_turns.py"
SMALL = ("--grid-rows", "128", "--off-grid-rows", "100", "--max-tokens", "16", "--warmup-rows", "64")
GRID = 128


def _module():
    spec = importlib.util.spec_from_file_location("warm_turns", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "receipt.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv, "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert out.is_file(), proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def test_order_and_hash_definitions():
    wt = _module()
    assert wt.sequence(1) == [True, False]
    assert wt.sequence(2) == [True, False, False, True]  # A B B A
    assert wt.sequence(3) == [True, False, False, True, True, False]
    assert wt.ids_sha256([1, 22, 333]) == hashlib.sha256(b"1,22,333").hexdigest()
    assert wt.output_sha256("", "hé") == hashlib.sha256('["", "hé"]'.encode()).hexdigest()


def test_both_cases_abba_on_the_tiny_model(tmp_path):
    policy = tmp_path / "grid.toml"
    policy.write_text(f"grid_rows = {GRID}\n")
    proc, receipt = _run(tmp_path, "--server-args", f"--backend reference --policy {policy}", "--repeat", "2",
                         "--trace-dir", str(tmp_path / "traces"), *SMALL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert receipt["qualified"] and receipt["error"] is None
    verdicts = {(a["name"], a["case"]): a["ok"] for a in receipt["assertions"]}
    assert set(verdicts) == {
        *((n, c) for n in ("client_render_matches_server", "first_turn_cold", "warm_pass_started", "warm_pass_finished",
                           "continuation_cached", "reference_never_cached", "hashes_equal_cache_off")
          for c in ("on-grid", "off-grid")),
        ("first_prompt_under_grid", "on-grid"), ("continuation_on_grid", "on-grid")}
    assert all(verdicts.values())
    runs = receipt["runs"]
    assert [(r["server"], r["case"]) for r in runs] == [(s, c) for s in "ABBA" for c in ("on-grid", "off-grid")]
    for run in runs:
        first, second = run["turns"]
        assert first["cached_tokens"] == 0 and first["ttft_s"] > 0 and first["prefill_s"] > 0
        for turn in run["turns"]:  # the engine hands the token over before the client has it
            times = {k: turn[k] for k in ("publish_s", "server_ttft_s", "ttft_s")}
            assert 0 < turn["publish_s"] <= turn["server_ttft_s"] and turn["publish_s"] < turn["ttft_s"], times
        if run["case"] == "on-grid":
            assert first["prompt_tokens"] < GRID == first["continuation_rows"]
        else:
            assert first["prompt_tokens"] == 100 < first["continuation_rows"]
        assert first["phases_ms"]["forward"] > 0 and first["phases_ms"]["decode"] > 0, first["phases_ms"]
        if run["server"] == "A":  # resumed exactly where the warm pass stopped: the next message's start
            assert second["cached_tokens"] == first["continuation_rows"]
            assert first["warm"]["started"] == first["warm"]["finished"] == 1 and first["warm_settled"]
            assert second["phases_ms"]["restore"] > 0 and second["phases_ms"]["keep"] > 0, second["phases_ms"]
        else:
            assert second["cached_tokens"] == 0 and "warm" not in first
    for case in ("on-grid", "off-grid"):
        for k in range(2):
            turns = [r["turns"][k] for r in runs if r["case"] == case]
            assert len({(t["token_sha256"], t["output_sha256"], t["prompt_sha256"]) for t in turns}) == 1
    assert "qualified: true" in proc.stdout and "PASS  continuation_on_grid" in proc.stdout
    assert "host ms per step phase" in proc.stdout and "restore ms" in proc.stdout
    assert receipt["environment"]["commit"] and sorted(p.name for p in (tmp_path / "traces").glob("*.log")) == [
        "1-A.log", "2-B.log", "3-B.log", "4-A.log"]
    assert receipt["environment"]["tree"] == _module().tree_hash() and len(receipt["environment"]["tree"]) == 40


def test_publish_seconds_reads_the_step_that_ran_the_last_chunk():
    """publish_s: the step that ran the request's last chunk is the first recorded after that
    chunk started; the publish is at its hand-off (t - ran_s) plus its published_s; a step
    without published_s (the token waited for the commit) gives the first_token's ttft_s, even
    when the commit took long (the old 2 ms window then fell back wrongly under load)."""
    wt = _module()
    steps = [{"kind": "step", "t": 1.010, "ran_s": 0.008, "published_s": 0.004},  # before the chunk
             {"kind": "step", "t": 1.0398, "ran_s": 0.028, "published_s": 0.025},  # ran it
             {"kind": "step", "t": 1.2, "ran_s": 0.003, "published_s": 0.001}]  # a later step
    assert abs(wt.publish_seconds(1.0100, 1.0117, 0.0350, steps) - (1.0398 - 0.028 + 0.025 - 1.0100)) < 1e-12
    no_early = [steps[0], {"kind": "step", "t": 1.0398, "ran_s": 0.028}, steps[2]]
    assert wt.publish_seconds(1.0100, 1.0117, 0.0350, no_early) == 0.0350
    assert wt.publish_seconds(1.0100, 1.3, 0.0350, steps) == 0.0350  # no step after the chunk: the commit's
    assert wt.publish_seconds(None, 1.0117, 0.0350, steps) is None
    assert wt.publish_seconds(1.0, None, 0.0350, steps) is None
    assert wt.publish_seconds(1.0, 1.0117, None, steps) is None


def test_planted_breaks_turn_the_receipt_red(tmp_path):
    other = random_checkpoint(tiny_config(), 1, tmp_path / "other-weights")
    no_cache = ServerProcess("--backend", "reference", "--prompt-cache-gib", "0")
    wrong = ServerProcess("--backend", "reference", "--model", str(other), "--prompt-cache-gib", "0")
    try:
        proc, receipt = _run(tmp_path, "--url", no_cache.url, "--url-off", wrong.url, "--cases", "off-grid",
                             "--warm-timeout-s", "0.5", *SMALL, "--warmup-rows", "0")
    finally:
        assert no_cache.stop() == 0 and wrong.stop() == 0
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert {a["name"]: a["ok"] for a in receipt["assertions"]} == {
        "client_render_matches_server": True, "first_turn_cold": True, "warm_pass_started": False,
        "warm_pass_finished": False, "continuation_cached": False, "reference_never_cached": True,
        "hashes_equal_cache_off": False}
    assert "qualified: false" in proc.stdout and "FAIL  hashes_equal_cache_off" in proc.stdout


def test_expected_row_follows_the_server_s_start_grid(tmp_path):
    wt = _module()
    s = wt.Settings()
    run = {"case": "off-grid", "start_grid": 64, "turns": [{"continuation_rows": 2014}, {}, {}]}
    assert wt.expected_row(run, 1, s) == 1984  # snapped: 31 * 64
    assert wt.expected_row(run | {"start_grid": 1}, 1, s) == 2014
    assert wt.expected_row({k: v for k, v in run.items() if k != "start_grid"}, 1, s) == 2014
    on = {"case": "on-grid", "start_grid": 64, "turns": [{"continuation_rows": 4096}, {}]}
    assert wt.expected_row(on, 1, s) == 4096
    log = tmp_path / "server.log"
    log.write_text('{"event": "loading"}\n{"url": "u", "start_grid": 64, "invariant_rows": 64, "event": "ready"}\n')
    assert wt.ready_start_grid(log) == 64
    log.write_text('{"url": "u", "start_grid": 1, "invariant_rows": null, "event": "ready"}\n')
    assert wt.ready_start_grid(log) == 1
    log.write_text("no ready line\n")
    assert wt.ready_start_grid(log) == 1


def test_chat_requests_share_one_kept_alive_connection():
    """Turns ride one HTTP/1.1 connection, as pooled clients' do (no connect in a turn's
    TTFT but the first's); a failed request drops it and the next opens a new one."""
    wt = _module()
    served = ServerProcess("--backend", "reference", "--prompt-cache-gib", "0")
    try:
        server = wt.Server(served.url, cache_on=False)
        messages = [{"role": "user", "content": "hello there"}]
        first = wt.chat_stream(server, messages, 3)
        port = server.connection().sock.getsockname()[1]
        second = wt.chat_stream(server, messages, 3)
        assert server.connection().sock.getsockname()[1] == port
        assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) == 3
        model, server.model = server.model, "no-such-model"
        try:
            wt.chat_stream(server, messages, 3)
        except wt.BenchError as exc:
            assert "HTTP 404" in str(exc) or "HTTP 400" in str(exc), exc
        else:
            raise AssertionError("a request for an unknown model must fail")
        assert server._conn is None
        server.model = model
        assert wt.chat_stream(server, messages, 3)["token_ids"] == first["token_ids"]
        assert server.connection().sock.getsockname()[1] != port
        server.drop_connection()
    finally:
        assert served.stop() == 0


def test_server_args_may_be_one_flag():
    """argparse takes a lone "--flag" value for an option of its own; the bench tools take it
    as --server-args' value (a fresh-user run of `--server-args --no-engine-process` failed)."""
    from executor.server_process import attach_server_args

    wt = _module()
    assert wt.parse_args(["--server-args", "--no-engine-process", "--repeat", "2"]).server_args == "--no-engine-process"
    assert wt.parse_args(["--server-args", "--random-weights qwen3.5-27b --backend cuda"]).server_args == (
        "--random-weights qwen3.5-27b --backend cuda")
    assert attach_server_args(["--repeat", "1", "--server-args", "-x", "--cases", "on-grid"]) == [
        "--repeat", "1", "--server-args=-x", "--cases", "on-grid"]
    assert attach_server_args(["--server-args"]) == ["--server-args"]  # argparse then names the missing value
    assert attach_server_args(["--server-arg", "-x"]) == attach_server_args(["--serv", "-x"]) == ["--server-args=-x"]
    assert attach_server_args(["--ser", "-x"]) == ["--ser", "-x"]  # too short to be sure (--seed, --salt)


def test_bad_flags_are_refused_before_any_server_starts_each_with_its_own_message(capsys):
    """A fresh-user review found --repeat and --url-off sharing one message, and a negative
    --max-ttft-ratio checked only after every server had run (minutes on the 27B)."""
    wt = _module()
    cases = {("--server-args", "--backend reference", "--repeat", "0"): "--repeat must be >= 1, got 0",
             ("--server-args", "--backend reference", "--url-off", "http://x"): "--url-off needs --url",
             ("--server-args", "--backend reference", "--max-ttft-ratio", "-1"): "--max-ttft-ratio must be > 0, got -1.0"}
    for argv, message in cases.items():
        assert wt.main(list(argv)) == 2
        err = capsys.readouterr().err
        assert f"error: {message}" in err and "starting server" not in err
    assert "must be >= 1" not in err  # one message a flag


def test_tree_hash_names_the_files_whatever_head_says(tmp_path):
    """The GPU machine's copy of the checkout kept an old .git: its receipts named a parent commit,
    dirty (session 26). The tree hash names the files: equal to the commit's tree when they are
    that commit's, with untracked files counted and ignored ones not; the index is untouched."""
    wt = _module()

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "a.py").write_text("one\n")
    git("add", "-A")
    git("commit", "-qm", "first")
    first = git("rev-parse", "HEAD^{tree}")
    (tmp_path / "a.py").write_text("two\n")
    git("commit", "-qam", "second")
    second = git("rev-parse", "HEAD^{tree}")
    assert wt.tree_hash(tmp_path) == second
    git("reset", "-q", "--soft", "HEAD~1")  # HEAD says "first"; the files are still the second commit's
    index_before = git("diff", "--cached", "--name-only")
    assert wt.tree_hash(tmp_path) == second != first
    assert git("diff", "--cached", "--name-only") == index_before  # the checkout's index is left alone
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "x").write_text("not counted\n")
    assert wt.tree_hash(tmp_path) == second
    (tmp_path / "b.py").write_text("counted\n")
    assert wt.tree_hash(tmp_path) not in (first, second, None)
    assert wt.tree_hash(tmp_path / "ignored" / "..") == wt.tree_hash(tmp_path)
