"""Prompt digest properties for real tokens: equal prefixes give equal digests however the
runs were split (and equal to Prompt.from_tokens); different tokens give different digests.

Each `check_*` runs over a digest function: the real Prompt's, and a planted wrong one.
"""

from __future__ import annotations

import hashlib

from hypothesis import given
from hypothesis import strategies as st
from policy_strategies import assert_caught

from policy.prefix import Prompt, Run

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
