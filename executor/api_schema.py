"""OpenAI request bodies checked into frozen values, and OpenAI-style errors.

`parse_chat` / `parse_completion` take the decoded JSON body and return a `ChatCall` /
`CompletionCall`, or raise `ApiError` naming the field (`param`). Fields OpenAI accepts
but this server cannot honour are rejected with a message saying so; unknown fields are
rejected as OpenAI does. Extensions (vLLM names): `chat_template_kwargs.enable_thinking`,
`ignore_eos`, `return_token_ids`. Rendering and tokenization happen elsewhere.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import attrs

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4
_IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "parallel_tool_calls")
_SAMPLING_KEYS = (
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop",
    "stream",
    "stream_options", "frequency_penalty", "presence_penalty", "logit_bias", "ignore_eos", "return_token_ids",
)
CHAT_KEYS = frozenset(
    _SAMPLING_KEYS + _IGNORED
    + ("messages", "tools", "tool_choice", "response_format", "logprobs", "top_logprobs", "chat_template_kwargs",
       "reasoning_effort")
)
COMPLETION_KEYS = frozenset(_SAMPLING_KEYS + _IGNORED + ("prompt", "echo", "logprobs", "best_of", "suffix"))


class ApiError(Exception):
    """An OpenAI-style error: HTTP `status`, `message`, `type`, `param` (the field), `code`."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict[str, Any]:
        """The JSON body: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@attrs.frozen(kw_only=True)
class Sampling:
    """Generation knobs of one request.

    max_tokens: None (not given) or >= 0 (0: prefill only).
    default_max_tokens: when max_tokens is not given, at most this many (/v1/completions: 16, as
    OpenAI's), capped at the room the prompt leaves in the context; None: as many as it allows.
    temperature >= 0 (0: greedy), top_p in (0, 1], top_k >= 0 (0: no limit; vLLM's extra
    parameter, whose -1 also means none), min_p in [0, 1] (vLLM's), seed: None (draw one) or an int,
    stop: stop strings, stream / include_usage: SSE output, ignore_eos: do not stop at
    EOS, return_token_ids: add token ids to the response.
    """

    model: str | None = None
    max_tokens: int | None = None
    default_max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    return_token_ids: bool = False


@attrs.frozen(kw_only=True)
class ChatCall:
    """A checked chat request: messages (roles normalized), tools, thinking, sampling."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    parse_tools: bool
    enable_thinking: bool
    sampling: Sampling


@attrs.frozen(kw_only=True)
class CompletionCall:
    """A checked completion request: the prompt as text or token ids, and sampling."""

    prompt: str | tuple[int, ...]
    sampling: Sampling


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; ApiError (400) for bad UTF-8, bad JSON, nesting
    deeper than the interpreter's recursion limit (~1000 levels), an integer longer than
    Python converts (4,300 digits by default), lone surrogates."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
        if not isinstance(body, dict):
            raise ApiError("request body must be a JSON object")
        if _SURROGATE_ESCAPE.search(text):  # valid UTF-8 holds no surrogate: only a \uD800-\uDFFF escape makes one
            _check_strings(body, "")
    except json.JSONDecodeError as exc:
        raise ApiError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # json and the string check recurse once per nesting level
        raise ApiError("request body is nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than int() converts (sys.get_int_max_str_digits)
        raise ApiError(f"request body is not valid JSON: {exc}") from None
    return body


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
"""A JSON escape of a UTF-16 surrogate (\\uD800-\\uDFFF): the only way a body that is valid UTF-8 gets
one into a string. Without a match `decode_body` skips `_check_strings`, whose walk of a 32K-id
prompt took 7-8 ms on the CPU VM (one call and one path string an id; bench/RESULTS.md, session 41)."""


def _check_strings(value: Any, path: str) -> None:
    """Every string (and key) must encode as UTF-8 (JSON escapes can smuggle lone surrogates).
    Numbers, booleans and nulls in a list are passed over without a call."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(f"{path or 'body'}: contains a lone surrogate (invalid Unicode)", path or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            _check_strings(k, sub)
            _check_strings(v, sub)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, (str, dict, list)):
                _check_strings(v, f"{path}[{i}]")


def _unknown(body: Mapping[str, Any], known: frozenset[str]) -> None:
    for key in body:
        if key not in known:
            raise ApiError(f"Unrecognized request argument supplied: {key}", key, code="unrecognized_argument")


def _int(body: Mapping[str, Any], key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{key}: expected an integer, got {json.dumps(value)[:40]}", key, code="invalid_type")
    if lo is not None and value < lo:
        raise ApiError(f"{key}: must be >= {lo}, got {value}", key, code="invalid_value")
    if hi is not None and value > hi:
        raise ApiError(f"{key}: must be <= {hi}, got {value}", key, code="invalid_value")
    return value


def _number(body: Mapping[str, Any], key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(f"{key}: expected a number, got {json.dumps(value)[:40]}", key, code="invalid_type")
    if not lo <= value <= hi:
        raise ApiError(f"{key}: must be in [{lo}, {hi}], got {value}", key, code="invalid_value")
    return float(value)


def _bool(body: Mapping[str, Any], key: str, path: str | None = None) -> bool | None:
    """body[key] as a bool, or None when absent. Raises ApiError (400, invalid_type) naming
    `path` (the field's full name, e.g. "chat_template_kwargs.enable_thinking"; default key)."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        name = path or key
        raise ApiError(f"{name}: expected true or false, got {json.dumps(value)[:40]}", name, code="invalid_type")
    return value


def _unsupported(key: str, why: str) -> ApiError:
    return ApiError(f"{key}: {why}", key, code="unsupported_parameter")


def _sampling(body: Mapping[str, Any], default_max_tokens: int | None) -> Sampling:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError("model: expected a string", "model", code="invalid_type")
    max_tokens = _int(body, "max_tokens", 0)
    max_completion = _int(body, "max_completion_tokens", 0)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise ApiError("max_tokens and max_completion_tokens disagree; give one", "max_completion_tokens")
    if max_completion is not None:
        max_tokens = max_completion
    n = _int(body, "n")
    if n is not None and n < 1:
        raise ApiError(f"n: must be at least 1, got {n}", "n", code="invalid_value")
    if n is not None and n > 1:
        raise _unsupported("n", f"only n=1 is supported, got {n}")
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    top_k = _int(body, "top_k", -1, 2**31 - 1)
    min_p = _number(body, "min_p", 0.0, 1.0)
    seed = _int(body, "seed", -(2**63), 2**64 - 1)
    for key in ("frequency_penalty", "presence_penalty"):
        if _number(body, key, -2.0, 2.0):
            raise _unsupported(key, "only 0 is supported")
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise ApiError("logit_bias: expected an object", "logit_bias", code="invalid_type")
    if bias:
        raise _unsupported("logit_bias", "not supported")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise ApiError("stop: expected a string or a list of strings", "stop", code="invalid_type")
    if len(stops) > MAX_STOP:
        raise ApiError(f"stop: at most {MAX_STOP} stop strings, got {len(stops)}", "stop", code="invalid_value")
    if any(not s for s in stops):
        raise ApiError("stop: stop strings must be non-empty", "stop", code="invalid_value")
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise ApiError("stream_options: only allowed when stream is true", "stream_options")
        if not isinstance(options, dict):
            raise ApiError("stream_options: expected an object", "stream_options", code="invalid_type")
        for key in options:
            if key != "include_usage":
                raise ApiError(f"Unrecognized request argument supplied: stream_options.{key}",
                               f"stream_options.{key}", code="unrecognized_argument")
        include_usage = bool(_bool(options, "include_usage"))
    if top_p == 0.0:  # the smallest nucleus: the most likely token
        temperature = 0.0
    return Sampling(
        model=model,
        max_tokens=max_tokens,
        default_max_tokens=default_max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if not top_p else top_p,
        top_k=max(0, top_k or 0),
        min_p=min_p or 0.0,
        seed=seed,
        stop=stops,
        stream=stream,
        include_usage=include_usage,
        ignore_eos=bool(_bool(body, "ignore_eos")),
        return_token_ids=bool(_bool(body, "return_token_ids")),
    )


def _content(value: Any, path: str, role: str) -> None:
    if value is None:
        if role in ("user", "system", "developer"):
            raise ApiError(f"{path}: missing content", path)
        return
    if isinstance(value, str):
        return
    if not isinstance(value, list):
        raise ApiError(f"{path}: expected a string or a list of text parts", path, code="invalid_type")
    for j, part in enumerate(value):
        sub = f"{path}[{j}]"
        if not isinstance(part, dict) or part.get("type", "text") != "text":
            raise _unsupported(sub, "only text content parts are supported")
        if not isinstance(part.get("text"), str):
            raise ApiError(f"{sub}.text: expected a string", f"{sub}.text", code="invalid_type")


def _message(raw: Any, i: int) -> dict[str, Any]:
    path = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise ApiError(f"{path}: expected an object", path, code="invalid_type")
    role = raw.get("role")
    if not isinstance(role, str):
        raise ApiError(f"{path}.role: missing or not a string", f"{path}.role")
    if role not in ROLES:
        raise ApiError(f"{path}.role: unknown role {role!r}; expected one of {', '.join(ROLES)}",
                       f"{path}.role", code="invalid_value")
    _content(raw.get("content"), f"{path}.content", role)
    message = dict(raw)
    if role == "developer":
        message["role"] = "system"
    calls = raw.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise ApiError(f"{path}.tool_calls: only an assistant message has a list of tool calls",
                           f"{path}.tool_calls")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ApiError(f"{path}.tool_calls[{j}].function.name: missing", f"{path}.tool_calls[{j}].function")
            if not isinstance(fn.get("arguments", "{}"), (str, dict)):
                raise ApiError(f"{path}.tool_calls[{j}].function.arguments: expected a JSON string",
                               f"{path}.tool_calls[{j}].function.arguments", code="invalid_type")
    for key in ("reasoning_content", "reasoning"):
        if raw.get(key) is not None and not isinstance(raw.get(key), str):
            raise ApiError(f"{path}.{key}: expected a string", f"{path}.{key}", code="invalid_type")
    return message


def _tools(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiError("tools: expected a list", "tools", code="invalid_type")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ApiError(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{...}}}}", f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(f"tools[{i}].function.name: missing", f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ApiError(f"tools[{i}].function.parameters: expected an object",
                           f"tools[{i}].function.parameters", code="invalid_type")
    return tuple(tools) or None


def parse_chat(body: Mapping[str, Any], default_max_tokens: int | None = None) -> ChatCall:
    """Check a /v1/chat/completions body; ApiError naming the field when it is bad."""
    _unknown(body, CHAT_KEYS)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ApiError("messages: expected a list of messages", "messages", code="invalid_type")
    if not messages:
        raise ApiError("messages: must hold at least one message", "messages", code="invalid_value")
    checked = tuple(_message(m, i) for i, m in enumerate(messages))
    tools = _tools(body)
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise _unsupported("tool_choice", "only \"auto\" and \"none\" are supported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _unsupported("response_format", "only {\"type\": \"text\"} is supported")
    if _bool(body, "logprobs"):
        raise _unsupported("logprobs", "not supported")
    if _int(body, "top_logprobs", 0, 20):
        raise _unsupported("top_logprobs", "not supported")
    if body.get("reasoning_effort") is not None and not isinstance(body.get("reasoning_effort"), str):
        raise ApiError("reasoning_effort: expected a string", "reasoning_effort", code="invalid_type")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError("chat_template_kwargs: expected an object", "chat_template_kwargs", code="invalid_type")
    for key in kwargs:
        if key != "enable_thinking":
            raise _unsupported(f"chat_template_kwargs.{key}", "only enable_thinking is supported")
    thinking = _bool(kwargs, "enable_thinking", "chat_template_kwargs.enable_thinking")
    return ChatCall(
        messages=checked,
        tools=tools,
        parse_tools=bool(tools) and choice != "none",
        enable_thinking=True if thinking is None else thinking,
        sampling=_sampling(body, default_max_tokens),
    )


def parse_completion(body: Mapping[str, Any], vocab_size: int) -> CompletionCall:
    """Check a /v1/completions body (max_tokens defaults to 16, as OpenAI's does)."""
    _unknown(body, COMPLETION_KEYS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("prompt: must not be empty", "prompt", code="invalid_value")
        value: str | tuple[int, ...] = prompt
    elif isinstance(prompt, list) and prompt and set(map(type, prompt)) == {int}:  # JSON ints (a bool is not one)
        if min(prompt) < 0 or max(prompt) >= vocab_size:  # C loops: 32K ids in ~1 ms, not ~3 in a Python one
            bad = next(t for t in prompt if not 0 <= t < vocab_size)
            raise ApiError(f"prompt: token id {bad} is outside [0, {vocab_size})", "prompt", code="invalid_value")
        value = tuple(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise _unsupported("prompt", "one prompt per request (a list of prompts is not supported)")
    else:
        raise ApiError("prompt: expected a non-empty string or list of token ids", "prompt", code="invalid_type")
    if _bool(body, "echo"):
        raise _unsupported("echo", "not supported")
    if body.get("logprobs") is not None:
        raise _unsupported("logprobs", "not supported")
    if _int(body, "best_of", 1) not in (None, 1):
        raise _unsupported("best_of", "only best_of=1 is supported")
    if body.get("suffix") is not None:
        raise _unsupported("suffix", "not supported")
    return CompletionCall(prompt=value, sampling=_sampling(body, 16))
