"""Captured prefill chunks (graphs.PrefillGraphs) on a real GPU: a chunk replayed through the
graph of its padded bucket gives the eager chunk's bits (last-row logits and the whole
packed state: K/V, recurrent matrices, conv tails), from any start (on and off the 64-row
grid), in any slot, with eager chunks before and after it; padding rows write no cache row;
and each property has a planted break that turns its check red. Marked `cuda`; skips
cleanly without an NVIDIA GPU and numba-cuda + nvmath-python.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from executor.numba_cuda.device import is_gpu_available

pytestmark = pytest.mark.cuda
if not is_gpu_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("nvmath")

from executor.config import FULL  # noqa: E402
from executor.model import random_checkpoint  # noqa: E402
from executor.numba_cuda import graphs as nb_graphs  # noqa: E402
from executor.numba_cuda.backend import NumbaCudaBackend  # noqa: E402
from executor.weights import load_weights  # noqa: E402
from tests.executor.qwen_support import gpu_test_configs  # noqa: E402

CONFIGS = gpu_test_configs()
CAPACITY = 3072


@pytest.fixture(scope="module", params=list(CONFIGS))
def backend(request, tmp_path_factory):
    config = CONFIGS[request.param]
    path = random_checkpoint(config, seed=5, out_dir=tmp_path_factory.mktemp(request.param))
    gpu = NumbaCudaBackend(load_weights(path), slots=8, capacity_rows=CAPACITY)
    assert gpu.prefill_delta == "mma", gpu.delta_failures
    assert gpu.prefill_attention == "flash", gpu.attention_failures
    assert gpu.enable_prefill_graphs(prune=False), gpu.prefill_graphs_off  # every bucket the server may keep
    assert gpu.prefill_graphs.buckets == nb_graphs.BUCKETS and not gpu.prefill_graphs.failed
    yield gpu
    gpu.prefill_graphs.close()


def _prompt(config, rows, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, config.vocab_size, rows)]


def _run(gpu, cuts, ids, graphs: bool, state=None):
    """Prefill ids over `cuts` (eager, or through the graphs where a bucket holds the chunk);
    returns (state, [last-row logits per chunk], [packed state bytes after each chunk])."""
    state = state or gpu.new_state()
    logits, packs = [], []
    with contextlib.nullcontext() if graphs else gpu.eager_prefill():
        for a, b in zip(cuts, cuts[1:]):
            logits.append(gpu.prefill(state, ids, (a, b)))
            assert state.greedy == int(np.argmax(logits[-1])), f"the device's greedy pick after rows [{a}, {b})"
            packs.append(gpu.pool.pack(state.slot, b).copy_to_host())
    return state, logits, packs


# chunks of every bucket, padded and full, from row 0, from grid rows, from off-grid rows,
# an eager chunk (> the largest bucket) between captured ones, and a last chunk that ends at
# the capacity: 1, 16, 16, 31, 64, 36, 128, 8, 200, 320, 880, 1100 (eager), 272 rows
CUTS = (0, 1, 17, 33, 64, 128, 164, 292, 300, 500, 820, 1700, 2800, CAPACITY)


def test_graph_chunks_equal_eager(backend):
    ids = _prompt(backend.config, CUTS[-1], 11)
    before = backend.prefill_graphs.replays
    eager, want_logits, want_packs = _run(backend, CUTS, ids, graphs=False)
    graph, got_logits, got_packs = _run(backend, CUTS, ids, graphs=True)
    assert eager.slot != graph.slot
    # every chunk but the 1100-row one (no bucket holds it) replayed a graph
    assert backend.prefill_graphs.replays - before == len(CUTS) - 2
    for i, (a, b) in enumerate(zip(CUTS, CUTS[1:])):
        assert np.array_equal(got_logits[i], want_logits[i]), f"logits of rows [{a}, {b})"
        assert np.array_equal(got_packs[i], want_packs[i]), f"state after rows [{a}, {b})"
    backend.release(eager)
    backend.release(graph)


def test_graph_chunks_without_logits_keep_the_state(backend):
    """want_logits=False (a middle chunk): the graph runs the full last layer; the state
    equals the eager one that skips the last layer's q/o/MLP."""
    ids = _prompt(backend.config, 100, 12)
    a, b = backend.new_state(), backend.new_state()
    last = {}
    for state, graphs in ((a, False), (b, True)):
        with contextlib.nullcontext() if graphs else backend.eager_prefill():
            assert backend.prefill(state, ids, (0, 40), want_logits=False) is None
            assert state.greedy is None  # no logits, no pick
            last[graphs] = backend.prefill(state, ids, (40, 100))
    assert np.array_equal(last[False], last[True])
    assert np.array_equal(backend.pool.pack(a.slot, 100).copy_to_host(), backend.pool.pack(b.slot, 100).copy_to_host())
    backend.release(a)
    backend.release(b)


def _cache_rows(gpu, slot):
    return [(k[slot].copy_to_host(), v[slot].copy_to_host()) for k, v in zip(gpu.pool.keys, gpu.pool.values)]


