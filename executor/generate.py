"""Single-prompt generation (prefill, then decode until max_tokens or a stop token) and its
CLI: `python -m executor.generate [--model DIR] --backend reference (--prompt TEXT |
--chat FILE.json | --prompt-ids 1,2,3) --max-tokens N [--temperature T --top-p P --top-k K --min-p M
--seed S] [--logprobs K] [--json]`. With no --model, the built-in tiny model.

The server and the scheduler are elsewhere; this is the smallest end-to-end path.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path
from typing import Any, Sequence

import attrs
import structlog

from executor.api_schema import ApiError, parse_chat
from executor.backend import Backend
from executor.chat import ChatRenderer, load_template
from executor.config import Qwen35Config, load_config
from executor.model import tiny_model_dir
from executor.reference.backend import ReferenceBackend
from executor.sampling import SamplingParams, new_rng, sample, top_logprobs
from executor.tokenizer import load_tokenizer

BACKENDS = ("reference",)


@attrs.frozen(slots=True)
class GenerateRequest:
    """One generation: prompt ids, how many tokens at most, sampling and seed, stop ids."""

    prompt_ids: tuple[int, ...] = attrs.field(converter=tuple)
    max_tokens: int = 16
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    seed: int = 0
    stop_ids: frozenset[int] = attrs.field(default=frozenset(), converter=frozenset)

    def __attrs_post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")


@attrs.frozen(slots=True)
class GenerateResult:
    """Generated ids, per-token top log-probabilities (when asked) and why it stopped
    ("stop": a stop token, included in tokens; "length": max_tokens reached)."""

    tokens: tuple[int, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    finish_reason: str


def check_fits(config: Qwen35Config, request: GenerateRequest) -> None:
    """Raise ValueError, naming the limit, when the prompt and max_tokens pass the model's
    context (max_position_embeddings: the server rejects the same request with a 400) or
    logprobs asks for more tokens than the vocabulary has."""
    context, vocab = config.max_position_embeddings, config.vocab_size
    rows = len(request.prompt_ids) + request.max_tokens
    if rows > context:
        raise ValueError(f"max_tokens: the prompt's {len(request.prompt_ids)} tokens and {request.max_tokens} "
                         f"to generate pass the model's context of {context} (max_position_embeddings)")
    if request.sampling.logprobs > vocab:
        raise ValueError(f"logprobs: at most the vocabulary's {vocab} tokens, got {request.sampling.logprobs}")


def generate(backend: Backend, request: GenerateRequest) -> GenerateResult:
    """Prefill the whole prompt in one chunk, then decode one token per step. Raises
    ValueError when the request does not fit the model (`check_fits`)."""
    check_fits(backend.config, request)
    rng = new_rng(request.seed)
    state = backend.new_state()
    tokens: list[int] = []
    reported: list[tuple[tuple[int, float], ...]] = []
    if request.max_tokens == 0:
        backend.prefill(state, request.prompt_ids, (0, len(request.prompt_ids)), want_logits=False)
        return GenerateResult((), (), "length")
    logits = backend.prefill(state, request.prompt_ids, (0, len(request.prompt_ids)))
    finish = "length"
    while True:
        token = sample(logits, request.sampling, rng)
        tokens.append(token)
        if request.sampling.logprobs:
            reported.append(tuple(top_logprobs(logits, request.sampling.logprobs)))
        if token in request.stop_ids:
            finish = "stop"
            break
        if len(tokens) >= request.max_tokens:
            break
        logits = backend.decode([state], [token])[0]
    return GenerateResult(tuple(tokens), tuple(reported), finish)


class _CurrentStderr:
    """Logs go to whatever sys.stderr is at write time (stdout carries the JSON)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = GenerateRequest(prompt_ids=(0,))
    parser = argparse.ArgumentParser(prog="python -m executor.generate", description=(
        "Generate from one prompt on the reference backend: prefill, then decode until "
        "--max-tokens or a stop token."))
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the built-in tiny model)")
    parser.add_argument("--backend", choices=BACKENDS, default=BACKENDS[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw prompt text (no chat template)")
    source.add_argument("--chat", type=Path, help="JSON file: a message list, or {messages, tools, enable_thinking}")
    source.add_argument("--prompt-ids", help="comma-separated token ids (works without a tokenizer)")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--temperature", type=float, default=defaults.sampling.temperature)
    parser.add_argument("--top-p", type=float, default=defaults.sampling.top_p)
    parser.add_argument("--top-k", type=int, default=defaults.sampling.top_k, help="0: no limit (default: %(default)s)")
    parser.add_argument("--min-p", type=float, default=defaults.sampling.min_p, help="0: no limit (default: %(default)s)")
    parser.add_argument("--seed", type=int, help="sampling seed (default: drawn and reported)")
    parser.add_argument("--logprobs", type=int, default=defaults.sampling.logprobs)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; bad input (a message list the chat format rejects, a token id outside
    the vocabulary, a bad checkpoint) prints one `error:` line and returns 2."""
    try:
        return _main(argv)
    except ValueError as err:  # ChatError, CheckpointError and range checks are ValueErrors
        print(f"error: {err}", file=sys.stderr)
        return 2


def _main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(_CurrentStderr()))
    model_dir = args.model or tiny_model_dir()
    if not Path(model_dir).is_dir() or not (Path(model_dir) / "config.json").is_file():
        print(f"error: --model {model_dir}: not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    if args.max_tokens < 0:
        print(f"error: --max-tokens must be >= 0, got {args.max_tokens}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(model_dir)
    if args.prompt_ids is not None:
        try:
            prompt_ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            print(f"error: --prompt-ids must be comma-separated integers, got {args.prompt_ids!r}", file=sys.stderr)
            return 2
    elif tokenizer is None:
        print(f"error: {model_dir} has no tokenizer.json; use --prompt-ids", file=sys.stderr)
        return 2
    elif args.prompt is not None:
        prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=False).ids
    else:
        try:
            spec: Any = json.loads(args.chat.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            print(f"error: --chat {args.chat}: {err}", file=sys.stderr)
            return 2
        spec = {"messages": spec} if isinstance(spec, list) else spec
        if not isinstance(spec, dict) or not isinstance(spec.get("messages"), list):
            print(f"error: --chat {args.chat}: want a message list or {{\"messages\": [...]}}", file=sys.stderr)
            return 2
        thinking = spec.get("enable_thinking", True)
        if not isinstance(thinking, bool):
            print(f"error: --chat {args.chat}: enable_thinking: expected true or false, got {json.dumps(thinking)[:40]}",
                  file=sys.stderr)
            return 2
        try:  # the server's checks of a message list: a bad role or field named as the API names it
            call = parse_chat({"messages": spec["messages"], "tools": spec.get("tools"),
                               "chat_template_kwargs": {"enable_thinking": thinking}})
        except ApiError as err:
            print(f"error: --chat {args.chat}: {err.message}", file=sys.stderr)
            return 2
        renderer = ChatRenderer(tokenizer, load_template(model_dir))
        prompt_ids = list(
            renderer.render(
                list(call.messages), list(call.tools) if call.tools else None, enable_thinking=call.enable_thinking
            ).token_ids
        )
    config = load_config(model_dir)
    stop = set(config.eos_token_ids)
    if tokenizer is not None and tokenizer.token_to_id("<|im_end|>") is not None:
        stop.add(tokenizer.token_to_id("<|im_end|>"))
    seed = args.seed if args.seed is not None else secrets.randbits(63)
    try:
        request = GenerateRequest(
            prompt_ids=prompt_ids,
            max_tokens=args.max_tokens,
            sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                    min_p=args.min_p, logprobs=args.logprobs),
            seed=seed,
            stop_ids=stop,
        )
        check_fits(config, request)  # before the weights load: a large checkpoint takes minutes
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = generate(ReferenceBackend.from_dir(model_dir), request)
    text = tokenizer.decode(list(result.tokens), skip_special_tokens=False) if tokenizer is not None else None
    if args.json:
        out: dict[str, Any] = {
            "tokens": list(result.tokens),
            "text": text,
            "finish_reason": result.finish_reason,
            "prompt_tokens": len(prompt_ids),
            "seed": seed,
            "model": str(model_dir),
            "backend": args.backend,
        }
        if args.logprobs:
            out["top_logprobs"] = [[[i, lp] for i, lp in step] for step in result.top_logprobs]
        print(json.dumps(out, ensure_ascii=False))
    else:
        print(text if text is not None else " ".join(map(str, result.tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
