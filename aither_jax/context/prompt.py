"""Prompt assembly: a conversation or a completion prompt -> token ids and the span to pin.

Every path from a request to engine input goes through here: the server's routes,
`LLM.generate` / `LLM.chat`, evaluation and draft training. A conversation is rendered with
the model's chat template (generation prompt appended) and encoded with
`Tokenizer.encode_prompt` (BOS in front where the model's file asks for one); a completion's
text is encoded the same way and its token ids are taken as given. The pin span is how many
leading tokens the prefix cache keeps pinned once computed: for a conversation, its leading
system messages; for a completion, all of it or a given count. A conversation's prompt also
carries each message's token span, tagged with its role and the role's importance
(`ROLE_IMPORTANCE`), for the KV pages' block records.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import secrets
from collections.abc import Sequence

import numpy as np

from models.tokenizer import Tokenizer

# The importance (0-1) of a KV page filled by a message of each role, where no tagged section
# says otherwise: system messages (a model's identity and rules) are the last to give up (1.0:
# protected from eviction); a conversation's turns weigh the same whoever wrote them, so that
# among them recency, sharing and hits decide (a follow-up turn needs all of its history).
ROLE_IMPORTANCE = {"system": 1.0, "user": 0.5, "tool": 0.5, "assistant": 0.5}

# Stands in for a user message's content, to find where the template starts writing it.
_CONTENT_MARK = "\x00request\x00"


@dataclasses.dataclass(frozen=True)
class SectionSpan:
    """The tokens [start, stop) of a prompt that one tagged section fills (context/sections.py)."""

    tag: str
    importance: float
    start: int
    stop: int


class PinOwner:
    """The owner of a replaceable pin (one per `Context`): the engine keeps one pin per owner's
    `key`. Whoever gives the pin back does so when the owner is garbage collected
    (`weakref.finalize`): the context and every prompt it made are gone by then."""

    __slots__ = ("key", "__weakref__")

    def __init__(self):
        self.key = secrets.token_bytes(16)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """Token ids for the engine, and how many of the leading ones to pin.

    Attributes:
        ids: the prompt's token ids [num_tokens].
        num_pinned: leading tokens whose cached pages stay pinned (0: none; at most len(ids)).
        text: the text the ids encode (a rendered conversation), or None for ids given as ids.
        sections: the tagged sections' token spans, for the KV pages' block records.
        pin_owner: the owner of the pin (a `Context`'s `PinOwner`): a pin under its key
            replaces the owner's earlier one when it is taken, and is taken once however many
            prompts ask for it. The prompt holds the owner, so the owner outlives its prompts.
        report: what the context pipeline kept and cut (a `ContextReport`), or None.
    """

    ids: list[int]
    num_pinned: int = 0
    text: str | None = None
    sections: tuple[SectionSpan, ...] = ()
    pin_owner: PinOwner | None = None
    report: object | None = None

    @property
    def pin_key(self) -> bytes | None:
        return None if self.pin_owner is None else self.pin_owner.key

    @property
    def pinned_ids(self) -> list[int]:
        """The pinned span: what `/v1/unpin` names to release the pin."""
        return self.ids[: self.num_pinned]


def chat_prompt(tokenizer: Tokenizer, messages: Sequence[dict], *, pin_system: bool = False) -> Prompt:
    """A conversation rendered with the model's chat template, ready for the assistant's turn.

    Args:
        tokenizer: the model's tokenizer and chat template.
        messages: [{"role", "content"}, ...], roles among `models.tokenizer.CHAT_ROLES`.
        pin_system: pin the tokens of the leading system messages: those the template writes
            for them alone, when the whole conversation starts with exactly those tokens.
            Nothing is pinned without leading system messages, or when the template writes
            them differently alone (a pin must name pages that later requests share).

    Raises:
        ChatTemplateError: (a ValueError) the model has no chat template, the messages are
            malformed, or the template raised.
    """
    ids, starts, text = tokenizer.encode_chat(messages, add_generation_prompt=True)
    num_pinned = len(_system_head(tokenizer, messages, ids)) if pin_system else 0
    return Prompt(ids, num_pinned, text, sections=role_spans(tokenizer, messages, text, starts))


def role_spans(
    tokenizer: Tokenizer, messages: Sequence[dict], text: str, starts: Sequence[int]
) -> tuple[SectionSpan, ...]:
    """Each message's tokens in the rendered conversation `text` (whose tokens start at the
    character offsets `starts`), tagged with its role: a token belongs to the message whose
    rendering it starts in. None when the template does not render messages one after another
    (each conversation's rendering a prefix of the next one's)."""
    ends = []
    for k in range(1, len(messages) + 1):
        head = tokenizer.apply_chat_template(messages[:k], add_generation_prompt=False)
        if not text.startswith(head):
            return ()
        ends.append(len(head))
    spans, start = [], 0
    for message, end in zip(messages, ends, strict=True):
        stop = bisect.bisect_left(starts, end)
        if stop > start:
            role = message["role"]
            spans.append(SectionSpan(role, ROLE_IMPORTANCE.get(role, 0.5), start, stop))
        start = stop
    return tuple(spans)


def text_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int], *, pin: bool | int = False) -> Prompt:
    """A completion prompt: text encoded with `Tokenizer.encode_prompt`, or token ids as given.

    Token ids are not checked against the vocabulary, and an empty prompt is returned as is:
    the engine refuses both with its own errors.

    Args:
        tokenizer: the model's tokenizer.
        prompt: text, or a sequence of token ids (Python or NumPy integers).
        pin: True pins the whole prompt, False nothing, an int that many leading tokens (at
            most the whole prompt).

    Raises:
        ValueError: the prompt is neither text nor a sequence of integers, or `pin` is neither
            a bool nor a count >= 0.
    """
    if isinstance(prompt, str):
        text, ids = prompt, tokenizer.encode_prompt(prompt)
    elif isinstance(prompt, Sequence) and all(isinstance(t, int | np.integer) for t in prompt):
        text, ids = None, [int(t) for t in prompt]
    else:
        raise ValueError("a prompt must be a string or a list of token ids")
    if isinstance(pin, bool):
        num_pinned = len(ids) if pin else 0
    elif isinstance(pin, int | np.integer) and pin >= 0:
        num_pinned = min(int(pin), len(ids))
    else:
        raise ValueError(f"pin must be True, False or a token count >= 0, got {pin!r}")
    return Prompt(ids, num_pinned, text)


def user_turn_prefix(tokenizer: Tokenizer) -> list[int] | None:
    """The ids the chat template writes before the content of a lone user message: sampling
    from there makes an instruction-tuned model write a user's request. None when the template
    does not write the content as given, so there is no place to cut.

    Raises:
        ChatTemplateError: the model has no chat template, or it raised.
    """
    text = tokenizer.apply_chat_template([{"role": "user", "content": _CONTENT_MARK}], add_generation_prompt=False)
    if text.count(_CONTENT_MARK) != 1:
        return None
    return tokenizer.encode_prompt(text[: text.index(_CONTENT_MARK)])


def _system_head(tokenizer: Tokenizer, messages: Sequence[dict], ids: list[int]) -> list[int]:
    """The tokens of the leading system messages, as they start `ids` (the whole rendered
    conversation); none when there are none or the template writes them differently alone."""
    num_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if not num_system:
        return []
    head = tokenizer.encode_chat(messages[:num_system], add_generation_prompt=False)[0]
    return head if ids[: len(head)] == head else []


def read_prompts(path: str) -> list[tuple[str, object]]:
    """("messages", conversation) or ("prompt", text) per line of a JSON-lines file."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from e
            if isinstance(item, dict) and isinstance(item.get("messages"), list) and item["messages"]:
                if not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in item["messages"]
                ):
                    raise ValueError(f'{path}:{n}: each message needs a "role" and a "content"')
                out.append(("messages", item["messages"]))
            elif isinstance(item, dict) and isinstance(item.get("prompt"), str) and item["prompt"]:
                out.append(("prompt", item["prompt"]))
            else:
                raise ValueError(f'{path}:{n}: expected {{"messages": [...]}} or {{"prompt": "..."}}')
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def file_prompts(tokenizer: Tokenizer, items: list[tuple[str, object]]) -> list[Prompt]:
    """The prompts of read_prompts() items (conversations through the chat template)."""
    return [
        chat_prompt(tokenizer, value) if kind == "messages" else text_prompt(tokenizer, value) for kind, value in items
    ]
