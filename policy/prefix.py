"""Prompt: a token sequence described by runs, with a digest of every prefix [0, P).

Two prompts share a kept state at row P only if their digests at P are equal. A run is
either real tokens (the executor) or a synthetic content id with a row count (the
simulator, where rows of one id are a fixed sequence, so (id, k) names its first k rows).
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from array import array
from typing import Iterable, Sequence

import attrs

DIGEST_BYTES = 16
BLOCK_ROWS = 64


def _hash(prev: bytes, payload: bytes) -> bytes:
    return hashlib.blake2b(prev + payload, digest_size=DIGEST_BYTES).digest()


def _synthetic_payload(content_id: int, rows: int) -> bytes:
    return b"s" + content_id.to_bytes(16, "big", signed=True) + rows.to_bytes(8, "big")


def _token_payload(tokens: Sequence[int]) -> bytes:
    return b"t" + array("q", tokens).tobytes()


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as native int64 bytes (8 an id), the digest input of real runs. struct takes
    any int-like with __index__; others go through int(). A bytes-like object is not taken as
    packed ids: each of its bytes is one id. Raises TypeError or ValueError for an id int()
    cannot convert, OverflowError for one outside int64."""
    try:
        if isinstance(token_ids, (bytes, bytearray, memoryview)):  # one id a byte, not raw int64s
            raise TypeError
        return struct.pack(f"={len(token_ids)}q", *token_ids)
    except (struct.error, TypeError):  # not plain ints: convert each (int() raises as documented)
        return array("q", [int(t) for t in token_ids]).tobytes()


@attrs.frozen
class Run:
    """One run of rows: `rows` rows named by `content_id`, or by `tokens` when real.

    content_id: int naming the content of a synthetic run (ignored when tokens are given).
    rows: row count, > 0.
    tokens: the token ids (len == rows) of a real run, or None.
    """

    content_id: int
    rows: int
    tokens: tuple[int, ...] | None = None

    def __attrs_post_init__(self) -> None:
        if self.rows <= 0:
            raise ValueError(f"rows must be > 0, got {self.rows}")
        if self.tokens is not None and len(self.tokens) != self.rows:
            raise ValueError(f"tokens has {len(self.tokens)} ids but rows is {self.rows}")

    def payload(self, rows: int) -> bytes:
        """Digest input naming the first `rows` rows of this run."""
        if self.tokens is not None:
            return _token_payload(self.tokens[:rows])
        return _synthetic_payload(self.content_id, rows)


