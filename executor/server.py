"""The OpenAI-compatible HTTP API (aiohttp) over a `Runtime`, in this process or in the
engine process (`executor.engine.EngineClient`, the same interface).

Routes: POST /v1/chat/completions and /v1/completions (SSE streaming or not), GET
/v1/models, /health, /metrics. Request bodies are checked in `executor/api_schema.py`;
every error, whatever raised it, leaves as an OpenAI error body with a 4xx/5xx status.
Scheduling, sampling and stops live in `executor/runtime.py`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from executor.api_schema import ApiError, ChatCall, Sampling, decode_body, parse_chat, parse_completion
from executor.chat import IM_START, ChatError, ChatRenderer, Rendered
from executor.engine import EngineClient
from executor.metrics import CONTENT_TYPE
from executor.replies import ChatContinuation, ReplyParser
from executor.runtime import Done, Handle, Job, Rejected, Runtime, Tokens
from executor.sampling import SamplingParams
from executor.tokenizer import RELEASE_GIL_CHARS

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 32 << 20
"""Largest request body accepted (bytes); larger gets 413."""
HEALTH_TIMEOUT_S = 5.0
"""How long /health waits for the engine process's status before answering 503."""
INLINE_RENDER_BYTES = RELEASE_GIL_CHARS
"""Bodies of at most this many bytes (by Content-Length) render and tokenize on the event loop;
larger ones in a worker thread. Such a body's text is at most RELEASE_GIL_CHARS characters, which
`tokenizers` encodes holding the GIL, so a thread would not free the loop meanwhile; and the two
thread hops cost more than the work: for a 2,036-row chat with its history's blocks cached, 0.4 ms
each way around a 0.2 ms render, on this VM (bench/RESULTS.md, session 17)."""


@attrs.frozen(kw_only=True)
class ApiConfig:
    """What the API layer needs besides the runtime.

    model_id: the served model's name (requests naming another get 404).
    context_rows: most rows (prompt + generated) one request may use.
    stop_ids: token ids that end a reply (EOS), unless the request sets ignore_eos.
    """

    model_id: str
    context_rows: int
    stop_ids: frozenset[int]


def _usage(done: Done) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda d: json.dumps(d, ensure_ascii=False))


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode("utf-8") + b"\n\n"


def rows_of(ids: tuple[int, ...], token: int) -> tuple[int, ...]:
    """The rows of `ids` that hold `token`, ascending (a prompt of token ids starts a request, DESIGN
    rule 1, at each <|im_start|>). Most such prompts hold none, so a C-level `in` scan goes first:
    0.3 ms for 32K ids, against 2 ms for the Python loop that finds the rows."""
    return tuple(i for i, t in enumerate(ids) if t == token) if token in ids else ()


async def _off_loop_if_large(api: "Api", request: web.Request, fn: Callable[[Any], Rendered], arg: Any) -> Rendered:
    """fn(arg) on the event loop when the request's body is at most INLINE_RENDER_BYTES bytes
    long (by its Content-Length), else in a worker thread (`asyncio.to_thread`), counted in
    `api.off_loop` meanwhile (a busy-polling loop waits then: `executor.polling`)."""
    size = request.content_length
    if size is not None and size <= INLINE_RENDER_BYTES:
        return fn(arg)
    api.off_loop += 1
    try:
        return await asyncio.to_thread(fn, arg)
    finally:
        api.off_loop -= 1


def _done_error(done: Done) -> ApiError:
    if done.reason == "cancelled":
        return ApiError(done.error or "request cancelled", status=503, type="server_error", code="cancelled")
    return ApiError(done.error or "internal error", status=500, type="server_error", code="internal_error")


