"""Rule 8 properties: the tail fires only on a last chunk of more than tail_rows rows of a
fitting model with no reader; a chunk whose logits nobody reads skips the whole last layer.

Each `check_*` runs against `tail_from` and against a planted wrong one.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from policy_strategies import assert_caught

from policy.plan import Chunk
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
