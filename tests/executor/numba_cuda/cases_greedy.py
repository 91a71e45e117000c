"""Kernel cases for the greedy pick on the device (greedy.argmax_rows) against np.argmax,
bit for bit: ties, NaN, -0.0 and +0.0, -inf rows, rows shorter and longer than a block's
threads. Run by test_kernels_simulated.py under the CUDA simulator, or directly with pytest
on a GPU. Outputs are poisoned before launch."""

from __future__ import annotations

import numpy as np
import pytest

from executor.numba_cuda import greedy
from executor.numba_cuda.device import poisoned, to_device
from tests.executor.numba_cuda.kernel_support import host, rng


def _check(logits: np.ndarray) -> None:
    with poisoned():
        got = host(greedy.argmax_rows(to_device(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=1).astype(np.int32))


@pytest.mark.parametrize("vocab", [1, 7, greedy.ARGMAX_THREADS + 3, 5 * greedy.ARGMAX_THREADS + 1])
def test_argmax_rows_equals_numpy_on_random_rows(vocab):
    _check(rng().normal(size=(3, vocab)).astype(np.float32))


def test_argmax_rows_ties_nan_zeros_and_infinities():
    n = 3 * greedy.ARGMAX_THREADS + 5
    r = rng()
    rows = np.full((7, n), -1.0, np.float32)
    ties = r.choice(n, 3, replace=False)
    rows[0, ties] = 2.0  # the lowest index of three maxima
    rows[1, [n - 1, 4]] = np.nan  # the first NaN, whatever the numbers
    rows[1, 0] = np.inf
    rows[2, :] = -np.inf  # every entry -inf: index 0
    rows[3, [9, 2]] = [0.0, -0.0]  # -0.0 == +0.0: the first of them
    rows[3, :] = np.where(rows[3] == -1.0, -5.0, rows[3])
    rows[4, :] = np.nan  # all NaN: index 0
    rows[5, n - 1] = np.inf  # the last entry
    rows[6, :] = r.integers(-3, 3, n).astype(np.float32)  # many ties, spread over every thread
    _check(rows)


def test_argmax_rows_checks_its_arguments():
    with pytest.raises(ValueError, match="logits"):
        greedy.argmax_rows(to_device(np.zeros((2, 4), np.float64)))
    with pytest.raises(ValueError, match="out"):
        greedy.argmax_rows(to_device(np.zeros((2, 4), np.float32)), out=to_device(np.zeros(3, np.int32)))