class Api:
    """Request handlers of one server (see the module docstring)."""

    def __init__(self, runtime: Runtime | EngineClient, renderer: ChatRenderer, cfg: ApiConfig) -> None:
        self.runtime, self.renderer, self.cfg = runtime, renderer, cfg
        self._prefix = secrets.token_hex(4)
        self._created = int(time.time())
        self._im_start = renderer.tokenizer.token_to_id(IM_START)
        self.off_loop = 0
        """Renders running in worker threads now (`_off_loop_if_large`)."""

    # --- helpers -----------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(f"request body larger than {MAX_BODY_BYTES} bytes", status=413,
                           code="request_too_large") from None
        except (RequestPayloadError, HttpProcessingError) as exc:  # e.g. a corrupt gzip body
            raise ApiError(f"request body cannot be read: {exc}", code="invalid_body") from None
        return decode_body(raw)

    def _check_model(self, sampling: Sampling) -> None:
        if sampling.model is not None and sampling.model != self.cfg.model_id:
            raise ApiError(f"The model {sampling.model!r} does not exist; this server serves "
                           f"{self.cfg.model_id!r}", "model", status=404, code="model_not_found")

    def _max_tokens(self, rows: int, sampling: Sampling, prompt_param: str) -> int:
        """Completion tokens of a prompt of `rows` rows: max_tokens as given, or when not given
        the room left in the context, capped at default_max_tokens (16 for /v1/completions: a
        default never makes a prompt that fits fail). Raises ApiError (400,
        context_length_exceeded) when the prompt leaves no room or prompt + max_tokens pass
        the context."""
        ctx, wanted = self.cfg.context_rows, sampling.max_tokens
        if rows > ctx or (wanted is None and rows == ctx):
            raise ApiError(f"This model's maximum context length is {ctx} tokens; the prompt has {rows}",
                           prompt_param, code="context_length_exceeded")
        if wanted is None:
            default = sampling.default_max_tokens
            return ctx - rows if default is None else min(default, ctx - rows)
        if rows + wanted > ctx:
            raise ApiError(f"This model's maximum context length is {ctx} tokens; you requested "
                           f"{rows + wanted} ({rows} in the prompt, {wanted} for the completion)",
                           "max_tokens", code="context_length_exceeded")
        return wanted

    def _job(self, rendered: Rendered, sampling: Sampling, max_tokens: int,
             continuation: Callable[[str], Rendered] | None) -> Job:
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        return Job(
            prompt_ids=rendered.token_ids,
            starts=rendered.starts,
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                    min_p=sampling.min_p),
            seed=seed % (1 << 64),
            stop=sampling.stop,
            stop_ids=frozenset() if sampling.ignore_eos else self.cfg.stop_ids,
            continuation=continuation,
        )

    async def _submit(self, job: Job) -> Handle:
        try:
            return await self.runtime.enqueue(job)
        except Rejected as exc:
            if exc.reason == "queue_full":
                raise ApiError("server overloaded: the request queue is full; retry later", status=503,
                               type="server_error", code="queue_full") from None
            raise ApiError(f"request rejected: {exc.reason}", status=503, type="server_error",
                           code=exc.reason) from None

    async def _run(self, handle: Handle, body: Callable[[], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Run a response body; a client that goes away cancels its request."""
        try:
            return await body()
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client_gone", request=handle.id)
            raise
        finally:
            if not handle.done:
                self.runtime.cancel(handle)

    # --- chat ----------------------------------------------------------------------------------
    def _render_chat(self, call: ChatCall) -> Rendered:
        try:
            return self.renderer.render(list(call.messages), list(call.tools) if call.tools else None,
                                        add_generation_prompt=True, enable_thinking=call.enable_thinking)
        except (ChatError, ValueError, KeyError, TypeError, AttributeError) as exc:
            text = str(exc) if isinstance(exc, ValueError) else f"messages: cannot be rendered ({exc!r})"
            head = text.split(":", 1)[0]
            param = head if head.startswith(("messages", "tools")) and " " not in head else "messages"
            raise ApiError(text, param, code="invalid_value") from None

    def _continuation(self, call: ChatCall) -> ChatContinuation:
        return ChatContinuation(messages=call.messages, tools=call.tools, enable_thinking=call.enable_thinking,
                                parse_tools=call.parse_tools, renderer=self.renderer)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        call = parse_chat(await self._body(request))
        self._check_model(call.sampling)
        rendered = await _off_loop_if_large(self, request, self._render_chat, call)
        max_tokens = self._max_tokens(len(rendered.token_ids), call.sampling, "messages")
        job = self._job(rendered, call.sampling, max_tokens, self._continuation(call))
        handle = await self._submit(job)
        cid = f"chatcmpl-{self._prefix}-{handle.id}"
        tools = list(call.tools) if call.parse_tools and call.tools else None

        def parser() -> ReplyParser:
            return ReplyParser(call.enable_thinking, tools, id_prefix=f"call_{self._prefix}{handle.id[4:]}_")

        if call.sampling.stream:
            return await self._run(handle, lambda: self._chat_stream(request, handle, cid, call, parser()))
        return await self._run(handle, lambda: self._chat_whole(handle, cid, call, parser()))

    async def _chat_whole(self, handle: Handle, cid: str, call: ChatCall, parser: ReplyParser) -> web.Response:
        done = None
        async for event in handle.events():
            if isinstance(event, Done):
                done = event
        assert done is not None
        if done.reason in ("cancelled", "error"):
            raise _done_error(done)
        parser.feed(done.text)
        _, reply = parser.finish()
        finish = "tool_calls" if reply.tool_calls and done.reason == "stop" else done.reason
        choice: dict[str, Any] = {"index": 0, "message": reply.message(), "logprobs": None, "finish_reason": finish}
        if call.sampling.return_token_ids:
            choice["token_ids"] = list(done.token_ids)
        out = {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": self.cfg.model_id,
               "choices": [choice], "usage": _usage(done)}
        self._log_done(handle, done, "chat")
        return _json(out)

    async def _chat_stream(self, request: web.Request, handle: Handle, cid: str, call: ChatCall,
                           parser: ReplyParser) -> web.StreamResponse:
        resp = await self._open_stream(request)
        created = int(time.time())
        usage_null = {"usage": None} if call.sampling.include_usage else {}

        async def send(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> None:
            chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.cfg.model_id,
                     "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}],
                     **usage_null}
            await resp.write(_sse(chunk))

        def delta_of(d: Any) -> dict[str, Any]:
            out = {}
            if d.reasoning:
                out["reasoning_content"] = d.reasoning
            if d.content:
                out["content"] = d.content
            return out

        await send({"role": "assistant", "content": ""})
        async for event in handle.events():
            if isinstance(event, Tokens):
                delta = delta_of(parser.feed(event.text))
                extra = {"token_ids": list(event.token_ids)} if call.sampling.return_token_ids else {}
                if delta or extra.get("token_ids"):
                    await send(delta, **extra)
                continue
            if event.reason in ("cancelled", "error"):
                await resp.write(_sse(_done_error(event).body()))
                return resp
            last, reply = parser.finish()
            delta = delta_of(last)
            if reply.tool_calls:
                delta["tool_calls"] = [{"index": i, **c.to_openai()} for i, c in enumerate(reply.tool_calls)]
            if delta:
                await send(delta)
            finish = "tool_calls" if reply.tool_calls and event.reason == "stop" else event.reason
            await send({}, finish)
            await self._close_stream(resp, handle, event, "chat", call.sampling.include_usage,
                                     {"id": cid, "object": "chat.completion.chunk", "created": created})
        return resp

    # --- completions -------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        call = parse_completion(await self._body(request), self.runtime.vocab_size)
        self._check_model(call.sampling)
        if isinstance(call.prompt, str):
            rendered = await _off_loop_if_large(self, request, self.renderer.encode, call.prompt)
        else:
            ids = call.prompt
            rendered = Rendered("", ids, rows_of(ids, self._im_start))
        max_tokens = self._max_tokens(len(rendered.token_ids), call.sampling, "prompt")
        handle = await self._submit(self._job(rendered, call.sampling, max_tokens, None))
        cid = f"cmpl-{self._prefix}-{handle.id}"
        if call.sampling.stream:
            return await self._run(handle,
                                   lambda: self._completion_stream(request, handle, cid, call.sampling))
        return await self._run(handle, lambda: self._completion_whole(handle, cid, call.sampling))

    async def _completion_whole(self, handle: Handle, cid: str, sampling: Sampling) -> web.Response:
        done = None
        async for event in handle.events():
            if isinstance(event, Done):
                done = event
        assert done is not None
        if done.reason in ("cancelled", "error"):
            raise _done_error(done)
        choice: dict[str, Any] = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": done.reason}
        if sampling.return_token_ids:
            choice["token_ids"] = list(done.token_ids)
        self._log_done(handle, done, "completions")
        return _json({"id": cid, "object": "text_completion", "created": int(time.time()),
                      "model": self.cfg.model_id, "choices": [choice], "usage": _usage(done)})

    async def _completion_stream(self, request: web.Request, handle: Handle, cid: str,
                                 sampling: Sampling) -> web.StreamResponse:
        resp = await self._open_stream(request)
        created = int(time.time())
        usage_null = {"usage": None} if sampling.include_usage else {}

        def chunk(text: str, finish: str | None, **extra: Any) -> bytes:
            return _sse({"id": cid, "object": "text_completion", "created": created, "model": self.cfg.model_id,
                         "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish, **extra}],
                         **usage_null})

        async for event in handle.events():
            if isinstance(event, Tokens):
                extra = {"token_ids": list(event.token_ids)} if sampling.return_token_ids else {}
                if event.text or extra.get("token_ids"):
                    await resp.write(chunk(event.text, None, **extra))
                continue
            if event.reason in ("cancelled", "error"):
                await resp.write(_sse(_done_error(event).body()))
                return resp
            await resp.write(chunk("", event.reason))
            await self._close_stream(resp, handle, event, "completions", sampling.include_usage,
                                     {"id": cid, "object": "text_completion", "created": created})
        return resp

    async def _close_stream(self, resp: web.StreamResponse, handle: Handle, done: Done, endpoint: str,
                            include_usage: bool, head: dict[str, Any]) -> None:
        """End an SSE stream: the usage chunk when asked (`stream_options.include_usage`),
        then `[DONE]`, and log the request."""
        if include_usage:
            await resp.write(_sse({**head, "model": self.cfg.model_id, "choices": [], "usage": _usage(done)}))
        await resp.write(b"data: [DONE]\n\n")
        self._log_done(handle, done, endpoint)

    async def _open_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        return resp

    def _log_done(self, handle: Handle, done: Done, endpoint: str) -> None:
        log.info("request_done", request=handle.id, endpoint=endpoint, conversation=handle.conversation,
                 reason=done.reason, prompt_tokens=done.prompt_tokens, cached_tokens=done.cached_tokens,
                 completion_tokens=done.completion_tokens)

    # --- small routes ----------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models."""
        return _json({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model}: the served model's card (`client.models.retrieve`); 404
        with code model_not_found for any other id."""
        name = request.match_info["model"]
        if name != self.cfg.model_id:
            raise ApiError(f"The model {name!r} does not exist; this server serves {self.cfg.model_id!r}",
                           "model", status=404, code="model_not_found")
        return _json(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.cfg.model_id, "object": "model", "created": self._created, "owned_by": "warmstate",
                "max_model_len": self.cfg.context_rows}

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 while serving; 503 when the runtime failed, or when the engine
        process did not answer within HEALTH_TIMEOUT_S seconds."""
        fresh = await self.runtime.refresh_status(HEALTH_TIMEOUT_S)
        if self.runtime.broken:
            return _json({"status": "failed", "error": self.runtime.broken}, status=503)
        if not fresh:
            return _json({"status": "unresponsive",
                          "error": f"the engine did not answer within {HEALTH_TIMEOUT_S:g} s"}, status=503)
        return _json({"status": "ok", "lanes_busy": self.runtime.lanes_busy, "waiting": self.runtime.waiting})

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: Prometheus text (503 when the engine process does not answer or is gone)."""
        try:
            body = await self.runtime.render_metrics()
        except TimeoutError:
            raise ApiError("the engine did not answer", status=503, type="server_error",
                           code="engine_unresponsive") from None
        if not body and self.runtime.broken:  # the engine process died: its counters went with it
            raise ApiError(f"no metrics: {self.runtime.broken}", status=503, type="server_error",
                           code="runtime_failed")
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


API_KEY = web.AppKey("api", Api)


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Every failure becomes an OpenAI error body; nothing escapes to crash a connection."""
    api = request.app[API_KEY]
    try:
        return await handler(request)
    except ApiError as exc:
        if exc.status < 500:
            api.runtime.count_invalid()
        return _json(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = ApiError(exc.reason or "error", status=exc.status,
                       code="not_found" if exc.status == 404 else None)
        return _json(err.body(), status=exc.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        log.exception("handler_failed", path=request.path)
        err = ApiError(f"internal error: {exc!r}", status=500, type="server_error", code="internal_error")
        return _json(err.body(), status=500)


def build_app(api: Api) -> web.Application:
    """The aiohttp application serving `api`."""
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    app[API_KEY] = api
    app.router.add_post("/v1/chat/completions", api.chat)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model}", api.model)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics)
    return app
