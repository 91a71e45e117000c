"""Prompt digests: equal prefixes give equal digests, different tokens different ones."""

from __future__ import annotations

import pytest

from policy.prefix import BLOCK_ROWS, DIGEST_BYTES, Prompt, Run

TOKENS = tuple(range(1000, 1300))  # 300 rows: 4 whole blocks of 64 and 44 rows


def test_from_tokens_cuts_absolute_blocks():
    p = Prompt.from_tokens(TOKENS)
    assert len(p) == 300
    assert p.run_ends == (0, 64, 128, 192, 256, 300)
    assert p.digest(0) == b""  # the empty prefix, shared by every prompt
    assert all(len(p.digest(r)) == DIGEST_BYTES for r in (1, 63, 64, 65, 300))
    assert BLOCK_ROWS == 64


@pytest.mark.parametrize(
    "split",
    [(300,), (1, 299), (63, 237), (65, 235), (100, 100, 100), (299, 1), (64, 64, 172)],
    ids=["whole", "1+299", "63+237", "65+235", "3x100", "299+1", "64+64+172"],
)
def test_real_token_digests_ignore_run_splitting(split):
    ref = Prompt.from_tokens(TOKENS)
    runs, a = [], 0
    for n in split:
        runs.append(Run(0, n, TOKENS[a : a + n]))
        a += n
    p = Prompt(tuple(runs))
    assert p == ref
    assert [p.digest(r) for r in range(301)] == [ref.digest(r) for r in range(301)]


@pytest.mark.parametrize("cut", [1, 63, 64, 65, 200, 299], ids=lambda c: f"at-{c}")
def test_extend_and_prefix_keep_digests(cut):
    ref = Prompt.from_tokens(TOKENS)
    head = Prompt.from_tokens(TOKENS[:cut])
    grown = head.extend([Run(0, 300 - cut, TOKENS[cut:])])
    assert [grown.digest(r) for r in range(301)] == [ref.digest(r) for r in range(301)]
    assert ref.prefix(cut) == head
    assert ref.prefix(cut).digest(cut) == ref.digest(cut)


def test_longer_prompt_shares_digests_of_its_prefix():
    short = Prompt.from_tokens(TOKENS[:130])
    long = Prompt.from_tokens(TOKENS + (7, 8, 9))
    assert all(short.digest(r) == long.digest(r) for r in range(131))


@pytest.mark.parametrize("where", [0, 1, 63, 64, 65, 129, 299], ids=lambda w: f"token-{w}")
def test_different_tokens_give_different_digests(where):
    other = list(TOKENS)
    other[where] += 1
    a, b = Prompt.from_tokens(TOKENS), Prompt.from_tokens(other)
    assert all(a.digest(r) == b.digest(r) for r in range(where + 1))
    assert all(a.digest(r) != b.digest(r) for r in range(where + 1, 301))


def test_digest_rejects_rows_outside():
    p = Prompt.from_tokens(TOKENS[:10])
    for row in (-1, 11):
        with pytest.raises(ValueError, match=f"row {row} outside"):
            p.digest(row)
    with pytest.raises(ValueError, match="row 11 outside"):
        p.prefix(11)


def test_synthetic_runs_name_first_rows_of_content():
    a = Prompt.synthetic([(1, 100), (2, 50)])
    b = Prompt.synthetic([(1, 100), (2, 80)])
    c = Prompt.synthetic([(1, 60), (1, 40)])  # rows 0..59 of content 1, then its rows 0..39
    assert a.runs == (Run(1, 100), Run(2, 50))  # synthetic runs are kept as given
    assert all(a.digest(r) == b.digest(r) for r in range(151))
    assert a.digest(60) == c.digest(60)
    assert a.digest(61) != c.digest(61)
    assert a.prefix(120).digest(120) == a.digest(120)


def test_synthetic_and_real_runs_never_collide():
    real = Prompt((Run(0, 3, (1, 2, 3)),))
    synthetic = Prompt.synthetic([(0, 3)])
    assert real.digest(3) != synthetic.digest(3)


def test_run_validation():
    with pytest.raises(ValueError, match="rows must be > 0"):
        Run(0, 0)
    with pytest.raises(ValueError, match="tokens has 2 ids but rows is 3"):
        Run(0, 3, (1, 2))


def test_from_tokens_digests_are_the_blake2b_chain_of_its_blocks():
    """The digest at a block end is blake2b(previous digest + b"t" + the block's ids as
    native int64), 16 bytes: from_tokens's one-array fast path keeps the scheme (session 17)."""
    import hashlib
    from array import array

    p = Prompt.from_tokens(TOKENS)
    digest = b""
    for a, b in ((0, 64), (64, 128), (128, 192), (192, 256), (256, 300)):
        digest = hashlib.blake2b(digest + b"t" + array("q", TOKENS[a:b]).tobytes(), digest_size=16).digest()
        assert p.digest(b) == digest
    assert p.runs == tuple(Run(0, b - a, TOKENS[a:b]) for a, b in ((0, 64), (64, 128), (128, 192), (192, 256),
                                                                    (256, 300)))


class _IntLike:
    """An id with __int__ but no __index__ (array("q") refuses it; int() takes it)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value


def test_from_tokens_converts_ids_that_are_not_plain_ints_and_refuses_non_numbers():
    assert Prompt.from_tokens([_IntLike(t) for t in TOKENS]) == Prompt.from_tokens(TOKENS)
    assert Prompt.from_tokens(()) == Prompt(()) and len(Prompt.from_tokens([])) == 0
    for raw in (b"abcdefghi", bytearray(b"abcdefghi"), memoryview(b"abcdefghi")):  # one id a byte, not raw int64s
        assert Prompt.from_tokens(raw) == Prompt.from_tokens(tuple(b"abcdefghi"))
    with pytest.raises((TypeError, ValueError)):
        Prompt.from_tokens(["a", "b"])
    with pytest.raises(OverflowError):
        Prompt.from_tokens([1 << 70])


def test_from_packed_is_from_tokens_of_the_packed_ids():
    """`from_packed(pack_tokens(ids))` gives the prompt `from_tokens(ids)` gives (runs, row ends,
    every digest) and the ids back as plain ints, for lengths around the block edges; bytes that
    are not whole int64s are a ValueError."""
    from policy.prefix import pack_tokens

    for n in (0, 1, 63, 64, 65, 128, 300):
        ids = TOKENS[:n] if n <= len(TOKENS) else TOKENS + tuple(range(n - len(TOKENS)))
        prompt, back = Prompt.from_packed(pack_tokens(ids))
        ref = Prompt.from_tokens(ids)
        assert back == tuple(ids) and all(type(t) is int for t in back)
        assert prompt == ref and prompt.run_ends == ref.run_ends and len(prompt) == n
        assert [prompt.digest(r) for r in range(n + 1)] == [ref.digest(r) for r in range(n + 1)]
    assert pack_tokens([_IntLike(5), 6]) == pack_tokens((5, 6)) and len(pack_tokens((5, 6))) == 16
    with pytest.raises(ValueError, match="8 bytes each, got 12 bytes"):
        Prompt.from_packed(b"x" * 12)
