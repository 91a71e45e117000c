"""bench/serve_ttft.py: the prompts it sends, the chunks it reads back from the trace, its flag
checks, and whole runs against the built-in tiny model's server on the CPU."""

from __future__ import annotations

import json

import pytest

from bench.serve_ttft import IDS, cold_chunks, main, prompts


def test_prompts_are_distinct_from_their_first_row():
    a = prompts(3, 50, seed=0)
    assert [p[0] for p in a] == [IDS[0], IDS[0] + 1, IDS[0] + 2]
    assert all(len(p) == 50 and all(IDS[0] <= t < IDS[1] for t in p) for p in a)
    assert prompts(3, 50, seed=0) == a  # seeded


def test_cold_chunks_are_read_per_request_in_order(tmp_path):
    events = [{"kind": "chunk_started", "pass_kind": "cold", "request": "r1", "start": 0, "end": 64, "tail_from": 64},
              {"kind": "chunk_done", "request": "r1"},
              {"kind": "chunk_started", "pass_kind": "warm", "request": None, "start": 0, "end": 64, "tail_from": 64},
              {"kind": "chunk_started", "pass_kind": "cold", "request": "r1", "start": 64, "end": 300,
               "tail_from": 172},
              {"kind": "chunk_started", "pass_kind": "cold", "request": "r2", "start": 0, "end": 100,
               "tail_from": None}]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert cold_chunks(trace) == [[(0, 64, 64), (64, 300, 172)], [(0, 100, None)]]


@pytest.mark.parametrize(("chunk_rows", "chunks", "tail"), [(None, [(0, 300, 172)], "from row 172"),
                                                           (128, [(0, 128, 128), (128, 256, 256), (256, 300, None)],
                                                            "-")])
def test_a_tiny_server_run(tmp_path, capsys, chunk_rows, chunks, tail):
    """One chunk: the scheduler's tail (the last 128 rows); 128-row chunks: the chunks before the
    last skip the last layer (tail_from = their end), and the 44-row last one is too short for a tail."""
    args = ["--rows", "300", "--repeat", "2", "--out", str(tmp_path)]
    if chunk_rows:
        args += ["--chunk-rows", str(chunk_rows)]
    assert main(args) == 0
    out = json.loads((tmp_path / "serve_ttft.json").read_text())
    assert out["rows"] == 300 and len(out["ttft_runs_s"]) == 2 and len(out["warmup_s"]) == 1
    assert out["ttft_s"] > 0
    assert out["chunks"] == [[list(c) for c in chunks]] * 3
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.startswith(f"| tiny-qwen3_5-v1 | 300 | {len(chunks)} (at most {chunk_rows or 300} rows each) | {tail} |")
    assert out["seed"] == 0 and out["commit"] and out["machine"] and out["server_args"][-2:] == ["--context", "316"]


@pytest.mark.parametrize(("flag", "value"), [("--rows", "0"), ("--repeat", "0"), ("--warmup", "-1"),
                                             ("--chunk-rows", "0")])
def test_cli_errors_name_the_flag(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as stop:
        main([flag, value, "--out", str(tmp_path)])
    assert stop.value.code == 2
    assert f"{flag}: must be at least" in capsys.readouterr().err


@pytest.mark.parametrize("given", ["--policy p.toml", "--trace=t.jsonl"])
def test_the_bench_s_own_server_flags_are_refused(tmp_path, capsys, given):
    with pytest.raises(SystemExit) as stop:
        main(["--server-args", given, "--out", str(tmp_path)])
    assert stop.value.code == 2
    assert "is this bench's own" in capsys.readouterr().err


def test_a_server_that_fails_to_start_is_an_error_and_leaves_nothing_running(tmp_path, capsys):
    assert main(["--server-args", "--lanes 0", "--rows", "300", "--out", str(tmp_path), "--timeout-s", "60"]) == 1
    assert "error: the server did not get ready" in capsys.readouterr().err


def test_running_server_stops_the_server_when_its_block_raises(tmp_path):
    import urllib.request

    from executor.server_process import running_server

    with pytest.raises(ZeroDivisionError):
        with running_server([], tmp_path / "server.log", 60.0) as (url, ready, model):
            assert model == "tiny-qwen3_5-v1" and ready["backend"] == "reference"
            1 / 0
    with pytest.raises(OSError):  # nothing listens there any more
        urllib.request.urlopen(url + "/v1/models", timeout=5)
