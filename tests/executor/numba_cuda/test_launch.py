"""The fast launch path's packing and bookkeeping, without a GPU (executor/numba_cuda/launch.py).

The parameter buffer must hold exactly the bytes numba-cuda's `_Kernel._prepare_args` would
pass (an array as meminfo, parent, nitems, itemsize, data, shape, strides; scalars as their
C value), each field at its natural alignment. The expected bytes here are built the way
`_prepare_args` builds them: one ctypes object per field. On a GPU the same comparison runs
against numba's own `_prepare_args` before a signature takes the fast path
(tests/executor/numba_cuda/test_gpu_backend.py covers that and the bits of a whole forward).
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
from numba.core import types

from executor.numba_cuda import launch
from executor.numba_cuda.device import EMPTY_LAYOUT


class FakeArray:
    """What `_arg_key`, `_pack` and numba's `_numba_type_` read of a numba DeviceNDArray."""

    __cuda_ndarray__ = True

    def __init__(self, shape, strides, dtype, pointer, c=True, f=False):
        self.shape, self.strides, self.dtype = tuple(shape), tuple(strides), np.dtype(dtype)
        self.ndim = len(self.shape)
        self.size = int(np.prod(shape))
        self.pointer = self.ptr = pointer
        self.flags = {"C_CONTIGUOUS": c, "F_CONTIGUOUS": f}


def _numba_fields(ty, value):
    """The ctypes fields `_prepare_args` appends for one argument (numba-cuda, dispatcher.py)."""
    if isinstance(ty, types.Array):
        fields = [ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_ssize_t(value.size),
                  ctypes.c_ssize_t(value.dtype.itemsize), ctypes.c_void_p(value.pointer)]
        fields += [ctypes.c_ssize_t(d) for d in value.shape]
        fields += [ctypes.c_ssize_t(s) for s in value.strides]
        return fields
    if ty == types.boolean:
        return [ctypes.c_uint8(int(value))]
    if ty == types.float32:
        return [ctypes.c_float(value)]
    if ty == types.float64:
        return [ctypes.c_double(value)]
    return [getattr(ctypes, f"c_{ty}")(value)]


@pytest.mark.parametrize("seed", range(20))
def test_packed_parameters_equal_numba_s_fields(seed):
    rng = np.random.default_rng(seed)
    choices = [
        lambda: (types.Array(types.float32, 2, "C"), FakeArray((3, 5), (20, 4), np.float32, int(rng.integers(1, 2**40)))),
        lambda: (types.Array(types.uint16, 4, "A"),
                 FakeArray((2, 3, 4, 5), (240, 80, 20, 2), np.uint16, int(rng.integers(1, 2**40)), c=False)),
        lambda: (types.int64, int(rng.integers(-(2**62), 2**62))),
        lambda: (types.int32, np.int32(rng.integers(-(2**31), 2**31))),
        lambda: (types.uint64, np.uint64(rng.integers(0, 2**63))),
        lambda: (types.float32, np.float32(rng.standard_normal())),
        lambda: (types.float64, float(rng.standard_normal())),
        lambda: (types.boolean, bool(rng.integers(0, 2))),
        lambda: (types.uint8, np.uint8(rng.integers(0, 256))),
    ]
    picked = [choices[i]() for i in rng.integers(0, len(choices), int(rng.integers(1, 9)))]
    argtypes, args = [t for t, _ in picked], [v for _, v in picked]
    kinds, fmt = launch.parameter_layout(argtypes)
    signature = launch._Signature(0, kinds, fmt)
    packed = launch._pack(signature, args, pointer=lambda a: a.pointer)
    expected = launch._numba_bytes([f for t, v in picked for f in _numba_fields(t, v)])
    assert packed == expected
    assert signature.size.value == len(expected)


def test_alignment_pads_a_pointer_after_a_four_byte_scalar():
    kinds, fmt = launch.parameter_layout([types.float32, types.Array(types.int32, 1, "C")])
    packed = launch._pack(launch._Signature(0, kinds, fmt), [np.float32(1.5), FakeArray((7,), (4,), np.int32, 0xABC)],
                          pointer=lambda a: a.pointer)
    assert len(packed) == 8 + 8 * 7  # float, 4 bytes of padding, then seven 8-byte fields
    assert packed[:4] == np.float32(1.5).tobytes() and packed[4:8] == b"\0\0\0\0"
    assert int.from_bytes(packed[8 + 32 : 8 + 40], "little") == 0xABC