def _token_blocks(tokens: list[int], begin: int) -> list[Run]:
    """Real runs holding `tokens` (rows from `begin`), cut at absolute multiples of BLOCK_ROWS."""
    out: list[Run] = []
    a = 0
    while a < len(tokens):
        b = min(len(tokens), ((begin + a) // BLOCK_ROWS + 1) * BLOCK_ROWS - begin)
        out.append(Run(0, b - a, tuple(tokens[a:b])))
        a = b
    return out


def _canonical_runs(runs: Iterable[Run]) -> tuple[Run, ...]:
    """`runs` with every stretch of real tokens re-cut at absolute multiples of BLOCK_ROWS.

    Real tokens then digest the same whatever runs a caller split them into
    (`Prompt.from_tokens`, `extend` with a reply's tokens, `prefix`). Synthetic runs are
    kept as given: (id, k) names the first k rows of content `id`, so they cannot be re-cut.
    """
    runs = tuple(runs)
    if all(run.tokens is None for run in runs):
        return runs
    out: list[Run] = []
    tokens: list[int] = []
    begin = row = 0
    for run in runs:
        if run.tokens is None:
            out.extend(_token_blocks(tokens, begin))
            out.append(run)
            tokens = []
        else:
            if not tokens:
                begin = row
            tokens.extend(run.tokens)
        row += run.rows
    out.extend(_token_blocks(tokens, begin))
    return tuple(out)


@attrs.frozen
class Prompt:
    """A prompt of `len(prompt)` rows as runs, with digests of its prefixes.

    `digest(P)` is a 16-byte blake2b chain: over the runs wholly inside [0, P), then the
    first rows of the run that P cuts. Equal digests mean equal tokens [0, P) (up to
    blake2b collisions), whatever other rows follow. Real-token runs are stored re-cut at
    absolute multiples of BLOCK_ROWS, so for real tokens the converse holds too: equal
    tokens [0, P) give equal digests however the runs were split.
    """

    runs: tuple[Run, ...] = attrs.field(converter=_canonical_runs)
    _ends: tuple[int, ...] = attrs.field(init=False, repr=False, eq=False)
    _chain: tuple[bytes, ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        ends, chain, row, digest = [0], [b""], 0, b""
        for run in self.runs:
            row += run.rows
            digest = _hash(digest, run.payload(run.rows))
            ends.append(row)
            chain.append(digest)
        object.__setattr__(self, "_ends", tuple(ends))
        object.__setattr__(self, "_chain", tuple(chain))

    def __len__(self) -> int:
        return self._ends[-1]

    @property
    def run_ends(self) -> tuple[int, ...]:
        """Row where each run ends, in order (the first entry is 0)."""
        return self._ends

    def digest(self, row: int) -> bytes:
        """Digest of rows [0, row); 0 <= row <= len(self), else ValueError."""
        if not 0 <= row <= len(self):
            raise ValueError(f"row {row} outside [0, {len(self)}]")
        i = bisect.bisect_right(self._ends, row) - 1
        if self._ends[i] == row:
            return self._chain[i]
        return _hash(self._chain[i], self.runs[i].payload(row - self._ends[i]))

    def extend(self, runs: Iterable[Run]) -> Prompt:
        """This prompt followed by `runs`; synthetic runs reuse this prompt's digest chain."""
        more = tuple(runs)
        if not more:
            return self
        if any(r.tokens is not None for r in more) or any(r.tokens is not None for r in self.runs[-1:]):
            return Prompt(self.runs + more)
        ends, chain = list(self._ends), list(self._chain)
        for run in more:
            ends.append(ends[-1] + run.rows)
            chain.append(_hash(chain[-1], run.payload(run.rows)))
        out = object.__new__(Prompt)
        object.__setattr__(out, "runs", self.runs + more)
        object.__setattr__(out, "_ends", tuple(ends))
        object.__setattr__(out, "_chain", tuple(chain))
        return out

    def prefix(self, row: int) -> Prompt:
        """The first `row` rows, with the same digests as this prompt for rows <= `row`."""
        if not 0 <= row <= len(self):
            raise ValueError(f"row {row} outside [0, {len(self)}]")
        out: list[Run] = []
        for run, start in zip(self.runs, self._ends):
            if start >= row:
                break
            take = min(run.rows, row - start)
            if take == run.rows:
                out.append(run)
            else:
                tokens = None if run.tokens is None else run.tokens[:take]
                out.append(Run(run.content_id, take, tokens))
        return Prompt(tuple(out))

    @staticmethod
    def from_tokens(token_ids: Sequence[int]) -> Prompt:
        """A real prompt, cut into runs of BLOCK_ROWS absolute rows (the last one shorter).

        The same runs and digests as `Prompt(runs)` would give, built in one pass: the ids
        are packed once as native int64 (`pack_tokens`) and unpacked once into plain ints,
        each run holds a slice of that tuple, and each digest input is a slice of the packed
        bytes. The runs are canonical already, so their checks are skipped. The engine's
        submit runs this (or `from_packed`) for every request: 3,522 ids took 213 us before
        session 21 (162 after), 2,036 ids 0.77 ms under a server's load before session 17
        (bench/RESULTS.md). Raises TypeError or ValueError for an id int() cannot convert,
        OverflowError for one outside int64."""
        raw = pack_tokens(token_ids)
        return _from_packed(raw, struct.unpack(f"={len(raw) // 8}q", raw))

    @staticmethod
    def from_packed(raw: bytes) -> tuple[Prompt, tuple[int, ...]]:
        """A real prompt from its token ids packed as native int64 (`pack_tokens`'s bytes,
        8 bytes an id), and those ids as a tuple of plain ints: `from_tokens` without the
        packing, for ids that crossed a process boundary packed (`executor.engine`: a 32K-id
        prompt pickles and unpickles as bytes in ~0.1 ms against ~1 ms as a tuple of ints, on
        a 2-core VM). Raises ValueError when len(raw) is not a multiple of 8."""
        if len(raw) % 8:
            raise ValueError(f"packed token ids must be 8 bytes each, got {len(raw)} bytes")
        ids = struct.unpack(f"={len(raw) // 8}q", raw)
        return _from_packed(bytes(raw), ids), ids

    @staticmethod
    def synthetic(pieces: Iterable[tuple[int, int]]) -> Prompt:
        """A simulated prompt from (content_id, rows) pieces."""
        return Prompt(tuple(Run(cid, rows) for cid, rows in pieces))


_RUN_CONTENT_ID = Run.__dict__["content_id"].__set__
_RUN_ROWS = Run.__dict__["rows"].__set__
_RUN_TOKENS = Run.__dict__["tokens"].__set__


def _from_packed(raw: bytes, ids: tuple[int, ...]) -> Prompt:
    """The real prompt of `ids` (plain ints) whose native int64 bytes are `raw`: runs of
    BLOCK_ROWS absolute rows, each digest `_hash` of the previous one and b"t" + the block's
    bytes (`_token_payload`'s payload, sliced from `raw` rather than packed again). The runs
    are built through their slots' setters: they are canonical, so `Run`'s checks are skipped."""
    n = len(ids)
    width = 8 * BLOCK_ROWS
    new_run = object.__new__
    runs, chain, digest = [], [b""], b""
    for a in range(0, n, BLOCK_ROWS):
        block = ids[a : a + BLOCK_ROWS]
        run = new_run(Run)
        _RUN_CONTENT_ID(run, 0)
        _RUN_ROWS(run, len(block))
        _RUN_TOKENS(run, block)
        runs.append(run)
        digest = _hash(digest, b"t" + raw[8 * a : 8 * a + width])
        chain.append(digest)
    out = object.__new__(Prompt)
    object.__setattr__(out, "runs", tuple(runs))
    object.__setattr__(out, "_ends", (*range(0, n, BLOCK_ROWS), n) if n else (0,))
    object.__setattr__(out, "_chain", tuple(chain))
    return out
