"""The tensor-core delta rule's CUDA C++ (executor/numba_cuda/delta_mma.cu, and delta_wgmma.cu's
walk) on the CPU, through a host emulator of the CUDA features they use (emulator/cuda_host.h: a
fiber per thread, real barriers, mma.m16n8k8 tf32 from the PTX fragment tables, wgmma summed as
the mma.sync products of its k-step, cp.async copies that are NaN until their wait). CI has no GPU
and the numba simulator cannot run linked CUDA C++, so this is where CI checks that code: values
against the float64 twin at both tf32 splits, every element of the outputs and scratch written,
no write outside a buffer, the same bits for any chunking on the 64-row grid, for every CTA shape,
for every thread schedule, and for the walk on wgmma or mma.sync; and that the checks fail on a
planted break (a chunk-start anchor; a barrier removed; V' in S's buffer; the state's decay one
ulp off or one row off; the wgmma walk's V' barrier or its S descriptor). The GPU tests
(test_gpu_delta_mma.py) check the same on the H100/H200. Skips when no C++ compiler is found.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from executor.reference import ops
from tests.executor.numba_cuda.kernel_support import build_emulated, delta_inputs

HERE = Path(__file__).parent / "emulator"
SOURCE = Path(__file__).parents[3] / "executor" / "numba_cuda" / "delta_mma.cu"
WGMMA_SOURCE = SOURCE.with_name("delta_wgmma.cu")
WGMMA_HELPERS = SOURCE.with_name("wgmma.cu")
V0 = 4
TOL = {1: 4e-3, 3: 1e-5}
"""Relative to max |ref| against the float64 twin (the emulated products are exact, summed in
double: a little closer than the hardware's; the GPU tests use 4e-3 and 1e-4)."""


PLANTED_BARRIER = ("__syncthreads();  // W, q and S buffers read", "/* planted: barrier removed */")
"""The walk's barrier between its last reads of the W and q buffers and the copies of the next
sub-chunk into them: removed, a warp that runs ahead overwrites rows the others still read."""

PLANTED_ALIAS = ("static constexpr int V = SL + KD * LS; // tf32(V'), then (SPLIT 3) its low part\n"
                 "    static constexpr int VL = V + C * LS;\n"
                 "    static constexpr int DV = VL + C * LS;",
                 "static constexpr int V = S; static constexpr int VL = SL; static constexpr int DV = SL + KD * LS;")
"""V' in S's buffer (as before session 30): a warp that runs ahead stores the next sub-chunk's
S over the V' the others still read for M V' and the state update (no barrier ends a step)."""


def device_code(source: str, plant: tuple[str, str] | None = None, wgmma_plant: bool = False) -> str:
    """delta_mma.cu's device code as host C++: the mma helpers and both phases, its dynamic
    shared memory the emulator's block buffer, then delta_wgmma.cu's walk (from its emulator
    marker; the emulator stands in for its wgmma instructions). plant: (text, replacement), a
    planted break (PLANTED_BARRIER, PLANTED_ALIAS, PLANTED_DECAY, PLANTED_DECAY_ROW; with
    wgmma_plant, one of the wgmma walk's: PLANTED_WGMMA_*). Raises ValueError when a source lost
    a marker or the plant's text is not there exactly once."""
    markers = ("template <int SPLIT, bool A_TF32", "__device__ __forceinline__ u32 smem_addr",
               "// Shared-memory layout of phase 1", "// Entry points")
    missing = [m for m in markers if m not in source]
    if missing:
        raise ValueError(f"delta_mma.cu no longer has {missing}: update device_code")
    helpers = source[source.index(markers[0]) : source.index(markers[1])]
    body = source[source.index(markers[2]) : source.index(markers[3])]
    body = body.replace("extern __shared__ __align__(16) float smem[];", "float* smem = g_smem;")
    if plant is not None and not wgmma_plant:
        if body.count(plant[0]) != 1:
            raise ValueError(f"delta_mma.cu no longer has exactly one {plant[0]!r}")
        body = body.replace(*plant)
    wgmma = WGMMA_SOURCE.read_text()
    start, end = "// The host emulator", "}  // namespace delta"
    if start not in wgmma or end not in wgmma:
        raise ValueError(f"delta_wgmma.cu no longer has {start!r} and {end!r}: update device_code")
    wgmma = wgmma[wgmma.index(start) : wgmma.index(end)]
    if plant is not None and wgmma_plant:
        if wgmma.count(plant[0]) != 1:
            raise ValueError(f"delta_wgmma.cu no longer has exactly one {plant[0]!r}")
        wgmma = wgmma.replace(*plant)
    wgmma = wgmma.replace("extern __shared__ __align__(16) float smem[];", "float* smem = g_smem;")
    helpers_text = WGMMA_HELPERS.read_text()  # wgmma.cu: the emulator stands in for all of it but wg_desc
    mark = "// The host emulator of the delta rule's tests"
    if mark not in helpers_text:
        raise ValueError(f"wgmma.cu no longer has {mark!r}: update device_code")
    wgmma = helpers_text[helpers_text.index(mark):] + wgmma
    return '#include "cuda_host.h"\nnamespace delta {\n' + helpers + body + "namespace delta {\n" + wgmma + "}\n"


def _build(out_dir: Path, code: str) -> Path:
    return build_emulated(out_dir, code, "delta_mma", "-O2")


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    code = device_code(SOURCE.read_text())
    host_files = "".join((HERE / n).read_text() for n in ("cuda_host.h", "cuda_host.cpp", "delta_mma_host.cpp"))
    digest = hashlib.sha256((code + host_files).encode()).hexdigest()[:12]
    return _build(tmp_path_factory.mktemp(f"delta-host-{digest}"), code)


def _inputs(seed, rows, key_heads, value_heads, key_dim, value_dim, decay=1.0):
    """delta_inputs of the seed (g times `decay`), then the three slots' states and `mixed` (v at
    column V0)."""
    r = np.random.default_rng(seed)
    q, k, v, g, beta = delta_inputs(r, rows, key_heads, value_heads, key_dim, value_dim)
    g = (g * np.float32(decay)).astype(np.float32)
    state = (r.normal(size=(3, value_heads, key_dim, value_dim)) * 0.3).astype(np.float32)
    mixed = np.concatenate([r.normal(size=(rows, V0)), v.reshape(rows, -1)], axis=1).astype(np.float32)
    return q, k, v, g, beta, state, mixed


def _launch(exe, tmp, case, *, bv, warps, split, per_block=1, cuts=None, anchor=True, env=None):
    """Write the case's inputs into tmp and run the host runner: the CompletedProcess."""
    seed, start_row, rows, key_heads, value_heads, key_dim, value_dim, *decay = case
    q, k, v, g, beta, state, mixed = _inputs(seed, rows, key_heads, value_heads, key_dim, value_dim, *decay)
    d = Path(tmp)
    files = {"q": q * np.float32(key_dim**-0.5), "k": k, "mixed": mixed, "g": g, "beta": beta, "state": state,
             "dims": np.array([rows, key_heads, value_heads, V0])}
    for name, x in files.items():
        np.ascontiguousarray(x, np.float32).tofile(d / f"{name}.bin")
    args = [str(exe), str(d), key_dim, value_dim, bv, warps, split, per_block, start_row, int(anchor)]
    args += list(cuts or [rows])
    base = {k: v for k, v in os.environ.items() if not k.startswith("DELTA_HOST_")}
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600,
                          env={**base, **(env or {})})


