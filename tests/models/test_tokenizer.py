"""Tokenizer and chat template from the GGUF against HF transformers' tokenizer from the same file."""

from __future__ import annotations

import gguf
import pytest
import tokenizers

from models.gguf_file import GGUFError, GGUFFile
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


def test_a_file_without_a_template_gets_its_family_turn_format():
    """Gemma-3-270M's file has no chat template: the Gemma 3 turn format, system text opening
    the first user turn, `<end_of_turn>` a stop token; each message's rendering extends the
    rendering of the messages before it (role spans and system pins rely on it)."""
    from aither_jax.context.prompt import chat_prompt
    from models.registry import resolve_model

    gemma = Tokenizer.from_gguf(GGUFFile(resolve_model("gemma3-270m")))
    messages = [
        {"role": "system", "content": "You are Aither. "},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "tool", "content": "42"},
        {"role": "user", "content": "Thanks"},
    ]
    assert gemma.apply_chat_template(messages) == (
        "<start_of_turn>user\nYou are Aither.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\n42<end_of_turn>\n<start_of_turn>user\nThanks<end_of_turn>\n<start_of_turn>model\n"
    )
    assert gemma.apply_chat_template(messages[1:2]) == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    for k in range(1, len(messages)):
        head = gemma.apply_chat_template(messages[:k], add_generation_prompt=False)
        assert gemma.apply_chat_template(messages[: k + 1], add_generation_prompt=False).startswith(head)
    assert gemma.token_text(106) == "<end_of_turn>" and 106 in gemma.stop_token_ids
    prompt = chat_prompt(gemma, messages, pin_system=True)
    assert prompt.ids[0] == gemma.bos_token_id and prompt.num_pinned > 0
    assert [s.tag for s in prompt.sections] == ["system", "user", "assistant", "tool", "user"]


def test_decode_rejects_out_of_range_ids(tokenizer):
    with pytest.raises(ValueError, match="out of range"):
        tokenizer.decode([1, 10**7])


# --------------------------------------------------------------------------------------------
# Vocabularies and merges from tiny files written by gguf.GGUFWriter
# --------------------------------------------------------------------------------------------


def tokenizer_file(path, tokens: list[str], merges: list[str]) -> GGUFFile:
    """A header-only GGUF holding just a byte-level BPE vocabulary and its merges."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


def test_tiny_vocabulary_applies_its_merges(tmp_path):
    tok = Tokenizer.from_gguf(tokenizer_file(tmp_path / "ok.gguf", ["a", "b", "ab", "abb"], ["a b", "ab b"]))
    assert tok.encode("abb") == [3] and tok.encode("ba") == [1, 0]


@pytest.mark.parametrize(
    ("tokens", "merges", "message"),
    [
        (["a", "b", "ab"], ["a c"], r"merge #0 'a c' needs 'c', which is not in the vocabulary"),
        (["a", "b", "ab"], ["a b", "b a"], r"merge #1 'b a' needs 'ba', which is not in the vocabulary"),
        (["a", "b"], ["a b"], r"merge #0 'a b' needs 'ab', which is not in the vocabulary"),  # tokenizers panics
        (["a", "b", "ab"], ["a b", " b"], r"merge #1 ' b' needs '', which is not in the vocabulary"),
        (["a", "b", "ab"], ["a b c"], r"malformed merge 'a b c'"),
    ],
)
def test_merges_outside_the_vocabulary_are_rejected(tmp_path, tokens, merges, message):
    g = tokenizer_file(tmp_path / "bad.gguf", tokens, merges)
    with pytest.raises(GGUFError, match=message):
        Tokenizer.from_gguf(g)


def test_any_failure_inside_tokenizers_is_a_gguf_error(tmp_path, monkeypatch):
    """A Rust panic in tokenizers is a BaseException (pyo3's PanicException); it must not escape as one."""
    with pytest.raises(BaseException) as panic:  # captures the type pyo3 gives a Rust panic
        tokenizers.models.BPE(vocab={"a": 0, "b": 1}, merges=[("a", "b")])  # 'ab' is not in the vocabulary
    g = tokenizer_file(tmp_path / "ok.gguf", ["a", "b", "ab"], ["a b"])
    for error in (panic.value, RuntimeError("boom")):

        def failing_bpe(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(tokenizers.models, "BPE", failing_bpe)
        with pytest.raises(GGUFError, match=rf"ok.gguf: cannot build the tokenizer \({type(error).__name__}"):
            Tokenizer.from_gguf(g)


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_token_bytes_put_back_together_are_the_decoded_text(model):
    # A character spread over several tokens decodes as U+FFFD token by token; the tokens' raw
    # bytes, joined, are the text (what OpenAI's logprobs `bytes` lets a client rebuild).
    import numpy as np

    from models.registry import resolve_model

    tok = Tokenizer.from_gguf(GGUFFile(resolve_model(model)))
    for text in TEXTS:
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids).decode() == tok.decode(ids, skip_special_tokens=False)
    split = [i for i in tok.encode("𐍈 🤖🎉 日本語") if "\ufffd" in tok.decode([i])]
    assert split and all(max(tok.token_bytes(i)) >= 0x80 for i in split)  # pieces of characters
    rng = np.random.default_rng(0)
    for _ in range(200):  # any ids, control tokens included
        ids = rng.integers(0, tok.vocab_size, 6).tolist()
        joined = b"".join(tok.token_bytes(i) for i in ids).decode("utf-8", errors="replace")
        assert joined == tok.decode(ids, skip_special_tokens=False)
    assert tok.special_ids and all(tok.decode([i]) == "" for i in tok.special_ids)
