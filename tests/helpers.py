"""Shared test helpers (no fixtures): `assert_close`."""

from __future__ import annotations

import numpy as np


def assert_close(name: str, ref, out, tol: float, *, rel: bool = False) -> None:
    """Assert `out` matches `ref` elementwise, reporting max abs and relative RMS error.

    Passes iff max |out - ref| <= tol (rel=False), or <= tol * max |ref| (rel=True).
    Shapes must match; NaN anywhere fails.
    """
    ref = np.asarray(ref, dtype=np.float64)
    out = np.asarray(out, dtype=np.float64)
    assert ref.shape == out.shape, f"{name}: shape {out.shape} != reference shape {ref.shape}"
    diff = np.abs(out - ref)
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.sqrt(np.mean(ref * ref))) if ref.size else 0.0
    rel_rms = float(np.sqrt(np.mean(diff * diff)) / scale) if scale > 0 else max_abs
    bound = tol * (float(np.abs(ref).max()) if rel and ref.size else 1.0)
    finite = bool(np.isfinite(out).all() and np.isfinite(ref).all())
    assert finite and max_abs <= bound, (
        f"{name}: max abs error {max_abs:.3e} (bound {bound:.3e}), relative RMS error {rel_rms:.3e}"
        + ("" if finite else ", non-finite values")
    )
