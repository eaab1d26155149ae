"""The eviction advisor under the engine (the real tokenizer and chat template, the model's
first two blocks): chat pages carry their message's role, the advisor changes which pages stay
but never what is generated, and a persona's system pages survive pressure that LRU evicts."""

from __future__ import annotations

import numpy as np
import pytest

import aither_jax as aj
from aither_jax.core.engine import MASS_EVERY
from tests.conftest import F32, TINY

MODEL = "smollm2-135m"
SETTINGS = {k: v for k, v in F32.items() if k != "num_pages"} | dict(
    max_model_len=128, max_num_seqs=1, page_size=16, enable_prefix_caching=True, max_pinned_fraction=0.25, **TINY
)
GREEDY = aj.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PERSONA = "You are Aither, a research assistant for the sea. Your name is Aither; say so when asked. " * 2


def chats(n: int) -> list[list[dict]]:
    rng = np.random.default_rng(0)
    words = ["tide", "moon", "salt", "wave", "reef", "kelp", "gull", "foam", "shell", "drift"]
    return [
        [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": " ".join(rng.choice(words, 30)) + f" ({i})"},
        ]
        for i in range(n)
    ]


def persona_run(llm: aj.LLM) -> tuple[list[list[int]], int]:
    """A persona's chat, twelve other chats, the persona again: (every answer, prompt tokens
    the persona's second chat found cached)."""
    persona = [{"role": "system", "content": PERSONA}, {"role": "user", "content": "Who are you?"}]
    answers = [llm.chat([persona], GREEDY)[0].token_ids]
    answers += [o.token_ids for o in llm.chat(chats(12), GREEDY)]
    again = llm.chat([[persona[0], {"role": "user", "content": "And what do you do?"}]], GREEDY)[0]
    return [*answers, again.token_ids], again.num_cached_tokens


@pytest.fixture(scope="module")
def runs():
    out = {}
    for policy in ("lru", "advisor"):
        llm = aj.LLM(MODEL, num_pages=24, eviction_policy=policy, **SETTINGS)
        out[policy] = (*persona_run(llm), llm)
    return out


def test_the_persona_stays_cached_under_the_advisor_and_answers_stay_the_same(runs):
    lru_answers, lru_cached, _ = runs["lru"]
    advisor_answers, advisor_cached, llm = runs["advisor"]
    assert advisor_answers == lru_answers  # the advisor changes what is kept, never what is generated
    persona_tokens = len(llm.tokenizer.encode(f"<|im_start|>system\n{PERSONA}<|im_end|>\n"))
    assert lru_cached < 16  # LRU evicted the persona's pages: recomputed
    assert advisor_cached >= persona_tokens // 16 * 16
    policy = llm.engine.scheduler.policy
    assert policy.evicted_by_tag["system"] == 0 and policy.evicted_by_tag["user"] > 0


def test_chat_pages_carry_their_message_role(runs):
    llm = runs["advisor"][2]
    cache = llm.engine.scheduler.prefix_cache
    tags = {b.source_tag for b in cache.cached_blocks()}
    assert {"system", "user"} <= tags
    system = [b for b in cache.cached_blocks() if b.source_tag == "system"]
    assert all(b.importance == 1.0 and b.tenant is not None for b in system)


def test_an_advisor_without_prefix_caching_is_refused():
    with pytest.raises(ValueError, match="needs prefix caching"):
        aj.LLM(MODEL, **{**SETTINGS, "enable_prefix_caching": False}, eviction_policy="advisor")


def mass_by_name(llm: aj.LLM) -> dict[bytes, float]:
    return {b.name: b.attention_mass for b in llm.engine.scheduler.prefix_cache.cached_blocks() if b.name is not None}


@pytest.mark.parametrize("kv", ["fp32", "tq4"])
def test_attention_mass_is_the_same_whichever_path_attention_takes(kv):
    """Pages' attention mass (the advisor's signal) with the rotated-domain path against the
    reference path that decodes every page: the same up to the paths' rounding."""
    params = aj.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    masses = {}
    for attention in ("reference", "xla"):
        llm = aj.LLM(
            MODEL, num_pages=40, eviction_policy="advisor", attention=attention, **{**SETTINGS, "kv_cache_dtype": kv}
        )
        llm.chat(chats(2), params)
        masses[attention] = mass_by_name(llm)
    assert masses["reference"].keys() == masses["xla"].keys() and len(masses["xla"]) >= 5
    ref, xla = (np.array([m[n] for n in sorted(masses["xla"])]) for m in (masses["reference"], masses["xla"]))
    assert ref.max() > 0.01  # attended pages carry mass
    np.testing.assert_allclose(xla, ref, rtol=2e-2, atol=1e-4)


def test_heavily_co_attended_pages_are_linked_and_named_pages_summarized():
    """Also: attention mass is folded for the prefill and one decode call in `MASS_EVERY`."""
    llm = aj.LLM(MODEL, num_pages=40, eviction_policy="advisor", **SETTINGS)
    params = aj.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    policy = llm.engine.scheduler.policy
    folds, fold = [], policy.attended
    policy.attended = lambda rows: (folds.append(len(rows)), fold(rows))
    llm.chat(chats(1), params)
    assert llm.engine.num_mass_calls == 47 and len(folds) == 1 + 47 // MASS_EVERY  # 48 tokens: 1 prefill
    from aither_jax.eviction.graph import EdgeType

    assert policy.graph.num_edges(EdgeType.CO_ATTEND) > 0
    blocks = llm.engine.scheduler.prefix_cache.cached_blocks()
    named = {b.name for b in blocks if b.name is not None}
    assert named and named <= set(policy.graph._summaries)  # every named page's mean key, for SEMANTIC edges
    assert all(0 <= b.attention_mass <= 1 for b in blocks) and any(b.attended_at > 0 for b in blocks)
