"""PolicyConfig properties: every valid config survives a TOML round trip.

`check_round_trip` runs against `format_policy` and against a planted format that rounds.
"""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from policy_strategies import assert_caught

from policy.config import PolicyConfig, format_policy, parse_policy, policy_to_dict

POSITIVE = st.integers(1, 2**40)
TIMES = st.one_of(st.floats(0, 1e9), st.integers(0, 10**6).map(float),
                  st.sampled_from([0.1 + 0.2, 1e-300, 5e-324, math.inf]))
HALF_LIVES = TIMES.filter(lambda t: t > 0)
CONFIGS = st.builds(
    PolicyConfig,
    grid_rows=POSITIVE, request_starts=st.booleans(), max_chunk_rows=POSITIVE, tail_rows=POSITIVE,
    warm_enabled=st.booleans(), warm_quiet_ms=TIMES, prompt_cache_bytes=st.integers(0, 2**62),
    lanes=POSITIVE, queue_rows=POSITIVE, idle_half_life_s=HALF_LIVES,
)


def check_round_trip(format_fn, cfg: PolicyConfig) -> None:
    back = parse_policy(format_fn(cfg))
    assert back == cfg and policy_to_dict(back) == policy_to_dict(cfg), format_fn(cfg)


def format_short_floats(cfg: PolicyConfig) -> str:
    """Wrong: writes floats with 6 significant digits."""
    return "".join(
        f"{k} = {v:g}\n" if isinstance(v, float) else line + "\n"
        for (k, v), line in zip(policy_to_dict(cfg).items(), format_policy(cfg).splitlines())
    )


@given(CONFIGS)
def test_toml_round_trip(cfg):
    check_round_trip(format_policy, cfg)


def test_catches_a_format_that_rounds_floats():
    assert_caught(CONFIGS, lambda cfg: check_round_trip(format_short_floats, cfg))