def _run(exe, tmp, case, **kwargs):
    """(out [rows, value_heads, value_dim], states [3, ...]) of the emulated launches."""
    done = _launch(exe, tmp, case, **kwargs)
    assert done.returncode == 0, f"emulated launch failed: {done.stderr[-2000:]}"
    _, _, rows, _, value_heads, key_dim, value_dim, *_ = case
    out = np.fromfile(Path(tmp) / "out.bin", np.float32).reshape(rows, value_heads, value_dim)
    states = np.fromfile(Path(tmp) / "state_out.bin", np.float32).reshape(3, value_heads, key_dim, value_dim)
    return out, states


def _twin(case):
    seed, start_row, rows, key_heads, value_heads, key_dim, value_dim, *decay = case
    q, k, v, g, beta, state, _ = _inputs(seed, rows, key_heads, value_heads, key_dim, value_dim, *decay)
    return ops.gated_delta_rule_chunked(q, k, v, g, beta, state[1], start_row), state


SMALL = (1, 30, 70, 1, 3, 16, 8)  # seed, start_row, rows, key_heads, value_heads, key_dim, value_dim
WIDE = (2, 100, 150, 1, 2, 128, 128)
SLOW = (2, 100, 150, 1, 2, 128, 128, 0.01)
"""WIDE with g x 0.01: at delta_inputs' own gates the state decays so fast that what a sub-chunk
carries to the next barely reaches the outputs (a planted 1-ulp change of e^(c_last) left WIDE's
bits as they were, session 36); here it does."""


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("case, bv, warps", [(SMALL, 8, 4), ((3, 0, 130, 2, 4, 32, 32), 32, 8), (WIDE, 32, 8),
                                             (SLOW, 32, 8)],
                         ids=["tiny-dims", "dims-32", "dims-128", "slow-gates"])
