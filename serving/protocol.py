"""OpenAI request bodies (validated with pydantic) and the response objects built from results.

Every count a client controls is bounded here (n, max_tokens, logprobs, stop strings, prompt
list sizes); parameters we do not implement are refused with a 400 that names them rather
than silently ignored, unless they are set to their no-op default.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from aither_jax.device.sampling import MAX_LOGPROBS, MAX_STOP_STRING_LEN, MAX_STOP_STRINGS

MAX_N = 8
MAX_CHOICES = 16  # prompts x n in one request
MAX_MESSAGES = 512
MAX_PROMPT_TOKEN_LIST = 1 << 17

Number = StrictInt | StrictFloat
StopStr = Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_STRING_LEN)]
TokenId = Annotated[StrictInt, Field(ge=0, lt=2**31)]


def _no_lone_surrogates(value, where: str = "body"):
    """Raises ValueError naming the first string in a parsed JSON body that holds a lone
    UTF-16 surrogate (valid JSON escapes such as "\\ud800", but no character: it cannot be
    encoded as UTF-8, so no tokenizer can read it)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where} holds a lone UTF-16 surrogate, which is not a character") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_lone_surrogates(k, where)
            _no_lone_surrogates(v, f"{where}.{k}" if where != "body" else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_lone_surrogates(v, f"{where}.{i}")
    return value


class _Text(BaseModel):
    """A request body whose strings must all be text (no lone surrogates)."""

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        return _no_lone_surrogates(data)


class _Nullable(BaseModel):
    """A body whose explicit nulls take the fields' defaults, as OpenAI's nullable fields do
    (clients send every field, the unset ones as null)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].default is None}


class StreamOptions(_Nullable):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Sampling(_Text, _Nullable):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, lt=2**31)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=100)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, lt=2**31)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StopStr | Annotated[list[StopStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=2**32)] | None = None
    ignore_eos: StrictBool = False
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict | None = None
    best_of: StrictInt | None = None
    user: Annotated[StrictStr, Field(max_length=256)] | None = None
    # With `model: "auto"`: how much reasoning the request needs (OpenAI's values); it picks
    # the model instead of the effort scorer.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise ValueError(f"{name} is not supported (only {neutral})")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it may only equal n)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


COMPLETION_MAX_TOKENS = 16  # the Completions API's default (OpenAI's, vLLM's)


class CompletionRequest(_Sampling):
    max_tokens: Annotated[StrictInt, Field(ge=1, lt=2**31)] = COMPLETION_MAX_TOKENS
    prompt: (
        StrictStr
        | Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_LIST)]
        | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_CHOICES)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_LIST)]],
            Field(min_length=1, max_length=MAX_CHOICES),
        ]
    )
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    # Extension: pin the cached pages of the prompt (true: all of it; an integer: that many
    # leading tokens) so pressure never evicts them.
    pin_prefix: StrictBool | Annotated[StrictInt, Field(ge=0)] = False

    @model_validator(mode="after")
    def _completion_only(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class CacheControl(BaseModel):
    """Anthropic's prompt-caching breakpoint: what precedes it, inclusive, is the stable prefix."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["ephemeral"]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Null only for an assistant turn (one that made tool calls, in OpenAI's API): no text.
    content: StrictStr | Annotated[list[TextPart], Field(max_length=64)] | None
    name: Annotated[StrictStr, Field(max_length=64)] | None = None
    # Extensions (context pipeline, aither_jax/context/sections.py): the section this message
    # belongs to ({"tag", "importance", "stable", "truncate", "min_tokens", "max_tokens",
    # "step"}; consecutive messages with one tag form one section), and a cache breakpoint.
    section: dict | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: only an assistant message may have null content, not a {self.role} message")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    @property
    def breakpoint(self) -> bool:
        parts = self.content if isinstance(self.content, list) else []
        return self.cache_control is not None or any(p.cache_control is not None for p in parts)


class ContextOptions(_Nullable):
    """Extension: budgets for a sectioned prompt, and whether to report what was kept."""

    model_config = ConfigDict(extra="forbid")
    budget: Annotated[StrictInt, Field(ge=1)] | None = None
    prefill_budget: Annotated[StrictInt, Field(ge=1)] | None = None
    report: StrictBool = False


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, lt=2**31)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list | None = None
    tool_choice: StrictStr | dict | None = None
    response_format: dict | None = None
    # Extension: pin the cached pages of the leading system messages.
    pin_prefix: StrictBool = False
    # OpenAI's cache key: requests sharing it (and the tenant) share the context pipeline's
    # record of stable prefixes seen.
    prompt_cache_key: Annotated[StrictStr, Field(max_length=256)] | None = None
    context: ContextOptions | None = None

    @property
    def sectioned(self) -> bool:
        """Whether the prompt goes through the context pipeline."""
        return self.context is not None or any(m.section is not None or m.breakpoint for m in self.messages)

    @model_validator(mode="after")
    def _chat_only(self):
        if self.tools:
            raise ValueError("tools are not supported")
        if self.tool_choice not in (None, "none"):
            raise ValueError("tool_choice is not supported (only none: tools are not)")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than text is not supported")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.pin_prefix and self.sectioned:
            raise ValueError("pin_prefix does not apply to a sectioned request: it pins its stable sections")
        return self

    def conversation(self) -> list[dict]:
        return template_messages(self.messages)


def template_messages(messages: list[Message]) -> list[dict]:
    """Messages for the chat template (developer messages count as system messages)."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


class UnpinRequest(_Text):
    """Body of `POST /v1/unpin` (our extension): the prefix a `pin_prefix` request pinned,
    given as that request gave it: `prompt` (a completion's; all its full pages) or `messages`
    (a chat's; the pages of its leading system messages)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_LIST)] | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None

    @model_validator(mode="after")
    def _one_prefix(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError"}
    kinds |= {405: "MethodNotAllowedError", 429: "RateLimitError", 500: "InternalServerError"}
    kinds |= {503: "ServiceUnavailableError"}
    return {"error": {"message": message, "type": kinds.get(status, "Error"), "param": param, "code": status}}


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, spec: list | None = None, context=None
) -> dict:
    """The usage block; with speculative decoding, `spec` holds the request's sequences and the
    block reports their drafts and acceptance; `context`, a context pipeline's report."""
    block = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if spec is not None:
        drafts = sum(s.num_spec_steps for s in spec)
        draft_tokens = sum(s.num_draft_tokens for s in spec)
        accepted = sum(s.num_accepted_tokens for s in spec)
        block["speculative_decoding"] = {
            "num_drafts": drafts,
            "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else 0.0,
            "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else 1.0,
        }
    if context is not None:
        block["context"] = dataclasses.asdict(context) | {"cascade": context.cascade}
    return block


def envelope(request_id: str, kind: str, model: str, choices: list[dict], usage_block: dict | None = None) -> dict:
    body = {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage_block is not None:
        body["usage"] = usage_block
    return body
