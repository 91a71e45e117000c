"""Kept logits are shared when nothing can change them (executor.backend.frozen_logits, used by
both backends' snapshots and by payloads.snapshot): the GPU backend's prefill logits are
read-only and owned by the call, so a first-token step's keep no longer copies them (1 MB
at Qwen3.5's vocabulary, up to four times). Writable arrays, and read-only views that would
pin a larger array (one lane of a decode round), are still copied."""

from __future__ import annotations

import numpy as np
import pytest

from executor.backend import frozen_logits, immutable


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def test_a_writable_array_is_copied_read_only():
    logits = np.arange(8, dtype=np.float32)
    kept = frozen_logits(logits)
    assert kept is not logits and not kept.flags.writeable
    logits[0] = 99.0
    assert kept[0] == 0.0


def test_a_read_only_owner_and_its_whole_row_view_are_shared():
    owner = _read_only(np.arange(8, dtype=np.float32))
    assert immutable(owner) and frozen_logits(owner) is owner
    row = _read_only(np.arange(8, dtype=np.float32).reshape(1, 8).copy())[0]  # prefill: [1, vocab] -> [vocab]
    assert row.base is not None and immutable(row) and frozen_logits(row) is row
    buffer = np.zeros(32, np.uint8)  # as numba's copy_to_host: a float view of a byte buffer
    host = np.ndarray(shape=(1, 8), dtype=np.float32, buffer=buffer)
    host.flags.writeable = False
    buffer.flags.writeable = False
    row = host[0]
    assert immutable(row) and frozen_logits(row) is row


@pytest.mark.parametrize("case", ["lane-of-a-round", "writable-base", "float64"])
def test_arrays_that_could_change_or_pin_more_are_copied(case):
    if case == "lane-of-a-round":  # a payload keeping the view would keep all 16 lanes
        logits = _read_only(np.zeros((16, 8), np.float32))[3]
    elif case == "writable-base":
        base = np.zeros((1, 8), np.float32)
        logits = base[0]
        logits.flags.writeable = False
    else:
        logits = _read_only(np.zeros(8, np.float64))
    kept = frozen_logits(logits)
    assert kept is not logits and kept.dtype == np.float32 and not kept.flags.writeable
    assert kept.base is None
    assert not immutable(logits) or case == "float64"


def test_none_stays_none():
    assert frozen_logits(None) is None
