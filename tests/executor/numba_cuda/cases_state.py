"""Kernel cases of the state pool (executor/numba_cuda/state.py): a payload holds exactly a
slot's state in the documented order, packs and unpacks in a few strided-copy launches, and
`take` zeroes a slot unless told a restore will overwrite it. Run under the CUDA simulator or
on a GPU; payload buffers poisoned.
"""

from __future__ import annotations

import numpy as np
import pytest

from executor.numba_cuda.device import poisoned, to_device
from executor.numba_cuda.state import StatePool, copy_rows
from tests.executor.numba_cuda.kernel_support import rng
from tests.executor.qwen_support import small_config


@pytest.fixture(scope="module")
def pool():
    """One pool for the module (building one zeroes its K/V: slow under the simulator)."""
    return StatePool(small_config(), 3, 40)


def _fill(pool, seed=0):
    """Random contents in every slot; returns the host copies."""
    r = np.random.default_rng(seed)
    hosts = {}
    for name in ("recurrent", "conv", "keys", "values"):
        array = getattr(pool, name)
        if array.dtype == np.float32:
            host = r.standard_normal(array.shape).astype(np.float32)
        else:
            host = r.integers(0, 0x7F00, array.shape).astype(np.uint16)
        array.copy_to_device(host)
        hosts[name] = host
    return hosts


@pytest.mark.parametrize("rows", [0, 37])
def test_pack_holds_the_slot_in_payload_order_and_unpack_restores_it(pool, rows):
    config = pool.config
    h = _fill(pool, seed=rows)
    with poisoned():
        data = pool.pack(2, rows)
    payload = data.copy_to_host()
    assert payload.shape[0] == config.state_bytes(rows)
    expected = b"".join([
        h["recurrent"][:, 2].tobytes(), h["conv"][:, 2].tobytes(),
        h["keys"][:, 2, :rows].tobytes(), h["values"][:, 2, :rows].tobytes(),
    ])
    assert payload.tobytes() == expected
    pool.unpack(data, 0, rows)
    for name in ("recurrent", "conv"):
        got = getattr(pool, name).copy_to_host()
        np.testing.assert_array_equal(got[:, 0], h[name][:, 2])
        np.testing.assert_array_equal(got[:, 1], h[name][:, 1])  # other slots untouched
    for name in ("keys", "values"):
        got = getattr(pool, name).copy_to_host()
        np.testing.assert_array_equal(got[:, 0, :rows], h[name][:, 2, :rows])
        np.testing.assert_array_equal(got[:, 0, rows:], h[name][:, 0, rows:])  # rows past the payload untouched
    with pytest.raises(ValueError, match="payload"):
        pool.unpack(data, 0, rows + 1)


def test_fixed_part_and_row_segments_pack_what_they_name_and_unpack_it(pool):
    """pack_fixed: recurrent then conv of one slot; pack_rows: K then V rows [a, b) of every
    full layer; unpacking them into another slot writes those and nothing else."""
    config = pool.config
    h = _fill(pool, seed=3)
    with poisoned():
        fixed = pool.pack_fixed(2)
        low, high = pool.pack_rows(2, 0, 11), pool.pack_rows(2, 11, 29)
    assert fixed.copy_to_host().tobytes() == h["recurrent"][:, 2].tobytes() + h["conv"][:, 2].tobytes()
    assert fixed.shape[0] == config.state_bytes(0)
    for seg, (a, b) in ((low, (0, 11)), (high, (11, 29))):
        assert (seg.start, seg.end, seg.nbytes) == (a, b, (b - a) * config.kv_bytes_per_row)
        got = seg.data.copy_to_host()
        assert got[0].tobytes() == h["keys"][:, 2, a:b].tobytes() and got[1].tobytes() == h["values"][:, 2, a:b].tobytes()
    pool.unpack_fixed(fixed, 0)
    pool.unpack_rows(high, 0)  # any order: each segment writes only its rows
    pool.unpack_rows(low, 0)
    for name in ("recurrent", "conv"):
        got = getattr(pool, name).copy_to_host()
        np.testing.assert_array_equal(got[:, 0], h[name][:, 2])
        np.testing.assert_array_equal(got[:, 1], h[name][:, 1])
    for name in ("keys", "values"):
        got = getattr(pool, name).copy_to_host()
        np.testing.assert_array_equal(got[:, 0, :29], h[name][:, 2, :29])
        np.testing.assert_array_equal(got[:, 0, 29:], h[name][:, 0, 29:])  # rows past the segments untouched
        np.testing.assert_array_equal(got[:, 1], h[name][:, 1])
    with pytest.raises(ValueError, match="fixed part"):
        pool.unpack_fixed(high.data.reshape(high.data.size).view(np.uint8), 0)
    with pytest.raises(ValueError, match="outside"):
        pool.pack_rows(2, 5, 5)
    with pytest.raises(ValueError, match="outside"):
        pool.pack_rows(2, 30, pool.capacity_rows + 1)


