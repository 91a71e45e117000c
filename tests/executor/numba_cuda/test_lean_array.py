"""`LeanArray`'s metadata against NumPy's, without a GPU (executor/numba_cuda/device.py).

A LeanArray is a pointer, shape, strides and dtype: every view it builds (indexing, reshape,
view(dtype)) must land on the same bytes NumPy's view of a host array would, and its
`launch_key` must be the numba layout numba-cuda gives the same array, or a launch would run
a kernel compiled for another layout. Here the pointer is a host address (only metadata is
read); on a GPU, tests/executor/numba_cuda/test_gpu_backend.py checks the same views
against numba's and the whole forward's bits.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.numba_cuda import launch
from executor.numba_cuda.device import EMPTY_LAYOUT, LeanArray, layout_of


def _lean(host: np.ndarray) -> LeanArray:
    return LeanArray(host.__array_interface__["data"][0], host.shape, host.strides, host.dtype, host)


def _same(lean: LeanArray, host: np.ndarray) -> None:
    assert lean.ptr == host.__array_interface__["data"][0]
    assert lean.shape == host.shape and lean.strides == host.strides and lean.dtype == host.dtype
    assert lean.size == host.size and lean.ndim == host.ndim and lean.nbytes == host.nbytes


def _numpy_layout(host: np.ndarray) -> str:
    if host.size and 0 in host.strides:
        return "A"
    return "C" if host.flags.c_contiguous else "F" if host.flags.f_contiguous else "A"


@st.composite
def _arrays(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from([np.float32, np.uint16, np.int32, np.uint8]))
    base = np.zeros(shape, dtype)
    if draw(st.booleans()):  # a transposed or sliced parent: any strides
        base = base.transpose(draw(st.permutations(range(ndim))))
    return base


@st.composite
def _keys(draw, shape):
    items = []
    for dim in shape[: draw(st.integers(1, len(shape)))]:
        if draw(st.booleans()):
            lo = draw(st.integers(-dim - 1, dim + 1))
            hi = draw(st.one_of(st.none(), st.integers(-dim - 1, dim + 1)))
            items.append(slice(lo, hi))
        else:
            items.append(draw(st.integers(-dim, dim - 1)))
    if all(isinstance(i, int) for i in items) and len(items) == len(shape):
        items[-1] = slice(None)  # NumPy returns a scalar there
    return tuple(items) if len(items) > 1 or draw(st.booleans()) else items[0]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_indexing_lands_on_numpy_s_bytes(data):
    host = data.draw(_arrays())
    key = data.draw(_keys(host.shape))
    view, want = _lean(host)[key], host[key]
    _same(view, want)
    layout = layout_of(want.shape, want.strides, want.dtype.itemsize) if want.size else EMPTY_LAYOUT
    assert view.launch_key == (want.dtype, want.ndim, layout)
    if want.size and view.ndim:  # views of views too
        _same(view[0:1], want[0:1])


@settings(max_examples=300, deadline=None)
@given(_arrays())
def test_layout_is_numpy_s_contiguity(host):
    assert layout_of(host.shape, host.strides, host.itemsize) == _numpy_layout(host)
    assert _lean(host).is_c_contiguous() == host.flags.c_contiguous


@pytest.mark.parametrize("shape, strides, layout", [
    ((3, 5), (20, 4), "C"), ((3, 5), (4, 12), "F"), ((3, 5), (40, 4), "A"),
    ((1, 5), (999, 4), "C"),  # an axis of length 1 has any stride
    ((5, 1), (4, 4), "C"), ((0, 5), (20, 4), "C"), ((3, 5), (0, 4), "A"), ((), (), "C"),
])
def test_layout_of_named_cases(shape, strides, layout):
    assert layout_of(shape, strides, 4) == layout


def test_out_of_range_index_and_bad_reshape_raise():
    lean = _lean(np.zeros((4, 6), np.float32))
    with pytest.raises(IndexError, match="out of bounds for axis 1"):
        lean[0, 6]
    with pytest.raises(IndexError, match="3 indices"):
        lean[0, 0, 0]
    with pytest.raises(ValueError, match="cannot reshape an array of size 24"):
        lean.reshape(5, 5)
    with pytest.raises(ValueError, match="contiguous in its last axis"):
        LeanArray(0, (4, 3), (24, 8), np.float32, None).view(np.uint16)
    with pytest.raises(ValueError, match="not a multiple"):
        LeanArray(0, (4, 3), (12, 4), np.float32, None)[:, :1].view(np.float64)


@pytest.mark.parametrize("shape, new", [((4, 6), (24,)), ((4, 6), (2, 3, 4)), ((2, 3, 4), (6, 4))])
def test_reshape_and_view_equal_numpy_s(shape, new):
    host = np.zeros(shape, np.uint16)
    _same(_lean(host).reshape(new), host.reshape(new))
    _same(_lean(host).reshape(*new), host.reshape(new))
    _same(_lean(host).view(np.uint32), host.view(np.uint32))
    _same(_lean(host)[1:].view(np.uint8), host[1:].view(np.uint8))


@pytest.mark.parametrize("offset, shape, dtype", [(0, (3, 4), np.float32), (48, (2, 5), np.uint16), (68, (1,), np.uint32),
                                                   (72, (0, 3), np.float32)])
def test_at_equals_numpy_s_slice_view_reshape(offset, shape, dtype):
    """`at(offset, shape, dtype)`: the bytes `data[offset:offset + n].view(dtype).reshape(shape)`
    names (the state pool builds a restore's payload views with it)."""
    host = np.zeros(72, np.uint8)
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    got = _lean(host).at(offset, shape, dtype)
    want = host[offset : offset + n].view(dtype).reshape(shape)
    assert got.ptr == host.__array_interface__["data"][0] + offset
    assert (got.shape, got.strides, got.dtype, got.size) == (want.shape, want.strides, want.dtype, want.size)
    assert got.launch_key == (np.dtype(dtype), len(shape), "C" if want.size else EMPTY_LAYOUT)
    with pytest.raises(ValueError, match="do not fit"):
        _lean(host).at(offset, (4, 5), np.float32)  # 80 bytes of 72
    with pytest.raises(ValueError, match="do not fit"):
        _lean(host.reshape(8, 9))[:, :4].at(0, (1,), np.uint8)  # not C-contiguous
    with pytest.raises(ValueError, match="negative"):
        _lean(host).at(0, (-2, 4), np.float32)
    with pytest.raises(ValueError, match="negative"):
        _lean(host).at(0, (-1, -3), np.uint8)  # a positive product of negative dimensions
    with pytest.raises(ValueError, match="not a multiple"):
        _lean(host).at(2, (2,), np.float32)  # a misaligned pointer
    with pytest.raises(TypeError):
        _lean(host).at(0, (2.5, 2), np.uint8)


def test_cuda_array_interface_names_the_view():
    host = np.zeros((4, 6), np.float32)
    cai = _lean(host)[:, 2:5].__cuda_array_interface__
    assert cai == {"shape": (4, 3), "strides": (24, 4), "data": (host.ctypes.data + 8, False), "typestr": "<f4",
                   "stream": None, "version": 3}
    assert _lean(host)[1:3].__cuda_array_interface__["strides"] is None  # C-contiguous
    # C-contiguous, but the row stride is the parent's: numba's view must keep it (its launch
    # packs the strides, and launch.py compares those bytes with ours)
    assert _lean(host)[1:2, 2:5].__cuda_array_interface__["strides"] == (24, 4)


def test_views_keep_the_owner_alive_and_let_it_go():
    freed = []

    class Owner:
        def __del__(self):
            freed.append(True)

    lean = LeanArray(4096, (8, 8), (32, 4), np.float32, Owner())
    view = lean[2:, 1:3].reshape  # a bound method holds the view, which holds the owner
    del lean
    gc.collect()
    assert freed == []
    del view
    gc.collect()
    assert freed == [True]


@pytest.mark.parametrize("key", [(slice(None), slice(1, 4)), (slice(1, 3),), (2,)])
def test_launch_key_and_packing_equal_a_numba_array_s(key):
    """A LeanArray and a numba array over the same memory share a signature and pack the same bytes."""
    from numba.core import types

    from tests.executor.numba_cuda.test_launch import FakeArray

    host = np.zeros((4, 6), np.float32)[key]
    lean = _lean(np.zeros((4, 6), np.float32))[key]
    fake = FakeArray(lean.shape, lean.strides, np.float32, lean.ptr, c=host.flags.c_contiguous,
                     f=host.flags.f_contiguous)
    assert launch._arg_key(lean) == launch._arg_key(fake) == lean.launch_key
    kinds, fmt = launch.parameter_layout([types.Array(types.float32, lean.ndim, lean.launch_key[2])])
    signature = launch._Signature(0, kinds, fmt)
    assert launch._pack(signature, [lean]) == launch._pack(signature, [fake], pointer=lambda a: a.pointer)