def _padding_untouched(gpu, fill=None) -> bool:
    """Run a 20-row chunk (bucket 32: 12 padding rows) from row 64 through the graph after
    writing a sentinel into the slot's cache rows [84, 96); True when they are unchanged and
    no other slot's cache changed either (a slot of -1 must not wrap around to the last)."""
    ids = _prompt(gpu.config, 84, 13)
    state = gpu.new_state()
    try:
        gpu.prefill(state, ids, (0, 64))
        sentinel = np.uint16(0x3F80)  # bf16 1.0
        for k, v in zip(gpu.pool.keys, gpu.pool.values):
            for cache in (k, v):
                host = cache.copy_to_host()
                host[state.slot, 84:96] = sentinel
                cache.copy_to_device(host)
        others = [s for s in range(gpu.pool.keys.shape[1]) if s != state.slot]
        before = [_cache_rows(gpu, s) for s in others]
        saved = nb_graphs._fill
        if fill is not None:
            nb_graphs._fill = fill
        try:
            gpu.prefill(state, ids, (64, 84))
        finally:
            nb_graphs._fill = saved
        after = [_cache_rows(gpu, s) for s in others]
        others_same = all(np.array_equal(a, b) for x, y in zip(before, after) for pa, pb in zip(x, y)
                          for a, b in zip(pa, pb))
        return others_same and all((k[84:96] == sentinel).all() and (v[84:96] == sentinel).all()
                                   for k, v in _cache_rows(gpu, state.slot))
    finally:
        gpu.release(state)


def test_padding_rows_write_no_cache_row(backend):
    assert FULL in backend.config.layer_types
    assert _padding_untouched(backend)


def test_planted_padding_slot_is_caught(backend):
    """Planted break: padding rows carry the stream's slot (and positions past the chunk),
    so they write K/V rows past the chunk: the check above turns red."""

    def leaky_fill(host, rows, ids, start, slot):
        nb_graphs.__dict__["_fill_orig"](host, rows, ids, start, slot)
        n = len(ids)
        host[rows + n : 2 * rows] = np.arange(start + n, start + rows, dtype=np.int32)
        host[2 * rows + n : 3 * rows] = slot

    nb_graphs.__dict__["_fill_orig"] = nb_graphs._fill
    assert not _padding_untouched(backend, leaky_fill)


def test_planted_host_fixed_rows_are_caught(backend):
    """Planted break: a replay whose meta keeps the captured (bucket) row count, as if the
    host had fixed it at capture: the state differs from the eager chunk's."""
    ids = _prompt(backend.config, 20, 14)
    saved = nb_graphs._fill

    def stale_meta(host, rows, ids_, start, slot):
        saved(host, rows, ids_, start, slot)
        host[3 * rows + 3] = rows

    eager, _, want = _run(backend, (0, 20), ids, graphs=False)
    nb_graphs._fill = stale_meta
    try:
        graph, _, got = _run(backend, (0, 20), ids, graphs=True)
    finally:
        nb_graphs._fill = saved
    backend.release(eager)
    backend.release(graph)
    assert not np.array_equal(got[0], want[0])


def test_buckets_and_serves(backend):
    graphs = backend.prefill_graphs
    assert [graphs.bucket(n) for n in (1, 16, 17, 128, 129, 256, 257, 1024, 1025)] == [
        16, 16, 32, 128, 256, 256, 512, 1024, None]
    assert graphs.serves(0, 1024) and not graphs.serves(0, 1025)
    assert graphs.serves(CAPACITY - 32, CAPACITY) and not graphs.serves(CAPACITY - 31, CAPACITY + 1)


def test_each_kept_bucket_beats_the_eager_chunk_of_the_kept_bucket_below(backend):
    """The server's capture (prune on): the first bucket is kept; every other kept bucket's
    replay is faster than the eager chunk of the kept bucket below it, and every pruned one
    that was captured is not (its timings in the reason); the buckets past the first replay
    at PRUNE_STOP times that chunk or more were never captured ("above b")."""
    try:
        assert backend.enable_prefill_graphs(), backend.prefill_graphs_off
        g = backend.prefill_graphs
        assert g.buckets[0] == nb_graphs.BUCKETS[0] and set(g.buckets) | set(g.pruned) == set(nb_graphs.BUCKETS)
        assert all(b in g.seconds and min(g.seconds[b]) > 0 for b in g.buckets)
        below, stopped = None, None
        for b in nb_graphs.BUCKETS:
            if stopped is not None:
                assert g.pruned[b] == f"above {stopped}" and b not in g.seconds
            elif b in g.buckets:
                assert below is None or g.seconds[b][1] < g.seconds[below][0]
                below = b
            else:
                assert g.seconds[b][1] >= g.seconds[below][0] and f"eager chunk of {below} rows" in g.pruned[b]
                if g.seconds[b][1] >= nb_graphs.PRUNE_STOP * g.seconds[below][0]:
                    stopped = b
    finally:
        assert backend.enable_prefill_graphs(prune=False)  # the other tests' buckets
        assert backend.prefill_graphs.buckets == nb_graphs.BUCKETS
