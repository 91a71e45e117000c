"""Greedy, seeded temperature / top-p sampling, and top-k log-probabilities."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bench.sampling import FixedDraw, full_sort_sample
from executor.sampling import SamplingParams, new_rng, sample, top_logprobs
from tests.helpers import assert_close

LOGITS = np.array([1.0, 3.0, 3.0, -2.0, 0.5, 2.9], np.float32)


def test_greedy_takes_the_lowest_id_among_ties():
    assert sample(LOGITS, SamplingParams(), new_rng(0)) == 1


def test_greedy_needs_no_generator_and_draws_nothing_from_one():
    assert SamplingParams().is_greedy and SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy and not SamplingParams(temperature=0.7, top_k=2).is_greedy
    assert sample(LOGITS, SamplingParams(), None) == 1
    assert sample(LOGITS, SamplingParams(temperature=0.7, top_k=1), None) == 1
    rng = new_rng(5)
    sample(LOGITS, SamplingParams(), rng)
    assert rng.random() == new_rng(5).random()


def test_a_seed_reproduces_the_draws():
    params = SamplingParams(temperature=1.3, top_p=0.9)
    a = [sample(LOGITS, params, rng) for rng in [new_rng(7)] for _ in range(50)]
    rng = new_rng(7)
    b = [sample(LOGITS, params, rng) for _ in range(50)]
    assert a == b and len(set(a)) > 1


def test_small_top_p_keeps_only_the_head():
    params = SamplingParams(temperature=1.0, top_p=1e-6)
    rng = new_rng(1)
    assert {sample(LOGITS, params, rng) for _ in range(50)} == {1}
    nucleus = SamplingParams(temperature=1.0, top_p=0.6)
    assert {sample(LOGITS, nucleus, rng) for _ in range(200)} <= {1, 2, 5}


def test_sampling_follows_the_softmax():
    params = SamplingParams(temperature=2.0)
    rng = new_rng(3)
    counts = np.bincount([sample(LOGITS, params, rng) for _ in range(4000)], minlength=len(LOGITS))
    p = np.exp(LOGITS / 2.0) / np.exp(LOGITS / 2.0).sum()
    assert_close("frequencies", p, counts / 4000, 0.03)


def test_top_logprobs():
    pairs = top_logprobs(LOGITS, 3)
    assert [i for i, _ in pairs] == [1, 2, 5]
    full = LOGITS.astype(np.float64) - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    assert_close("logprobs", full[[1, 2, 5]], [lp for _, lp in pairs], 1e-12)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"logprobs": -1}, "logprobs"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(st.sampled_from([-30.0, -3.0, -1.0, 0.0, 0.5, 2.0, 2.0, 7.5]) | st.floats(-40, 40, width=32),
                    min_size=1, max_size=300),
    temperature=st.sampled_from([0.05, 0.3, 1.0, 2.5]),
    top_p=st.sampled_from([1e-6, 0.1, 0.5, 0.9, 0.999, 1.0]),
    u=st.floats(0.0, 1.0, exclude_max=True),
)
def test_nucleus_candidates_pick_what_a_full_sort_picks(logits, temperature, top_p, u):
    """`sample` sorts only the tokens above a probability (NUCLEUS_SPANS); for every draw
    u it picks the token a stable sort of the whole vocabulary picks (ties included)."""
    x = np.asarray(logits, np.float32)
    params = SamplingParams(temperature=temperature, top_p=top_p)
    assert sample(x, params, FixedDraw(u)) == full_sort_sample(x, params, u)


def test_nucleus_of_a_large_vocabulary_matches_the_full_sort():
    rng = np.random.default_rng(5)
    for scale, top_p in ((10.0, 0.9), (3.0, 0.5), (1.0, 0.2)):
        x = (rng.standard_normal(248_320) * scale).astype(np.float32)
        params = SamplingParams(temperature=0.7, top_p=top_p)
        for u in (0.0, 0.37, 0.999):
            assert sample(x, params, FixedDraw(u)) == full_sort_sample(x, params, u)


def _filtered_reference(logits: np.ndarray, params: SamplingParams, u: float) -> int:
    """`sample`'s definition with top_k / min_p, from a stable sort of every token: the
    top_k first (ties by lower id), then p >= min_p * max p, then the top_p nucleus of the
    rest's mass, renormalised; u picks in that order."""
    scaled = np.asarray(logits, np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())
    if not params.top_k and not params.min_p and params.top_p >= 1.0:
        # no limit at all: `sample` draws in id order (its docstring). The same law as the
        # sorted order, but another token where u lands in a token's sliver of mass: CI drew
        # logits (-30, -3) at temperature 0.05 with u = 0.0, where token 0 holds 1e-235
        cumulative = np.cumsum(probs)
        return int(min(np.searchsorted(cumulative, u * cumulative[-1], side="right"), probs.size - 1))
    order = np.argsort(-probs, kind="stable")
    if params.top_k:
        order = order[: params.top_k]
    order = order[probs[order] >= params.min_p]
    cumulative = np.cumsum(probs[order])
    keep = order.size
    if params.top_p < 1.0:
        keep = min(int(np.searchsorted(cumulative, params.top_p * cumulative[-1], side="left")) + 1, order.size)
    kept = cumulative[:keep] / cumulative[keep - 1]
    return int(order[min(int(np.searchsorted(kept, u, side="right")), keep - 1)])


@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(st.sampled_from([-30.0, -3.0, -1.0, 0.0, 0.5, 2.0, 2.0, 7.5]) | st.floats(-40, 40, width=32),
                    min_size=1, max_size=300),
    temperature=st.sampled_from([0.05, 0.3, 1.0, 2.5]),
    top_p=st.sampled_from([1e-6, 0.5, 0.95, 1.0]),
    top_k=st.sampled_from([0, 2, 3, 20, 500]),
    min_p=st.sampled_from([0.0, 1e-9, 0.05, 0.5, 1.0]),
    u=st.floats(0.0, 1.0, exclude_max=True),
)
@example(logits=[-30.0, -3.0], temperature=0.05, top_p=1.0, top_k=0, min_p=0.0, u=0.0)  # found by CI
def test_top_k_and_min_p_pick_what_their_definition_picks(logits, temperature, top_p, top_k, min_p, u):
    """top_k, then min_p, then top_p (vLLM's order), ties by lower id, for every draw u."""
    x = np.asarray(logits, np.float32)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    assert sample(x, params, FixedDraw(u)) == _filtered_reference(x, params, u)


def test_top_k_limits_the_draws_to_the_k_most_likely():
    """Qwen3.5's recommended top_k 20 over a real-size vocabulary: every draw of a seeded
    request is one of the 20 most likely tokens, the draws spread over more than one of
    them, and top_k 1 is greedy."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(248_320) * 2.0).astype(np.float32)
    top20 = set(np.argsort(-x, kind="stable")[:20].tolist())
    draws = new_rng(11)
    picks = [sample(x, SamplingParams(temperature=1.0, top_p=0.95, top_k=20), draws) for _ in range(200)]
    assert set(picks) <= top20 and len(set(picks)) > 5
    assert sample(x, SamplingParams(temperature=0.7, top_k=1), new_rng(1)) == int(np.argmax(x))
    assert sample(x, SamplingParams(temperature=0.7, min_p=1.0), FixedDraw(0.99)) == int(np.argmax(x))
