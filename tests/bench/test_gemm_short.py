"""bench/gemm_short.py's bookkeeping on the CPU (the measurements need the GPU)."""

from __future__ import annotations

import argparse

import pytest

from bench.gemm_short import best_equal, best_streaming, parse_rows, per_forward


def test_per_forward_counts_every_layer_s_products():
    counts = per_forward("qwen3.5-27b")  # 64 layers, every 4th full attention
    assert counts == {"in_proj(qkv|z|b|a)": 48, "out_proj": 48, "q_proj": 16, "kv_proj": 16, "o_proj": 16,
                      "gate_up": 64, "down": 64}
    assert sum(per_forward("qwen3.5-2b").values()) == 102  # 24 layers: 18 linear x 2 + 6 full x 3 + 24 x 2


def test_best_equal_takes_the_fastest_bit_equal_choice_only():
    result = {"variants": {"a": {"rows_differ": []}, "b": {"rows_differ": [51]}, "c": {"rows_differ": []}},
              "m51": {"bucket_us": 40.0, "a": 35.0, "b": 10.0, "c": 38.0}}
    assert best_equal(result, 51) == ("a", 35.0)  # b is faster but its bits differ
    result["m51"]["a"] = 45.0
    assert best_equal(result, 51) == ("c", 38.0)
    result["m51"]["c"] = 41.0
    assert best_equal(result, 51) == ("cuBLASLt bucket", 40.0)


def test_best_streaming_ignores_bits_and_the_bucket():
    result = {"variants": {"a": {"rows_differ": []}, "b": {"rows_differ": [51]}},
              "m51": {"bucket_us": 5.0, "a": 35.0, "b": 10.0}}
    assert best_streaming(result, 51) == ("b", 10.0)
    assert best_streaming({"variants": {}, "m1": {"bucket_us": 5.0}}, 1) == ("-", float("inf"))


def test_rows_must_be_1_to_64():
    assert parse_rows("1,16,64") == [1, 16, 64]
    for bad in ("0,16", "65", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--rows"):
            parse_rows(bad)
