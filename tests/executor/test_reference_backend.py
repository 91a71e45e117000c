"""Reference backend contracts: chunked equals whole, restore-then-continue equals
never-stopped, lanes are independent, state bytes follow the config."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor.backend import Backend
from executor.config import FULL, LINEAR
from executor.model import random_checkpoint
from executor.presets import preset
from executor.reference.backend import ReferenceBackend
from tests.executor.qwen_support import small_config
from tests.helpers import assert_close

PROMPT_ROWS = 150


@pytest.fixture(scope="module")
def backend(tmp_path_factory) -> ReferenceBackend:
    config = small_config(num_hidden_layers=5, layer_types=(LINEAR, FULL, LINEAR, LINEAR, FULL))
    return ReferenceBackend.from_dir(random_checkpoint(config, 11, tmp_path_factory.mktemp("ckpt")))


@pytest.fixture(scope="module")
def prompt(backend) -> list[int]:
    return [int(x) for x in np.random.default_rng(5).integers(0, backend.config.vocab_size, PROMPT_ROWS)]


@pytest.fixture(scope="module")
def whole(backend, prompt):
    state = backend.new_state()
    logits = backend.prefill(state, prompt, (0, PROMPT_ROWS))
    return logits, state


def _assert_states_close(backend, a, b, tol=1e-5):
    assert a.rows == b.rows
    for i in backend.config.linear_layers:
        assert_close(f"recurrent[{i}]", a.recurrent[i], b.recurrent[i], tol, rel=True)
        assert_close(f"conv_tail[{i}]", a.conv_tail[i], b.conv_tail[i], tol, rel=True)
    for i in backend.config.full_layers:
        assert_close(f"keys[{i}]", a.keys[i], b.keys[i], tol, rel=True)
        assert_close(f"values[{i}]", a.values[i], b.values[i], tol, rel=True)


def test_is_a_backend(backend):
    assert isinstance(backend, Backend)


cuts_strategy = st.lists(st.integers(1, PROMPT_ROWS - 1), max_size=5, unique=True).map(sorted)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=cuts_strategy)
def test_chunked_prefill_equals_whole(backend, prompt, whole, cuts):
    state = backend.new_state()
    bounds = [0, *cuts, PROMPT_ROWS]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        logits = backend.prefill(state, prompt, (lo, hi), want_logits=hi == PROMPT_ROWS)
        assert (logits is None) == (hi != PROMPT_ROWS)
    assert_close("last-row logits", whole[0], logits, 1e-5, rel=True)
    _assert_states_close(backend, whole[1], state)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(row=st.integers(1, PROMPT_ROWS - 1), decode_steps=st.integers(0, 3))
def test_restore_then_continue_equals_never_stopped(backend, prompt, row, decode_steps):
    steps = [int(t) for t in np.random.default_rng(row).integers(0, backend.config.vocab_size, 4)]
    straight = backend.new_state()
    backend.prefill(straight, prompt, (0, row), want_logits=False)
    payload = backend.snapshot(straight)
    logits = backend.prefill(straight, prompt, (row, PROMPT_ROWS))
    resumed = backend.restore(payload)
    again = backend.restore(payload)  # a payload restores any number of times
    resumed_logits = backend.prefill(resumed, prompt, (row, PROMPT_ROWS))
    assert np.array_equal(logits, resumed_logits)
    for token in steps[:decode_steps]:
        a = backend.decode([straight], [token])[0]
        b = backend.decode([resumed], [token])[0]
        assert np.array_equal(a, b)
    assert again.rows == row and payload.rows == row
    assert backend.payload_bytes(payload) == backend.config.state_bytes(row)


def test_snapshot_keeps_prompt_end_logits_and_is_immutable(backend, prompt, whole):
    payload = backend.snapshot(whole[1])
    assert np.array_equal(payload.logits, whole[0])
    with pytest.raises(ValueError):
        payload.segments[0].keys[backend.config.full_layers[0]][0, 0, 0] = 1.0
    restored = backend.restore(payload)
    assert np.array_equal(restored.logits, whole[0])


def test_decode_lanes_do_not_depend_on_each_other(backend, prompt):
    states = []
    for n in (20, 33, 70):
        s = backend.new_state()
        backend.prefill(s, prompt, (0, n), want_logits=False)
        states.append(s)
    solo = [backend.restore(backend.snapshot(s)) for s in states]
    together = backend.decode(states, [5, 6, 7])
    for lane, token in enumerate([5, 6, 7]):
        assert np.array_equal(together[lane], backend.decode([solo[lane]], [token])[0])
    assert [s.rows for s in states] == [21, 34, 71]


def test_decode_equals_prefill_of_the_same_row(backend, prompt):
    a = backend.new_state()
    backend.prefill(a, prompt, (0, 99), want_logits=False)
    decoded = backend.decode([a], [prompt[99]])[0]
    b = backend.new_state()
    assert_close("decode vs prefill", backend.prefill(b, prompt, (0, 100)), decoded, 1e-5, rel=True)


def test_prefill_rejects_bad_rows(backend, prompt):
    state = backend.new_state()
    with pytest.raises(ValueError, match="state holds 0 rows"):
        backend.prefill(state, prompt, (5, 10))
    with pytest.raises(ValueError, match="rows"):
        backend.prefill(state, prompt, (0, PROMPT_ROWS + 1))
    with pytest.raises(ValueError, match="token_ids"):
        backend.prefill(state, [0, backend.config.vocab_size], (0, 2))
    with pytest.raises(ValueError, match="token_ids"):
        backend.decode([state], [1, 2])


def test_state_bytes_formula_for_27b():
    config = preset("qwen3.5-27b")
    recurrent = 48 * 128 * 128 * 4
    conv = 3 * (2 * 16 * 128 + 48 * 128) * 2
    kv_row = 16 * 2 * 4 * 256 * 2
    assert config.fixed_state_bytes == 48 * (recurrent + conv)
    assert config.kv_bytes_per_row == kv_row == 65536
    assert config.state_bytes(4096) == 48 * (recurrent + conv) + 4096 * kv_row


def test_state_bytes_of_live_state(backend, whole):
    c = backend.config
    expected = (
        len(c.linear_layers)
        * (
            4 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
            + (c.linear_conv_kernel_dim - 1) * c.conv_channels * 2
        )
        + PROMPT_ROWS * len(c.full_layers) * 2 * c.num_key_value_heads * c.head_dim * 2
    )
    assert backend.state_bytes(whole[1]) == expected


def test_planted_wrong_restore_is_caught(backend, prompt, whole):
    """A restore that forgets the conv tails must fail the restore-equals-straight check."""
    state = backend.new_state()
    backend.prefill(state, prompt, (0, 90), want_logits=False)
    broken = backend.restore(backend.snapshot(state))
    for i in broken.conv_tail:
        broken.conv_tail[i][:] = 0.0
    logits = backend.prefill(broken, prompt, (90, PROMPT_ROWS))
    with pytest.raises(AssertionError, match="max abs error"):
        assert_close("planted", whole[0], logits, 1e-5, rel=True)


def test_a_chain_of_keeps_shares_kv_rows_and_resumes_exactly_through_a_ghost(backend, prompt):
    """Three keeps of one pass, each on the one below (the store's parent): each payload
    holds the fixed part and only the K/V rows above its base; with the middle one a ghost,
    restoring the top one equals the state that never stopped, bit for bit, and so does
    everything after it."""
    c = backend.config
    state = backend.new_state()
    chain = []
    for lo, hi in ((0, 40), (40, 90), (90, 120)):
        backend.prefill(state, prompt, (lo, hi), want_logits=False)
        chain.append(backend.snapshot(state, chain[-1] if chain else None))
    first, middle, top = chain
    assert [(p.rows, p.kv_from) for p in chain] == [(40, 0), (90, 40), (120, 90)]
    assert [backend.payload_bytes(p) for p in chain] == [c.state_bytes(40), c.state_bytes(50), c.state_bytes(30)]
    assert middle.segments[0] is first.segments[0] and top.segments[:2] == middle.segments  # shared, not copied
    ghost = backend.ghost(middle)
    assert backend.payload_bytes(ghost) == 50 * c.kv_bytes_per_row and ghost.segments == middle.segments
    with pytest.raises(ValueError, match="ghost"):
        backend.restore(ghost)
    with pytest.raises(ValueError, match="base holds 120 rows"):
        backend.snapshot(backend.restore(first), top)
    revived = backend.snapshot(backend.restore(middle), ghost)  # a ghost kept again: fixed part only
    assert (revived.kv_from, backend.payload_bytes(revived)) == (40, c.state_bytes(50))
    assert revived.segments == ghost.segments
    del middle, chain
    resumed = backend.restore(top)
    for i in c.linear_layers:
        assert np.array_equal(resumed.recurrent[i], state.recurrent[i])
        assert np.array_equal(resumed.conv_tail[i], state.conv_tail[i])
    for i in c.full_layers:
        assert np.array_equal(resumed.keys[i], state.keys[i]) and np.array_equal(resumed.values[i], state.values[i])
    want = backend.prefill(state, prompt, (120, PROMPT_ROWS))
    assert np.array_equal(backend.prefill(resumed, prompt, (120, PROMPT_ROWS)), want)
    assert np.array_equal(backend.decode([resumed], [7])[0], backend.decode([state], [7])[0])


def test_serve_warm_up_runs_every_kind_of_backend_call(backend):
    """executor.serve.warm_up compiles what the first request would: prefill, a keep, a keep
    chained on it, its restore and a decode, and gives its states back."""
    from executor.serve import warm_up

    calls = []

    class Recording:
        config = backend.config

        def __getattr__(self, name):
            def call(*args):
                calls.append(name if name != "snapshot" else ("snapshot", len(args) > 1))
                return getattr(backend, name)(*args)
            return call

        def prefill(self, state, ids, rows, want_logits=True):
            calls.append("prefill")
            return backend.prefill(state, ids, rows, want_logits=want_logits)

        def release(self, state):
            calls.append("release")

    warm_up(Recording())
    assert calls == ["new_state", "prefill", ("snapshot", False), "prefill", ("snapshot", True), "restore",
                     "decode", "release", "release"]
