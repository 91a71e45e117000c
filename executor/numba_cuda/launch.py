"""Kernel launches in a few microseconds of host time: `fast(kernel)` is a drop-in for a
`@cuda.jit` dispatcher whose `kernel[grid, block, stream](*args)` skips numba's per-launch
typing and ctypes marshalling.

Why: numba types every argument on every launch (a numba Array type per array), builds one
ctypes object per flattened field and calls cuLaunchKernel through cuda.bindings: 25-38 us
of host time a launch on the H200 machine (../shared/device/README.md). A 27B prefill chunk
is ~560 launches, so a chunk of a few rows was host-bound (bench/RESULTS.md, session 2).

How: the first launch of each argument signature goes through numba (which compiles it),
then resolves the compiled kernel (`dispatcher.overloads`) and its CUfunction. Later launches
of that signature pack the flattened fields with `struct` into one parameter buffer and call
`cuLaunchKernel` in libcuda with CU_LAUNCH_PARAM_BUFFER_POINTER (CUDA driver API, "Execution
Control": the `extra` argument). The field layout is numba-cuda's
`dispatcher._Kernel._prepare_args`: an array is meminfo, parent (null pointers), nitems,
itemsize, data pointer, shape[ndim], strides[ndim]; an integer, float or boolean scalar is
its C value; each field at its natural alignment, as `struct`'s native mode lays them out.
Checked at run time, not assumed: the first fast launch of each signature packs numba's own
ctypes fields (`_prepare_args` on the same arguments) and compares bytes, and compares each
array argument's key (layout, ndim) with numba's type for it; on a mismatch, an argument
kind this does not pack (records, tuples, complex), a cooperative or debug kernel, or any
error, that signature stays on numba's path for good. Under the CUDA simulator, or
with WARMSTATE_FAST_LAUNCH=0, `fast` returns the dispatcher itself.

Launches go to the same stream in the same order as numba's, so stream capture into CUDA
graphs (graphs.py) records them the same way.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import os
import struct
import threading

from executor.numba_cuda.device import EMPTY_LAYOUT, IS_SIMULATOR, LeanArray

ENABLED = not IS_SIMULATOR and os.environ.get("WARMSTATE_FAST_LAUNCH", "1") != "0"
"""Whether `fast` wraps dispatchers (off under the simulator and with WARMSTATE_FAST_LAUNCH=0)."""

_SCALAR_FORMATS = {
    "int8": "b", "int16": "h", "int32": "i", "int64": "q",
    "uint8": "B", "uint16": "H", "uint32": "I", "uint64": "Q",
    "float32": "f", "float64": "d", "bool": "B",
}
"""struct codes of the scalar numba types `_prepare_args` passes as one C value
(numba's `boolean` goes as c_uint8; its str() is "bool")."""

_ARRAY = object()
_SLOW = object()

_numba_only: contextvars.ContextVar[bool] = contextvars.ContextVar("warmstate_numba_launches", default=False)


@contextlib.contextmanager
def numba_launches():
    """Within this block every `FastKernel` launches through numba's own path (the A side of
    an A/B: tests compare bits, bench/prefill_overhead.py compares host time)."""
    token = _numba_only.set(True)
    try:
        yield
    finally:
        _numba_only.reset(token)


def _dim3(dim) -> tuple[int, int, int]:
    if isinstance(dim, tuple):
        dims = tuple(int(d) for d in dim) + (1,) * (3 - len(dim))
        if len(dims) != 3:
            raise ValueError(f"a launch dimension has at most 3 entries, got {dim}")
        return dims
    return (int(dim), 1, 1)


def _handle(value) -> int:
    """The integer value of a driver handle (cuda.bindings object, ctypes value or int)."""
    inner = getattr(value, "value", value)
    if inner is None:
        return 0
    return int(inner)


def _stream_handle(stream) -> int:
    if not stream:
        return 0
    return _handle(stream.handle)


def _arg_key(arg):
    """What decides numba's type of an argument: (dtype, ndim, layout) for a numba device
    array, by DeviceNDArray._numba_type_'s rule for a non-empty one (a zero stride is a
    broadcast, typed "A"), layout EMPTY_LAYOUT for an empty one (numba versions type those
    differently; the key sends them to numba's path); a LeanArray's `launch_key` (the same
    triple, computed once); else the argument's Python type."""
    if type(arg) is LeanArray:
        return arg.launch_key
    if getattr(arg, "__cuda_ndarray__", False):
        strides = arg.strides
        if not arg.size:
            return (arg.dtype, len(strides), EMPTY_LAYOUT)
        flags = arg.flags
        broadcast = 0 in strides
        if flags["C_CONTIGUOUS"] and not broadcast:
            layout = "C"
        elif flags["F_CONTIGUOUS"] and not broadcast:
            layout = "F"
        else:
            layout = "A"
        return (arg.dtype, len(strides), layout)
    return type(arg)


def _field_bytes(value) -> tuple[int, bytes]:
    """(alignment, bytes) of one field numba passes: a ctypes value, a NumPy scalar, a
    cuda.bindings pointer object (8 bytes), or, as numba-cuda 0.30 passes array fields and
    booleans, a Python int (an intptr_t: 8 bytes) or bool (1 byte). Raises TypeError for
    anything else."""
    if isinstance(value, bool):
        return 1, bytes([value])
    if isinstance(value, int):
        return 8, value.to_bytes(8, "little", signed=value < 0)
    if isinstance(value, ctypes._SimpleCData):
        return ctypes.alignment(value), bytes(value)
    if hasattr(value, "dtype") and hasattr(value, "tobytes"):
        return value.dtype.alignment, value.tobytes()
    if hasattr(value, "getPtr") and not isinstance(value, int):
        return 8, int(value).to_bytes(8, "little")
    raise TypeError(f"a kernel parameter of type {type(value).__name__} is not laid out here")


def _numba_bytes(kernelargs) -> bytes:
    """numba's parameter fields laid out at their natural alignment (what the driver copies)."""
    out = bytearray()
    for value in kernelargs:
        align, data = _field_bytes(value)
        out += b"\0" * (-len(out) % align)
        out += data
    return bytes(out)


class _Signature:
    """One compiled kernel and how to pack its arguments."""

    __slots__ = ("format", "function", "kinds", "packer", "size")

    def __init__(self, function: int, kinds: tuple, fmt: str) -> None:
        self.function = function
        self.kinds = kinds
        self.format = fmt
        self.packer = struct.Struct(fmt)
        self.size = ctypes.c_size_t(self.packer.size)


class _Driver:
    """cuLaunchKernel from libcuda, and a per-thread check that a context is current."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.launch = lib.cuLaunchKernel
        self.launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        self.launch.restype = ctypes.c_int
        self.local = threading.local()

    def ensure_context(self) -> None:
        if not getattr(self.local, "ready", False):
            from numba import cuda

            cuda.current_context()  # makes numba's context current on this thread
            self.local.ready = True


_driver: _Driver | None = None
_driver_lock = threading.Lock()


def _get_driver() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


class FastKernel:
    """A `@cuda.jit` dispatcher whose launches take the fast path once checked (module docstring).

    `kernel[grid, block]` / `kernel[grid, block, stream]` / `kernel[grid, block, stream,
    shared_bytes]` then `(*args)`, as numba's. Attributes: `dispatcher` (the wrapped one),
    `fast_launches` and `numba_launches` (counts, for tests and benchmarks).
    """

    def __init__(self, dispatcher) -> None:
        self.dispatcher = dispatcher
        self._signatures: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self.fast_launches = 0
        self.numba_launches = 0
        self.rejected: dict[tuple, str] = {}
        self.name = getattr(getattr(dispatcher, "py_func", None), "__name__", "kernel")

    def __getitem__(self, config):
        if not isinstance(config, tuple) or not 2 <= len(config) <= 4:
            raise ValueError(f"launch configuration must be [grid, block(, stream(, shared bytes))], got {config!r}")
        return _Configured(self, config)

    def __getattr__(self, name):  # overloads, specialize, ... of the dispatcher
        return getattr(self.dispatcher, name)

    def _numba_launch(self, config, args) -> None:
        self.numba_launches += 1
        self.dispatcher[config](*_numba_args(args))

    def _resolve(self, key, config, args) -> None:
        """Launch through numba, then decide this signature's path (module docstring)."""
        self._numba_launch(config, args)
        try:
            signature = self._check(config, args)
        except Exception as exc:  # noqa: BLE001 - anything unexpected keeps numba's path
            signature, reason = _SLOW, f"{type(exc).__name__}: {exc}"
        else:
            reason = None if isinstance(signature, _Signature) else signature
            signature = signature if isinstance(signature, _Signature) else _SLOW
        with self._lock:
            self._signatures[key] = signature
            if reason is not None:
                self.rejected[key] = reason

    def _check(self, config, args):
        """The signature of these arguments' compiled kernel, or the reason (a str) it stays
        on numba's path: no overload, a kernel kind or argument type not packed here, an
        array argument whose `_arg_key` layout or ndim is not numba's type for it, or packed
        bytes that differ from numba's."""
        dispatcher = self.dispatcher
        numba_args = _numba_args(args)
        argtypes = tuple(dispatcher.typeof_pyval(a) for a in numba_args)
        kernel = dispatcher.overloads.get(argtypes)
        if kernel is None:
            return f"no overload for {argtypes}"
        if getattr(kernel, "cooperative", False) or getattr(kernel, "debug", False) or getattr(kernel, "extensions", []):
            return "cooperative, debug or extended kernel"
        layout = parameter_layout(kernel.argument_types)
        if isinstance(layout, str):
            return layout
        for kind, ty, value in zip(layout[0], kernel.argument_types, args):
            if kind is _ARRAY:
                key = _arg_key(value)
                if not isinstance(key, tuple) or (key[2], key[1]) != (ty.layout, ty.ndim):
                    return f"numba types an array argument keyed {key} as {ty}"
        signature = _Signature(_handle(kernel._codelibrary.get_cufunc().handle), *layout)
        stream = config[2] if len(config) > 2 else 0
        expected = []
        for ty, value in zip(kernel.argument_types, numba_args):
            kernel._prepare_args(ty, value, stream, [], expected)
        packed = _pack(signature, args)
        if packed != _numba_bytes(expected):
            return "packed parameters differ from numba's"
        return signature


def _numba_args(args) -> tuple:
    """args with each LeanArray replaced by its numba view (numba's own launch path)."""
    return tuple(a.to_numba() if type(a) is LeanArray else a for a in args)


def parameter_layout(argument_types) -> tuple[tuple, str] | str:
    """(kinds, struct format) of a kernel's numba argument types, or the reason it is not
    packed here. An array is "PPqqP" then 2 * ndim "q" (numba-cuda `_prepare_args`)."""
    from numba.core import types

    kinds, fmt = [], "@"
    for ty in argument_types:
        if isinstance(ty, types.Array):
            kinds.append(_ARRAY)
            fmt += "PPqqP" + "q" * (2 * ty.ndim)
        elif str(ty) in _SCALAR_FORMATS and isinstance(ty, (types.Integer, types.Float, types.Boolean)):
            kinds.append(str(ty))
            fmt += _SCALAR_FORMATS[str(ty)]
        else:
            return f"argument type {ty} is not packed here"
    return tuple(kinds), fmt


def _pointer(array) -> int:
    """The device address of an array's data, as numba's `_prepare_args` reads it (`ptr` in
    numba-cuda 0.30; the driver's `device_pointer` before)."""
    ptr = getattr(array, "ptr", None)
    if ptr is None:
        from numba.cuda.cudadrv.driver import device_pointer

        ptr = device_pointer(array)
    return int(ptr)


def _pack(signature: _Signature, args, pointer=_pointer) -> bytes:
    """The parameter buffer of one launch: `signature.format` over the flattened fields."""
    values = []
    for kind, arg in zip(signature.kinds, args):
        if kind is _ARRAY:
            values += (0, 0, arg.size, arg.dtype.itemsize, arg.ptr if type(arg) is LeanArray else pointer(arg))
            values += arg.shape
            values += arg.strides
        elif kind == "bool":
            values.append(int(bool(arg)))
        else:
            values.append(arg)
    return signature.packer.pack(*values)


class _Configured:
    __slots__ = ("config", "kernel")

    def __init__(self, kernel: FastKernel, config: tuple) -> None:
        self.kernel = kernel
        self.config = config

    def __call__(self, *args) -> None:
        kernel, config = self.kernel, self.config
        if _numba_only.get():
            kernel._numba_launch(config, args)
            return
        key = tuple([a.launch_key if type(a) is LeanArray else _arg_key(a) for a in args])
        signature = kernel._signatures.get(key)
        if signature is None:
            kernel._resolve(key, config, args)
            return
        if signature is _SLOW:
            kernel._numba_launch(config, args)
            return
        driver = _driver or _get_driver()
        driver.ensure_context()
        params = ctypes.create_string_buffer(_pack(signature, args), signature.size.value)
        extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(params), 2, ctypes.addressof(signature.size), 0)
        grid, block = config[0], config[1]
        grid = (grid, 1, 1) if type(grid) is int else _dim3(grid)
        block = (block, 1, 1) if type(block) is int else _dim3(block)
        stream = _stream_handle(config[2]) if len(config) > 2 else 0
        shared = int(config[3]) if len(config) > 3 else 0
        result = driver.launch(signature.function, *grid, *block, shared, stream, None, extra)
        if result:
            raise RuntimeError(f"cuLaunchKernel of {kernel.name} failed with CUresult {result}")
        kernel.fast_launches += 1


