"""The tail rule (rule 8): when a chunk's last layer runs only over its last tail_rows rows."""

from __future__ import annotations

import pytest

from policy.plan import Chunk
from policy.tail import TailFacts, tail_from

FACTS = TailFacts(tail_rows=128)


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        (0, 1, None),
        (0, 128, None),
        (4096, 4224, None),
        (0, 129, 1),
        (0, 4095, 3967),
        (0, 4096, 3968),
        (4096, 9000, 8872),
        (8999, 9000, None),
    ],
    ids=["1-row", "128-rows", "128-rows-late", "129-rows", "4095-rows", "4096-rows", "4904-rows", "last-row"],
)
def test_tail_of_a_last_chunk(start, end, expected):
    assert tail_from(Chunk(start, end, reads_logits=True), FACTS) == expected


@pytest.mark.parametrize(("start", "end"), [(0, 1), (0, 128), (0, 4096), (4096, 9000)],
                         ids=["1-row", "128-rows", "4096-rows", "4904-rows"])
def test_no_logits_read_skips_the_whole_last_layer(start, end):
    assert tail_from(Chunk(start, end, reads_logits=False), FACTS) == end


@pytest.mark.parametrize("reads_logits", [True, False], ids=["last-chunk", "inner-chunk"])
@pytest.mark.parametrize(
    "facts",
    [
        TailFacts(tail_rows=128, has_reader=True),
        TailFacts(tail_rows=128, last_layer_is_attention=False),
        TailFacts(tail_rows=128, even_head_grouping=False),
    ],
    ids=["reader", "linear-last-layer", "uneven-grouping"],
)
def test_no_tail_when_the_model_does_not_fit(facts, reads_logits):
    assert not facts.model_fits
    assert tail_from(Chunk(0, 4096, reads_logits=reads_logits), facts) is None


def test_tail_rows_setting():
    assert tail_from(Chunk(0, 100, reads_logits=True), TailFacts(tail_rows=16)) == 84
    assert tail_from(Chunk(0, 16, reads_logits=True), TailFacts(tail_rows=16)) is None
    assert tail_from(Chunk(0, 17, reads_logits=True), TailFacts(tail_rows=16)) == 1


@pytest.mark.parametrize("bad", [0, -1], ids=["zero", "negative"])
def test_tail_rows_must_be_positive(bad):
    with pytest.raises(ValueError, match="tail_rows must be > 0"):
        TailFacts(tail_rows=bad)


def test_tail_facts_are_frozen():
    with pytest.raises(AttributeError):
        FACTS.has_reader = True  # type: ignore[misc]