def test_emulated_kernels_match_the_twin(host, tmp_path, case, bv, warps, split):
    out, states = _run(host, tmp_path, case, bv=bv, warps=warps, split=split)
    errors = _twin_errors(case, out, states)
    assert max(errors) < TOL[split], errors


def _twin_errors(case, out, states):
    """(output, state) error relative to max |twin|; slots 0 and 2 must be untouched."""
    (ref, ref_state), state0 = _twin(case)
    np.testing.assert_array_equal(states[[0, 2]], state0[[0, 2]])
    return (float(np.abs(out - ref).max() / np.abs(ref).max()),
            float(np.abs(states[1] - ref_state).max() / np.abs(ref_state).max()))


PLANTED_DECAY_ROW = ("        const float decay = dv[n - 1];", "        const float decay = dv[n - 2];")
"""The state's decay over a sub-chunk taken from the row before its last: off by one row's gate."""


def test_emulated_twin_check_of_slow_gates_catches_a_wrong_state_decay(tmp_path):
    """PLANTED_DECAY_ROW moves SLOW's values past the 3xTF32 tolerance (at delta_inputs' own
    gates the carried state hardly reaches the outputs, so only a slow-gate case can see it)."""
    exe = _build(tmp_path / "planted", device_code(SOURCE.read_text(), PLANTED_DECAY_ROW))
    out, states = _run(exe, tmp_path, SLOW, bv=32, warps=8, split=3)
    assert max(_twin_errors(SLOW, out, states)) > 10 * TOL[3]


MID = (3, 0, 130, 2, 4, 32, 32)


@pytest.mark.parametrize("case, base, change", [
    (WIDE, dict(bv=32, warps=8, split=3), dict(cuts=[28, 92, 150])),
    (WIDE, dict(bv=32, warps=8, split=3), dict(cuts=[92, 150], bv=64)),
    (WIDE, dict(bv=32, warps=8, split=3), dict(bv=32, warps=4, per_block=2)),
    (MID, dict(bv=32, warps=8, split=3), dict(cuts=[64, 128, 130], per_block=2)),
    (MID, dict(bv=32, warps=8, split=3), dict(env={"DELTA_HOST_EAGER": "1"})),
    (MID, dict(bv=32, warps=8, split=1), dict(env={"DELTA_HOST_ORDER": "1"})),
    (MID, dict(bv=32, warps=8, split=3), dict(env={"DELTA_HOST_ORDER": "2"})),
    (MID, dict(bv=32, warps=8, split=3), dict(env={"DELTA_HOST_ORDER": "3"})),
    (MID, dict(bv=32, warps=8, split=3), dict(env={"DELTA_HOST_ORDER": "4"})),
    (SMALL, dict(bv=8, warps=4, split=1), dict(cuts=[34, 70], per_block=3, env={"DELTA_HOST_ORDER": "3"})),
], ids=["cuts-on-grid", "bv-64", "4-warps", "cuts-from-0", "copies-land-at-issue", "reversed", "shuffled",
        "first-warp-ahead", "last-warp-ahead", "tiny-dims"])
def test_emulated_bits_on_the_grid_for_every_cta_shape_and_schedule(host, tmp_path, case, base, change):
    """A chunk against chunkings cut on the 64-row grid (from row 100: the first piece is the
    partial sub-chunk), the other CTA shapes (value heads per phase-1 CTA; BV and warps of phase
    2), copies landing at once, and other thread schedules (reversed, shuffled, one warp
    running ahead to its next barrier): the same output and state bits."""
    want = _run(host, tmp_path, case, **base)
    got = _run(host, tmp_path, case, **(base | change))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_emulated_planted_chunk_start_anchor_breaks_grid_invariance(host, tmp_path):
    """Sub-chunks anchored at each chunk's start: the chunk from row 100 in one piece no longer
    matches the same rows cut at row 128 (the grid check above would turn red)."""
    whole = _run(host, tmp_path, WIDE, bv=32, warps=8, split=3, anchor=False)
    pieces = _run(host, tmp_path, WIDE, bv=32, warps=8, split=3, cuts=[28, 150], anchor=False)
    assert not np.array_equal(whole[0], pieces[0])
    assert not np.array_equal(whole[1], pieces[1])


