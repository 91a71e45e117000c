"""flash_attention.cu's entry points against attention_flash.VARIANTS, without a GPU: every
(head_dim, warps, stages) the Python side may ask for is instantiated in the source, and
every warps count has the default ring depth (a missing one fails only on a GPU, at launch)."""

from __future__ import annotations

import re

from executor.numba_cuda import attention_flash

ENTRY = re.compile(r"^FLASH_ENTRY\((\d+), (\d+), (\d+), (\d+)\)$", re.M)


def test_the_source_instantiates_exactly_the_variants():
    entries = {tuple(int(x) for x in m) for m in ENTRY.findall(attention_flash.SOURCE.read_text())}
    assert {(d, w, s) for d, w, bn, s in entries} == attention_flash.VARIANTS
    assert {bn for _, _, bn, _ in entries} == {attention_flash.BLOCK_KEYS}


def test_every_variant_s_warps_count_runs_at_the_default_ring_depth():
    for head_dim, warps, _ in attention_flash.VARIANTS:
        assert (head_dim, warps, attention_flash.STAGES) in attention_flash.VARIANTS, (head_dim, warps)
    assert all((d, w, attention_flash.STAGES) in attention_flash.VARIANTS for d, w in attention_flash.WARPS.items())


def test_shared_bytes_of_the_ring():
    assert attention_flash.shared_bytes(256, 1) == 0  # two static buffers
    assert attention_flash.shared_bytes(256, 3) == 3 * 2 * 32 * 264 * 2 == 101_376
