"""The tail (DESIGN rule 8): in a chunk's last layer, q/attention/gate/o_proj/MLP run
only over the rows whose logits are read. Kernels live in the executor; this is the rule.
"""

from __future__ import annotations

import attrs

from policy.plan import Chunk


@attrs.frozen(kw_only=True)
class TailFacts:
    """Model and request facts the tail depends on.

    tail_rows: rows the tail keeps (PolicyConfig.tail_rows, default 128: above the 16-row
      decode GEMV limit, so the tail's GEMMs keep their per-row bits).
    last_layer_is_attention: the model's last layer is full attention (Qwen3.5: yes).
    even_head_grouping: attention heads split evenly over KV heads (heads % kv_heads == 0).
    has_reader: something reads the last layer's hidden rows besides the kept row
      (hidden-state readouts, an MTP drafter tapping the last layer, hooks, image rows).
    """

    tail_rows: int
    last_layer_is_attention: bool = True
    even_head_grouping: bool = True
    has_reader: bool = False

    def __attrs_post_init__(self) -> None:
        if self.tail_rows <= 0:
            raise ValueError(f"tail_rows must be > 0, got {self.tail_rows}")

    @property
    def model_fits(self) -> bool:
        """The model allows a tail at all: last layer attention, even grouping, no reader."""
        return self.last_layer_is_attention and self.even_head_grouping and not self.has_reader


def tail_from(chunk: Chunk, facts: TailFacts) -> int | None:
    """First row of the chunk's last-layer tail, or None for the full last layer (rule 8).

    - No reader and the chunk's logits are not read: returns chunk.end (an empty tail: the
      last layer writes K/V for every row and skips q/o/MLP, and the LM head is skipped).
    - Logits read, chunk.rows > tail_rows, model fits: returns chunk.end - tail_rows.
    - Otherwise None (every row runs the whole last layer).
    """
    if not facts.model_fits:
        return None
    if not chunk.reads_logits:
        return chunk.end
    if chunk.rows > facts.tail_rows:
        return chunk.end - facts.tail_rows
    return None
