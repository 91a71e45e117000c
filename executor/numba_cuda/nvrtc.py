"""CUDA C++ compiled by NVRTC to a cubin for an arch-specific target (sm_90a: wgmma), loaded and
launched through the CUDA driver in numba's context, on numba's memory and streams: for kernels
that numba's `link=` cannot build (it compiles for the plain target, sm_90, which rejects
wgmma): the prefill attention walk of attention_wgmma.py and the benchmarks in bench/.

Needs cuda-bindings (numba-cuda's dependency) and a GPU; in CI only `wgmma_function` (text) runs.
A launch on a stream that is being captured joins the capture (graphs.PrefillGraphs).
"""

from __future__ import annotations

import ctypes

import numpy as np


def wgmma_function(name: str, n: int, a_registers: bool, transpose_b: bool, dtype: str = "bf16") -> str:
    """CUDA C++ of `void name(float (&d)[n / 2], A, unsigned long long b_desc)`: one
    `wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16` adding A x B into d (scale-d 1).
    A is `const u32* a` (the four bf16x2 registers of mma.sync's m16n8k16 A fragment, warp w of
    the warpgroup holding rows 16w..16w+15) when a_registers, else `unsigned long long a_desc`
    (a shared-memory descriptor, K-major); transpose_b: B is MN-major. d's layout is mma.sync's
    m16n8 accumulator repeated over n / 8 column tiles (PTX ISA, "wgmma.mma_async", register
    fragments). dtype "tf32": `wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32` instead, A's
    four registers mma.sync m16n8k8's tf32 fragment, B K-major only (tf32 has no transpose
    immediates). Raises ValueError for an n wgmma lacks (8 to 256, a multiple of 8), an unknown
    dtype, or a transposed tf32 B."""
    if not (8 <= n <= 256 and n % 8 == 0):
        raise ValueError(f"n must be a multiple of 8 in [8, 256], got {n}")
    if dtype not in ("bf16", "tf32"):
        raise ValueError(f"dtype must be bf16 or tf32, got {dtype!r}")
    if dtype == "tf32" and transpose_b:
        raise ValueError("a tf32 wgmma reads B K-major only (transpose_b False)")
    shape = f"m64n{n}k16.f32.bf16.bf16" if dtype == "bf16" else f"m64n{n}k8.f32.tf32.tf32"
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    if a_registers:
        a_arg, a_op = "const u32* a", f"{{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}"
        ins, b_op, tail = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc)', f"%{regs + 4}", f"{int(transpose_b)}"
    else:
        a_arg, a_op = "unsigned long long a_desc", f"%{regs}"
        ins, b_op, tail = '"l"(a_desc), "l"(b_desc)', f"%{regs + 1}", f"0, {int(transpose_b)}"
    scales = "p, 1, 1" if dtype == "tf32" else f"p, 1, 1, {tail}"
    return (f"__device__ __forceinline__ void {name}(float (&d)[{regs}], {a_arg}, unsigned long long b_desc) {{\n"
            f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, 1, 0;\\n"\n'
            f'                 "wgmma.mma_async.sync.aligned.{shape} {{{outs}}}, {a_op}, {b_op}, '
            f'{scales};\\n}}\\n"\n'
            f"                 : {cons}\n"
            f"                 : {ins});\n}}\n")


