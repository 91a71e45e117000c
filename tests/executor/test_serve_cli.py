"""`python -m executor.serve` arguments: policy defaults come from PolicyConfig, a
--policy file overrides them and flags override the file; bad values exit 2 naming them;
--random-weights takes a dense preset on the cuda backend and says clearly when it cannot."""

from __future__ import annotations

import pytest

from executor.numba_cuda.device import is_gpu_available
from executor.serve import (
    ServeConfig,
    config_from_args,
    main,
    parse_args,
    random_model_id,
)
from policy.config import GIB, PolicyConfig
from tests.executor.serve_support import ServerProcess


def test_defaults_are_the_config_classes():
    cfg = config_from_args(parse_args([]))
    assert cfg == ServeConfig() and cfg.policy == PolicyConfig()


def test_flags_override_the_policy_file(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("lanes = 3\nwarm_quiet_ms = 10\nrequest_starts = true\n")
    cfg = config_from_args(parse_args(["--policy", str(path), "--lanes", "5", "--no-request-starts",
                                       "--prompt-cache-gib", "0.5", "--context", "128", "--port", "0"]))
    p = cfg.policy
    assert (p.lanes, p.warm_quiet_ms, p.request_starts, p.prompt_cache_bytes) == (5, 10.0, False, GIB // 2)
    assert (cfg.context_rows, cfg.port) == (128, 0)
    assert config_from_args(parse_args(["--prompt-cache-gib", "0"])).policy.warm_active is False
    assert config_from_args(parse_args(["--no-snap-starts"])).policy.snap_starts is False
    assert config_from_args(parse_args(["--no-short-first"])).policy.short_first is False
    assert config_from_args(parse_args([])).policy.short_first is True
    assert config_from_args(parse_args([])).engine_process is True
    assert config_from_args(parse_args(["--no-engine-process"])).engine_process is False
    assert config_from_args(parse_args([])).prefill_graphs is True
    assert config_from_args(parse_args(["--no-prefill-graphs"])).prefill_graphs is False
    assert config_from_args(parse_args([])).busy_poll is False
    assert config_from_args(parse_args(["--busy-poll"])).busy_poll is True
    assert config_from_args(parse_args([])).keep_gpu_warm is False
    assert config_from_args(parse_args(["--keep-gpu-warm"])).keep_gpu_warm is True
    path.write_text("snap_starts = false\n")
    assert config_from_args(parse_args(["--policy", str(path), "--snap-starts"])).policy.snap_starts is True


@pytest.mark.parametrize("argv, word", [(["--lanes", "0"], "lanes"), (["--prompt-cache-gib", "-1"], "prompt-cache-gib"),
                                        (["--context", "0"], "context_rows"), (["--warm-quiet-ms", "-5"], "warm_quiet_ms")])
def test_bad_values_exit_2_naming_them(argv, word, capsys):
    assert main(argv) == 2
    assert word in capsys.readouterr().err


def test_random_weights_flags_resolve():
    cfg = config_from_args(parse_args(["--random-weights", "qwen3.5-27b", "--seed", "7", "--backend", "cuda"]))
    assert (cfg.random_weights, cfg.seed, cfg.model, cfg.backend) == ("qwen3.5-27b", 7, None, "cuda")
    assert random_model_id("Qwen/Qwen3.5-27B", 7) == "qwen3.5-27b-random-s7"


@pytest.mark.parametrize("argv, words", [
    (["--random-weights", "qwen3.5-27b", "--backend", "reference"], ("random_weights", "--backend cuda")),
    (["--random-weights", "qwen3.5-1t"], ("unknown preset 'qwen3.5-1t'", "qwen3.5-27b", "qwen3.5-2b")),
    (["--random-weights", "qwen3.5-35b-a3b"], ("MoE", "dense presets only")),
    (["--random-weights", "qwen3.5-2b", "--seed", "-1"], ("seed",)),
], ids=["reference-backend", "unknown-preset", "moe-preset", "negative-seed"])
def test_random_weights_errors_exit_2_naming_the_problem(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_random_weights_and_model_are_exclusive(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--random-weights", "qwen3.5-2b", "--model", str(tmp_path)])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err
    with pytest.raises(ValueError, match="random_weights"):
        ServeConfig(model=tmp_path, random_weights="qwen3.5-2b")


@pytest.mark.skipif(is_gpu_available(), reason="checks the error without a GPU")
def test_random_weights_without_a_gpu_exit_1_saying_so(capsys):
    """No silent fallback: the reference backend cannot hold a real shape's random weights."""
    assert main(["--random-weights", "qwen3.5-0.8b", "--port", "0"]) == 1
    assert "--random-weights qwen3.5-0.8b needs the cuda backend" in capsys.readouterr().err


def test_context_past_the_models_positions_exits_1_naming_both(capsys):
    """--context may not exceed max_position_embeddings (the tiny model's 262,144): a clear
    error at start, on the reference backend as on the GPU."""
    assert main(["--context", "999999999", "--port", "0", "--no-engine-process", "--backend", "reference"]) == 1
    assert "--context 999999999 exceeds the model's max_position_embeddings (262144)" in capsys.readouterr().err


def test_in_process_server_serves_and_stops():
    """--no-engine-process: the runtime in the HTTP process; the same API and metrics,
    and the ready log line says where the engine runs."""
    server = ServerProcess("--no-engine-process")
    try:
        reply = server.client().chat.completions.create(model="tiny-qwen3_5-v1", max_tokens=3, seed=1,
                                                        messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.completion_tokens == 3
        assert server.metric("warmstate_requests_total", outcome="length") == 1.0
        assert '"engine_process": false' in server.stderr_tail(100)
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("placement", [(), ("--no-engine-process",)])
def test_a_busy_polling_server_serves_streams_and_stops(placement):
    """--busy-poll (both placements): the event loops poll once serving; a streamed and a
    whole reply, the same tokens as each other, and a clean stop on SIGTERM."""
    server = ServerProcess("--busy-poll", *placement)
    try:
        client = server.client()
        args = dict(model="tiny-qwen3_5-v1", max_tokens=4, seed=1, messages=[{"role": "user", "content": "hi"}])
        whole = client.chat.completions.create(**args)
        chunks = list(client.chat.completions.create(stream=True, **args))
        assert whole.usage.completion_tokens == 4
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
        assert '"busy_poll": true' in server.stderr_tail(100)
    finally:
        assert server.stop() == 0


def test_keep_gpu_warm_on_the_reference_backend_is_ignored_with_a_warning():
    """--keep-gpu-warm needs the GPU backend: on the reference backend the server says so in
    its log and serves as without it."""
    server = ServerProcess("--keep-gpu-warm", "--backend", "reference", "--no-engine-process")
    try:
        reply = server.client().chat.completions.create(model="tiny-qwen3_5-v1", max_tokens=2, seed=1,
                                                         messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.completion_tokens == 2
        log = server.stderr_tail(200)
        assert "keep_gpu_warm_ignored" in log and '"keep_gpu_warm": true' in log
    finally:
        assert server.stop() == 0


def test_the_cache_budget_is_lowered_to_what_the_gpu_reserved():
    """A store counting more than the reserved cache memory would grow into the activations'
    room: the server takes the reserve as its budget when it is less, else keeps its own."""
    from executor.serve import cache_budget

    policy = PolicyConfig(prompt_cache_bytes=64 * GIB)
    assert cache_budget(policy, 64 * GIB) is policy and cache_budget(policy, 80 * GIB) is policy
    lowered = cache_budget(policy, 40 * GIB)
    assert lowered.prompt_cache_bytes == 40 * GIB and lowered.cache_enabled
    assert lowered.with_changes(prompt_cache_bytes=64 * GIB) == policy  # nothing else changed
    assert not cache_budget(policy, 0).cache_enabled


def test_without_the_server_extra_the_cli_names_it():
    """`python -m executor.serve` after a plain `pip install -e .` (no aiohttp) exits with a
    one-line hint naming the extra, not a traceback (a fresh-user run, session 21)."""
    import subprocess
    import sys

    code = ("import sys, runpy; sys.modules['aiohttp'] = None; sys.argv = ['executor.serve', '--help']; "
            "runpy.run_module('executor.serve', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "pip install -e '.[server]'" in done.stderr and "aiohttp is not installed" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("busy", [False, True])
def test_main_and_the_engine_run_their_loops_on_the_polling_selector_with_busy_poll(busy, monkeypatch):
    """`main` and `run_engine` build their event loops from `polling_loop_factory` (a
    PollingSelector gated by a PollGate) with --busy-poll, and asyncio's default loop without."""
    import executor.serve as serve_mod
    from executor.polling import PollGate, PollingSelector

    seen = []

    class Runner:
        def __init__(self, loop_factory=None):
            seen.append(loop_factory)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def run(self, coro):
            coro.close()

    monkeypatch.setattr(serve_mod.asyncio, "Runner", Runner)
    monkeypatch.setattr(serve_mod, "configure_logging", lambda: None)
    monkeypatch.setattr(serve_mod.signal, "signal", lambda *a: None)  # run_engine ignores SIGINT/SIGTERM
    assert serve_mod.main(["--busy-poll"] if busy else []) == 0
    serve_mod.run_engine(None, ServeConfig(busy_poll=busy))
    assert len(seen) == 2
    for factory in seen:
        if not busy:
            assert factory is None
            continue
        loop = factory()
        try:
            selector = loop._selector  # noqa: SLF001 - the factory's selector
            assert isinstance(selector, PollingSelector) and isinstance(selector.spin, PollGate)
            assert not selector.spin()  # closed until the server serves
        finally:
            loop.close()