@pytest.mark.parametrize("ty", [types.complex64, types.UniTuple(types.int64, 2), types.float16])
def test_argument_kinds_not_packed_here_are_named(ty):
    reason = launch.parameter_layout([types.int64, ty])
    assert isinstance(reason, str) and str(ty) in reason


@pytest.mark.parametrize(
    ("array", "layout"),
    [
        (FakeArray((4, 8), (32, 4), np.float32, 1), "C"),
        (FakeArray((4, 8), (4, 16), np.float32, 1, c=False, f=True), "F"),
        (FakeArray((4, 8), (64, 4), np.float32, 1, c=False), "A"),
        (FakeArray((4, 8), (0, 4), np.float32, 1), "A"),  # broadcast: numba types it "A"
    ],
)
def test_arg_key_follows_numba_s_layout_rule(array, layout):
    assert launch._arg_key(array) == (np.dtype(np.float32), 2, layout)
    assert launch._arg_key(3) is int and launch._arg_key(np.float32(1)) is np.float32


@pytest.mark.parametrize(
    ("shape", "order", "strides"),
    [((5, 0), "C", (0, 4)), ((3, 0, 4), "C", (0, 16, 4)), ((0, 5), "C", (20, 4)), ((0,), "C", (4,)),
     ((4, 0), "F", (4, 16))],
    ids=["5x0", "3x0x4", "0x5", "0", "4x0-fortran"],
)
def test_an_empty_array_is_keyed_apart_and_launches_through_numba(shape, order, strides):
    """Empty arrays as `cuda.device_array(shape, order=order)` makes them: keyed with
    EMPTY_LAYOUT (numba-cuda 0.30 types a 5x0 array with a zero stride "C", the numba CPU
    installs "A"), which the first-launch check rejects under that key alone: the launch
    goes through numba, and a non-empty array of the same dtype and rank stays fast."""
    from numba.cuda.api_util import prepare_shape_strides_dtype
    from numba.cuda.cudadrv import dummyarray

    assert prepare_shape_strides_dtype(shape, None, np.float32, order)[1] == strides
    flags = dummyarray.Array.from_desc(0, shape, strides, 4).flags
    empty = FakeArray(shape, strides, np.float32, 0, c=flags["C_CONTIGUOUS"], f=flags["F_CONTIGUOUS"])
    assert launch._arg_key(empty) == (np.dtype(np.float32), len(shape), EMPTY_LAYOUT)
    kernel = launch.FastKernel(TypedDispatcher(_numba_type(empty)))
    kernel[1, 32](empty)
    assert kernel.numba_launches == 1 and kernel.fast_launches == 0
    assert list(kernel.rejected) == [((np.dtype(np.float32), len(shape), EMPTY_LAYOUT),)]


@pytest.mark.parametrize("c", [True, False], ids=["c", "not-c"])
@pytest.mark.parametrize("f", [True, False], ids=["f", "not-f"])
@pytest.mark.parametrize(
    ("shape", "strides"),
    [((4, 8), (32, 4)), ((4, 8), (0, 4)), ((1, 8), (0, 4)), ((4, 8), (4, 16))],
    ids=["4x8", "4x8-broadcast", "1x8-zero-stride", "4x8-fortran"],
)
def test_arg_key_applies_numba_s_rule_to_any_flags(shape, strides, c, f):
    """For a non-empty array `_arg_key` is `DeviceNDArray._numba_type_`'s rule itself,
    whatever the flags say (a zero stride is "A"), so no array keys apart from its numba type."""
    array = FakeArray(shape, strides, np.float32, 0, c=c, f=f)
    want = _numba_type(array)
    assert launch._arg_key(array) == (np.dtype(np.float32), want.ndim, want.layout)


def _numba_type(array):
    """numba's own `DeviceNDArrayBase._numba_type_` of `array` (a property in the numba
    CPU installs carry, a cached_property in numba-cuda 0.30: call its function either way)."""
    import inspect

    from numba.cuda.cudadrv import devicearray

    attr = inspect.getattr_static(devicearray.DeviceNDArrayBase, "_numba_type_")
    return (getattr(attr, "fget", None) or attr.func)(array)