def compile_cubin(source: str, name: str, arch: str = "sm_90a") -> tuple[bytes, str]:
    """(cubin, NVRTC log with ptxas -v: registers, spills, wgmma serialization notes) of `source`
    for `arch`. Raises RuntimeError with the log when the compile fails, or naming what to
    install when cuda-bindings is missing."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        raise RuntimeError("NVRTC needs cuda-bindings (numba-cuda's dependency: pip install -e '.[cuda]'); "
                           "the kernels then need an NVIDIA H100/H200 (sm_90a)") from None

    # NVRTC writes into the buffers it is given: bytearrays of our own, never `b" " * size`,
    # which for a one-byte log (empty: just its NUL) is CPython's shared b" " object itself
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC ({arch}): nvrtcCreateProgram: {err}")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"--ptxas-options=-v"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        buffer = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, buffer)
        log = bytes(buffer).decode(errors="replace").rstrip("\x00 \n")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC ({arch}): {err}\n{log[-4000:]}")
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        buffer = bytearray(size)
        nvrtc.nvrtcGetCUBIN(prog, buffer)
        return bytes(buffer), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def check(result):
    """The value(s) of a cuda.bindings driver call; RuntimeError naming the CUresult otherwise."""
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(str(err))
    return rest[0] if len(rest) == 1 else rest


class Module:
    """A cubin loaded into numba's current context: `launch` runs an `extern "C" __global__`
    kernel on a numba stream."""

    def __init__(self, cubin: bytes):
        from cuda.bindings import driver
        from numba import cuda

        cuda.current_context()  # numba's primary context, current on this thread
        self._driver = driver
        self._image = bytes(cubin)  # kept while the module lives (a lazily loading driver may read it later)
        self._module = check(driver.cuModuleLoadData(self._image))
        self._functions = {}

    def function(self, name: str, shared_bytes: int = 0):
        """The kernel `name`, its dynamic shared memory limit raised to shared_bytes."""
        if name not in self._functions:
            f = check(self._driver.cuModuleGetFunction(self._module, name.encode()))
            if shared_bytes > 48 << 10:
                attr = self._driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                check(self._driver.cuFuncSetAttribute(f, attr, shared_bytes))
            self._functions[name] = f
        return self._functions[name]

    def attributes(self, name: str) -> tuple[int, int]:
        """(registers a thread, local memory bytes a thread: spills) of kernel `name`."""
        a = self._driver.CUfunction_attribute
        f = self.function(name)
        return (check(self._driver.cuFuncGetAttribute(a.CU_FUNC_ATTRIBUTE_NUM_REGS, f)),
                check(self._driver.cuFuncGetAttribute(a.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f)))

    def launch(self, name: str, grid: tuple[int, int], threads: int, shared_bytes: int, *args,
               wait: bool = True, stream=0) -> None:
        """Launch `name` on grid (x, y) with `threads` a CTA and `shared_bytes` of dynamic shared
        memory on `stream` (a numba stream, or 0: the legacy default stream); args (`kernel_args`):
        device arrays (pointers), numpy int64 (long long), other ints (int32), floats (float32),
        cuda.bindings structs such as a CUtensorMap (by value). Raises ValueError for an argument
        `kernel_args` refuses, RuntimeError on a launch or (wait: synchronizes the context)
        execution error."""
        values, types = kernel_args(args)
        check(self._driver.cuLaunchKernel(self.function(name, shared_bytes), grid[0], grid[1], 1, threads, 1, 1,
                                          shared_bytes, stream_handle(stream), (values, types), 0))
        if wait:
            check(self._driver.cuCtxSynchronize())


def kernel_args(args) -> tuple[tuple, tuple]:
    """(values, ctypes types) of a launch's arguments: a device array (`__cuda_array_interface__`)
    as its pointer, a numpy int64 as long long, a Python or numpy float as float32, a
    cuda.bindings struct (anything with `getPtr`, e.g. a CUtensorMap) by value, any other
    integer as int32. Raises ValueError naming the argument's position for a host array or an
    integer outside its C type's range (it would reach the kernel truncated)."""
    values, types = [], []
    for i, a in enumerate(args):
        if callable(getattr(a, "getPtr", None)):  # a cuda.bindings struct (a CUtensorMap): passed by value
            values.append(a)
            types.append(None)
        elif hasattr(a, "__cuda_array_interface__"):
            values.append(a.__cuda_array_interface__["data"][0])
            types.append(ctypes.c_void_p)
        elif isinstance(a, np.ndarray):
            raise ValueError(f"kernel argument {i} is a host array {a.shape}; pass a device array")
        elif isinstance(a, (float, np.floating)):
            values.append(float(a))
            types.append(ctypes.c_float)
        else:
            wide = isinstance(a, np.int64)
            bits = 64 if wide else 32
            if not -(1 << (bits - 1)) <= int(a) < 1 << (bits - 1):
                raise ValueError(f"kernel argument {i} = {int(a)} does not fit int{bits}"
                                 + ("" if wide else "; pass numpy.int64 for a long long"))
            values.append(int(a))
            types.append(ctypes.c_longlong if wide else ctypes.c_int)
    return tuple(values), tuple(types)


def stream_handle(stream) -> int:
    """The CUstream of a numba stream as an int (0: the legacy default stream)."""
    if stream == 0 or stream is None:
        return 0
    handle = stream.handle
    return int(getattr(handle, "value", handle) or 0)
