"""`python -m executor.serve`: the OpenAI-compatible server on one backend.

    python -m executor.serve [--model DIR | --random-weights PRESET [--seed N]]
        [--backend auto|cuda|reference] [--host H] [--port P] [--prompt-cache-gib G]
        [--request-starts | --no-request-starts] [--snap-starts | --no-snap-starts]
        [--short-first | --no-short-first] [--warm-quiet-ms MS] [--lanes N] [--context ROWS]
        [--decode-graphs | --no-decode-graphs] [--prefill-graphs | --no-prefill-graphs]
        [--engine-process | --no-engine-process] [--busy-poll | --no-busy-poll]
        [--keep-gpu-warm | --no-keep-gpu-warm] [--trace FILE] [--policy FILE.toml]

With no --model it serves the built-in tiny random Qwen3.5 (real tokenizer).
--random-weights serves seeded random weights made on the GPU at a published size's shape
(executor/presets.py) with the real Qwen3.5 tokenizer and chat template: benchmarks at
real shapes without a checkpoint (cuda backend only). Policy
defaults come from `PolicyConfig` (a --policy file, then these flags, override them).
The scheduler and the backend run in a process of their own (executor/engine.py) unless
--no-engine-process. Prints the URL and a `ready URL` line on stdout (`--port 0` picks a
free port); logs go to stderr through structlog (JSON unless stderr is a terminal);
SIGINT/SIGTERM stop it (a second one kills a busy engine at once).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import signal
import subprocess
import sys
import tomllib
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import attrs
import structlog

try:  # the server extra: say so on the command line, not with a traceback
    import aiohttp  # noqa: F401
    import prometheus_client  # noqa: F401
except ModuleNotFoundError as exc:
    if __name__ == "__main__":
        sys.exit(f"python -m executor.serve needs the server extra ({exc.name} is not installed): "
                 "pip install -e '.[server]'")
    raise
from aiohttp import web

from executor.backend import Backend
from executor.chat import ChatRenderer, builtin_template, load_template
from executor.config import Qwen35Config, load_config
from executor.engine import EngineClient, EngineFailed, EngineInfo, serve_engine
from executor.model import tiny_model_dir
from executor.polling import PollGate, polling_loop_factory
from executor.presets import PRESET_NAMES, preset
from executor.reference.backend import ReferenceBackend
from executor.runtime import Runtime
from executor.server import Api, ApiConfig, build_app
from executor.tokenizer import default_tokenizer, load_tokenizer
from policy.config import GIB, PolicyConfig, format_policy, parse_policy, policy_to_dict
from policy.usable import snapping

log = structlog.get_logger(__name__)

BACKENDS = ("auto", "cuda", "reference")
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


@attrs.frozen(kw_only=True)
class ServeConfig:
    """Server settings besides the policy (defaults live here).

    model: checkpoint directory, or None for the built-in tiny model. random_weights: a
    preset name (executor.presets.PRESET_NAMES): serve seeded random weights at that shape,
    made on the GPU, instead of a checkpoint (dense presets, cuda backend). seed: their
    seed, in [0, 2**32). backend: auto (GPU when numba-cuda and a GPU are usable, else
    reference), cuda or reference. host/port: where to listen (port 0: any free port).
    context_rows: most rows a request may use (None: the model's max_position_embeddings,
    capped at gpu_context_rows on the GPU, where every lane's state is allocated at full
    context). decode_graphs: on the GPU, replay each decode round as a CUDA graph (every
    lane count up to the policy's lanes captured before the server is ready; the same
    bits as eager launches). prefill_graphs: on the GPU, replay prefill chunks of at most
    1024 rows as CUDA graphs padded to a bucket of 16, 32, ..., 1024 rows (captured before
    the server is ready, up to the first bucket whose replay is not faster than the eager
    chunk of the bucket below; the same bits as eager launches; needs the tensor-core
    delta rule and the fused attention, else eager). trace: JSONL trace file, or None. engine_process: run the
    scheduler and the backend in a process of their own (`executor.engine`), so HTTP work
    does not slow the steps down; False keeps them in this process (one GIL for both).
    busy_poll: the server's event loops poll their sockets without waiting once it serves,
    each costing a CPU core (the engine process's only while no step runs): a request's
    hand-offs then find their process running (`executor.polling`). keep_gpu_warm: on the
    GPU backend, a one-thread kernel runs while the runtime waits for work (launched again
    each second), so the GPU does not idle (`executor.numba_cuda.keep_warm`); ignored, with a
    warning, on the reference backend.

    Raises ValueError naming the field: a bad value, --model with --random-weights, an
    unknown or MoE preset, or random weights on the reference backend.
    """

    model: Path | None = None
    random_weights: str | None = None
    seed: int = 0
    backend: str = attrs.field(default="auto", validator=attrs.validators.in_(BACKENDS))
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8000, validator=attrs.validators.and_(attrs.validators.ge(0),
                                                                           attrs.validators.le(65535)))
    context_rows: int | None = None
    decode_graphs: bool = True
    prefill_graphs: bool = True
    gpu_context_rows: int = 32768
    trace: Path | None = None
    engine_process: bool = True
    busy_poll: bool = False
    keep_gpu_warm: bool = False
    policy: PolicyConfig = attrs.field(factory=PolicyConfig)

    def __attrs_post_init__(self) -> None:
        if self.context_rows is not None and self.context_rows <= 0:
            raise ValueError(f"context_rows must be a positive integer, got {self.context_rows}")
        if not 0 <= self.seed < 1 << 32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed}")
        if self.random_weights is None:
            return
        if self.model is not None:
            raise ValueError("random_weights: give --model or --random-weights, not both")
        try:
            shape = preset(self.random_weights)
        except ValueError as exc:  # names the known presets
            raise ValueError(f"random_weights: {exc}") from None
        if self.backend == "reference":
            raise ValueError(f"random_weights: --random-weights {self.random_weights} makes its weights on the GPU "
                             "and needs --backend cuda (or auto on a GPU machine); the reference backend serves "
                             "--model DIR or the built-in tiny model")
        if shape.moe is not None:
            raise ValueError(f"random_weights: {self.random_weights} is a MoE shape; the numba-cuda backend serves "
                             f"dense presets only ({', '.join(n for n in PRESET_NAMES if preset(n).moe is None)})")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    d, p = ServeConfig(), PolicyConfig()
    ap = argparse.ArgumentParser(prog="python -m executor.serve", description=__doc__.splitlines()[0])
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="checkpoint directory (default: the built-in tiny model)")
    source.add_argument("--random-weights", metavar="PRESET",
                        help=f"serve seeded random weights at a published shape, made on the GPU (cuda backend "
                             f"only), with the real Qwen3.5 tokenizer; one of: {', '.join(PRESET_NAMES)}")
    ap.add_argument("--seed", type=int, default=d.seed, metavar="N",
                    help=f"seed of --random-weights (default: {d.seed})")
    ap.add_argument("--backend", choices=BACKENDS, default=d.backend, help=f"(default: {d.backend})")
    ap.add_argument("--host", default=d.host, help=f"(default: {d.host})")
    ap.add_argument("--port", type=int, default=d.port, help=f"0 picks a free port (default: {d.port})")
    ap.add_argument("--prompt-cache-gib", type=float, metavar="G",
                    help=f"prompt-cache budget, GiB: the device memory kept states hold (each its fixed "
                         f"part and its own K/V rows; the rows below, its parent's, are shared, not copied), "
                         f"reserved at start-up on the GPU, at most free memory less the measured peak of "
                         f"one chunk's activations and 2 GiB (the budget is lowered to what was reserved); "
                         f"0 turns the cache and warm passes off and reserves "
                         f"nothing (default: {p.prompt_cache_bytes / GIB:g})")
    ap.add_argument("--request-starts", action=argparse.BooleanOptionalAction, default=None,
                    help=f"cut and keep at chat-message starts (default: {p.request_starts})")
    ap.add_argument("--snap-starts", action=argparse.BooleanOptionalAction, default=None,
                    help="on a backend with an invariant grid g (numba-cuda: 64), cut and keep at the multiple "
                         f"of g at or below each request start (default: {p.snap_starts})")
    ap.add_argument("--short-first", action=argparse.BooleanOptionalAction, default=None,
                    help="a prefill with at most max_chunk_rows rows left runs before an older, longer one (at "
                         f"most --lanes times in a row); off: first come, first served (default: {p.short_first})")
    ap.add_argument("--warm-quiet-ms", type=float, metavar="MS",
                    help=f"quiet before a warm pass starts (default: {p.warm_quiet_ms:g})")
    ap.add_argument("--lanes", type=int, metavar="N", help=f"streams active at once (default: {p.lanes})")
    ap.add_argument("--context", type=int, metavar="ROWS",
                    help="most rows (prompt + output) per request (default: the model's max_position_embeddings)")
    ap.add_argument("--decode-graphs", action=argparse.BooleanOptionalAction, default=d.decode_graphs,
                    help="GPU: replay decode rounds as CUDA graphs (default: %(default)s)")
    ap.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=d.prefill_graphs,
                    help="GPU: replay prefill chunks as CUDA graphs, padded to 16, 32, ..., 1024 rows; sizes from "
                         "the first whose replay is not faster than the eager chunk of the size below launch "
                         "eagerly (timed at start); needs the tensor-core delta rule and the fused attention "
                         "(default: %(default)s)")
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=d.engine_process,
                    help="run the scheduler and the backend in their own process, apart from HTTP "
                         "(default: %(default)s)")
    ap.add_argument("--busy-poll", action=argparse.BooleanOptionalAction, default=d.busy_poll,
                    help="poll sockets without waiting once serving (a CPU core per process, the engine's only "
                         "between steps): shorter hand-offs on machines whose idle CPUs wake slowly "
                         "(default: %(default)s)")
    ap.add_argument("--keep-gpu-warm", action=argparse.BooleanOptionalAction, default=d.keep_gpu_warm,
                    help="GPU: run a one-thread kernel while waiting for work (launched again every second), "
                         "so the GPU does not idle and a request after an idle spell starts as fast as back to "
                         "back (costs the power of a busy GPU; default: %(default)s)")
    ap.add_argument("--trace", type=Path, metavar="FILE", help="write every scheduler event as JSONL (and each step's "
                    "seconds and phases to FILE.steps.jsonl)")
    ap.add_argument("--policy", type=Path, metavar="FILE.toml", help="PolicyConfig fields (flags override them)")
    return ap.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Resolve the policy file and flags into a ServeConfig; ValueError naming the field."""
    try:
        policy = parse_policy(args.policy.read_text(encoding="utf-8")) if args.policy else PolicyConfig()
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--policy {args.policy}: not valid TOML: {exc}") from None
    changes: dict[str, Any] = {}
    if args.prompt_cache_gib is not None:
        if not args.prompt_cache_gib >= 0:
            raise ValueError(f"--prompt-cache-gib must be >= 0, got {args.prompt_cache_gib}")
        changes["prompt_cache_bytes"] = round(args.prompt_cache_gib * GIB)
    for flag, name in (("request_starts", "request_starts"), ("snap_starts", "snap_starts"),
                       ("short_first", "short_first"), ("warm_quiet_ms", "warm_quiet_ms"), ("lanes", "lanes")):
        if getattr(args, flag) is not None:
            changes[name] = getattr(args, flag)
    if changes:
        policy = policy.with_changes(**changes)
    return ServeConfig(model=args.model, random_weights=args.random_weights, seed=args.seed, backend=args.backend,
                       host=args.host, port=args.port, context_rows=args.context, decode_graphs=args.decode_graphs,
                       prefill_graphs=args.prefill_graphs, trace=args.trace, engine_process=args.engine_process,
                       busy_poll=args.busy_poll, keep_gpu_warm=args.keep_gpu_warm, policy=policy)


def load_backend(kind: str, model_dir: Path | None, cfg: ServeConfig, config: Qwen35Config,
                 stage: Callable[[str], None] | None = None) -> tuple[Backend, str, int]:
    """The backend for `kind`, its name and the context rows it serves; `auto` falls back
    to reference without a usable GPU. model_dir: the checkpoint, or None for seeded
    random weights (`cfg.seed`) at `config`'s shape, made on the GPU (no fallback).
    stage: called on the GPU with "weights", "state_pool", "decode_graphs" and
    "prefill_graphs" as each is done (bench/memory.py reads the device memory there).

    Raises RuntimeError when `cuda` (or random weights) is asked for and cannot be loaded,
    and when cfg.context_rows exceeds the model's max_position_embeddings.
    """
    max_rows = config.max_position_embeddings
    if cfg.context_rows is not None and cfg.context_rows > max_rows:
        raise RuntimeError(f"--context {cfg.context_rows} exceeds the model's max_position_embeddings ({max_rows})")
    if kind in ("auto", "cuda"):
        try:
            from executor.numba_cuda.backend import NumbaCudaBackend
            from executor.numba_cuda.device import IS_SIMULATOR, is_gpu_available

            if IS_SIMULATOR or not is_gpu_available():
                raise RuntimeError("no usable GPU")
            rows = cfg.context_rows or min(max_rows, cfg.gpu_context_rows)
            slots = cfg.policy.lanes + 2  # the lanes, a warm pass, a restore in flight
            stage = stage or (lambda name: None)
            if model_dir is None:
                from executor.numba_cuda import device_weights

                weights = device_weights.random(config, seed=cfg.seed)
                stage("weights")
                backend = NumbaCudaBackend.from_device_weights(config, weights, slots=slots, capacity_rows=rows)
            else:
                backend = NumbaCudaBackend.from_dir(model_dir, slots=slots, capacity_rows=rows)
                stage("weights")  # with the state pool: from_dir makes both
            stage("state_pool")
            if cfg.decode_graphs:
                backend.enable_decode_graphs(cfg.policy.lanes)
                stage("decode_graphs")
            if cfg.prefill_graphs:
                backend.enable_prefill_graphs()
                stage("prefill_graphs")
            return backend, "cuda", rows
        except Exception as exc:  # ImportError, no GPU, a checkpoint the GPU backend cannot serve
            if model_dir is None:
                raise RuntimeError(f"--random-weights {cfg.random_weights} needs the cuda backend: {exc}") from exc
            if kind == "cuda":
                raise RuntimeError(f"--backend cuda: {exc}") from exc
            log.info("gpu_backend_unavailable", reason=repr(exc))
    assert model_dir is not None, "ServeConfig rejects random weights on the reference backend"
    return ReferenceBackend.from_dir(model_dir), "reference", cfg.context_rows or max_rows


def random_model_id(name: str, seed: int) -> str:
    """The served model id of random weights at preset `name`, e.g. "qwen3.5-27b-random-s0"."""
    return f"{name.rsplit('/', 1)[-1].lower()}-random-s{seed}"


def cache_budget(policy: PolicyConfig, held_bytes: int) -> PolicyConfig:
    """The policy with its prompt-cache budget lowered to `held_bytes`, the cache memory the
    backend could reserve (`NumbaCudaBackend.reserve_cache`), when that is less (logged as
    `prompt_cache_lowered`): the store must not count more than the device holds. 0 turns
    the cache and warm passes off."""
    if held_bytes >= policy.prompt_cache_bytes:
        return policy
    log.warning("prompt_cache_lowered", asked_gib=round(policy.prompt_cache_bytes / GIB, 2),
                held_gib=round(held_bytes / GIB, 2),
                why="the GPU cannot spare the budget beside the activations' headroom")
    return policy.with_changes(prompt_cache_bytes=max(0, int(held_bytes)))


def warm_up(backend: Backend) -> None:
    """Run one tiny prefill, decode, keep and restore, so their kernels compile before the
    server says ready: a keep chained on another (`Backend.snapshot` with a base) and the
    restore of the chain. Without it the first request's keep compiled the payload copy
    kernels (105 ms in session 12's call 5; bench/RESULTS.md)."""
    state = backend.new_state()
    restored = None
    try:
        backend.prefill(state, (0, 1, 2), (0, 1), want_logits=False)
        first = backend.snapshot(state)
        logits = backend.prefill(state, (0, 1, 2), (1, 3))
        restored = backend.restore(backend.snapshot(state, first))
        backend.decode([state], [int(logits.argmax())])
    finally:
        release = getattr(backend, "release", None)
        if release is not None:
            for s in (state, restored):
                if s is not None:
                    release(s)


def _git_commit() -> str | None:
    """HEAD's full hash, with "+dirty" when tracked files differ from it; None outside git."""
    here = Path(__file__).parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, check=False, capture_output=True, text=True,
                             timeout=5)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, check=False,
                                 capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return (commit + ("+dirty" if changed.stdout.strip() else "")) or None


