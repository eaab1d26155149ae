"""The context pipeline through the engine: every KV page learns the tag and importance of the
section whose tokens fill it, and the stable prefix is pinned once seen, its old pin released
when it changes."""

from __future__ import annotations

import aither_jax as aj
from aither_jax.context.sections import Section
from tests.conftest import TINY

SETTINGS = dict(
    dtype="float32", kv_cache_dtype="fp32", max_model_len=512, max_num_seqs=2, num_pages=64, page_size=16,
    max_prefill_chunk=64, progress=False, enable_prefix_caching=True, **TINY,
)  # fmt: skip
GREEDY = aj.SamplingParams(max_tokens=2, temperature=0.0)
IDENTITY = "Your name is Aither and you study the sea. " * 6


def sections(question: str, identity: str = IDENTITY) -> list[Section]:
    return [
        Section("identity", identity, importance=1.0, stable=True),
        Section("knowledge", "Tides follow the moon. " * 8, importance=0.4),
        Section("question", question, importance=0.7, role="user"),
    ]


def test_pages_carry_their_sections_tags_and_the_stable_prefix_is_pinned_once_seen():
    llm = aj.LLM("smollm2-135m", **SETTINGS)
    cache = llm.engine.scheduler.prefix_cache
    ctx = llm.context()
    first = ctx.assemble(sections("When is high tide?"))
    llm.generate(first, GREEDY)
    spans = {s.tag: s for s in first.sections}
    blocks = [b for b in cache.blocks.blocks if b.name is not None]
    assert blocks and all(b.source_tag is not None for b in blocks)
    by_tag = {}
    for b in blocks:
        by_tag.setdefault(b.source_tag, []).append(b)
    # Full pages of the prompt: the identity section's pages, then knowledge, then the question;
    # a page shared by two sections takes the less important one's tag (as evictable as that part).
    assert len(by_tag["identity"]) == spans["identity"].stop // 16 and spans["identity"].stop % 16
    assert {b.importance for b in by_tag["identity"]} == {1.0}
    assert all(b.importance == 0.4 for b in by_tag.get("knowledge", []))
    assert cache.num_pinned == 0  # seen once: not pinned yet
    assert first.report.stable_cached_tokens == 0 and first.report.prefill_tokens == len(first.ids)

    second = ctx.assemble(sections("And low tide?"))
    # What the engine holds of the stable prefix is credited: its whole pages, not its last partial one.
    whole = spans["identity"].stop // 16 * 16
    assert second.report.stable_cached_tokens == whole == llm.engine.cached_prefix_tokens(second.ids[:whole])
    assert second.report.prefill_tokens == len(second.ids) - whole
    llm.generate(second, GREEDY)
    assert second.num_pinned == spans["identity"].stop and cache.num_pinned == spans["identity"].stop // 16
    llm.generate(ctx.assemble(sections("And tomorrow?")), GREEDY)  # asks again: the pin is taken once
    assert {b.pins for b in cache.blocks.blocks if b.pins} == {1}

    changed = ctx.assemble(sections("And now?", IDENTITY + "You speak French."), pinned=True)
    llm.generate(changed, GREEDY)
    assert cache.num_pinned == changed.num_pinned // 16  # the old prefix's pin was released
    del ctx, second, changed  # a context dropped gives its pin back before the next requests
    llm.generate(["Hello"], GREEDY)
    assert cache.num_pinned == 0
    # A context dropped while its prompt still runs: the prompt keeps the pin's owner alive.
    prompt = llm.context().assemble(sections("And the day after?"), pinned=True)
    llm.generate(prompt, GREEDY)
    assert cache.num_pinned == prompt.num_pinned // 16 > 0
    del prompt
    llm.generate(["Hello"], GREEDY)
    assert cache.num_pinned == 0


def test_the_automatic_pin_stays_within_the_pools_cap():
    llm = aj.LLM("smollm2-135m", **{**SETTINGS, "num_pages": 21}, max_pinned_fraction=0.1)  # 2 pinnable pages
    cache = llm.engine.scheduler.prefix_cache
    ctx = llm.context()
    for question in ("When is high tide?", "And low tide?", "And tomorrow?"):
        prompt = ctx.assemble(sections(question))
        llm.generate(prompt, GREEDY)
    assert prompt.num_pinned > 2 * 16 and cache.num_pinned == cache.max_pinned_pages == 2
