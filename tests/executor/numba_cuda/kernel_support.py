"""Helpers for the kernel cases: random inputs, bf16 round trips, unwritten-output checks.

Imported only by the `cases_*.py` files, which run under the CUDA simulator in a
subprocess (test_kernels_simulated.py) or directly on a GPU.
"""

from __future__ import annotations

import numpy as np

from executor.safetensors_file import bf16_to_f32, f32_to_bf16


def rng() -> np.random.Generator:
    """Fresh random inputs on every run (the seed is printed on failure by the caller)."""
    return np.random.default_rng()


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16, as bits (uint16)."""
    return f32_to_bf16(np.asarray(x, np.float32))


def as_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits to float32."""
    return bf16_to_f32(bits)


def host(array) -> np.ndarray:
    """Device array to host, asserting every element was written (no poison left)."""
    out = array.copy_to_host()
    values = bf16_to_f32(out) if out.dtype == np.uint16 else out
    if values.dtype.kind == "f":
        assert np.isfinite(values).all(), f"{np.count_nonzero(~np.isfinite(values))} elements unwritten or non-finite"
    return out
