"""Rules 6 and 7 properties: warm run/cancel, quiet, adoption, prefill-only finish reason.

Each `check_*` runs against the real function and against a planted wrong one.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from policy_strategies import (
    Case,
    assert_caught,
    cases,
    oracle_fingerprint,
    oracle_fresh_cuts,
    oracle_usable,
    usable_resume_rows,
)

from policy.config import PolicyConfig
from policy.keep import PassKind, keep_rows
from policy.prefix import Prompt
from policy.warm import (
    WarmDecision,
    WarmVerdict,
    can_adopt,
    decide_warm,
    finish_reason,
    is_quiet,
)


@st.composite
def warm_examples(draw, real: bool = False):
    """(case, resume, cfg flags, rows already kept) for a warm pass over the case's prompt."""
    case = draw(cases(real=real))
    cfg = case.cfg.with_changes(
        warm_enabled=draw(st.sampled_from([True, True, True, False])),
        prompt_cache_bytes=draw(st.sampled_from([1 << 40, 1 << 40, 1 << 40, 0])),
    )
    case = Case(case.rows, case.starts, cfg, case.facts)
    resume = draw(st.sampled_from(usable_resume_rows(case)))
    would = [k.row for k in keep_rows(PassKind.WARM, case.rows, case.starts, resume, case.cfg.with_changes(prompt_cache_bytes=1), case.facts)]
    pool = would + [draw(st.integers(1, case.rows))]
    already = draw(st.one_of(st.just(would), st.lists(st.sampled_from(pool), max_size=len(pool))))
    return case, resume, tuple(already)


def check_decide_warm(decide_fn, example) -> None:
    """A warm pass runs iff warm passes are on and it keeps some row not already kept; then
    it ends at its last keep. A warm pass that would keep nothing new is cancelled."""
    case, resume, already = example
    d: WarmDecision = decide_fn(case.rows, case.starts, resume, case.cfg, case.facts, already)
    keeps = keep_rows(PassKind.WARM, case.rows, case.starts, resume, case.cfg, case.facts)
    new = [k.row for k in keeps if k.row not in set(already)]
    if not case.cfg.warm_active or not new:
        assert d.verdict is WarmVerdict.CANCEL, f"runs but keeps nothing new: {keeps} vs {already}"
    else:
        assert d.verdict is WarmVerdict.RUN, f"cancelled though {new} are new"
        assert d.keeps == keeps and d.end_row == keeps[-1].row > resume


@st.composite
def quiet_examples(draw):
    cfg = PolicyConfig(warm_quiet_ms=draw(st.sampled_from([0.0, 1.0, 150.0, 2500.0])))
    since = draw(st.one_of(st.none(), st.floats(0, 1e4, allow_nan=False)))
    now = (since or 0.0) + draw(st.floats(0, 5.0, allow_nan=False))
    return now, since, cfg


def check_quiet(quiet_fn, example) -> None:
    """Quiet iff nothing ran in the foreground for warm_quiet_ms (milliseconds)."""
    now, since, cfg = example
    expected = since is not None and now >= since + cfg.warm_quiet_ms / 1000.0
    assert quiet_fn(now, since, cfg) is expected


@st.composite
def adopt_examples(draw):
    """A warm pass over the first E rows of the next request, stopped at some row, and the
    next request (sometimes with other tokens or other starts)."""
    case = draw(cases())
    E = case.rows
    extra = draw(st.integers(1, 3 * case.cfg.grid_rows))
    diverge = draw(st.one_of(st.none(), st.integers(0, E + extra - 1)))
    tokens = list(range(E + extra))
    if diverge is not None:
        tokens[diverge] = -1
    warm = Prompt.from_tokens(range(E))
    request = Prompt.from_tokens(tokens)
    starts = tuple(sorted({*case.starts, E})) if draw(st.booleans()) else case.starts
    warm_cuts = oracle_fresh_cuts(E, case.starts, case.cfg)
    row = draw(st.one_of(st.sampled_from([*warm_cuts, E]), st.integers(0, E + 1)))
    fp = oracle_fingerprint(warm_cuts, row, case.facts)
    if draw(st.integers(0, 4)) == 0 and row > 1:
        fp = tuple(sorted({*fp, draw(st.integers(1, row - 1))}))
    return case, warm, row, fp, request, starts