def _write_meta(cfg: ServeConfig, model: str, backend: str, context_rows: int, invariant_rows: int | None) -> None:
    """Beside the trace: the command, commit and resolved config (as the simulator does), and
    the backend's invariant grid (`BackendFacts.invariant_rows`, rows; null: none), which the
    simulator needs to resume where this server can (bench/fidelity.py reads it)."""
    assert cfg.trace is not None
    meta = {"command": sys.argv, "commit": _git_commit(), "model": model, "backend": backend,
            "context_rows": context_rows, "invariant_rows": invariant_rows, "policy": policy_to_dict(cfg.policy)}
    cfg.trace.with_name(cfg.trace.name + ".meta.json").write_text(json.dumps(meta, indent=2) + "\n")


class _CurrentStderr:
    """Writes to whatever sys.stderr is at write time (tests swap and close it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging() -> None:
    """structlog to stderr: JSON lines unless stderr is a terminal."""
    renderer: Any = structlog.dev.ConsoleRenderer() if sys.stderr.isatty() else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"),
                    structlog.processors.format_exc_info, renderer],
        logger_factory=structlog.PrintLoggerFactory(_CurrentStderr()),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=False,
    )


@attrs.frozen
class _Model:
    """What `ServeConfig` names: the checkpoint directory (None: random weights), the
    config, the served model id, its name in logs, and the chat template."""

    model_dir: Path | None
    config: Qwen35Config
    model_id: str
    model_name: str
    template: str


def _model(cfg: ServeConfig) -> _Model:
    if cfg.random_weights is not None:
        return _Model(None, preset(cfg.random_weights), random_model_id(cfg.random_weights, cfg.seed),
                      f"random:{cfg.random_weights}", builtin_template())
    model_dir = cfg.model or tiny_model_dir()
    return _Model(model_dir, load_config(model_dir), model_dir.name, str(model_dir), load_template(model_dir))


def _tokenizer(model: _Model):
    return (model.model_dir and load_tokenizer(model.model_dir)) or default_tokenizer()


def _open_traces(cfg: ServeConfig) -> tuple[IO[str], IO[str]] | tuple[None, None]:
    """The trace file and the step file beside it (`Runtime`'s `trace` and `steps`), or Nones."""
    if not cfg.trace:
        return None, None
    steps = cfg.trace.with_name(cfg.trace.name + ".steps.jsonl")
    # block-buffered: the runtime flushes both as it hands a step to the worker and before it idles
    # (Runtime._flush_traces)
    return cfg.trace.open("w", encoding="utf-8"), steps.open("w", encoding="utf-8")


def _close_traces(*files: IO[str] | None) -> None:
    for f in files:
        if f is not None:
            f.close()


async def _build(cfg: ServeConfig, model: _Model, trace: IO[str] | None,
                 steps: IO[str] | None = None) -> tuple[Runtime, ChatRenderer, str, int]:
    """Tokenizer, backend (warmed up), runtime: (runtime, renderer, backend name, context rows)."""
    tokenizer, (backend, backend_name, context_rows) = await asyncio.gather(
        asyncio.to_thread(_tokenizer, model),
        asyncio.to_thread(load_backend, cfg.backend, model.model_dir, cfg, model.config),
    )
    await asyncio.to_thread(warm_up, backend)
    policy = cfg.policy
    reserve = getattr(backend, "reserve_cache", None)
    if reserve is not None and policy.cache_enabled:  # after the warm-up: it takes what is left
        policy = cache_budget(policy, await asyncio.to_thread(reserve, policy.prompt_cache_bytes,
                                                              chunk_rows=policy.max_chunk_rows))
    keep_warm = None
    if cfg.keep_gpu_warm and backend_name == "cuda":
        from executor.numba_cuda.keep_warm import KeepWarm

        keep_warm = await asyncio.to_thread(KeepWarm)
    elif cfg.keep_gpu_warm:
        log.warning("keep_gpu_warm_ignored", backend=backend_name, reason="not the GPU backend")
    gc.collect()
    gc.freeze()  # start-up objects (weights, kernels, tokenizer) leave the collector's scans
    runtime = Runtime(backend, tokenizer, policy, trace=trace, steps=steps, keep_warm=keep_warm)
    return runtime, ChatRenderer(tokenizer, model.template), backend_name, context_rows


def run_engine(conn: Any, cfg: ServeConfig) -> None:
    """The engine process (`executor.engine`): build the backend and the runtime for
    `cfg`, then serve them over `conn` until the API process closes it. A start-up failure
    goes back as ("failed", "value" | "runtime", message)."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # the API process stops the engine
        signal.signal(sig, signal.SIG_IGN)
    warnings.filterwarnings("ignore", message=".*will likely result in GPU under-utilization")
    configure_logging()
    runner, gate = _runner(cfg)
    with runner:
        runner.run(_engine(conn, cfg, gate))


def _runner(cfg: ServeConfig) -> tuple[asyncio.Runner, PollGate | None]:
    """The process's asyncio runner: on a `PollingSelector` behind a new, closed `PollGate`
    with `busy_poll` (the caller opens it once serving), else asyncio's default loop."""
    gate = PollGate() if cfg.busy_poll else None
    return asyncio.Runner(loop_factory=None if gate is None else polling_loop_factory(gate)), gate


async def _engine(conn: Any, cfg: ServeConfig, gate: PollGate | None = None) -> None:
    trace = steps = None
    try:
        model = _model(cfg)
        trace, steps = _open_traces(cfg)
        runtime, renderer, backend_name, context_rows = await _build(cfg, model, trace, steps)
    except BaseException as exc:
        kind = "value" if isinstance(exc, ValueError) else "runtime"
        conn.send(("failed", kind, str(exc) or repr(exc)))
        _close_traces(trace, steps)
        if not isinstance(exc, Exception):
            raise
        return
    info = EngineInfo(backend=backend_name, context_rows=context_rows, vocab_size=runtime.vocab_size,
                      facts=runtime.facts)
    if gate is not None:
        gate.runtime, gate.serving = runtime, True
    try:
        await serve_engine(conn, runtime, renderer, info)
    finally:
        if gate is not None:
            gate.serving = False
        _close_traces(trace, steps)


async def serve(cfg: ServeConfig, out: IO[str] = sys.stdout, gate: PollGate | None = None) -> None:
    """Load the model, serve until SIGINT/SIGTERM, stop cleanly (a signal while the engine
    process is still loading stops it too; a second signal kills a busy engine at once)."""
    stop, force = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():  # a second signal: do not wait for the engine's step in flight
            log.warning("stopping_now")
            force.set()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await _serve(cfg, out, stop, force, gate)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _start_engine(cfg: ServeConfig, stop: asyncio.Event) -> EngineClient | None:
    """The engine process once ready, or None when `stop` was set first (it is then stopped)."""
    starting = asyncio.ensure_future(EngineClient.start(run_engine, (cfg,)))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if starting.done():
        return starting.result()
    starting.cancel()  # EngineClient.start kills the process on cancellation
    try:
        await starting
    except asyncio.CancelledError:
        pass
    return None


async def _close(runtime: Runtime | EngineClient, force: asyncio.Event) -> None:
    """Close the runtime; with an engine process, a second signal (`force`) kills the engine
    instead of waiting for its step in flight (its open requests end with an error)."""
    closing = asyncio.ensure_future(runtime.close())
    if isinstance(runtime, EngineClient):
        forcing = asyncio.ensure_future(force.wait())
        await asyncio.wait({closing, forcing}, return_when=asyncio.FIRST_COMPLETED)
        forcing.cancel()
        if not closing.done():
            runtime.process.kill()
    await closing


async def _serve(cfg: ServeConfig, out: IO[str], stop: asyncio.Event, force: asyncio.Event,
                 gate: PollGate | None = None) -> None:
    model = _model(cfg)
    trace = steps = None
    runtime: Runtime | EngineClient
    if cfg.engine_process:
        tokenizer, engine = await asyncio.gather(asyncio.to_thread(_tokenizer, model), _start_engine(cfg, stop))
        if engine is None:
            log.info("stopped_while_starting")
            return
        runtime = engine
        renderer = ChatRenderer(tokenizer, model.template)
        engine.learn = renderer.learn  # the engine's rendered continuations: their blocks
        backend_name, context_rows = engine.info.backend, engine.info.context_rows
        gc.collect()
        gc.freeze()
    else:
        trace, steps = _open_traces(cfg)
        runtime, renderer, backend_name, context_rows = await _build(cfg, model, trace, steps)
        tokenizer = renderer.tokenizer
    config = model.config
    stop_ids = set(config.eos_token_ids) | {t for name in STOP_TOKENS if (t := tokenizer.token_to_id(name)) is not None}
    if cfg.trace:
        _write_meta(cfg, model.model_name, backend_name, context_rows, runtime.facts.invariant_rows)
    api = Api(runtime, renderer, ApiConfig(model_id=model.model_id, context_rows=context_rows,
                                           stop_ids=frozenset(stop_ids)))
    runner = web.AppRunner(build_app(api), handler_cancellation=True, access_log=None)
    site = None
    try:
        if isinstance(runtime, Runtime):
            await runtime.start()
        await runner.setup()
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        port = runner.addresses[0][1]
        url = f"http://{cfg.host}:{port}"
        facts = runtime.facts
        log.info("ready", url=url, model=model.model_name, backend=backend_name, context_rows=context_rows,
                 policy=format_policy(cfg.policy).strip().replace("\n", "; "), invariant_rows=facts.invariant_rows,
                 start_grid=facts.invariant_rows if snapping(cfg.policy, facts) else 1,
                 engine_process=cfg.engine_process, busy_poll=cfg.busy_poll, keep_gpu_warm=cfg.keep_gpu_warm)
        print(f"serving {model.model_id} on the {backend_name} backend at {url}/v1", file=out, flush=True)
        print(f"ready {url}", file=out, flush=True)
        if gate is not None:  # poll from here on (`busy_poll`)
            gate.runtime, gate.api = (runtime if isinstance(runtime, Runtime) else None), api
            gate.serving = True
        await stop.wait()
        log.info("stopping")
    finally:
        if gate is not None:
            gate.serving = False
        if site is not None:
            await site.stop()
        await _close(runtime, force)
        await runner.cleanup()
        _close_traces(trace, steps)
    log.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*will likely result in GPU under-utilization")
    try:
        cfg = config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging()
    runner, gate = _runner(cfg)
    try:
        with runner:
            runner.run(serve(cfg, gate=gate))
    except EngineFailed as exc:  # the engine process could not load the model or the backend
        print(f"error: {exc}", file=sys.stderr)
        return 2 if exc.kind == "value" else 1
    except (OSError, RuntimeError) as exc:  # e.g. the port is taken, no usable GPU for --backend cuda
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a checkpoint that cannot be served (CheckpointError names the file)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