def test_dim3():
    assert launch._dim3(5) == (5, 1, 1)
    assert launch._dim3((5, 2)) == (5, 2, 1)
    assert launch._dim3((5, 2, 3)) == (5, 2, 3)
    with pytest.raises(ValueError, match="at most 3"):
        launch._dim3((1, 2, 3, 4))


class FakeDispatcher:
    """Records numba launches; has no compiled overloads, so every signature stays slow."""

    def __init__(self):
        self.calls = []
        self.overloads = {}
        self.py_func = test_dim3

    def typeof_pyval(self, value):
        return types.int64

    def __getitem__(self, config):
        return lambda *args: self.calls.append((config, args))


def test_a_signature_without_an_overload_stays_on_numba_s_path():
    dispatcher = FakeDispatcher()
    kernel = launch.FastKernel(dispatcher)
    kernel[4, 128](1, 2)
    kernel[(4, 2), 128, 0](3, 4)
    kernel[4, 128](np.int32(5), 2)  # another signature: resolved (and rejected) on its own
    assert [args for _, args in dispatcher.calls] == [(1, 2), (3, 4), (np.int32(5), 2)]
    assert kernel.numba_launches == 3 and kernel.fast_launches == 0
    assert kernel.rejected == {(int, int): "no overload for (int64, int64)", (np.int32, int): "no overload for (int64, int64)"}
    assert kernel.name == "test_dim3"
    with pytest.raises(ValueError, match="launch configuration"):
        kernel[4]


def test_numba_launches_block_routes_every_launch_through_numba():
    dispatcher = FakeDispatcher()
    kernel = launch.FastKernel(dispatcher)
    with launch.numba_launches():
        kernel[1, 32](7)
    assert kernel.numba_launches == 1 and kernel.rejected == {}  # not even resolved
    kernel[1, 32](7)
    assert kernel.rejected == {(int,): "no overload for (int64,)"}


def test_numba_fields_may_be_numpy_scalars_or_binding_pointers():
    class Pointer:  # what a cuda.bindings CUdeviceptr offers
        def __init__(self, value):
            self.value = value

        def getPtr(self):
            return id(self)

        def __int__(self):
            return self.value

    got = launch._numba_bytes([np.int32(-3), Pointer(0x1234), np.float32(2.0)])
    assert got == np.int32(-3).tobytes() + b"\0" * 4 + (0x1234).to_bytes(8, "little") + np.float32(2.0).tobytes()
    # numba-cuda 0.30 passes an array's fields as Python ints (intptr_t) and booleans as bool
    assert launch._numba_bytes([True, 0, -2]) == b"\x01" + b"\0" * 7 + bytes(8) + (-2).to_bytes(8, "little", signed=True)
    with pytest.raises(TypeError, match="str"):
        launch._numba_bytes(["x"])


class _Compiled:
    """A compiled overload as `_check` reads it: its argument types, a CUfunction handle,
    and numba's `_prepare_args` (the fields `_numba_fields` builds)."""

    def __init__(self, argument_types):
        self.argument_types = argument_types
        self._codelibrary = SimpleNamespace(get_cufunc=lambda: SimpleNamespace(handle=7))

    def _prepare_args(self, ty, value, stream, retr, kernelargs):
        kernelargs.extend(_numba_fields(ty, value))


class TypedDispatcher(FakeDispatcher):
    """Types every argument as `numba_type` and has that one overload compiled."""

    def __init__(self, numba_type):
        super().__init__()
        self.numba_type = numba_type
        self.overloads = {(numba_type,): _Compiled([numba_type])}

    def typeof_pyval(self, value):
        return self.numba_type


def test_a_numba_array_typed_with_another_layout_than_its_key_stays_on_numba_s_path():
    array = FakeArray((4, 8), (32, 4), np.float32, 0xABC000)  # keyed (float32, 2, "C")
    same = launch.FastKernel(TypedDispatcher(types.Array(types.float32, 2, "C")))
    assert isinstance(same._check((1, 32), (array,)), launch._Signature)  # control: everything else passes

    kernel = launch.FastKernel(TypedDispatcher(types.Array(types.float32, 2, "A")))
    kernel[1, 32](array)
    key = ((np.dtype(np.float32), 2, "C"),)
    assert kernel.rejected == {
        key: "numba types an array argument keyed (dtype('float32'), 2, 'C') as array(float32, 2d, A)"}
    kernel[1, 32](array)
    assert kernel.numba_launches == 2 and kernel.fast_launches == 0