KERNELS: list[FastKernel] = []
"""Every `FastKernel` made by `fast` in this process (their launch counts and rejected
signatures, for tests and benchmarks)."""


def fast(dispatcher):
    """`dispatcher` with fast launches (`FastKernel`), or itself when `ENABLED` is False."""
    if not ENABLED:
        return dispatcher
    kernel = FastKernel(dispatcher)
    KERNELS.append(kernel)
    return kernel


MAX_DYNAMIC_SHARED_ATTRIBUTE = 8
"""CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (also the CUkernel attribute's number)."""


def allow_dynamic_shared(dispatcher, nbytes: int) -> None:
    """Allow `nbytes` of dynamic shared memory (past the default 48 KB) for the dispatcher's
    one compiled kernel (an eagerly compiled `cuda.jit` with one signature) on the current
    device only. numba-cuda 0.30 loads modules as libraries, so the handle its launches use is
    a CUkernel (cuKernelSetAttribute); an older one hands out a CUfunction (cuFuncSetAttribute).
    Raises ValueError when the dispatcher has no or several compiled overloads, RuntimeError on
    a driver error (e.g. more than the device's shared memory)."""
    overloads = list(dispatcher.overloads.values())
    if len(overloads) != 1:
        raise ValueError(f"allow_dynamic_shared needs one compiled overload, the dispatcher has {len(overloads)}")
    (kernel,) = overloads
    function = kernel._codelibrary.get_cufunc()
    handle = ctypes.c_void_p(int(getattr(function.handle, "value", function.handle)))
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    result = lib.cuFuncSetAttribute(handle, MAX_DYNAMIC_SHARED_ATTRIBUTE, int(nbytes))
    if result:
        device = ctypes.c_int()
        lib.cuCtxGetDevice(ctypes.byref(device))
        lib.cuKernelSetAttribute.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        result = lib.cuKernelSetAttribute(MAX_DYNAMIC_SHARED_ATTRIBUTE, int(nbytes), handle, device.value)
    if result:
        raise RuntimeError(f"cuFuncSetAttribute / cuKernelSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES, {nbytes}) "
                           f"failed: CUresult {result}")
