"""The CPU side of bench/delta_walk.py (its GPU side ran as .dbg/s40/time_walk.py in session 40):
the chunk parser, and inputs equal to the tests' delta_inputs recipe that run used."""

import numpy as np
import pytest

from bench.delta_walk import inputs, main, parse_chunks
from tests.executor.numba_cuda.kernel_support import delta_inputs


def test_chunks_parse_and_bad_ones_name_the_item():
    assert parse_chunks("8192@24576, 32768@0,64") == [(8192, 24576), (32768, 0), (64, 0)]
    for bad in ("x@1", "0@5", "5@-1"):
        with pytest.raises(ValueError, match="--chunks item"):
            parse_chunks(bad)


def test_inputs_are_the_recipe_of_session_40s_run():
    r = np.random.default_rng(7)
    q, k, v, g, beta = delta_inputs(r, 70, 16, 3, 128, 128)
    state0 = (r.normal(size=(1, 3, 128, 128)) * 0.3).astype(np.float32)
    got = inputs(3, 70)
    np.testing.assert_array_equal(got[0], (q * np.float32(128**-0.5)).astype(np.float32))
    np.testing.assert_array_equal(got[1], k)
    np.testing.assert_array_equal(got[2][:, 4:], v.reshape(70, -1))
    assert not got[2][:, :4].any()
    np.testing.assert_array_equal(got[3], (g * np.float32(0.01)).astype(np.float32))
    np.testing.assert_array_equal(got[4], beta)
    np.testing.assert_array_equal(got[5], state0)


def test_runs_below_one_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--runs", "0"])
    assert "--runs must be >= 1" in capsys.readouterr().err
