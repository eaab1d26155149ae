"""One request's state on the host."""

from __future__ import annotations

import dataclasses
import time

from aither_jax.device.sampling import SamplingParams


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's state on the host."""

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int  # params.max_tokens clipped to the context left
    stop_ids: frozenset[int]
    salt: bytes = b""  # root of the prefix-cache chain (the tenant)
    pin_tokens: int = 0  # pin the full pages of this many leading prompt tokens once computed
    pin_key: bytes | None = None  # the pin's owner: its pin replaces the owner's last one (Scheduler)
    sections: tuple = ()  # context/prompt.py SectionSpans: the tag and importance of prompt spans
    num_logprobs: int | None = None  # None: no logprobs; k: the sampled token's and the top k
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = dataclasses.field(default_factory=list)
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    names: list[bytes] = dataclasses.field(default_factory=list)  # chain of this sequence's full pages so far
    fork: bytes | None = None  # the last page reused from the prefix cache at admission
    num_cached: int = 0  # tokens whose KV is in the cache
    num_cached_prompt: int = 0  # prompt tokens found in the prefix cache at first admission
    num_computed: int = 0  # tokens run through the model (prefill and decode, recomputes too)
    num_preemptions: int = 0
    num_pinned_pages: int | None = None  # set once the pin_tokens prefix is computed and pinned
    num_spec_steps: int = 0  # speculative verify passes that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None
    # Bounded residency (core/bounded.py): which of the sequence's pages `pages` holds.
    resident: object | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens to run before the next one can be sampled (1 when decoding)."""
        return self.num_tokens - self.num_cached

    @property
    def prefilling(self) -> bool:
        return self.num_pending > 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def kv_offset(self) -> int:
        """Tokens of the pages bounded residency holds off the device, all before the pages
        the block table lists: the RoPE offset of its positions."""
        return 0 if self.resident is None else self.resident.offset

    def page_at(self, i: int) -> int | None:
        """The device page holding the sequence's page i (tokens [i P, (i + 1) P)), or None
        when it has none (not yet allocated, or held off the device by bounded residency)."""
        if self.resident is None:
            return self.pages[i] if i < len(self.pages) else None
        return self.resident.page_at(self, i)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Token ids [start, stop) of prompt + output."""
        n = len(self.prompt_ids)
        head = self.prompt_ids[start:stop] if start < n else []
        return head + self.output_ids[max(0, start - n) : max(0, stop - n)]
