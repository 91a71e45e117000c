"""Token selection from one row of logits: greedy, temperature, top-k, min-p and top-p
sampling with a per-request seeded NumPy Generator, and top-k log-probabilities.

The decode loop that calls these lives in `executor/generate.py`.
"""

from __future__ import annotations

import attrs
import numpy as np

from executor.reference.ops import log_softmax


def _check_temperature(instance, attribute, value: float) -> None:
    if not (value >= 0.0 and np.isfinite(value)):
        raise ValueError(f"temperature must be a finite number >= 0, got {value}")


def _check_top_p(instance, attribute, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {value}")


def _check_top_k(instance, attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {value}")


def _check_min_p(instance, attribute, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {value}")


def _check_logprobs(instance, attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"logprobs must be >= 0, got {value}")


@attrs.frozen(slots=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy (argmax, lowest id on ties); otherwise
    softmax(logits / temperature) restricted to the top_k most likely tokens (0: no limit),
    then to those at least min_p times as likely as the most likely (0: no limit), then to
    the smallest top-p nucleus of what is left: the order vLLM applies them in (Qwen3.5's
    model card recommends top_k 20 with top_p 0.8 or 0.95). `logprobs` is the number of top
    (token_id, logprob) pairs reported per generated token."""

    temperature: float = attrs.field(default=0.0, converter=float, validator=_check_temperature)
    top_p: float = attrs.field(default=1.0, converter=float, validator=_check_top_p)
    logprobs: int = attrs.field(default=0, converter=int, validator=_check_logprobs)
    top_k: int = attrs.field(default=0, converter=int, validator=_check_top_k)
    min_p: float = attrs.field(default=0.0, converter=float, validator=_check_min_p)

    @property
    def is_greedy(self) -> bool:
        """Whether `sample` takes the argmax (temperature 0, or top_k 1) and draws nothing."""
        return self.temperature == 0.0 or self.top_k == 1


def new_rng(seed: int) -> np.random.Generator:
    """The per-request generator: the same seed reproduces the same reply."""
    return np.random.default_rng(seed)


NUCLEUS_SPANS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)
"""Candidate sets `sample` tries when looking for a top-p nucleus: the tokens whose
probability is within e^-span of the top one, the narrowest whose mass reaches the
nucleus' (then every token). Only the candidates are sorted: a full sort of a 248K
vocabulary cost ~38 ms of CPU a token on a 2-core box, this ~5 ms (RESULTS.md, session 8)."""


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """Pick the next token id from logits [vocab] (float32). rng: the request's generator;
    None only for greedy params (`SamplingParams.is_greedy`).

    Greedy (temperature 0, or top_k 1) is the argmax, lowest id on ties, and draws nothing from rng.
    Otherwise p = exp(logits / temperature - max) in float64 (the softmax, unnormalised)
    and exactly one uniform u is drawn per token, so a seed fixes the whole reply.
    top_p = 1: the first token in id order whose cumulative mass exceeds u of the total.
    top_p < 1: the nucleus is the shortest head of the tokens sorted by probability (ties
    by lower id) whose cumulative mass reaches top_p of the total (np.sum of p),
    renormalised, and u picks in that order. Cost: a few passes over the vocabulary and a
    sort of the candidates of NUCLEUS_SPANS (a set of tokens above a probability is a
    prefix of the sorted order, ties included), not of the whole vocabulary.
    """
    if params.is_greedy:
        return int(np.argmax(logits))
    assert rng is not None, "sampling that is not greedy needs a generator"
    scaled = np.asarray(logits, dtype=np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())
    u = rng.random()
    if params.top_k or params.min_p:
        return _sample_filtered(probs, params, u)
    if params.top_p >= 1.0:
        cumulative = np.cumsum(probs)
        return int(min(np.searchsorted(cumulative, u * cumulative[-1], side="right"), probs.size - 1))
    target = params.top_p * float(probs.sum())
    for span in (*NUCLEUS_SPANS, None):
        if span is None:
            candidates = np.arange(probs.size)
        else:
            above = probs >= np.exp(-span)
            if np.sum(probs, where=above) < target:
                continue
            candidates = np.flatnonzero(above)
        order = candidates[np.argsort(-probs[candidates], kind="stable")]  # candidates ascend: ties by id
        cumulative = np.cumsum(probs[order])
        keep = int(np.searchsorted(cumulative, target, side="left")) + 1
        if keep <= order.size or span is None:  # (a sum in another order may fall short: widen)
            keep = min(keep, order.size)
            break
    kept = cumulative[:keep] / cumulative[keep - 1]
    choice = int(np.searchsorted(kept, u, side="right"))
    return int(order[min(choice, keep - 1)])


def _sample_filtered(probs: np.ndarray, params: SamplingParams, u: float) -> int:
    """`sample` with a top_k or min_p limit: probs [vocab] float64, the softmax unnormalised
    with its largest value exactly 1; u the token's one uniform draw. The candidates (the
    top_k most likely, ties by lower id, then those with p >= min_p) are sorted by
    probability, ties by lower id; the nucleus is the shortest head whose cumulative mass
    reaches top_p of the candidates' mass, renormalised, and u picks in that order."""
    candidates = np.flatnonzero(probs >= params.min_p) if params.min_p else np.arange(probs.size)
    if params.top_k and params.top_k < candidates.size:
        kth = np.partition(probs[candidates], candidates.size - params.top_k)[candidates.size - params.top_k]
        candidates = candidates[probs[candidates] >= kth]  # ties at the k-th value: all of them, cut below
    order = candidates[np.argsort(-probs[candidates], kind="stable")]  # candidates ascend: ties by id
    if params.top_k:
        order = order[: params.top_k]
    cumulative = np.cumsum(probs[order])
    keep = order.size
    if params.top_p < 1.0:
        keep = min(int(np.searchsorted(cumulative, params.top_p * cumulative[-1], side="left")) + 1, order.size)
    kept = cumulative[:keep] / cumulative[keep - 1]
    choice = int(np.searchsorted(kept, u, side="right"))
    return int(order[min(choice, keep - 1)])


def top_logprobs(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens as (token_id, natural-log probability), highest first
    (ties by lower id). Log-probabilities of the unscaled logits, float64."""
    logp = log_softmax(logits)
    order = np.argsort(-logp, kind="stable")[:k]
    return [(int(i), float(logp[i])) for i in order]
