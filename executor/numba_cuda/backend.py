"""The numba-cuda backend: the dense Qwen3.5 forward on one GPU, implementing
`executor.backend.Backend`, with per-stream state in a device pool.

Numerics: weights bf16, residual stream fp32, every GEMM input bf16 and output fp32.
Prefill GEMMs run on cuBLASLt with a pinned row-invariant algorithm at every row count;
prefill attention on the tensor cores (attention_flash.py: one fused pass, mma.sync through a
linked CUDA C++ device function, a long chunk's walk on wgmma where the GPU has it with the same
bits, attention_wgmma.py; else attention_mm.py: pinned cuBLASLt QK^T and PV; a row's
bits independent of its chunk and tile either way); the prefill delta rule in its chunked form with
64-row sub-chunks at absolute multiples of 64, on the tensor cores (delta_mma.py: tf32 mma.sync
through linked CUDA C++; else delta_chunked.py on the CUDA cores); decode GEMMs and
the LM head on the row-invariant GEMV at every lane count, the decode delta rule as the
one-row recurrence. Every other kernel computes a row independently of the chunk or lane
set, so prefill rows are chunk-invariant on the 64-row grid (`facts`). Wiring mirrors executor/reference/backend.py; the kernels live
in their own modules here, the device weights in device_weights.py, CUDA graphs of the
decode step and of short prefill chunks (padded to a bucket) in graphs.py.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Sequence

import attrs
import numpy as np
import structlog
from numba import cuda

from executor.backend import frozen_logits, shared_segments
from executor.config import FULL, Qwen35Config
from executor.numba_cuda import (attention, attention_flash, attention_prep, attention_wgmma, conv, delta_chunked,
                                 delta_mma, delta_rule, device_weights, elementwise, greedy, norms)
from executor.numba_cuda.attention_mm import MatrixAttention
from executor.numba_cuda.device import columns, copy_of, to_device
from executor.numba_cuda.device_weights import DeviceWeights
from executor.numba_cuda.gemm import Gemm, accumulate_aligned, refused_before_launch
from executor.numba_cuda.gemv import gemv
from executor.numba_cuda.state import DevicePayload, DeviceState, StatePool
from executor.weights import Weights, load_weights
from policy.usable import BackendFacts

INVARIANT_ROWS = 64
"""The invariant grid this backend claims (DESIGN: invariant grid). Proven on the GPU by
tests/executor/numba_cuda/test_gpu_backend.py::test_chunk_invariance_on_the_64_row_grid
(cuts on multiples of 64, and an off-grid fresh cut kept, give every last-row logit and
every state byte the same bits) and, for the GEMMs at real Qwen3.5 shapes, by the row
sweep of bench/gpu_kernels.py (the pinned cuBLASLt algorithms give each row the same bits
at every row count tried, 1 to 8192)."""


log = structlog.get_logger(__name__)

HEADROOM_MARGIN_BYTES = 2 << 30
"""Device memory `reserve_cache` leaves free beyond a chunk's measured activation peak:
allocations outside `device.POOL` (numba's own arrays, the driver, the GEMM library) and
size classes the cached blocks do not match."""

PREFILL_ATTENTION_PATHS = ("flash", "matrix", "cuda-core")
"""The prefill attention paths, fastest first (NumbaCudaBackend.prefill_attention)."""
PREFILL_ATTENTION_ENV = "WARMSTATE_PREFILL_ATTENTION"
"""Environment variable that forces one of PREFILL_ATTENTION_PATHS (A/B benchmarks)."""
PREFILL_DELTA_PATHS = ("mma", "cuda-core")
"""The prefill delta-rule paths, fastest first (NumbaCudaBackend.prefill_delta)."""
PREFILL_DELTA_ENV = "WARMSTATE_PREFILL_DELTA"
"""Environment variable that forces one of PREFILL_DELTA_PATHS (A/B benchmarks)."""
RESIDUAL_ACCUMULATE_ENV = "WARMSTATE_RESIDUAL_ACCUMULATE"
"""Environment variable: "0" keeps prefill's output projections out of the residual stream
(NumbaCudaBackend.residual_accumulate off: the A side of an A/B; the same bits either way)."""
BF16_PRODUCTS_ENV = "WARMSTATE_BF16_PRODUCTS"
"""Environment variable: "0" keeps prefill's in_proj and gate|up products in f32 for their
consumers to round (NumbaCudaBackend.bf16_products off: the A side of an A/B; the same bits
either way). WARMSTATE_GEMM_LARGE=0 turns it off too (no bf16 algorithm is searched then)."""


def _check_path_change(what: str, paths: Sequence[str], current: str | None, path: str, fixed: bool) -> None:
    """Raise ValueError when `path` is not one of `paths`, or differs from `current` once the
    path is `fixed` (a prefill ran: its states would not match the new path bit for bit)."""
    if path not in paths:
        raise ValueError(f"{what} {path!r} is not one of {paths}")
    if fixed and path != current:
        raise ValueError(f"{what} is {current!r} and a prefill ran: states already computed would not match "
                         f"{path!r} bit for bit")


def _i32(values) -> object:
    return to_device(np.asarray(values, dtype=np.int32))


class NumbaCudaBackend:
    """Dense Qwen3.5 on one NVIDIA GPU (numba-cuda kernels + cuBLASLt).

    slots: streams that can be live at once; capacity_rows: rows a stream may hold.
    `prefill` takes an extra `tail_from` (policy/tail.py): the absolute first row of the
    last layer's tail, or None for the full last layer when logits are read.
    `invariant_rows` / `facts`: the invariant grid, INVARIANT_ROWS (see its docstring
    for the tests that prove it).
    """

    invariant_rows = INVARIANT_ROWS

    def __init__(self, weights: Weights, *, slots: int = 16, capacity_rows: int = 4096) -> None:
        self._setup(weights.config, slots, capacity_rows)
        self.w = device_weights.from_checkpoint(weights)

    @classmethod
    def from_device_weights(cls, config: Qwen35Config, weights: DeviceWeights, *, slots: int = 16,
                            capacity_rows: int = 4096) -> "NumbaCudaBackend":
        """A backend over weights already on the device (device_weights.random for benchmarks)."""
        backend = cls.__new__(cls)
        backend._setup(config, slots, capacity_rows)
        backend.w = weights
        return backend

    def _setup(self, config: Qwen35Config, slots: int, capacity_rows: int) -> None:
        if config.moe is not None:
            raise NotImplementedError("the numba-cuda backend runs dense Qwen3.5 only")
        if config.dtype != "bfloat16":
            raise ValueError(f"dtype {config.dtype!r}: the numba-cuda backend serves bf16 checkpoints")
        self.config: Qwen35Config = config
        self.pool = StatePool(config, slots, capacity_rows)
        self.gemm = Gemm()
        self.matrix_attention = MatrixAttention()
        self._prefill_attention: str | None = None
        self._prefilled = False
        self.attention_failures: dict[str, str] = {}
        """Why a prefill attention path was passed over when choosing (path -> reason)."""
        self._prefill_delta: str | None = None
        self._delta_mma_why: str | None = None  # the probe's verdict, "" once it passed
        self.delta_failures: dict[str, str] = {}
        """Why a prefill delta-rule path was passed over when choosing (path -> reason)."""
        forced = os.environ.get(PREFILL_ATTENTION_ENV)
        if forced:
            self.prefill_attention = forced
        forced = os.environ.get(PREFILL_DELTA_ENV)
        if forced:
            self.set_prefill_delta(forced)
        self._graphs = None
        self._prefill_graphs = None
        self.prefill_graphs_off: str | None = None
        """Why `enable_prefill_graphs` left prefill eager (None when it did not, or was not asked)."""
        self.residual_accumulate: bool = os.environ.get(RESIDUAL_ACCUMULATE_ENV, "1") != "0"
        """Prefill's o_proj, out_proj and down_proj add their products into the fp32 residual
        stream in cuBLASLt's epilogue (`Gemm.matmul(..., accumulate=True)`) where the shape
        accumulates bit-exactly (`Gemm.accumulates`) and the rows are 256-byte aligned, so the
        next norm reads x alone (6 bytes an element, not 14). The same bits on or off: the
        epilogue's add is the norm's x += delta, checked on a shape's first use
        (`Gemm.accumulates`). Read at launch time: prefill graphs keep the setting they were
        captured with (`enable_prefill_graphs` again to change it there)."""
        self.accumulate_refused: dict[tuple[int, int], str] = {}
        """(N, K) -> why that projection shape gives its product to the norm instead (logged once)."""
        self.bf16_products: bool = os.environ.get(BF16_PRODUCTS_ENV, "1") != "0"
        """Prefill chunks of more than 1,024 rows take the linear attention's in_proj product
        and the MLP's gate|up product in bf16 from cuBLASLt's epilogue (`Gemm.matmul(...,
        bf16=True)`, where `Gemm.bf16_ready`): the GEMM writes half the bytes, and SwiGLU, the
        conv, the gates and the gated norm read 2 bytes an element, not 4 (bench/RESULTS.md,
        session 39). The same bits on or off: each consumer rounds an f32 input to bf16 first
        (`elementwise.swiglu`, `conv.causal_conv1d_qkv`, `delta_rule.delta_gates`,
        `norms.gated_rms_norm`), and the bf16 algorithm's output is checked to be that rounding
        (`Gemm.bf16_algo`). Read at launch time, like `residual_accumulate`."""
        self.flash_lookahead: bool | None = None
        """Prefill attention's wgmma walk in FlashAttention-3's order (attention_wgmma.LOOKAHEAD_KERNEL)
        when True, the backend's walk when False, and when None as `attention_flash.lookahead_status`
        decides (opt-in: WARMSTATE_FLASH_LOOKAHEAD=1, whose bit check runs on first use). True runs
        it without that check: for benchmarks, which check first (`bench.decode_prefill
        --flash-lookahead off,on`). The same bits either way. Read at launch time, like
        `residual_accumulate`."""

    def enable_prefill_graphs(self, buckets: Sequence[int] | None = None, prune: bool = True) -> bool:
        """Make `prefill` replay CUDA graphs for chunks of at most max(buckets) rows
        (graphs.PrefillGraphs: the chunk padded to its bucket, the same bits as the eager
        chunk, tested); every bucket is captured now (again, replacing earlier graphs, when
        called again); buckets (default graphs.BUCKETS) whose key blocks do not fit the
        pool's capacity are left out, and so is a bucket whose capture fails (logged).
        prune: leave out a bucket whose replay is not faster than the eager chunk of the
        kept bucket below, and every bucket above one whose replay is graphs.PRUNE_STOP times
        that chunk or more (`PrefillGraphs.prepare`; logged). Needs
        the tensor-core delta rule and the fused attention (their kernels read rows, start and
        slot on the device); returns False, leaving prefill eager with the reason in
        `prefill_graphs_off`, on a backend that runs another path, when no bucket fits, or
        when no capture succeeds."""
        from executor.numba_cuda.graphs import BUCKETS, PrefillGraphs, keys_fit

        if self._delta_path() != "mma" or self._prefill_path() != "flash":
            self.prefill_graphs_off = f"prefill paths delta {self._delta_path()}, attention {self._prefill_path()}"
            log.info("prefill_graphs_off", reason=self.prefill_graphs_off)
            return False
        capacity = self.pool.capacity_rows
        buckets = [b for b in (BUCKETS if buckets is None else buckets) if keys_fit(b, capacity)]
        if not buckets:
            self.prefill_graphs_off = f"no bucket fits the capacity of {capacity} rows"
            log.info("prefill_graphs_off", reason=self.prefill_graphs_off)
            return False
        if self._prefill_graphs is not None:  # asked again: capture anew for these buckets
            self._prefill_graphs.close()
            self._prefill_graphs = None
        graphs = None
        try:
            graphs = PrefillGraphs(self, buckets)
            graphs.prepare(prune=prune)
        except Exception as exc:  # noqa: BLE001 - eager chunks give the same bits: serve without graphs
            if graphs is not None:
                graphs.close()
            self.prefill_graphs_off = f"capture failed: {exc!r}"
            log.warning("prefill_graphs_off", reason=self.prefill_graphs_off)
            return False
        if graphs.failed:
            log.warning("prefill_graphs_partial", buckets=graphs.buckets, failed=graphs.failed)
        log.info("prefill_graphs", buckets=graphs.buckets, pruned=graphs.pruned,
                 ms={b: [round(t * 1e3, 2) for t in ts] for b, ts in graphs.seconds.items()})
        self._prefill_graphs = graphs
        self.prefill_graphs_off = None
        return True

    @property
    def prefill_graphs(self):
        """The `graphs.PrefillGraphs` that `prefill` replays short chunks through (None: eager)."""
        return self._prefill_graphs

    @contextlib.contextmanager
    def eager_prefill(self):
        """Within this block `prefill` launches every chunk eagerly (the A side of an A/B:
        tests compare bits, bench/prefill_overhead.py compares wall time)."""
        saved, self._prefill_graphs = self._prefill_graphs, None
        try:
            yield
        finally:
            self._prefill_graphs = saved

    def enable_decode_graphs(self, lanes: int = 0) -> None:
        """Make `decode` replay CUDA graphs of the step (graphs.DecodeGraphs: the same bits as
        the eager step, tested); lane counts 1..lanes are captured now, others on first use."""
        if self._graphs is None:
            from executor.numba_cuda.graphs import DecodeGraphs

            self._graphs = DecodeGraphs(self)
        self._graphs.prepare(range(1, lanes + 1))

    @property
    def prefill_attention(self) -> str:
        """Which prefill attention runs, decided once on first use (or set before the first
        prefill, or by the WARMSTATE_PREFILL_ATTENTION environment variable): "flash" (the
        fused tensor-core kernel of attention_flash.py) when it compiles (with link-time
        optimisation) and passes its probe at this head_dim, else "matrix" (cuBLASLt tensor
        cores, attention_mm.py) when both its GEMMs have a pinned invariant algorithm, else
        "cuda-core" (attention.py). The three give different bits, so once a prefill ran the
        path is fixed (`set_prefill_attention(..., after_prefill=True)` is for benchmarks,
        which time paths side by side). `attention_failures` says why a path was passed over.
        Setting it raises ValueError for an unknown path or one that cannot run here (an
        invalid WARMSTATE_PREFILL_ATTENTION raises from the constructor)."""
        if self._prefill_attention is None:
            self._prefill_attention = self._choose_prefill_attention()
            if self._prefill_attention != "flash":
                wgmma = "not the flash path"
            elif self.config.head_dim != attention_wgmma.HEAD_DIM:
                wgmma = f"head_dim {self.config.head_dim}, not {attention_wgmma.HEAD_DIM}"
            else:
                wgmma = attention_flash.wgmma_status()
            lookahead = attention_flash.lookahead_status() if wgmma is None else "no wgmma walk"
            if self.flash_lookahead is not None and wgmma is None:
                lookahead = None if self.flash_lookahead else "flash_lookahead = False"
            tma = attention_flash.tma_status() if wgmma is None else "no wgmma walk"
            if lookahead is None and tma is None:
                tma = "the lookahead walk copies by cp.async"
            log.info("prefill_attention", path=self._prefill_attention, passed_over=self.attention_failures,
                     wgmma_walk="on" if wgmma is None else f"off: {wgmma}", tma="on" if tma is None else f"off: {tma}",
                     lookahead="on" if lookahead is None else f"off: {lookahead}")
        return self._prefill_attention

    @prefill_attention.setter
    def prefill_attention(self, path: str) -> None:
        self.set_prefill_attention(path)

    def set_prefill_attention(self, path: str, *, after_prefill: bool = False) -> None:
        """Choose the prefill attention path (see `prefill_attention`). Raises ValueError for
        an unknown path, one that cannot run here, or a change after a prefill ran unless
        after_prefill (benchmarks only: states already computed keep the old path's bits)."""
        _check_path_change("prefill attention", PREFILL_ATTENTION_PATHS, self._prefill_attention, path,
                           self._prefilled and not after_prefill)
        if path == "matrix" and not self.matrix_attention.ready(self.config.head_dim):
            raise ValueError(f"matrix prefill attention is unavailable: {self.matrix_attention.failure}")
        if path == "flash":
            why = attention_flash.unavailable(self.config.head_dim)
            if why is None:
                try:
                    attention_flash.probe(self.config.head_dim)
                except Exception as exc:  # noqa: BLE001 - name why it cannot run
                    why = f"{type(exc).__name__}: {exc}"
            if why is not None:
                raise ValueError(f"flash prefill attention is unavailable: {why}")
        self._prefill_attention = path

    def _prefill_path(self) -> str:
        """The prefill attention path for this prefill (fixed from now on)."""
        path = self.prefill_attention
        self._prefilled = True
        return path

    def _choose_prefill_attention(self) -> str:
        head_dim = self.config.head_dim
        why = attention_flash.unavailable(head_dim)
        if why is None:
            try:
                attention_flash.probe(head_dim)
                return "flash"
            except Exception as exc:  # noqa: BLE001 - no NVRTC / nvJitLink / mma here: the next path
                why = f"{type(exc).__name__}: {exc}"
        self.attention_failures["flash"] = why
        if self.matrix_attention.ready(head_dim):
            return "matrix"
        self.attention_failures["matrix"] = self.matrix_attention.failure or "unavailable"
        return "cuda-core"

    @property
    def prefill_delta(self) -> str:
        """Which prefill gated delta rule runs, decided once on first use (or set before the
        first prefill, or by the WARMSTATE_PREFILL_DELTA environment variable): "mma" (the
        tensor-core kernels of delta_mma.py) when they compile and pass their probe at this
        model's key and value dims, else "cuda-core" (delta_chunked.py). Both are
        chunk-invariant on the 64-row grid; their bits differ, so once a prefill ran the path
        is fixed (`set_prefill_delta(..., after_prefill=True)` is for benchmarks).
        `delta_failures` says why a path was passed over."""
        if self._prefill_delta is None:
            self._prefill_delta = self._choose_prefill_delta()
            c = self.config
            walk = (delta_mma.wgmma_walk_status(c.linear_key_head_dim, c.linear_value_head_dim,
                                                c.linear_num_value_heads)
                    if self._prefill_delta == "mma" else "not the mma path")
            log.info("prefill_delta", path=self._prefill_delta, passed_over=self.delta_failures,
                     wgmma_walk="on" if walk is None else f"off: {walk}")
        return self._prefill_delta

    def set_prefill_delta(self, path: str, *, after_prefill: bool = False) -> None:
        """Choose the prefill delta-rule path (see `prefill_delta`). Raises ValueError for an
        unknown path, one that cannot run here, or a change after a prefill ran unless
        after_prefill (benchmarks only: states already computed keep the old path's bits)."""
        _check_path_change("prefill delta rule", PREFILL_DELTA_PATHS, self._prefill_delta, path,
                           self._prefilled and not after_prefill)
        if path == "mma":
            why = self._delta_mma_failure()
            if why is not None:
                raise ValueError(f"mma prefill delta rule is unavailable: {why}")
        self._prefill_delta = path

    def _delta_mma_failure(self) -> str | None:
        """Why the tensor-core delta rule cannot run for this model (None when it can): its dims,
        or its probe at the model's dims and head counts, run once a backend."""
        if self._delta_mma_why is None:
            c = self.config
            why = delta_mma.unavailable(c.linear_key_head_dim, c.linear_value_head_dim)
            if why is None:
                try:
                    delta_mma.probe(c.linear_key_head_dim, c.linear_value_head_dim, c.linear_num_key_heads,
                                    c.linear_num_value_heads // c.linear_num_key_heads)
                except Exception as exc:  # noqa: BLE001 - no NVRTC / nvJitLink / mma here: the next path
                    why = f"{type(exc).__name__}: {exc}"
            self._delta_mma_why = why or ""
        return self._delta_mma_why or None

    def _choose_prefill_delta(self) -> str:
        why = self._delta_mma_failure()
        if why is None:
            return "mma"
        self.delta_failures["mma"] = why
        return "cuda-core"

    def _delta_path(self) -> str:
        """The prefill delta-rule path for this prefill (fixed from now on)."""
        path = self.prefill_delta
        self._prefilled = True
        return path

    @classmethod
    def from_dir(cls, model_dir: str | Path, **kwargs) -> "NumbaCudaBackend":
        return cls(load_weights(model_dir), **kwargs)

    @property
    def facts(self) -> BackendFacts:
        """What this backend has proven about its numerics: BackendFacts(invariant_rows=64),
        proven by tests/executor/numba_cuda/test_gpu_backend.py::
        test_chunk_invariance_on_the_64_row_grid (see INVARIANT_ROWS)."""
        return BackendFacts(invariant_rows=self.invariant_rows)

    def new_state(self) -> DeviceState:
        return DeviceState(slot=self.pool.take())

    def release(self, state: DeviceState) -> None:
        """Return the state's slot to the pool (the state is unusable afterwards)."""
        if not state.released:
            state.released = True
            self.pool.give(state.slot)

    # layers ---------------------------------------------------------------------------

    def _linear_attention(self, i: int, li: int, h, mm, row_start, slots, at, stream, meta=None, padded=False):
        c, w = self.config, self.w.layers[i]
        ch, vd, vh = c.conv_channels, c.linear_value_dim, c.linear_num_value_heads
        proj = self._product(h, w["in_proj"], mm, stream)  # [rows, ch + vd + 2 vh]: qkv | z | b | a, f32 or bf16
        # conv + SiLU over q | k | v, q and k L2-normalised in the same pass; v: [rows, value heads x dim]
        qn, kn, v = conv.causal_conv1d_qkv(columns(proj, 0, ch), row_start, slots, w["conv"], self.pool.conv[li],
                                           c.linear_num_key_heads, c.linear_key_head_dim, stream=stream)
        b = columns(proj, ch + vd, ch + vd + vh)
        a = columns(proj, ch + vd + vh, ch + vd + 2 * vh)
        g, beta = delta_rule.delta_gates(a, b, w["a_log"], w["dt_bias"], stream=stream)
        if at is None:  # decode: one row per lane, the recurrent step
            out = delta_rule.delta_recurrence(qn, kn, v, 0, g, beta, row_start, slots, self.pool.recurrent[li],
                                              stream=stream)
        elif self._delta_path() == "mma":  # prefill: the chunked form on the tensor cores
            out = delta_mma.delta_mma(qn, kn, v, 0, g, beta, at[1], at[0], self.pool.recurrent[li], stream=stream,
                                      meta=meta, padded=padded)
        else:  # prefill: the chunked form, sub-chunks anchored at absolute multiples of 64
            out = delta_chunked.delta_chunked(qn, kn, v, 0, g, beta, at[1], at[0], self.pool.recurrent[li],
                                              stream=stream)
        # the gated norm's output: out_proj's input (`_into_residual`)
        return norms.gated_rms_norm(out, columns(proj, ch, ch + vd), w["norm"], c.rms_norm_eps, stream=stream)

    def _full_attention(self, i: int, fi: int, h, mm, positions, slots, first: int, max_pos: int, at, stream,
                        meta=None, padded: bool = False):
        """K/V for every row; q and attention for rows [first, rows): bf16 [rows - first, heads x
        head_dim], o_proj's input (`_into_residual`), or None when that is empty."""
        c, w = self.config, self.w.layers[i]
        kv = mm(h, w["kv_proj"], stream=stream)
        kc, vc = self.pool.keys[fi], self.pool.values[fi]
        attention_prep.kv_norm_rope_store(kv, w["k_norm"], self.w.freqs, positions, slots, c.rms_norm_eps, kc, vc,
                                          stream=stream)
        rows = h.shape[0]
        if first == rows:
            return None
        if first:
            h = copy_of(h[first:], stream)
            positions, slots = positions[first:], slots[first:]
        qg = mm(h, w["q_proj"], stream=stream)
        q = attention_prep.q_norm_rope(qg, w["q_norm"], self.w.freqs, positions, c.rms_norm_eps,
                                       c.num_attention_heads, c.head_dim, stream=stream)
        if at is None:
            out = attention.attention(q, slots, positions, max_pos, kc, vc, qg, 1, attention.DECODE_SPLIT_ROWS,
                                      stream=stream)
        elif self._prefill_path() == "flash":
            if first and meta is not None:  # the tail's rows: meta describes the whole chunk
                meta = None
            # keys: an eager chunk's own (its split holds partials for them alone), a captured one's
            # (padded) any row's up to the capacity, as its replays start anywhere
            out = attention_flash.prefill(q, qg, kc, vc, at[0], at[1] + first, stream=stream, meta=meta,
                                          keys=None if padded else max_pos + 1, lookahead=self.flash_lookahead)
        elif self._prefill_attention == "matrix":
            out = self.matrix_attention.prefill(q, qg, kc, vc, at[0], at[1] + first, stream=stream)
        else:
            out = attention.attention(q, slots, positions, max_pos, kc, vc, qg, attention.TILE_ROWS,
                                      attention.PREFILL_SPLIT_ROWS, stream=stream)
        return out

    def _into_residual(self, a, weight, x, mm, stream):
        """An output projection a @ weight.T of rows that the residual stream x (f32 [rows, hidden],
        those rows) adds next: added into x here and None returned when `residual_accumulate`
        is on, this is prefill (cuBLASLt), the shape accumulates exactly and x starts on a
        256-byte boundary (`accumulate_aligned`); else the product (f32 [rows, hidden]) for the
        next norm to add. The same bits either way."""
        if not self.residual_accumulate or mm != self.gemm.matmul or not x.shape[0]:
            return mm(a, weight, stream=stream)
        n, k = weight.shape
        if (n, k) not in self.accumulate_refused and not self.gemm.accumulates(n, k):
            self.accumulate_refused[(n, k)] = str(self.gemm.pinned[(n, k)]["accumulate"])
            log.warning("residual_accumulate_off", n=n, k=k, reason=self.accumulate_refused[(n, k)])
        if (n, k) in self.accumulate_refused or not accumulate_aligned(x):
            return mm(a, weight, stream=stream)
        self.gemm.matmul(a, weight, out=x, stream=stream, accumulate=True)
        return None

    def _product(self, h, weight, mm, stream, multiple: int = 1):
        """h @ weight.T for a product whose consumers round it to bf16 first (in_proj, gate|up):
        bf16 (uint16 [rows, N]) from cuBLASLt's epilogue when `bf16_products` is on, this is
        prefill (cuBLASLt) and the GEMM has a bf16 algorithm for this many rows
        (`Gemm.bf16_ready`: more than 1,024) and N is a multiple of `multiple` (16 for gate|up:
        the bf16 SwiGLU's 16-byte loads need inter % 8 == 0), else f32; the same bits after the
        consumers either way."""
        if self.bf16_products and mm == self.gemm.matmul:
            (m, _), (n, k) = h.shape, weight.shape
            if n % multiple == 0 and self.gemm.bf16_ready(m, n, k):
                try:
                    return self.gemm.matmul(h, weight, stream=stream, bf16=True)
                except Exception as exc:  # an M the probes missed, refused before any launch: f32 from now on
                    if not refused_before_launch(exc):
                        raise
                    self.gemm.refused_bf16[(m, n, k)] = repr(exc)
                    log.warning("bf16_product_refused", m=m, n=n, k=k, reason=repr(exc))
        return mm(h, weight, stream=stream)

    def _forward(self, ids, positions, row_slots, lane_slots, row_start, max_pos: int, at, first_tail: int,
                 want_logits: bool, stream=0, meta=None, padded: bool = False):
        """Run the rows through every layer; returns device logits f32 [lanes or 1, vocab]
        or None.

        ids, positions, row_slots: i32 device [rows]; lane_slots: i32 [lanes]; row_start:
        i32 [lanes + 1]; max_pos: at least the largest position (sizes the decode
        attention's split grid; a larger value changes no bit); at: None for a decode
        round, else (slot, first absolute row) of a one-stream prefill chunk; first_tail: the last
        layer's first tail row (relative). meta: None or i32 device [3] = (rows in use,
        first absolute row, slot) of a prefill chunk, which its delta-rule and attention
        kernels read on the device; padded: rows past meta[0] are padding (row slot -1, row_start
        [0, meta[0]]: graphs.PrefillGraphs), the logits row is row meta[0] - 1, no tail. Every
        launch and buffer is on `stream`."""
        c = self.config
        decode = at is None
        mm = gemv if decode else self.gemm.matmul
        norm_threads = norms.NORM_THREADS if decode else norms.PREFILL_NORM_THREADS
        x = elementwise.embed(ids, self.w.embed, stream=stream)
        delta = None
        lin = full = 0
        last = c.num_hidden_layers - 1
        for i, kind in enumerate(c.layer_types):
            w = self.w.layers[i]
            h = norms.add_rms_norm(x, w["in_norm"], c.rms_norm_eps, delta=delta, stream=stream, threads=norm_threads)
            first = first_tail if i == last else 0
            if kind == FULL:
                a = self._full_attention(i, full, h, mm, positions, row_slots, first, max_pos, at, stream, meta,
                                         padded)
                proj = "o_proj"
                full += 1
            else:
                a = self._linear_attention(i, lin, h, mm, row_start, lane_slots, at, stream, meta, padded)
                proj = "out_proj"
                lin += 1
            if a is None:
                return None
            if first:
                x = x[first:]
            y = self._into_residual(a, w[proj], x, mm, stream)
            h = norms.add_rms_norm(x, w["post_norm"], c.rms_norm_eps, delta=y, stream=stream, threads=norm_threads)
            delta = self._into_residual(elementwise.swiglu(self._product(h, w["gate_up"], mm, stream, 16), stream=stream),
                                        w["down"], x, mm, stream)
        if not want_logits:
            return None
        if padded:
            x, delta = elementwise.last_row(x, delta, meta, stream=stream)
        elif not decode:
            x = x[x.shape[0] - 1 :]
            delta = None if delta is None else delta[delta.shape[0] - 1 :]
        h = norms.add_rms_norm(x, self.w.norm, c.rms_norm_eps, delta=delta, stream=stream, threads=norm_threads)
        return gemv(h, self.w.lm_head, stream=stream)

    # Backend protocol -----------------------------------------------------------------

    def prefill(self, state: DeviceState, token_ids: Sequence[int], rows: tuple[int, int], want_logits: bool = True,
                tail_from: int | None = None) -> np.ndarray | None:
        """See `Backend.prefill`. tail_from: absolute first row of the last layer's tail
        (a <= tail_from < b when logits are read, tail_from == b to skip q/o/MLP); None
        means the full last layer, or the empty tail when want_logits is False. The logits
        come back read-only, shared with the state (a keep of it then shares them too:
        `frozen_logits`)."""
        start, end = rows
        if state.released:
            raise ValueError("state was released")
        if start != state.rows:
            raise ValueError(f"rows starts at {start} but the state holds {state.rows} rows")
        if not 0 <= start < end <= len(token_ids):
            raise ValueError(f"rows {rows} is not a non-empty range within the {len(token_ids)}-token prompt")
        if end > self.pool.capacity_rows:
            raise ValueError(f"rows {rows} exceed the state capacity of {self.pool.capacity_rows} rows")
        ids = np.asarray(token_ids[start:end], dtype=np.int64)
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token_ids hold an id outside [0, {self.config.vocab_size})")
        if tail_from is None:
            tail_from = end if not want_logits and self.config.layer_types[-1] == FULL else start
        if not start <= tail_from <= end or (want_logits and tail_from == end):
            raise ValueError(f"tail_from {tail_from} is outside [{start}, {end}{')' if want_logits else ']'}")
        if tail_from > start and self.config.layer_types[-1] != FULL:
            raise ValueError("a tail needs a full-attention last layer")
        n = end - start
        graphs = self._prefill_graphs
        pick = None
        if graphs is not None and graphs.serves(start, end):  # the full last layer: the same bits (tail == full)
            logits, pick = graphs.prefill(state.slot, ids, start, end)
            logits = logits[None] if want_logits else None
        else:
            # one upload: ids | positions | row slots | lane slot | row_start (0, n) | meta (n, start, slot)
            inputs = _i32(np.concatenate([ids, np.arange(start, end), np.full(n, state.slot),
                                          [state.slot, 0, n, n, start, state.slot]]))
            logits = self._forward(
                inputs[:n], inputs[n : 2 * n], inputs[2 * n : 3 * n], inputs[3 * n : 3 * n + 1],
                inputs[3 * n + 1 : 3 * n + 3], end - 1, (state.slot, start), tail_from - start, want_logits,
                meta=inputs[3 * n + 3 :],
            )
            if logits is not None:
                picks = greedy.argmax_rows(logits)
                logits = logits.copy_to_host()
                pick = int(picks.copy_to_host()[0])
        state.rows = end
        state.greedy = pick if logits is not None else None
        if logits is None:
            state.logits = None
            return None
        logits.flags.writeable = False  # [1, vocab], this call's own: the state and the caller share it
        if logits.base is not None:
            logits.base.flags.writeable = False
        state.logits = logits[0]
        return state.logits

    def prefill_step(self, ids, positions, row_slots, lane_slots, row_start, max_pos: int, stream=0,
                     slot: int | None = None, first_tail: int = 0):
        """Launch a whole prefill chunk of one stream from device inputs, as `prefill` does, and
        return the device logits f32 [1, vocab] of its last row; no checks, and the `DeviceState`
        is not advanced (benchmarks and profiles time this). The chunk's rows are positions
        [max_pos + 1 - rows, max_pos]; slot: the stream's slot (host int; read from lane_slots, a
        device sync, when None); first_tail: the last layer's first tail row, relative to the
        chunk (0: no tail; `prefill`'s tail_from - start, < rows)."""
        if slot is None:
            slot = int(lane_slots.copy_to_host()[0])
        if not 0 <= first_tail < ids.shape[0]:
            raise ValueError(f"first_tail {first_tail} is outside [0, {ids.shape[0]})")
        at = (slot, max_pos + 1 - ids.shape[0])
        meta = to_device(np.asarray([ids.shape[0], at[1], slot], np.int32), stream)
        return self._forward(ids, positions, row_slots, lane_slots, row_start, max_pos, at, first_tail, True, stream,
                             meta)

    def decode_inputs(self, states: Sequence[DeviceState], token_ids: Sequence[int]) -> tuple[np.ndarray, ...]:
        """Check a decode round's arguments; returns host i32 (token ids, positions, slots),
        one entry per lane. Raises ValueError naming the argument."""
        if len(states) != len(token_ids):
            raise ValueError(f"token_ids has {len(token_ids)} entries for {len(states)} states")
        if len({s.slot for s in states}) != len(states) or any(s.released for s in states):
            raise ValueError("states must be distinct live states")
        for lane, (state, token) in enumerate(zip(states, token_ids)):
            if not 0 <= int(token) < self.config.vocab_size:
                raise ValueError(f"token_ids[{lane}] = {token} is outside [0, {self.config.vocab_size})")
            if state.rows >= self.pool.capacity_rows:
                raise ValueError(f"states[{lane}] is full ({state.rows} rows)")
        as_i32 = lambda values: np.asarray(values, dtype=np.int32)  # noqa: E731
        return as_i32(token_ids), as_i32([s.rows for s in states]), as_i32([s.slot for s in states])

    def decode_step(self, ids, positions, slots, row_start, max_pos: int, stream=0):
        """Launch one decode round on `stream` from device inputs (i32 [lanes]: token ids,
        positions, slots; row_start i32 [lanes + 1] = 0..lanes); returns device logits
        f32 [lanes, vocab]. Advances the pool's states; the caller advances `DeviceState`s."""
        return self._forward(ids, positions, slots, slots, row_start, max_pos, None, 0, True, stream)

    @staticmethod
    def advance(states: Sequence[DeviceState], logits: np.ndarray, picks: Sequence[int]) -> None:
        """Record a finished decode round in the lanes' states. `logits` (the round's host
        array, f32 [lanes, vocab]) becomes read-only and each state keeps a view of its row:
        no second copy of every lane's logits (16 lanes: 16 MB a round); picks: each row's
        argmax from the device (`greedy.argmax_rows`), kept as `DeviceState.greedy`."""
        logits.flags.writeable = False
        for lane, state in enumerate(states):
            state.rows += 1
            state.logits = logits[lane]
            state.greedy = int(picks[lane])

    def decode(self, states: Sequence[DeviceState], token_ids: Sequence[int]) -> np.ndarray:
        """See `Backend.decode`. Every lane runs the same per-row kernels; a lane's bits
        do not depend on the other lanes (graphs.DecodeGraphs replays the same step, and
        does so here after `enable_decode_graphs`). The logits come back read-only (`advance`)."""
        if self._graphs is not None:
            return self._graphs.decode(states, token_ids)
        ids, positions, slots = self.decode_inputs(states, token_ids)
        lanes = len(states)
        logits = self.decode_step(_i32(ids), _i32(positions), _i32(slots), _i32(range(lanes + 1)),
                                  int(positions.max()), 0)
        picks = greedy.argmax_rows(logits)
        logits = logits.copy_to_host()
        self.advance(states, logits, picks.copy_to_host().tolist())
        return logits

    def activation_peak(self, chunk_rows: int) -> int:
        """Device bytes a prefill chunk of `chunk_rows` rows (capped at the capacity) takes
        beyond what is live now: the peak of `device.POOL`'s live blocks while one chunk runs
        at the end of a fresh slot's capacity (the most keys its attention reads), logits on,
        graphs off (chunks past the largest bucket run eagerly). Decode rounds and short
        chunks replay captured graphs whose buffers are held already. 0 without the pool
        (WARMSTATE_DEVICE_POOL=0, the simulator). The probe writes K/V rows of a slot it
        releases after; no state is changed."""
        from executor.numba_cuda import device

        pool = device.POOL
        if pool is None:
            return 0
        rows = max(1, min(int(chunk_rows), self.pool.capacity_rows))
        start = self.pool.capacity_rows - rows
        if self.bf16_products:  # the bf16 algorithm searches (first chunk past 1,024 rows) are not the chunk's peak
            for layer in ("in_proj", "gate_up"):
                weight = next((w[layer] for w in self.w.layers if layer in w), None)
                if weight is not None:
                    self.gemm.bf16_ready(rows, *weight.shape)
        state = self.new_state()
        cuda.synchronize()
        base = pool.live_bytes
        pool.reset_peak()
        try:
            state.rows = start  # rows below start are never read as a prompt: the zeroed K/V stand in
            with self.eager_prefill():
                self.prefill(state, np.zeros(start + rows, np.int64), (start, start + rows))
            cuda.synchronize()
        finally:
            self.release(state)
        return max(0, pool.peak_bytes - base)

    def reserve_cache(self, nbytes: int, headroom_bytes: int | None = None, chunk_rows: int = 4096) -> int:
        """Take payload memory from a stream-ordered pool grown now to min(nbytes, free device
        memory - headroom_bytes) (`cache_memory.CacheMemory`: a keep then allocates from
        memory the process holds, in exact sizes). Call once the weights, graphs and warm-up
        hold their memory. headroom_bytes: left for activations; None measures it:
        `activation_peak(chunk_rows)` + HEADROOM_MARGIN_BYTES, after which `device.POOL`'s
        cached blocks go back to the driver so the free memory counts them (session 12 left
        a fixed 20 GiB, which left the 27B server no cache at all: bench/RESULTS.md, session
        14). An activation that finds no memory trims the cache pool's unused part, never a
        kept state.

        Returns the prompt-cache budget this device holds, bytes: nbytes when all of it was
        reserved, else what was (0 when the device cannot spare any), so the caller can lower
        its budget: a store counting more than the reserve would grow the cache into the
        activations' headroom. nbytes unchanged where the driver has no memory pools (logged;
        keeps then allocate from device.POOL as before the reserve existed)."""
        from executor.numba_cuda import device
        from executor.numba_cuda.cache_memory import CacheMemory

        if self.pool.memory is None:
            self.pool.memory = CacheMemory.create()
        memory = self.pool.memory
        if memory is None:
            return int(nbytes)
        peak = None
        if headroom_bytes is None:
            peak = self.activation_peak(chunk_rows)
            headroom_bytes = peak + HEADROOM_MARGIN_BYTES
            if device.POOL is not None:
                device.POOL.release()
        free, total = cuda.current_context().get_memory_info()
        want = max(0, min(int(nbytes), int(free) - int(headroom_bytes)))
        got = memory.reserve(want)
        log.info("cache_memory_reserved", bytes=got, asked=int(nbytes), free=int(free), total=int(total),
                 headroom=int(headroom_bytes), activation_peak=peak, chunk_rows=chunk_rows)
        return got

    def snapshot(self, state: DeviceState, base: DevicePayload | None = None) -> DevicePayload:
        """See `Backend.snapshot`: the fixed part (2 launches) and, above `base`, one new
        K/V segment [base.rows, rows) (1 launch); base's segments are shared, not copied."""
        segments, start = shared_segments(base, state.rows)
        if state.rows > start:
            segments = segments + (self.pool.pack_rows(state.slot, start, state.rows),)
        return DevicePayload(rows=state.rows, fixed=self.pool.pack_fixed(state.slot), segments=segments,
                             logits=frozen_logits(state.logits))

    def restore(self, payload: DevicePayload) -> DeviceState:
        """See `Backend.restore`: 2 launches for the fixed part, 1 per K/V segment. Raises
        ValueError for a ghost."""
        if payload.fixed is None:
            raise ValueError("a ghost payload (no fixed part) cannot be restored")
        state = DeviceState(slot=self.pool.take(zero=False))  # the unpacks overwrite every part read
        self.pool.unpack_fixed(payload.fixed, state.slot)
        for segment in payload.segments:
            self.pool.unpack_rows(segment, state.slot)
        state.rows = payload.rows
        state.logits = frozen_logits(payload.logits)  # read-only already: shared, not copied (greedy: None)
        return state

    def ghost(self, payload: DevicePayload) -> DevicePayload:
        """See `Backend.ghost`: the payload without its fixed part and logits."""
        return attrs.evolve(payload, fixed=None, logits=None)

    def payload_bytes(self, payload: DevicePayload) -> int:
        """See `Backend.payload_bytes`: the fixed part (when held) and the last segment when
        it is the payload's own (ends at `rows`), in device bytes."""
        n = 0 if payload.fixed is None else int(payload.fixed.shape[0])
        if payload.segments and payload.segments[-1].end == payload.rows:
            n += payload.segments[-1].nbytes
        return n

    def state_bytes(self, state: DeviceState) -> int:
        return self.config.state_bytes(state.rows)