def test_payload_buffers_come_from_the_pool_memory_when_set(pool):
    """With `memory` set (the backend's reserve_cache), pack_fixed and pack_rows allocate
    there, each exactly its bytes; other buffers do not."""
    from numba import cuda

    class Recorder:
        def __init__(self):
            self.asked = []

        def array(self, shape, dtype, stream=0):
            self.asked.append(int(np.prod(shape)) * np.dtype(dtype).itemsize)
            return cuda.device_array(shape, dtype=dtype)

    config = pool.config
    h = _fill(pool, seed=4)
    pool.memory = Recorder()
    try:
        fixed, seg = pool.pack_fixed(1), pool.pack_rows(1, 3, 10)
        whole = pool.pack(1, 5)
    finally:
        recorder, pool.memory = pool.memory, None
    assert recorder.asked == [config.state_bytes(0), 7 * config.kv_bytes_per_row]
    assert fixed.copy_to_host().tobytes() == h["recurrent"][:, 1].tobytes() + h["conv"][:, 1].tobytes()
    assert seg.data.copy_to_host()[0].tobytes() == h["keys"][:, 1, 3:10].tobytes()
    assert whole.shape[0] == config.state_bytes(5)


def test_take_zeroes_a_slot_unless_a_restore_overwrites_it(pool):
    h = _fill(pool)
    pool._free = [2, 1, 0]
    first = pool.take()
    assert not pool.recurrent.copy_to_host()[:, first].any() and not pool.conv.copy_to_host()[:, first].any()
    np.testing.assert_array_equal(pool.recurrent.copy_to_host()[:, 1], h["recurrent"][:, 1])
    second = pool.take(zero=False)
    np.testing.assert_array_equal(pool.recurrent.copy_to_host()[:, second], h["recurrent"][:, second])


def test_copy_rows_copies_strided_views_and_checks_shapes():
    r = rng()
    src = r.standard_normal((5, 3, 700)).astype(np.float32)
    dst = np.zeros((5, 700), np.float32)
    d_src, d_dst = to_device(src), to_device(dst)
    copy_rows(d_src[:, 1], d_dst)
    np.testing.assert_array_equal(d_dst.copy_to_host(), src[:, 1])
    with pytest.raises(ValueError, match="copy of"):
        copy_rows(d_src[:, 1, :600], d_dst)


def test_a_pair_copy_of_two_shapes_and_dtypes_writes_each_pair_and_nothing_else():
    """`_copy_pair` with pairs of different rows, widths and dtypes (a fixed part's f32
    recurrent matrices and bf16 conv tails go in one launch): each destination gets its
    source, past-the-end destination bytes stay poisoned; a mismatched pair is named."""
    from executor.numba_cuda.state import _copy_pair

    r = rng()
    a = r.standard_normal((4, 2, 1500)).astype(np.float32)
    b = r.integers(0, 0x7F00, (7, 90)).astype(np.uint16)
    dst_a, dst_b = np.full((4, 1600), -7.0, np.float32), np.full((7, 95), 0xFFFF, np.uint16)
    d_a, d_b, d_dst_a, d_dst_b = to_device(a), to_device(b), to_device(dst_a), to_device(dst_b)
    _copy_pair(d_a[:, 1], d_dst_a[:, :1500], d_b, d_dst_b[:, :90])
    got_a, got_b = d_dst_a.copy_to_host(), d_dst_b.copy_to_host()
    np.testing.assert_array_equal(got_a[:, :1500], a[:, 1])
    np.testing.assert_array_equal(got_b[:, :90], b)
    assert (got_a[:, 1500:] == -7.0).all() and (got_b[:, 90:] == 0xFFFF).all()
    with pytest.raises(ValueError, match="mismatched"):
        _copy_pair(d_a[:, 1], d_dst_a[:, :1500], d_b, d_dst_b[:, :91])
