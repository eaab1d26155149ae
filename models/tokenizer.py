"""Tokenizer and chat template built from a GGUF file's own vocabulary, merges and template.

Byte-level BPE (`tokenizer.ggml.model == "gpt2"`, as in SmolLM2) and Gemma's
SentencePiece-style BPE (`"llama"` in a gemma3 file: no merges stored, so they are rebuilt from
the vocabulary) are built with HF `tokenizers`; tokens marked CONTROL become special tokens and
USER_DEFINED ones added tokens, so `<|im_start|>` stays whole. The chat template is rendered in a sandboxed jinja2
environment that sees only an allowlisted set of variables.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache, cached_property

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from models.chat_templates import FAMILY_TEMPLATES
from models.gguf_file import GGUFError, GGUFFile

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Split expressions for `tokenizer.ggml.pre` values whose merges were learned on a split other
# than GPT-2's default byte-level regex (which covers "gpt2", "smollm" and friends).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}

CHAT_ROLES = ("system", "user", "assistant", "tool")
SPACE_MARK = "\u2581"  # SentencePiece's visible space


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters.

    Printable Latin-1 bytes map to themselves; the remaining 68 bytes (controls, space, ...)
    map, in byte order, to code points 256, 257, ...
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@cache
def _byte_values() -> dict[str, int]:
    """`byte_alphabet`'s inverse: the byte each printable character spells."""
    return {c: b for b, c in byte_alphabet().items()}


class ChatTemplateError(ValueError):
    """Messages do not fit the chat template, or the template failed to render."""


