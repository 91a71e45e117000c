"""Token selection from one row of logits: greedy, temperature and top-p sampling with a
per-request seeded NumPy Generator, and top-k log-probabilities.

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


def _check_logprobs(instance, attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"logprobs must be >= 0, got {value}")


@attrs.frozen(slots=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy (argmax, lowest id on ties); otherwise
    softmax(logits / temperature) restricted to the smallest top-p nucleus. `logprobs`
    is the number of top (token_id, logprob) pairs reported per generated token."""

    temperature: float = attrs.field(default=0.0, converter=float, validator=_check_temperature)
    top_p: float = attrs.field(default=1.0, converter=float, validator=_check_top_p)
    logprobs: int = attrs.field(default=0, converter=int, validator=_check_logprobs)


def new_rng(seed: int) -> np.random.Generator:
    """The per-request generator: the same seed reproduces the same reply."""
    return np.random.default_rng(seed)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Pick the next token id from logits [vocab] (float32).

    Greedy draws nothing from rng; sampling draws exactly one uniform per token, so a
    seed fixes the whole reply. Nucleus: tokens sorted by probability (ties by id), the
    shortest head whose mass reaches top_p, renormalised.
    """
    if params.temperature == 0.0:
        return int(np.argmax(logits))
    scaled = np.asarray(logits, dtype=np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    sorted_probs = probs[order]
    cumulative = np.cumsum(sorted_probs)
    keep = int(np.searchsorted(cumulative, params.top_p * cumulative[-1], side="left")) + 1
    kept = cumulative[:keep] / cumulative[keep - 1]
    choice = int(np.searchsorted(kept, rng.random(), side="right"))
    return int(order[min(choice, keep - 1)])


def top_logprobs(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens as (token_id, natural-log probability), highest first
    (ties by lower id). Log-probabilities of the unscaled logits, float64."""
    logp = log_softmax(logits)
    order = np.argsort(-logp, kind="stable")[:k]
    return [(int(i), float(logp[i])) for i in order]