@pytest.mark.parametrize("plant", [PLANTED_BARRIER, PLANTED_ALIAS], ids=["barrier-removed", "v-on-s"])
def test_emulated_planted_race_is_caught(tmp_path, plant):
    """With a planted race, the first warp running ahead (DELTA_HOST_ORDER=3) writes shared rows
    the other warps still read (PLANTED_BARRIER: the next sub-chunk's W and q; PLANTED_ALIAS: the
    next S over V'): the emulator aborts on the NaN of a copy in flight reaching an mma (or an
    unwritten output), or the values come out wrong."""
    exe = _build(tmp_path / "planted", device_code(SOURCE.read_text(), plant))
    case = (4, 0, 130, 1, 2, 128, 128)
    done = _launch(exe, tmp_path, case, bv=32, warps=8, split=3, env={"DELTA_HOST_ORDER": "3"})
    if done.returncode:
        assert done.returncode == -6, done.stderr[-2000:]  # SIGABRT from a check, not a usage error
        assert any(m in done.stderr for m in ("is NaN", "unwritten", "outside the buffer", "deadlock", "in flight")), \
            done.stderr[-2000:]
        return
    out = np.fromfile(tmp_path / "out.bin", np.float32)
    want = _twin(case)[0][0].ravel()
    assert not np.isfinite(out).all() or np.abs(out - want).max() > 1e-3 * np.abs(want).max()


