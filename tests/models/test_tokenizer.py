"""Tokenizer and chat template from the GGUF against HF transformers' tokenizer from the same file."""

from __future__ import annotations

import pytest

from models.gguf_file import GGUFFile
from models.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces, trailing spaces   ",
    "naïve café — Ünïcödé ẞ ﬁ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "日本語のテキストと中文和한국어",
    "emoji 🤖🎉👩‍👩‍👧‍👦 and flags 🇫🇷",
    "def f(x):\n\treturn {'a': [x ** 2, 0x1F]}  # comment\n\n\n",
    "Numbers 1234567890 3.14159 -42 1e-5",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n<|endoftext|>",
    "\r\n windows \r\n line endings",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief 🙂"}, {"role": "user", "content": "What's 2+2?"}],
    [
        {"role": "user", "content": "Write code:\n```python\nprint('x')\n```"},
        {"role": "assistant", "content": "Sure — done."},
        {"role": "user", "content": "Now in 日本語?"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(model_path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(model_path))


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_decode_match_hf(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)


def test_special_tokens_are_single_ids(tokenizer):
    assert tokenizer.encode("<|im_start|><|im_end|>") == [1, 2]
    assert tokenizer.eos_token_id == 2 and 2 in tokenizer.stop_token_ids


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["single", "system", "multi-turn"])
def test_chat_template_matches_hf(tokenizer, hf_tokenizer, conversation, generation_prompt):
    ours = tokenizer.apply_chat_template(conversation, add_generation_prompt=generation_prompt)
    ref = hf_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours == ref
    assert tokenizer.encode(ours) == hf_tokenizer(ref, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty"),
        ({"role": "user", "content": "x"}, "non-empty list"),
        ([{"role": "wizard", "content": "x"}], "allowed roles"),
        ([{"role": "user", "content": 5}], "content must be a string"),
        ([{"role": "user", "content": "x", "extra": 1}], "must be a dict"),
        (["hello"], "must be a dict"),
    ],
)
def test_bad_messages(tokenizer, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        tokenizer.apply_chat_template(messages)


def test_template_runs_sandboxed(tokenizer):
    """A hostile template cannot reach Python internals; the error is a clean ChatTemplateError."""
    evil = Tokenizer(tokenizer.hf, tokenizer.vocab_size, {}, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])
    raising = Tokenizer(tokenizer.hf, tokenizer.vocab_size, {}, "{{ raise_exception('only user turns') }}")
    with pytest.raises(ChatTemplateError, match="only user turns"):
        raising.apply_chat_template([{"role": "user", "content": "x"}])
    none = Tokenizer(tokenizer.hf, tokenizer.vocab_size, {}, None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        none.apply_chat_template([{"role": "user", "content": "x"}])


def test_decode_rejects_out_of_range_ids(tokenizer):
    with pytest.raises(ValueError, match="out of range"):
        tokenizer.decode([1, 10**7])