def check_adopt(adopt_fn, example) -> None:
    """A request adopts a warm pass at row W iff W > 0 lies in both prompts, their tokens
    [0, W) match, W is usable for the request and the cuts below W match its fresh plan."""
    case, warm, row, fp, request, starts = example
    request_case = Case(len(request), starts, case.cfg, case.facts)
    expected = (
        0 < row <= min(len(warm), len(request))
        and warm.digest(row) == request.digest(row)
        and oracle_usable(request_case, row)
        and fp == oracle_fingerprint(oracle_fresh_cuts(len(request), starts, case.cfg), row, case.facts)
    )
    assert adopt_fn(warm, row, fp, request, starts, case.cfg, case.facts) is expected


def check_prefill_only(finish_fn, example) -> None:
    """Rule 7: max_tokens 0 finishes "length", never "cancelled"; else "stop" iff stopped."""
    max_tokens, generated, stopped = example
    reason = finish_fn(max_tokens, generated, stopped)
    if max_tokens == 0:
        assert reason == "length"
    else:
        assert reason == ("stop" if stopped else "length")


FINISH = st.tuples(st.integers(0, 4), st.integers(0, 4), st.booleans())


# --- planted wrong implementations ------------------------------------------------------------
def decide_runs_when_keeping_nothing(prompt_rows, starts, resume, cfg, facts, already_kept):
    """Wrong: only a missing keep list cancels; already-kept rows still run."""
    d = decide_warm(prompt_rows, starts, resume, cfg, facts, ())
    return d


def quiet_in_seconds(now_s, quiet_since_s, cfg):
    """Wrong: reads warm_quiet_ms as seconds."""
    return quiet_since_s is not None and now_s >= quiet_since_s + cfg.warm_quiet_ms


def adopt_ignores_cuts(warm_prompt, warm_row, warm_fingerprint, request_prompt, request_starts, cfg, facts):
    """Wrong: adopts whatever cuts made the warm pass's bits."""
    if not 0 < warm_row <= min(len(warm_prompt), len(request_prompt)):
        return False
    cuts = oracle_fresh_cuts(len(request_prompt), tuple(request_starts), cfg)
    return can_adopt(warm_prompt, warm_row, oracle_fingerprint(cuts, warm_row, facts),
                     request_prompt, request_starts, cfg, facts)


def finish_stop_for_prefill_only(max_tokens, generated, stopped):
    """Wrong: a prefill-only request that 'stopped' reports "stop"."""
    return "stop" if stopped else "length"


# --- properties ---------------------------------------------------------------------------------
@given(warm_examples())
def test_decide_warm(example):
    check_decide_warm(decide_warm, example)


@given(warm_examples(real=True))
def test_decide_warm_at_4096(example):
    check_decide_warm(decide_warm, example)


@given(quiet_examples())
def test_quiet(example):
    check_quiet(is_quiet, example)


@given(adopt_examples())
def test_adopt(example):
    check_adopt(can_adopt, example)


@given(FINISH)
def test_prefill_only_finishes_with_length(example):
    check_prefill_only(finish_reason, example)


def test_catches_a_warm_pass_that_runs_keeping_nothing_new():
    assert_caught(warm_examples(), lambda ex: check_decide_warm(decide_runs_when_keeping_nothing, ex))


def test_catches_quiet_read_as_seconds():
    assert_caught(quiet_examples(), lambda ex: check_quiet(quiet_in_seconds, ex))


def test_catches_adoption_that_ignores_cuts():
    assert_caught(adopt_examples(), lambda ex: check_adopt(adopt_ignores_cuts, ex))


def test_catches_prefill_only_reported_as_stop():
    assert_caught(FINISH, lambda ex: check_prefill_only(finish_stop_for_prefill_only, ex))
