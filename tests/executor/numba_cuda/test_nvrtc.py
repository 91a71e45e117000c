"""executor/numba_cuda/nvrtc.py's compile step against a stand-in for cuda-bindings' NVRTC that
writes into the buffers it is handed, as the real one does (no GPU, no NVRTC needed).

The bug this pins (session 27): the log and cubin buffers were `b" " * size`; for a one-byte log
(an empty one: its NUL) that is CPython's shared one-byte b" " object, and NVRTC's NUL went into
it, so every later `b" " * n` in the process gave NULs. On the H200 the next random checkpoint's
safetensors header was padded with NULs and failed to parse (test_gpu_prefill_graphs.py, 7
errors in three runs; 14 passed with the buffers as bytearrays). Each case runs in its own
interpreter: the bug, if back, corrupts the process it runs in.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).parents[3]

FAKE = textwrap.dedent('''
    import ctypes, enum, sys, types

    class nvrtcResult(enum.IntEnum):
        NVRTC_SUCCESS = 0
        NVRTC_ERROR_COMPILATION = 6

    LOG, FAIL = sys.argv[1].encode().decode("unicode_escape").encode("latin-1"), sys.argv[2] == "fail"
    destroyed = []

    def write(buffer, data):  # into the object itself, as NVRTC through cuda-bindings does
        if isinstance(buffer, bytearray):
            buffer[:len(data)] = data
        else:
            ctypes.memmove(ctypes.cast(ctypes.c_char_p(buffer), ctypes.c_void_p).value, data, len(data))

    nvrtc = types.ModuleType("cuda.bindings.nvrtc")
    nvrtc.nvrtcResult = nvrtcResult
    nvrtc.nvrtcCreateProgram = lambda *a: (nvrtcResult.NVRTC_SUCCESS, "prog")
    nvrtc.nvrtcCompileProgram = lambda *a: (nvrtcResult.NVRTC_ERROR_COMPILATION if FAIL else nvrtcResult.NVRTC_SUCCESS,)
    nvrtc.nvrtcGetProgramLogSize = lambda prog: (nvrtcResult.NVRTC_SUCCESS, len(LOG) + 1)
    nvrtc.nvrtcGetProgramLog = lambda prog, buffer: (write(buffer, LOG + b"\\0"), (nvrtcResult.NVRTC_SUCCESS,))[1]
    nvrtc.nvrtcGetCUBINSize = lambda prog: (nvrtcResult.NVRTC_SUCCESS, 4)
    nvrtc.nvrtcGetCUBIN = lambda prog, buffer: (write(buffer, b"\\x7fELF"), (nvrtcResult.NVRTC_SUCCESS,))[1]
    nvrtc.nvrtcDestroyProgram = lambda prog: (destroyed.append(prog), (nvrtcResult.NVRTC_SUCCESS,))[1]
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    bindings.nvrtc = nvrtc
    cuda.bindings = bindings
    sys.modules.update({"cuda": cuda, "cuda.bindings": bindings, "cuda.bindings.nvrtc": nvrtc})

    from executor.numba_cuda.nvrtc import compile_cubin

    try:
        cubin, log = compile_cubin("int x;", "t.cu")
        print("cubin", cubin, "log", repr(log))
    except RuntimeError as exc:
        print("raised", str(exc).splitlines()[-1])
    n = len(sys.argv)  # 3: a repeat the compiler cannot fold
    print("pad", repr(b" " * n), "destroyed", destroyed)
''')


def _run(log: str, outcome: str) -> str:
    done = subprocess.run([sys.executable, "-c", FAKE, log, outcome], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_an_empty_log_leaves_the_interpreter_s_one_byte_bytes_alone():
    out = _run("", "ok")
    assert "cubin b'\\x7fELF' log ''" in out
    assert "pad b'   '" in out, out
    assert "destroyed ['prog']" in out


def test_a_log_and_a_cubin_come_back_and_the_program_is_destroyed():
    out = _run("ptxas info    : Used 254 registers", "ok")
    assert "log 'ptxas info    : Used 254 registers'" in out and "cubin b'\\x7fELF'" in out
    assert "pad b'   '" in out and "destroyed ['prog']" in out


def test_a_failed_compile_raises_with_its_log_and_destroys_the_program():
    out = _run("t.cu(1): error: identifier x is undefined", "fail")
    assert "raised t.cu(1): error: identifier x is undefined" in out
    assert "destroyed ['prog']" in out


def test_kernel_args_pack_pointers_long_longs_floats_ints_and_structs():
    import ctypes

    import numpy as np
    import pytest

    from executor.numba_cuda.nvrtc import kernel_args

    class Device:
        __cuda_array_interface__ = {"data": (0xABC0, False)}

    class Struct:  # a cuda.bindings struct such as CUtensorMap: cuda.bindings reads it through getPtr
        def getPtr(self):  # noqa: N802 - cuda.bindings' name
            return 0x1000

    tensor_map = Struct()
    values, types = kernel_args((Device(), np.int64(5 << 32), np.float32(0.5), 2.0, 7, np.int32(-3), tensor_map))
    assert values == (0xABC0, 5 << 32, 0.5, 2.0, 7, -3, tensor_map)
    assert types == (ctypes.c_void_p, ctypes.c_longlong, ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                     None)
    with pytest.raises(ValueError, match="argument 0 = 2147483648 does not fit int32; pass numpy.int64"):
        kernel_args((1 << 31,))
    with pytest.raises(ValueError, match="argument 1 = 21474836480 does not fit int32"):
        kernel_args((1, 5 << 32))
    with pytest.raises(ValueError, match="argument 0 is a host array"):
        kernel_args((np.zeros(3, np.float32),))


def test_stream_handles_for_driver_launches():
    import ctypes

    from executor.numba_cuda.nvrtc import stream_handle

    class Stream:
        def __init__(self, handle):
            self.handle = handle

    assert stream_handle(0) == 0 and stream_handle(None) == 0
    assert stream_handle(Stream(ctypes.c_void_p(0x1234))) == 0x1234
    assert stream_handle(Stream(ctypes.c_void_p(0))) == 0  # a null ctypes handle: its value is None
    assert stream_handle(Stream(0x99)) == 0x99
