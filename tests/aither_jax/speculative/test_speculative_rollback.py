"""Speculative decoding on the stand-in target (common.STAND_IN) with drafts steered to plain
decoding's output: after rejections in every row, each row's target keys/values and draft
context equal what plain decoding of its committed tokens gives (within the rounding of the
cache format: see test_speculative_engine.py's docstring)."""

import numpy as np
import pytest

import aither_jax as aj
from aither_jax.context.prompt import chat_prompt
from tests.aither_jax.speculative.common import CHAIN, stand_in_llm, steer_drafts

ROLLBACK_PROMPTS = [
    "Name five fruits and say what colour each one is.",
    "Count from 1 to 15, separated by commas.",
    "Write a Python function that reverses a string.",
]
# The largest error, relative to its norm, of any cached key/value vector (one layer, position
# and head) against plain decoding's. bf16 and TurboQuant caches round the keys the verify pass
# computes in a chunk differently from keys computed one at a time (module docstring); the
# difference compounds over the tokens (measured: 0.013 bf16, 0.16 TurboQuant). At every
# position some vector of the neighbouring position's keys and values is at least 0.5 off.
ROLLBACK_TOL = {"fp32": 1e-4, "bf16": 0.03, "turboquant": 0.3}


@pytest.mark.parametrize(
    ("spec", "kv", "num_rows"),
    [
        (CHAIN, "fp32", 1),
        ({"method": "dflash", "tree": 15}, "fp32", 1),
        (CHAIN, "bf16", 3),
        ({"method": "dflash", "tree": 15}, "bf16", 3),
        (CHAIN, "turboquant", 3),
    ],
    ids=["chain-fp32-1", "tree-fp32-1", "chain-bf16-3", "tree-bf16-3", "chain-turboquant-3"],
)
def test_rollback_leaves_the_caches_of_plain_decoding(
    stand_in_draft, stand_in_key_transform, monkeypatch, spec, kv, num_rows
):
    """Rows of different prompts decode side by side, so a row's rejected drafts could land in
    its own later positions or in another row's pages. After rejections in every row, each row's
    target keys/values and draft context are those plain decoding of its committed tokens gives,
    every vector within ROLLBACK_TOL[kv]."""
    convs = [[{"role": "user", "content": p}] for p in ROLLBACK_PROMPTS[:num_rows]]
    # One spare slot: `hidden_states` below scores in a slot of its own.
    plain = stand_in_llm(kv, num_rows + 1)
    prompts = [chat_prompt(plain.tokenizer, c).ids for c in convs]
    params = aj.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    refs = [plain.engine.add_request(ids, params) for ids in prompts]
    # A step commits at most 16 tokens, so the speculative run below stops by 61 tokens a row;
    # plain decoding stops at 62 of its 64, its caches still held.
    while min(len(r.output_ids) for r in refs) < 62:
        plain.engine.step()
    llm = stand_in_llm(kv, num_rows + 1, spec, draft=stand_in_draft)
    steer_drafts(llm.engine, {tuple(ids): r.output_ids for ids, r in zip(prompts, refs, strict=True)}, monkeypatch)
    seqs = [llm.engine.add_request(ids, params) for ids in prompts]

    def mixed(s):  # the row has had drafts both rejected and accepted
        return s.num_draft_tokens > s.num_accepted_tokens > 0

    def longest():
        return max(len(s.output_ids) for s in seqs)

    # At least 30 tokens a row, then on until every row is mixed; stopping by 46 keeps every
    # row short of its 64 and none finishes.
    while longest() < 46 and (longest() < 30 or not all(map(mixed, seqs))):
        llm.engine.step()
    assert all(map(mixed, seqs)), [(s.num_draft_tokens, s.num_accepted_tokens, len(s.output_ids)) for s in seqs]

    drafter, page_size = llm.engine.drafter, llm.engine.page_size
    from models.draft import context_features, context_kv

    tol = ROLLBACK_TOL[kv]
    for i, (seq, ref) in enumerate(zip(seqs, refs, strict=True)):
        n = seq.num_cached
        assert ref.output_ids[: len(seq.output_ids)] == seq.output_ids and ref.num_cached >= n
        for name, got, want in zip("kv", _slot_kv(llm.engine, seq, n), _slot_kv(plain.engine, ref, n), strict=True):
            _assert_vectors_close(got, want, tol, f"row {i} target {name}")

        # The draft's context cache: projections of the target's hidden states of the committed tokens.
        hidden = plain.engine.hidden_states(seq.token_slice(0, n), drafter.taps)
        feats = context_features(drafter.params, drafter.cfg, hidden[None])
        want = context_kv(drafter.params, drafter.cfg, feats, np.arange(n)[None])  # ([L, 1, n, Hkv, Dh],) * 2
        pages = np.asarray(llm.engine.scheduler.block_tables[seq.slot])[np.arange(n) // page_size]
        for name, pool, w in zip("kv", (drafter.pools.k, drafter.pools.v), want, strict=True):
            got = np.asarray(pool)[:, pages, np.arange(n) % page_size]
            _assert_vectors_close(got, np.asarray(w)[:, 0], tol, f"row {i} draft context {name}")


def _slot_kv(engine, seq, num_tokens: int):
    """Target keys/values [layers, tokens, Hkv, Dh] of the sequence's first `num_tokens` cached tokens."""
    table = np.asarray(engine.scheduler.block_tables[seq.slot : seq.slot + 1])
    ks, vs = zip(*(engine.cache.read(table, i) for i in range(engine.cfg.num_layers)), strict=True)
    return np.stack([np.asarray(k)[0, :num_tokens] for k in ks]), np.stack([np.asarray(v)[0, :num_tokens] for v in vs])


def _assert_vectors_close(got, want, tol: float, what: str):
    """Every vector got[l, t, h] [Dh] within `tol` of want's, relative to want's norm."""
    err = np.linalg.norm(got - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-6)
    layer, pos, head = np.unravel_index(err.argmax(), err.shape)
    assert err.max() <= tol, f"{what}: layer {layer}, position {pos}, head {head} is {err.max():.3g} off"
