"""The engine process: the scheduler, the backend and the trace in a process of their own.

Why: the backend's steps are host-bound Python (numba launches, ~30 ms of a 2B prefill
chunk is host time) and the HTTP side (parsing, chat rendering, tokenization, one SSE
write per token per lane) is Python too. In one process they share the GIL, so every
millisecond the aiohttp loop works is a millisecond added to the step in flight: on the
H200 a 2B server's prefill chunks ran 1.27x their in-process time alone and 1.72x with a
dozen streaming clients (bench/RESULTS.md, session 5). vLLM splits the same way (its V1
engine core runs in its own process). Here the API process keeps HTTP, rendering and
tokenization; the engine process (started with the `spawn` method: CUDA does not survive
`fork`) runs an unchanged `executor.runtime.Runtime` on its own asyncio loop, and the two
exchange pickled tuples over one `multiprocessing` pipe:

    API -> engine: ("submit", token, Job, packed ids)  ("cancel", request id)  ("metrics", token)
                   ("status", token)  ("invalid",)  ("close",)
    engine -> API: ("ready", EngineInfo)  ("failed", kind, message)
                   ("accepted", token, request id, conversation, prompt rows)  ("rejected", token, reason)
                   ("events", [(request id, token ids, text) | (request id, Done), ...], status)
                   ("metrics", token, bytes, status)  ("status", token, status)  ("closed",)
                   ("learn", text, token ids)   (a reply's block: see below)

where status is a `Status`'s fields. Messages leave as plain pickles (`_post`); a request's
and its first token's are on the path to the client, so events and the status travel as
tuples rather than attrs objects (`_pack`, `_unpack`).

Each event goes straight into an outbox (`Runtime.submit(job, sink=...)`: no queue or task
per request), and the outbox leaves as one "events" message right after each step's
commit (`Runtime.after_commit`), before the next step starts: the engine's loop does no
per-token work while a step's host work runs (one GIL per process here too). The one
exception is a first token that the worker publishes before the rest of its step (the
chunk's keep, a decode round: `Stepper.publish`): it leaves at once, in a message of its own. `EngineClient` offers the
interface `executor.server.Api` uses (`enqueue`, `cancel`, `render_metrics`,
`count_invalid`, `vocab_size`, `lanes_busy`, `waiting`, `broken`, `close`), so the API
code is the same for both placements. A reply's continuation is rendered in the engine
(`Runtime.on_continuation`); the text and ids of its last block (the reply's: the API process
rendered the rest itself) cross back in a "learn" message after the commit's events, so that
the API process's renderer knows the reply's block when the next turn arrives
(`EngineClient.learn`) and tokenizes only that turn's new messages. The block alone, and at
most LEARN_FLUSH_BYTES of learns a commit (`reply_block`): the pipe's sends block, and an
engine that filled the pipe while the API process was itself blocked sending a large submit
would hang both (a fresh review deadlocked them with whole 5,000-row continuations). The
engine exits when the API process closes the pipe or goes away (it ignores SIGINT and
SIGTERM: the API process stops it).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import multiprocessing
import pickle
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import structlog

from executor.chat import IM_START
from executor.replies import ChatContinuation
from executor.runtime import Done, Handle, Rejected, Runtime, Tokens
from executor.stepper import Job
from policy.prefix import Prompt, pack_tokens
from policy.usable import BackendFacts

log = structlog.get_logger(__name__)


LEARN_FLUSH_BYTES = 64 << 10
"""The most text and id bytes of "learn" messages one commit sends; a reply block past what is
left is not sent (the next turn then tokenizes it: speed, never ids)."""


def reply_block(rendered: Any, budget: int) -> tuple[str, array] | None:
    """The text and token ids (array of uint32) of a rendered continuation's last block, from
    its last `<|im_start|>` (the reply's block), or None when it has no such block or the two
    take more than `budget` bytes (characters + 4 an id). rendered: `executor.chat.Rendered`."""
    at = rendered.text.rfind(IM_START)
    if at < 0 or not rendered.starts:
        return None
    text, ids = rendered.text[at:], rendered.token_ids[rendered.starts[-1]:]
    if len(text) + 4 * len(ids) > budget:
        return None
    return text, array("I", ids)


@attrs.frozen
class Status:
    """What `/health` reads, sent (as a tuple) with every batch of events: admitted foreground
    requests, requests waiting for a lane, and the runtime's failure (None while serving)."""

    lanes_busy: int = 0
    waiting: int = 0
    broken: str | None = None


@attrs.frozen(kw_only=True)
class EngineInfo:
    """What the engine process reports once it serves: the backend's name ("cuda" or
    "reference"), the most rows a request may use, the model's vocabulary size, and the
    backend's proven numerics (`policy.usable.BackendFacts`)."""

    backend: str
    context_rows: int
    vocab_size: int
    facts: BackendFacts


class EngineFailed(Exception):
    """The engine process could not start. kind: "value" for a bad checkpoint or setting
    (the CLI exits 2), "runtime" for everything else (exit 1)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _post(conn: Any, message: tuple) -> None:
    """Send `message` on `conn` (read with `Connection.recv`) as a plain pickle: the messages
    hold values, never handles or sockets, which `Connection.send`'s ForkingPickler is for
    (it copies its dispatch table for every message: 5-25 us more a message, cold, 2-core VM).
    Raises OSError or BrokenPipeError when the other end is gone."""
    conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


def _pack(rid: str, event: Tokens | Done) -> tuple:
    """An event as it crosses the pipe: (request id, token ids, text) for `Tokens`, (request
    id, Done) for a `Done`. Plain tuples pickle and unpickle in a quarter of the time of attrs
    objects (~70 us less a message, both ends, cold, on a 2-core VM)."""
    return (rid, event.token_ids, event.text) if isinstance(event, Tokens) else (rid, event)


def _unpack(item: tuple) -> tuple[str, Tokens | Done]:
    """(request id, event) of a `_pack`ed event."""
    return (item[0], Tokens(item[1], item[2])) if len(item) == 3 else (item[0], item[1])


def _wire(job: Job) -> tuple[Job, bytes]:
    """The job as it crosses the pipe: without its prompt ids, which travel packed as native
    int64 bytes (`policy.prefix.pack_tokens`: a 32K-id prompt pickled and unpickled in ~1 ms
    as a tuple of ints, ~0.1 ms as bytes, on a 2-core VM, and the engine's `Prompt` is built
    from those bytes without packing them again: `_unwire`), and a chat continuation without
    its renderer. Raises ValueError for a continuation that is not a ChatContinuation."""
    continuation = job.continuation
    if isinstance(continuation, ChatContinuation):
        continuation = attrs.evolve(continuation, renderer=None)
    elif continuation is not None:
        raise ValueError("Job.continuation must be a ChatContinuation (or None) to cross to the engine process")
    return attrs.evolve(job, prompt_ids=(), continuation=continuation), pack_tokens(job.prompt_ids)


def submit_message(token: int, job: Job) -> tuple:
    """The "submit" message that hands `job` to the engine process under the API's `token`:
    ("submit", token, the `_wire`d job, its packed prompt ids). Raises ValueError as `_wire`."""
    return ("submit", token, *_wire(job))


def _unwire(job: Job, packed: bytes) -> tuple[Job, Prompt]:
    """A `_wire`d job with its prompt ids back (plain ints), and the `Prompt` of those ids
    (`Runtime.submit`'s `prompt`), built from the packed bytes in one pass. Raises ValueError
    for bytes that are not whole int64s."""
    prompt, ids = Prompt.from_packed(packed)
    return attrs.evolve(job, prompt_ids=ids), prompt


# --- the engine side ---------------------------------------------------------------------------


async def serve_engine(conn: Any, runtime: Runtime, renderer: Any, info: EngineInfo) -> None:
    """Serve `runtime` to the API process at the other end of `conn` (a multiprocessing
    Connection) until it sends "close" or goes away; then close the runtime (every request
    still open ends "cancelled"), send what is left and "closed". renderer: binds the chat
    continuations of incoming jobs. Call from the loop the runtime will run on."""
    loop = asyncio.get_running_loop()
    outbox: list[tuple] = []  # _pack'ed events
    learned: list[tuple[str, array]] = []  # (text, ids) of the reply blocks rendered in this commit
    handles: dict[str, Handle] = {}
    stop = asyncio.Event()
    flush_pending = False
    gone = False

    def status() -> tuple:  # a Status's fields, in order
        return runtime.lanes_busy, runtime.waiting, runtime.broken

    def send(message: tuple) -> None:
        nonlocal gone
        if gone:
            return
        try:
            _post(conn, message)
        except (OSError, EOFError, BrokenPipeError):
            gone = True
            stop.set()

    def flush() -> None:
        nonlocal flush_pending
        flush_pending = False
        if outbox:
            batch = outbox[:]
            outbox.clear()
            send(("events", batch, status()))
        left = LEARN_FLUSH_BYTES
        for text, ids in learned:  # after the events: off the tokens' path; past the budget, dropped
            left -= len(text) + 4 * len(ids)
            if left >= 0:
                send(("learn", text, ids))
        learned.clear()

    def put(rid: str, event: Tokens | Done) -> None:
        nonlocal flush_pending
        outbox.append(_pack(rid, event))
        if isinstance(event, Done):
            handles.pop(rid, None)
        if not flush_pending:  # events outside a commit (a cancel, closing) go out soon
            flush_pending = True
            loop.call_soon(flush)

    runtime.after_commit = flush  # a step's tokens leave before the next step starts

    def learn(rendered: Any) -> None:
        block = reply_block(rendered, LEARN_FLUSH_BYTES)
        if block is not None:
            learned.append(block)

    runtime.on_continuation = learn

    def on_message(message: tuple) -> None:
        kind = message[0]
        if kind == "submit":
            token = message[1]
            try:
                _, _, job, packed = message
                job, prompt = _unwire(job, packed)
            except (ValueError, TypeError, AttributeError) as exc:  # not `submit_message`'s shape
                log.error("engine_malformed_submit", token=token, error=repr(exc))
                send(("rejected", token, "malformed_submit"))
                return
            if isinstance(job.continuation, ChatContinuation):
                job = attrs.evolve(job, continuation=attrs.evolve(job.continuation, renderer=renderer))
            named: list[str] = []  # the request's id, known once submit returns (no event comes earlier)
            try:
                handle = runtime.submit(job, sink=lambda event: put(named[0], event), prompt=prompt)
            except Rejected as exc:
                send(("rejected", token, exc.reason))
                return
            named.append(handle.id)
            handles[handle.id] = handle
            if isinstance(job.continuation, ChatContinuation):  # its history's blocks, while a step runs
                runtime.defer(functools.partial(job.continuation.prewarm, job.prompt_ids), key=handle.id)
            send(("accepted", token, handle.id, handle.conversation, handle.prompt_tokens))
        elif kind == "cancel":
            handle = handles.get(message[1])
            if handle is not None:
                runtime.cancel(handle)
        elif kind == "metrics":
            send(("metrics", message[1], runtime.metrics_text(), status()))
        elif kind == "status":
            send(("status", message[1], status()))
        elif kind == "invalid":
            runtime.count_invalid()
        elif kind == "close":
            stop.set()
        else:
            log.error("engine_unknown_message", kind=repr(kind))

    def readable() -> None:
        nonlocal gone
        try:
            while conn.poll():
                on_message(conn.recv())
        except (EOFError, OSError):  # the API process went away
            gone = True
            stop.set()

    loop.add_reader(conn.fileno(), readable)
    try:
        await runtime.start()
        send(("ready", info))
        await stop.wait()
    finally:
        loop.remove_reader(conn.fileno())
        await runtime.close()
        flush()
        send(("closed",))


# --- the API side ------------------------------------------------------------------------------


class EngineClient:
    """The API process's end of the engine process (see the module docstring).

    Built by `start`; `info` is what the engine reported. `broken` is set when the runtime
    failed or the engine process died (every open request then ends with an error)."""

    def __init__(self, process: Any, conn: Any, info: EngineInfo) -> None:
        self.process, self._conn, self.info = process, conn, info
        self.facts: BackendFacts = info.facts
        self._status = Status()
        self._dead: str | None = None
        self._tokens = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._handles: dict[str, Handle] = {}
        self._closed = asyncio.Event()
        self._closing = False
        self.learn: Callable[[str, Sequence[int]], None] | None = None
        """Called with the text and token ids of each reply's block, from the continuation the
        engine rendered (the API process's `ChatRenderer.learn`: the next turn then tokenizes only
        its new messages). On the H200 the API process rendered the 27B off-grid turn 2 in 0.61 ms
        without it, against 0.18 ms where one renderer saw both (bench/RESULTS.md, session 23)."""
        loop = asyncio.get_running_loop()
        loop.add_reader(conn.fileno(), self._readable)

    @classmethod
    async def start(cls, target: Callable[..., None], args: tuple, timeout_s: float = 3600.0) -> EngineClient:
        """Start `target(conn, *args)` in a spawned process and wait for its "ready".

        target must be importable (a module-level function) and must run `serve_engine`,
        or send ("failed", kind, message) when it cannot start. Raises EngineFailed with
        the engine's message, or RuntimeError when the process exits silently or
        `timeout_s` seconds pass (the process is then killed)."""
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe(duplex=True)
        process = ctx.Process(target=target, args=(child, *args), name="warmstate-engine", daemon=True)
        process.start()
        child.close()

        def wait_ready() -> tuple:
            deadline = time.monotonic() + timeout_s
            while not conn.poll(0.2):
                if not process.is_alive():
                    raise RuntimeError(f"the engine process exited with code {process.exitcode} while starting")
                if time.monotonic() > deadline:
                    process.kill()
                    raise RuntimeError(f"the engine process did not get ready in {timeout_s:g} s")
            try:
                return conn.recv()
            except EOFError:
                process.join(5)
                raise RuntimeError(f"the engine process exited with code {process.exitcode} while starting") from None

        try:
            message = await asyncio.to_thread(wait_ready)
        except BaseException:
            if process.is_alive():
                process.kill()
            process.join(5)
            conn.close()
            raise
        if message[0] == "failed":
            process.join(30)
            conn.close()
            raise EngineFailed(message[1], message[2])
        assert message[0] == "ready", f"unexpected first message from the engine: {message[0]!r}"
        return cls(process, conn, message[1])

    # --- what Api uses ------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The served model's vocabulary size."""
        return self.info.vocab_size

    @property
    def broken(self) -> str | None:
        """Why serving failed (the runtime's error, or the engine process died), or None."""
        return self._dead or self._status.broken

    @property
    def lanes_busy(self) -> int:
        """Admitted foreground requests, as of the engine's last message."""
        return self._status.lanes_busy

    @property
    def waiting(self) -> int:
        """Requests waiting for a lane, as of the engine's last message."""
        return self._status.waiting

    async def enqueue(self, job: Job) -> Handle:
        """Submit `job` to the engine; its Handle once the scheduler took it. Raises
        Rejected with the scheduler's reason, or "shutting_down" / "runtime_failed"."""
        if self._closing or self.broken:
            raise Rejected("shutting_down" if self._closing else "runtime_failed")
        token = next(self._tokens)
        future = asyncio.get_running_loop().create_future()
        self._pending[token] = future
        try:
            _post(self._conn, submit_message(token, job))
        except (OSError, BrokenPipeError):
            self._pending.pop(token, None)
            self._died()
            raise Rejected("runtime_failed") from None
        return await future

    def cancel(self, handle: Handle) -> None:
        """The client went away: the engine frees its lane within one chunk."""
        if handle.id in self._handles:
            self._send(("cancel", handle.id))

    async def _ask(self, kind: str, timeout_s: float):
        token = next(self._tokens)
        future = asyncio.get_running_loop().create_future()
        self._pending[token] = future
        self._send((kind, token))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._pending.pop(token, None)

    async def render_metrics(self, timeout_s: float = 10.0) -> bytes:
        """The engine's Prometheus text, gauges read now (b"" when the engine is gone).
        Raises TimeoutError when the engine does not answer within `timeout_s` seconds."""
        if self._dead:
            return b""
        try:
            return await self._ask("metrics", timeout_s)
        except Rejected:  # it died meanwhile
            return b""

    async def refresh_status(self, timeout_s: float = 5.0) -> bool:
        """Ask the engine for its status now (its loop answers even while a step runs);
        False when it did not answer within `timeout_s` seconds (a wedged engine), or is gone."""
        if self._dead:
            return False
        try:
            await self._ask("status", timeout_s)
        except (TimeoutError, Rejected):
            return False
        return True

    def count_invalid(self) -> None:
        """Count a request refused before it reached the scheduler."""
        self._send(("invalid",))

    async def close(self, timeout_s: float = 120.0) -> None:
        """Stop the engine: every open request ends "cancelled", the step in flight
        finishes, the process exits (killed after `timeout_s` seconds)."""
        if not self._closing:
            self._closing = True
            self._send(("close",))
        if not self._dead:
            try:
                await asyncio.wait_for(self._closed.wait(), timeout_s)
            except TimeoutError:
                log.error("engine_close_timeout", timeout_s=timeout_s)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.process.join, 10)
        if self.process.is_alive():
            self.process.kill()
            await loop.run_in_executor(None, self.process.join, 5)
        self._stop_reading()
        self._conn.close()

    # --- the pipe -----------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        if self._dead:
            return
        try:
            _post(self._conn, message)
        except (OSError, BrokenPipeError):
            self._died()

    def _stop_reading(self) -> None:
        try:
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
        except (OSError, ValueError):  # already closed
            pass

    def _readable(self) -> None:
        try:
            while self._conn.poll():
                self._dispatch(self._conn.recv())
        except (EOFError, OSError):
            self._died()

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "events":
            self._status = Status(*message[2])
            for rid, event in map(_unpack, message[1]):
                handle = self._handles.get(rid)
                if handle is None:
                    continue
                if isinstance(event, Done):
                    handle.done = True
                    del self._handles[rid]
                handle.queue.put_nowait(event)
        elif kind == "accepted":
            _, token, rid, conversation, prompt_tokens = message
            future = self._pending.pop(token)
            handle = Handle(rid, conversation, prompt_tokens)
            self._handles[rid] = handle
            if future.done():  # the caller went away while it waited (a client gone): cancel the request
                self.cancel(handle)
            else:
                future.set_result(handle)
        elif kind == "rejected":
            future = self._pending.pop(message[1])
            if not future.done():
                future.set_exception(Rejected(message[2]))
        elif kind == "metrics":
            self._status = Status(*message[3])
            future = self._pending.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == "status":
            self._status = Status(*message[2])
            future = self._pending.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(None)
        elif kind == "closed":
            self._closed.set()
        elif kind == "learn":
            if self.learn is not None:
                try:
                    self.learn(message[1], message[2])
                except Exception as exc:  # noqa: BLE001 - a lost block costs the next turn speed, not its ids
                    log.warning("learn_failed", error=repr(exc))
        else:
            log.error("engine_unknown_message", kind=repr(kind))

    def _died(self) -> None:
        """The engine process is gone: fail what waits on it."""
        if self._dead:
            return
        self._stop_reading()
        self.process.join(0.5)  # reap it, so its exit code is known
        code = self.process.exitcode
        self._dead = "shut down" if self._closed.is_set() else f"the engine process died (exit code {code})"
        if not self._closed.is_set():
            log.error("engine_died", exitcode=code)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(Rejected("runtime_failed"))
        self._pending.clear()
        for handle in self._handles.values():
            handle.done = True
            handle.queue.put_nowait(Done(reason="error", prompt_tokens=handle.prompt_tokens, completion_tokens=0,
                                         cached_tokens=0, token_ids=(), text="", error=self._dead))
        self._handles.clear()
        self._closed.set()