class Tokenizer:
    """Encode/decode and chat-template rendering for one model.

    Attributes:
        vocab_size: number of token ids.
        bos_token_id / eos_token_id: ids from the GGUF (None when absent).
        stop_token_ids: ids that end generation by default (end-of-sequence and end-of-turn,
            and the turn end of the family template a file without a template gets).
        chat_template: the jinja2 source: the file's, else its architecture's
            (models/chat_templates.py), else None.
    """

    def __init__(
        self,
        hf: HFTokenizer,
        vocab_size: int,
        special: dict[str, int | None],
        chat_template: str | None,
        add_bos: bool = False,
        extra_stop_ids: tuple[int, ...] = (),
        byte_level: bool = True,
    ):
        self.hf = hf
        self.byte_level = byte_level  # tokens spelled in GPT-2's byte alphabet, else SentencePiece's
        self.add_bos = bool(add_bos) and special.get("bos") is not None
        self.vocab_size = vocab_size
        self.bos_token_id = special.get("bos")
        self.eos_token_id = special.get("eos")
        ends = {i for k in ("eos", "eot") if (i := special.get(k)) is not None}
        self.stop_token_ids = tuple(sorted(ends | set(extra_stop_ids)))
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        self._controls: tuple[str, ...] | None = None
        self._literal_hf: HFTokenizer | None = None  # encodes added-token strings as text

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Tokenizer:
        kind = gguf.get("tokenizer.ggml.model")
        tokens = gguf.get("tokenizer.ggml.tokens")
        sentencepiece = kind == "llama" and gguf.get("general.architecture") == "gemma3"
        if kind != "gpt2" and not sentencepiece:
            raise GGUFError(
                f"{gguf.path}: tokenizer model {kind!r} is not supported yet "
                "(supported: 'gpt2', and 'llama' in gemma3 files)"
            )
        if not isinstance(tokens, list) or not tokens:
            raise GGUFError(f"{gguf.path}: tokenizer.ggml.tokens is missing or empty")
        token_types = gguf.get("tokenizer.ggml.token_type")
        if token_types is None:
            token_types = np.ones(len(tokens), dtype=np.int32)
        if len(token_types) != len(tokens):
            raise GGUFError(f"{gguf.path}: {len(token_types)} token types for {len(tokens)} tokens")
        if sentencepiece:
            hf = _sentencepiece_bpe(tokens, token_types)
        else:
            hf = _byte_level_from_gguf(gguf, tokens, token_types)

        def special_id(key: str) -> int | None:
            value = gguf.get(f"tokenizer.ggml.{key}_token_id")
            if value is None:
                return None
            if not isinstance(value, int) or not 0 <= value < len(tokens):
                raise GGUFError(f"{gguf.path}: tokenizer.ggml.{key}_token_id={value!r} is out of range")
            return value

        special = {k: special_id(k) for k in ("bos", "eos", "eot", "padding")}
        template = gguf.get("tokenizer.chat_template")
        add_bos = gguf.get("tokenizer.ggml.add_bos_token") is True
        family = FAMILY_TEMPLATES.get(gguf.get("general.architecture"))
        byte_level = not sentencepiece
        if isinstance(template, str) or family is None:
            template = template if isinstance(template, str) else None
            return cls(hf, len(tokens), special, template, add_bos, byte_level=byte_level)
        # No template in the file: its family's turn format, whose end-of-turn token stops generation.
        turn_ends = tuple(i for t in family.stop_tokens if (i := hf.token_to_id(t)) is not None)
        return cls(hf, len(tokens), special, family.source, add_bos, extra_stop_ids=turn_ends, byte_level=byte_level)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in the text map to their ids; no BOS added."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a string, got {type(text).__name__}")
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` as `encode_chat` encodes a message's content: added-token strings
        are plain characters; no BOS added."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a string, got {type(text).__name__}")
        return self._encode_literal(text).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt: `encode`, with BOS in front where the model's file asks for
        one (`tokenizer.ggml.add_bos_token`, as Gemma's does) and the text does not already
        start with it (a chat template that writes it)."""
        ids = self.encode(text)
        if self.add_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_prompt_offsets(self, text: str, literal: Sequence[tuple[int, int]] = ()) -> tuple[list[int], list[int]]:
        """`encode_prompt`'s ids, and where in `text` each token starts (0 for an added BOS).
        Within the `literal` character ranges (in order, not overlapping) added-token strings
        are encoded as plain characters; the text is encoded piece by piece at their edges."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a string, got {type(text).__name__}")
        ids, starts, pos = [], [], 0
        for start, stop in [*literal, (len(text), len(text))]:
            for piece, begin, plain in ((text[pos:start], pos, False), (text[start:stop], start, True)):
                if piece:
                    enc = self._encode_literal(piece) if plain else self.hf.encode(piece, add_special_tokens=False)
                    ids += enc.ids
                    starts += [begin + a for a, _ in enc.offsets]
            pos = stop
        if self.add_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
            starts.insert(0, 0)
        return ids, starts

    def encode_chat(
        self, messages: Sequence[dict], add_generation_prompt: bool = True
    ) -> tuple[list[int], list[int], str]:
        """(ids, each token's start in the text, the text) of a conversation rendered with the
        chat template and encoded as a prompt, where the template's own control tokens are
        control tokens but the messages' contents are text: a user message that writes
        `<|im_end|>` gets the tokens of those characters, never the control token, so it cannot
        close its turn and open another role's. Conversations whose contents hold no
        control-token text encode exactly as `encode_prompt_offsets` of the text.

        Raises:
            ChatTemplateError: as `apply_chat_template`, or a content that holds control-token
                text is not written verbatim by the template (it could not be encoded safely).
        """
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        controls = self._control_strings()
        literal, pos = [], 0
        for i, m in enumerate(messages):
            content = m["content"]
            if not any(c in content for c in controls):
                continue
            found = text.find(content, pos)
            if found < 0:
                found, content = text.find(content.strip(), pos), content.strip()
            if found < 0:
                raise ChatTemplateError(f"message {i} holds control-token text the template does not write verbatim")
            literal.append((found, found + len(content)))
            pos = found + len(content)
        ids, starts = self.encode_prompt_offsets(text, literal=literal)
        return ids, starts, text

    def _control_strings(self) -> tuple[str, ...]:
        """The text of every control (special) token, which encoding would otherwise turn into
        that token. User-defined added tokens (Gemma's runs of newlines) are text already."""
        if self._controls is None:
            tokens = self.hf.get_added_tokens_decoder().values()
            self._controls = tuple(t.content for t in tokens if t.special and t.content)
        return self._controls

    def _encode_literal(self, text: str):
        """`text` encoded with added-token strings as plain characters."""
        if self._literal_hf is None:
            literal = HFTokenizer.from_str(self.hf.to_str())
            literal.encode_special_tokens = True
            self._literal_hf = literal
        return self._literal_hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry for one id (byte-level spelling)."""
        return self.hf.id_to_token(int(token_id))

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special (control) tokens, which `decode` leaves out by default."""
        return frozenset(i for i, t in self.hf.get_added_tokens_decoder().items() if t.special)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for: part of a character where a character takes
        several tokens (which `decode([token_id])` shows as U+FFFD). A special token's bytes
        are its text."""
        spelled = self.hf.id_to_token(int(token_id)) or ""
        if self.byte_level:
            inverse = _byte_values()
            if all(c in inverse for c in spelled):
                return bytes(inverse[c] for c in spelled)
            return spelled.encode()
        if len(spelled) == 6 and spelled.startswith("<0x") and spelled.endswith(">"):  # SentencePiece's byte fallback
            try:
                return bytes([int(spelled[3:5], 16)])
            except ValueError:
                pass
        return spelled.replace(SPACE_MARK, " ").encode()

    def set_chat_template(self, source: str) -> None:
        """Replaces the GGUF's chat template (jinja2 source, rendered in the same sandbox).

        Raises:
            ChatTemplateError: the source does not compile.
        """
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("a chat template must be non-empty jinja2 source")
        try:
            template = _sandbox().from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from None
        self.chat_template, self._template = source, template

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """Renders a conversation with the model's template.

        Raises:
            ChatTemplateError: no template, malformed messages, or the template raised.
        """
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; use plain generation")
        if isinstance(messages, dict | str) or not isinstance(messages, Sequence) or len(messages) == 0:
            raise ChatTemplateError("a conversation must be a non-empty list of {'role', 'content'} messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
                raise ChatTemplateError(f"message {i} must be a dict with 'role' and 'content', got {m!r}"[:200])
            role, content = m.get("role"), m.get("content")
            if role not in CHAT_ROLES:
                raise ChatTemplateError(f"message {i} has role {role!r}; allowed roles: {', '.join(CHAT_ROLES)}")
            if not isinstance(content, str):
                raise ChatTemplateError(f"message {i} content must be a string, got {type(content).__name__}")
            clean.append(dict(m))
        if self._template is None:
            self._template = _sandbox().from_string(self.chat_template)
        special = {
            "bos_token": self._text_of(self.bos_token_id),
            "eos_token": self._text_of(self.eos_token_id),
        }
        try:
            return self._template.render(messages=clean, add_generation_prompt=add_generation_prompt, **special)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None

    def _text_of(self, token_id: int | None) -> str:
        return "" if token_id is None else self.hf.id_to_token(token_id)


def _byte_level_from_gguf(gguf: GGUFFile, tokens: list[str], token_types) -> HFTokenizer:
    """The byte-level BPE tokenizer of a `gpt2` GGUF vocabulary and its stored merges."""
    merges = gguf.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise GGUFError(f"{gguf.path}: tokenizer.ggml.merges is missing")
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    # Byte-level vocabularies spell every token in the byte alphabet; respell any that are not.
    vocab = {}
    for i, tok in enumerate(tokens):
        spelled = tok if set(tok) <= letters else "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab.setdefault(spelled, i)
    pairs = []
    for i, m in enumerate(merges):
        parts = m.split(" ") if isinstance(m, str) else []
        if len(parts) != 2:
            raise GGUFError(f"{gguf.path}: malformed merge {m!r}")
        # tokenizers panics (a BaseException) on a merge whose parts or result it cannot look up.
        missing = [t for t in (*parts, "".join(parts)) if t not in vocab]
        if missing:
            raise GGUFError(f"{gguf.path}: merge #{i} {m!r} needs {missing[0]!r}, which is not in the vocabulary")
        pairs.append((parts[0], parts[1]))
    control = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind_id in zip(tokens, token_types, strict=True)
        if kind_id == TOKEN_TYPE_CONTROL and set(tok) <= letters
    ]
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind_id in zip(tokens, token_types, strict=True)
        if kind_id == TOKEN_TYPE_USER_DEFINED and tok in vocab
    ]
    split = PRE_TOKENIZER_SPLITS.get(gguf.get("tokenizer.ggml.pre"))
    try:
        hf = _byte_level_bpe(vocab, pairs, split, control, user)
    except BaseException as e:
        # A Rust panic inside tokenizers arrives as pyo3's PanicException, a BaseException.
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise
        raise GGUFError(f"{gguf.path}: cannot build the tokenizer ({type(e).__name__}: {e})") from None
    return hf


def _sentencepiece_bpe(tokens: list[str], token_types) -> HFTokenizer:
    """Gemma's tokenizer from a GGUF vocabulary: BPE over text with spaces written as U+2581,
    byte fallback for characters outside the vocabulary, and no prefix space.

    The file lists no merges, so they are rebuilt from the vocabulary: every token that splits
    into two tokens gives a merge, ranked by where the token stands in the file (earlier
    first; Gemma's scores do not follow its merge order), and within one token by the longer
    left part first. Runs of spaces are stored as real spaces and are respelled as runs of
    U+2581 so the merges reach them. This matches the tokenizer transformers builds from the
    same file (tests/models/test_gemma3.py).
    """
    spelled = [SPACE_MARK * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(spelled)}  # a repeated spelling keeps its last id
    ranked = []
    for tok, rank in vocab.items():
        for cut in range(len(tok) - 1, 0, -1):  # longer left part first
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                ranked.append((rank, left, right))
    ranked.sort(key=lambda m: m[0])  # stable: keeps the longer-left-first order within a token
    hf = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for _, left, right in ranked],
            unk_token="<unk>" if "<unk>" in vocab else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    hf.normalizer = normalizers.Replace(" ", SPACE_MARK)
    hf.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()])
    kinds = [int(k) for k in token_types]
    hf.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, kinds, strict=True)
            if k == TOKEN_TYPE_CONTROL
        ]
    )
    # Whitespace runs respelled above are no longer in the vocabulary under their stored
    # spelling and stay ordinary BPE tokens.
    hf.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, kinds, strict=True)
            if k == TOKEN_TYPE_USER_DEFINED and t in vocab
        ]
    )
    return hf


def _byte_level_bpe(
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    split: str | None,
    control: list[AddedToken],
    user: list[AddedToken],
) -> HFTokenizer:
    """An HF byte-level BPE tokenizer; `split` is the pre-tokenizer regex (None: GPT-2's own)."""
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if split is None:
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    else:
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(control)
    hf.add_tokens(user)
    return hf


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _sandbox() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """A jinja2 environment that cannot reach Python internals or mutate its inputs."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], autoescape=False
    )
    env.globals["raise_exception"] = _raise_exception
    return env
