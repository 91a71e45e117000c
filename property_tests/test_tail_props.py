"""Rule 8 properties: the tail fires only on a last chunk of more than tail_rows rows of a
fitting model with no reader; a chunk whose logits nobody reads skips the whole last layer.

Also: PolicyConfig TOML round trip of random configs, and Prompt digests of real tokens
(equal prefixes, equal digests across run splittings; different tokens, different digests).
Each `check_*` runs against the real code and against a planted wrong one.
"""

from __future__ import annotations

import hashlib
import math

from hypothesis import given
from hypothesis import strategies as st
from policy_strategies import assert_caught

from policy.config import PolicyConfig, format_policy, parse_policy, policy_to_dict
from policy.plan import Chunk
from policy.prefix import Prompt, Run
from policy.tail import TailFacts, tail_from


@st.composite
def tail_examples(draw):
    tail_rows = draw(st.one_of(st.just(128), st.integers(1, 300)))
    start = draw(st.integers(0, 10_000))
    rows = draw(st.one_of(st.integers(1, 2 * tail_rows + 2), st.sampled_from([tail_rows, tail_rows + 1]),
                          st.integers(1, 8192)))
    chunk = Chunk(start, start + rows, draw(st.booleans()))
    facts = TailFacts(
        tail_rows=tail_rows,
        last_layer_is_attention=draw(st.sampled_from([True, True, False])),
        even_head_grouping=draw(st.sampled_from([True, True, False])),
        has_reader=draw(st.booleans()),
    )
    return chunk, facts


def check_tail(tail_fn, example) -> None:
    """Never with a reader or an unfit model; never on a logits chunk of <= tail_rows rows;
    otherwise the last tail_rows rows of a logits chunk, or chunk.end when no logits are read."""
    chunk, facts = example
    got = tail_fn(chunk, facts)
    if facts.has_reader or not facts.last_layer_is_attention or not facts.even_head_grouping:
        assert got is None, f"tail {got} with {facts}"
    elif not chunk.reads_logits:
        assert got == chunk.end
    elif chunk.rows <= facts.tail_rows:
        assert got is None, f"tail {got} on a {chunk.rows}-row chunk"
    else:
        assert got == chunk.end - facts.tail_rows and chunk.start < got


def tail_on_short_chunks(chunk, facts):
    """Wrong: a short chunk gets a tail of its whole length."""
    got = tail_from(chunk, facts)
    if got is None and facts.model_fits and chunk.reads_logits:
        return chunk.start
    return got


def tail_ignores_reader(chunk, facts):
    """Wrong: forgets that a reader needs every row of the last layer."""
    return tail_from(chunk, TailFacts(tail_rows=facts.tail_rows,
                                      last_layer_is_attention=facts.last_layer_is_attention,
                                      even_head_grouping=facts.even_head_grouping))


@given(tail_examples())
def test_tail(example):
    check_tail(tail_from, example)


def test_catches_a_tail_on_a_short_chunk():
    assert_caught(tail_examples(), lambda ex: check_tail(tail_on_short_chunks, ex))


def test_catches_a_tail_that_ignores_the_reader():
    assert_caught(tail_examples(), lambda ex: check_tail(tail_ignores_reader, ex))


# --- PolicyConfig TOML round trip ------------------------------------------------------------
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


# --- Prompt digests of real tokens ------------------------------------------------------------
TOKENS = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=300)


@st.composite
def splittings(draw):
    """Tokens, and two ways of cutting them into real runs."""
    tokens = draw(TOKENS)

    def cut():
        points = draw(st.lists(st.integers(1, max(1, len(tokens) - 1)), max_size=6))
        edges = sorted({0, len(tokens), *(p for p in points if p < len(tokens))})
        return [tuple(tokens[a:b]) for a, b in zip(edges, edges[1:])]

    return tokens, cut(), cut()


def digests_of(runs) -> list[bytes]:
    """Digest of every prefix [0, P) of a real prompt built from `runs` (token tuples)."""
    p = Prompt(tuple(Run(0, len(r), r) for r in runs))
    return [p.digest(r) for r in range(len(p) + 1)]


def naive_digests(runs) -> list[bytes]:
    """Wrong (the code before the fix): a hash chain over the runs as the caller split them."""
    out, chain = [b""], b""
    for run in runs:
        for k in range(1, len(run) + 1):
            out.append(hashlib.blake2b(chain + repr(run[:k]).encode(), digest_size=16).digest())
        chain = out[-1]
    return out


def check_equal_prefixes(digests_fn, example) -> None:
    """Equal tokens [0, P) give equal digests at P, however the runs were split, and the
    same digests as Prompt.from_tokens of any prompt with that prefix."""
    tokens, a, b = example
    da, db = digests_fn(a), digests_fn(b)
    assert da == db, "digests depend on the run splitting"
    ref = Prompt.from_tokens(tokens + [7, 7])
    assert da == [ref.digest(r) for r in range(len(tokens) + 1)]


@st.composite
def different_tokens(draw):
    tokens = draw(TOKENS)
    where = draw(st.integers(0, len(tokens) - 1))
    other = list(tokens)
    other[where] = draw(st.integers(0, 2**31 - 1).filter(lambda t: t != tokens[where]))
    return tokens, other, where


def check_different_tokens(digests_fn, example) -> None:
    """Prompts equal up to row w and different at w: equal digests up to w, different after."""
    tokens, other, where = example
    da, db = digests_fn([tuple(tokens)]), digests_fn([tuple(other)])
    assert da[: where + 1] == db[: where + 1]
    assert all(x != y for x, y in zip(da[where + 1 :], db[where + 1 :]))


def length_only_digests(runs) -> list[bytes]:
    """Wrong: names a prefix by its length and first token only."""
    tokens = [t for r in runs for t in r]
    return [b""] + [hashlib.blake2b(repr((p, tokens[0])).encode(), digest_size=16).digest()
                    for p in range(1, len(tokens) + 1)]


@given(splittings())
def test_equal_prefixes_equal_digests(example):
    check_equal_prefixes(digests_of, example)


@given(different_tokens())
def test_different_tokens_different_digests(example):
    check_different_tokens(digests_of, example)


def test_catches_digests_that_depend_on_run_splitting():
    assert_caught(splittings(), lambda ex: check_equal_prefixes(naive_digests, ex))


def test_catches_digests_blind_to_token_values():
    assert_caught(different_tokens(), lambda ex: check_different_tokens(length_only_digests, ex))
