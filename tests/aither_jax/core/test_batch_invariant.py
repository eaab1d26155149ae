"""`batch_invariant=True`: a request's tokens and their log probabilities are the same bits
whatever shares its batch, however its prompt was chunked, and with or without speculation,
for every KV format (models/llama_invariant.py). On the two-block stand-in: the point is the
engine's arithmetic, and exact equality of log probabilities shows a difference in the last
bit that greedy tokens of a random-weight model would rarely show."""

from __future__ import annotations

import pytest

import aither_jax as aj
from aither_jax.core import speculate
from tests.conftest import MODEL, TINY

PROMPTS = [
    "Hi",
    "Write a short poem about the sea and the wind that moves across it at night.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,",
    "Here is a list of facts about the planets of the solar system. " * 4 + "The largest planet is",
    "Q: What is 7 times 8?\nA:",
]
GREEDY = aj.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# bf16 pages; TurboQuant codes, whose boundaries turn a last-bit difference into another
# code, with sink tokens kept in bf16 beside them.
FORMATS = ["bf16", "tq-k6v5-s2"]


def invariant_llm(kv: str, **overrides) -> aj.LLM:
    settings = dict(
        dtype="float32", kv_cache_dtype=kv, max_model_len=160, max_num_seqs=8, num_pages=64, max_prefill_chunk=32,
        progress=False, _cache_fill_value=float("nan"), batch_invariant=True,
    )  # fmt: skip
    return aj.LLM(MODEL, **{**settings, **overrides}, **TINY)


def run(llm: aj.LLM, prompts: list[str]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their log probabilities, all requests in at once."""
    engine = llm.engine
    seqs = [engine.add_request(llm.tokenizer.encode(p), GREEDY, num_logprobs=0) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [(s.output_ids, [lp[0] for lp in s.logprobs]) for s in seqs]


@pytest.fixture(scope="module")
def alone():
    """format -> (an engine, each prompt's result run alone on it)."""
    engines = {}

    def get(kv: str):
        if kv not in engines:
            llm = invariant_llm(kv)
            engines[kv] = llm, [run(llm, [p])[0] for p in PROMPTS]
        return engines[kv]

    return get


@pytest.mark.parametrize("kv", FORMATS)
def test_together_alone_and_chunked_differently_are_the_same_bits(kv, alone):
    llm, each = alone(kv)
    assert run(llm, PROMPTS) == each
    other_chunks = invariant_llm(kv, max_prefill_chunk=16, max_num_seqs=4)  # and a queue: 5 requests, 4 slots
    assert run(other_chunks, PROMPTS) == each


def test_speculative_greedy_is_plain_greedy_to_the_bit(alone, monkeypatch):
    """Verify passes score a chunk of drafts where plain decoding scores one token at a time;
    both write the same codes and give the same tokens and log probabilities. A random-weight
    stand-in's output repeats nothing for prompt lookup to find, so the drafts come from an
    oracle that knows the plain output: all of it right, or every third draft wrong."""
    plain_llm, plain = alone("tq-k6v5-s2")
    prompts = [tuple(plain_llm.tokenizer.encode(p)) for p in PROMPTS]
    known = [(prompt, out) for prompt, (out, _) in zip(prompts, plain, strict=True)]
    wrong = False

    def oracle(tokens, k, **_):
        for prompt, out in known:
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                drafts = list(out[done : done + k])
                return [t if (done + i) % 3 or not wrong else t + 1 for i, t in enumerate(drafts)]
        raise AssertionError("a request the oracle does not know")

    monkeypatch.setattr(speculate, "ngram_propose", oracle)
    llm = invariant_llm("tq-k6v5-s2", speculative={"method": "ngram", "num_speculative_tokens": 4})
    counters = llm.engine.speculator.counters
    for wrong in (False, True):
        drafted, accepted = counters.num_draft_tokens, counters.num_accepted_tokens
        assert run(llm, PROMPTS) == plain
        drafted, accepted = counters.num_draft_tokens - drafted, counters.num_accepted_tokens - accepted
        assert accepted > 0 and (accepted < drafted) == wrong


def test_batch_invariant_runs_its_own_attention():
    with pytest.raises(ValueError, match="batch_invariant runs its own attention"):
        aj.LLM(MODEL, batch_invariant=True, attention="pallas", progress=False)
