"""PolicyConfig: defaults, validation naming the field, TOML round trip (parse/format)."""

from __future__ import annotations

import math

import pytest

from policy.config import (
    GIB,
    PolicyConfig,
    format_policy,
    parse_policy,
    policy_fields,
    policy_from_dict,
    policy_to_dict,
)


def test_defaults_match_design():
    cfg = PolicyConfig()
    assert (cfg.grid_rows, cfg.max_chunk_rows, cfg.tail_rows) == (4096, 4096, 128)
    assert cfg.request_starts is True and cfg.warm_enabled is True
    assert cfg.warm_quiet_ms == 150.0
    assert cfg.prompt_cache_bytes == 64 * GIB == 68_719_476_736
    assert (cfg.lanes, cfg.queue_rows, cfg.idle_half_life_s) == (16, 1024, 600.0)
    assert cfg.cache_enabled and cfg.warm_active


def test_fields_in_declaration_order():
    assert policy_fields() == (
        "grid_rows", "request_starts", "snap_starts", "max_chunk_rows", "tail_rows", "warm_enabled",
        "warm_quiet_ms", "prompt_cache_bytes", "lanes", "queue_rows", "idle_half_life_s", "short_first",
    )


def test_format_policy_text():
    text = format_policy(PolicyConfig(grid_rows=64, request_starts=False, warm_quiet_ms=12.5))
    assert text.splitlines() == [
        "grid_rows = 64",
        "request_starts = false",
        "snap_starts = true",
        "max_chunk_rows = 4096",
        "tail_rows = 128",
        "warm_enabled = true",
        "warm_quiet_ms = 12.5",
        f"prompt_cache_bytes = {64 * GIB}",
        "lanes = 16",
        "queue_rows = 1024",
        "idle_half_life_s = 600.0",
        "short_first = true",
    ]
    assert text.endswith("\n")


@pytest.mark.parametrize(
    "cfg",
    [
        PolicyConfig(),
        PolicyConfig(grid_rows=1, max_chunk_rows=1, tail_rows=1, lanes=1, queue_rows=1),
        PolicyConfig(prompt_cache_bytes=0, warm_enabled=False, request_starts=False),
        PolicyConfig(warm_quiet_ms=0.1 + 0.2, idle_half_life_s=1e-9, prompt_cache_bytes=2**62),
        PolicyConfig(warm_quiet_ms=math.inf, idle_half_life_s=math.inf),
    ],
    ids=["defaults", "all-ones", "cache-off", "awkward-floats", "inf-quiet"],
)
def test_toml_round_trip(cfg):
    assert parse_policy(format_policy(cfg)) == cfg
    assert policy_from_dict(policy_to_dict(cfg)) == cfg


def test_parse_policy_table_and_defaults():
    cfg = parse_policy("[policy]\ngrid_rows = 8192\nwarm_quiet_ms = 200\n")
    assert cfg == PolicyConfig(grid_rows=8192, warm_quiet_ms=200.0)
    assert isinstance(cfg.warm_quiet_ms, float)
    assert parse_policy("") == PolicyConfig()


def test_unknown_key_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="'grid_rowz'"):
        parse_policy("grid_rowz = 4096\n")
    with pytest.raises(ValueError, match="'chunk'"):
        parse_policy("[policy]\nchunk = 1\n")
    with pytest.raises(ValueError, match="'bogus'"):
        PolicyConfig().with_changes(bogus=1)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("grid_rows = 0", "grid_rows"),
        ("grid_rows = -4096", "grid_rows"),
        ("max_chunk_rows = 4096.0", "max_chunk_rows"),
        ("tail_rows = true", "tail_rows"),
        ("lanes = 0", "lanes"),
        ("queue_rows = '8'", "queue_rows"),
        ("request_starts = 1", "request_starts"),
        ("warm_enabled = 'yes'", "warm_enabled"),
        ("warm_quiet_ms = -1", "warm_quiet_ms"),
        ("warm_quiet_ms = nan", "warm_quiet_ms"),
        ("idle_half_life_s = -0.5", "idle_half_life_s"),
        ("idle_half_life_s = 0", "idle_half_life_s"),
        ("idle_half_life_s = nan", "idle_half_life_s"),
        ("prompt_cache_bytes = -1", "prompt_cache_bytes"),
        ("prompt_cache_bytes = 1.5", "prompt_cache_bytes"),
        ("prompt_cache_bytes = '64GiB'", "prompt_cache_bytes"),
    ],
    ids=lambda v: v if " " not in v else v.split(" = ")[0] + "=" + v.split(" = ")[1],
)
def test_bad_values_name_the_field(text, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        parse_policy(text + "\n")


def test_config_is_frozen_and_with_changes_copies():
    cfg = PolicyConfig()
    with pytest.raises(AttributeError):
        cfg.grid_rows = 64  # type: ignore[misc]
    changed = cfg.with_changes(grid_rows=64, prompt_cache_bytes=0)
    assert (changed.grid_rows, changed.prompt_cache_bytes) == (64, 0)
    assert cfg.grid_rows == 4096
    assert not changed.cache_enabled and not changed.warm_active


def test_warm_active_needs_warm_and_cache():
    assert not PolicyConfig(warm_enabled=False).warm_active
    assert not PolicyConfig(prompt_cache_bytes=0).warm_active
    assert PolicyConfig(prompt_cache_bytes=1).warm_active