def test_host_runner_shared_memory_equals_the_launcher_s(host):
    """The shared floats delta_mma.py asks for at launch equal the source's PrepareSmem /
    WalkSmem for every build of the runner (the emulator's buffers are those structs), and
    delta_wgmma.shared_bytes equals delta_wgmma.cu's WgWalkSmem at both column splits."""
    listed = subprocess.run([str(host), "--sizes"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    wgmma = {int(bv): 4 * int(floats) for _, bv, floats in (x.split() for x in lines if x.startswith("wgmma "))}
    from executor.numba_cuda import delta_wgmma

    assert wgmma == {bv: delta_wgmma.shared_bytes(bv) for bv in delta_wgmma.COLUMNS}  # the launch asks for these
    rows = [tuple(int(v) for v in line.split()) for line in lines if not line.startswith("wgmma ")]
    assert len(rows) >= 5
    script = ("import sys; from executor.numba_cuda import delta_mma as d; "
              "print(*[f'{d._prepare_floats(int(a), int(b))} {d._walk_floats(int(a), int(c))}' "
              "for a, b, c in (x.split(',') for x in sys.argv[1:])], sep='\\n')")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": str(Path(__file__).parents[3])}
    args = [f"{kd},{vd},{bv}" for kd, vd, bv, *_ in rows]
    python = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120,
                            env=env, cwd=Path(__file__).parents[3])
    assert python.returncode == 0, python.stderr[-2000:]
    want = [tuple(int(v) for v in line.split()) for line in python.stdout.splitlines()]
    assert want == [(p, w) for *_, p, w in rows]


def test_every_walk_shape_fits_a_cta_s_shared_memory():
    """Every (BV, warps) `walk_shape` picks, at every key and value dim the kernel is built for,
    asks for at most the 232,448 bytes of dynamic shared memory an H200 CTA may have (V' in its
    own buffer took the 27B's BV 64 to 230,912; a stride 4 floats wider passes every emulator
    test and fails only at launch on a GPU)."""
    from executor.numba_cuda import attention_flash, delta_mma

    most = max(4 * delta_mma._walk_floats(kd, delta_mma.walk_shape(vd, heads, sms)[0])
               for kd in delta_mma.KEY_DIMS for vd in delta_mma.VALUE_DIMS
               for heads in (1, 2, 3, 16, 32, 48, 64, 128, 256) for sms in (132, 114, 78))
    assert most == 230_912 and most <= attention_flash.MAX_SHARED_BYTES == 232_448


PINNED = {(WIDE, 3): "9102955de7d0c56105e7aff0b42d123cc7a83596115a083f2824ab818e922bbc",
          (WIDE, 1): "a0edae320a03e1276065460bc5316299fc320f978f757081f87c9f547382feae",
          (SLOW, 3): "0fda9369b8265cec1dab00c05e923fa754b4449c27f4ee1b5d03dd05fe0ca9ed",
          (SLOW, 1): "fc6701c78ec4190415e91cba7b3ed41500155ef45baf62b219d249ef49999d94"}
"""sha256 of the emulated output and state bytes (BV 32, 8 warps): WIDE's pinned on the source of
90f340a and unchanged since (bench/RESULTS.md, session 29: the walk's B operands split once);
SLOW's pinned in session 36, the same on 841e2bf's source and on the walk split by role."""

PLANTED_DECAY = ("        const float decay = dv[n - 1];",
                 "        const float decay = __uint_as_float(__float_as_uint(dv[n - 1]) + 1u);")
"""The state's decay over a sub-chunk, e^(c_last), one ulp off: SLOW's pinned bits move (WIDE's did
not, session 36)."""


def _pinned_digest(exe, tmp, case, split):
    out, states = _run(exe, tmp, case, bv=32, warps=8, split=split)
    return hashlib.sha256(out.tobytes() + states.tobytes()).hexdigest()


@pytest.mark.parametrize("case, split", [(WIDE, 3), (WIDE, 1), (SLOW, 3), (SLOW, 1)],
                         ids=["wide-3", "wide-1", "slow-3", "slow-1"])
def test_emulated_bits_are_pinned(host, tmp_path, case, split):
    """The emulated bits of a fixed case equal the pinned ones: a change that keeps the values within
    the twin's tolerance but moves bits (e.g. the three tf32 products of a 3xTF32 product reordered,
    which a review planted and no other CPU test caught) fails here. The emulator's products are
    exact, summed in double, so its bits are the source's order of operations, not the hardware's:
    a deliberate change of order re-pins them, with the GPU's bits measured and said in RESULTS."""
    assert _pinned_digest(host, tmp_path, case, split) == PINNED[case, split]


def test_emulated_pin_of_slow_gates_sees_the_carried_state(tmp_path):
    """PLANTED_DECAY (e^(c_last) one ulp off) moves SLOW's pinned bits: the pin that guards the state
    between sub-chunks. (In session 36 it left WIDE's as they were: WIDE's state hardly reaches its
    outputs at delta_inputs' gates.)"""
    exe = _build(tmp_path / "planted", device_code(SOURCE.read_text(), PLANTED_DECAY))
    assert _pinned_digest(exe, tmp_path, SLOW, 3) != PINNED[SLOW, 3]


# The wgmma walk (delta_wgmma.cu, DELTA_HOST_WGMMA=1): the emulator runs each wgmma as the mma.sync
# sums of its k-step, so its bits must be the emulated mma.sync walk's exactly (on the GPU,
# delta_wgmma.status checks the same against the hardware's mma.sync walk before first use).
WGMMA = {"DELTA_HOST_WGMMA": "1"}


@pytest.mark.parametrize("case, bv, change", [
    (WIDE, 32, {}),
    (SLOW, 64, {}),
    (SLOW, 32, {"cuts": [28, 92, 150]}),
    (MID[:5] + (128, 128), 32, {"env": {"DELTA_HOST_ORDER": "2"}}),
    (WIDE, 32, {"env": {"DELTA_HOST_ORDER": "3"}}),
    (WIDE, 64, {"env": {"DELTA_HOST_ORDER": "4"}}),
    (WIDE, 32, {"env": {"DELTA_HOST_EAGER": "1"}}),
], ids=["wide", "slow-bv-64", "cuts-on-grid", "from-0-shuffled", "first-warp-ahead", "last-warp-ahead-bv-64",
        "copies-land-at-issue"])
def test_emulated_wgmma_walk_gives_the_mma_sync_walk_s_bits(host, tmp_path, case, bv, change):
    """Every output and state bit of the mma.sync walk, at both column splits, over cuts on the
    64-row grid and under other thread schedules (a missing barrier would let a warpgroup read V'
    or S before it is stored: NaN, an abort, or other values). The emulator does not model the
    proxy fences (plain stores are all it has): test_wgmma_walk_fences_every_shared_operand
    checks them in the source."""
    want = _run(host, tmp_path, case, bv=bv, warps=8, split=3)
    env = {**WGMMA, **change.get("env", {})}
    got = _run(host, tmp_path, case, bv=bv, warps=8, split=3, cuts=change.get("cuts"), env=env)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


PLANTED_WGMMA_BARRIER = ("        wg_proxy_fence();\n        __syncthreads();  // V' stored",
                         "        wg_proxy_fence();  /* planted: barrier removed */")
"""The wgmma walk's barrier between warpgroup 0's V' stores and both warpgroups' wgmma reading V'."""
PLANTED_WGMMA_COMMIT = ("            wg_commit();\n            wg_wait0();\n            wg_keep<BV / 2>(sacc);",
                        "            wg_wait0();\n            wg_keep<BV / 2>(sacc);")
"""The state update's products waited for but never committed: wgmma.wait_group does not wait for
them on the hardware, so the state and O would be read while they run."""
PLANTED_WGMMA_STRIDE = ("constexpr int CORE_P = 36;", "constexpr int CORE_P = 32;")
"""S and V' with their core matrices 128 bytes apart along k instead of 144, in the stores and the
descriptors alike: not a break (P only spreads the stores over the banks), so the bits stay."""
PLANTED_WGMMA_DESC = ("const unsigned long long s_hi = wg_desc(smem_addr(ss), L::P * 4, L::SBO_S * 4);",
                      "const unsigned long long s_hi = wg_desc(smem_addr(ss), L::SBO_S * 4, L::P * 4);")
"""S's descriptor with its leading and stride byte offsets swapped (the other reading of the PTX
ISA's table): W S and q S read S's elements in the wrong places."""


@pytest.mark.parametrize("plant", [PLANTED_WGMMA_BARRIER, PLANTED_WGMMA_DESC, PLANTED_WGMMA_COMMIT],
                         ids=["barrier-removed", "desc-swapped", "commit-removed"])
def test_emulated_wgmma_walk_planted_break_is_caught(tmp_path, plant):
    """A planted break of the wgmma walk (the V' barrier removed; S's descriptor strides swapped; the
    state update's commit removed) aborts the emulator (NaN of memory not yet written reaching a
    wgmma, a store racing one, a wait on products never committed) or
    moves the bits off the mma.sync walk's, with the last warp (warpgroup 1) running ahead."""
    exe = _build(tmp_path / "planted", device_code(SOURCE.read_text(), plant, wgmma_plant=True))
    want = _run(exe, tmp_path, WIDE, bv=32, warps=8, split=3)
    done = _launch(exe, tmp_path, WIDE, bv=32, warps=8, split=3, env={**WGMMA, "DELTA_HOST_ORDER": "4"})
    if done.returncode != 0:
        assert any(m in done.stderr for m in ("NaN", "raced", "not committed")), done.stderr[-2000:]
        return
    got = (np.fromfile(Path(tmp_path) / "out.bin", np.float32), np.fromfile(Path(tmp_path) / "state_out.bin", np.float32))
    assert not all(np.array_equal(a.ravel(), b.ravel()) for a, b in zip(got, want))


def test_emulated_wgmma_walk_stride_is_free_when_stores_and_descriptors_agree(tmp_path):
    """PLANTED_WGMMA_STRIDE moves the stores and the descriptors together (P 36 -> 32): the same
    bits, which shows the descriptor check above fails for the mismatch, not for P itself."""
    exe = _build(tmp_path / "p32", device_code(SOURCE.read_text(), PLANTED_WGMMA_STRIDE, wgmma_plant=True))
    want = _run(exe, tmp_path, WIDE, bv=32, warps=8, split=3)
    got = _run(exe, tmp_path, WIDE, bv=32, warps=8, split=3, env=WGMMA)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_wgmma_walk_fences_every_shared_operand():
    """What the emulator cannot see, read from delta_wgmma.cu's text: each store of a wgmma B
    operand (the split stores of S and of V') is followed by a proxy fence before the next barrier
    (st.shared writes reach wgmma's async-proxy reads only so), each issue of products by a
    wgmma.fence after the A fragments are written, and each wait by the keeps of its registers."""
    text = WGMMA_SOURCE.read_text()
    body = text[text.index("__device__ __forceinline__ void walk_wgmma("):text.index("}  // namespace delta")]
    stores = [i for i in range(len(body)) if body.startswith("split_store<3>(", i)]
    assert len(stores) == 2
    for at in stores:
        fence, barrier = body.find("wg_proxy_fence();", at), body.find("__syncthreads();", at)
        assert -1 < fence < barrier, body[at:at + 400]
    issues = [i for i in range(len(body)) if body.startswith("wg_split_step<BV>(", i)]
    assert len(issues) == 6  # W S or q S, the state update and M V', each interleaved and built first
    for at in issues:
        before = body[:at]
        assert before.rfind("wg_fence();") > max(before.rfind("split_a("), before.rfind("wg_wait0();")), body[at - 300:at]
    waits = [i for i in range(len(body)) if body.startswith("wg_wait0();", i)]
    assert len(waits) == 2 and all("wg_keep<" in body[at:at + 120] for at in waits)
