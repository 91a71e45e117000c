"""Greedy, seeded temperature / top-p sampling, and top-k log-probabilities."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.sampling import FixedDraw, full_sort_sample
from executor.sampling import SamplingParams, new_rng, sample, top_logprobs
from tests.helpers import assert_close

LOGITS = np.array([1.0, 3.0, 3.0, -2.0, 0.5, 2.9], np.float32)


def test_greedy_takes_the_lowest_id_among_ties():
    assert sample(LOGITS, SamplingParams(), new_rng(0)) == 1


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
