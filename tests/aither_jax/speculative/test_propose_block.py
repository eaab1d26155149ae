"""Multi-step drafting (`propose_block` with S > 1) against a step-by-step numpy loop over the
same draft forward: each step reveals the most confident still-masked positions by the
schedule and feeds their tokens back into the next pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aither_jax.speculative.dflash import DraftPools, _block_attention, _masked_block, propose_block
from models.draft import MASK, DraftConfig, block_forward, init_params, unmask_schedule
from models.llama import vocab_logits

CFG = DraftConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    target_layers=(0, 1),
    target_num_layers=2,
    block_size=8,
)
PAGE, ROWS, PAGES = 4, 3, 3


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    params = init_params(CFG, jax.random.PRNGKey(seed))
    embed = jnp.asarray(rng.standard_normal((CFG.vocab_size + 1, CFG.hidden_size)), jnp.float32)
    lm_head = jnp.asarray(rng.standard_normal((CFG.vocab_size, CFG.hidden_size)), jnp.float32)
    shape = (CFG.num_layers, ROWS * PAGES + 1, PAGE, CFG.num_kv_heads, CFG.head_dim)
    pools = DraftPools(*(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2)))
    table = jnp.asarray(np.arange(1, ROWS * PAGES + 1).reshape(ROWS, PAGES), jnp.int32)
    ctx_lens = jnp.asarray([5, 0, 12], jnp.int32)
    last = jnp.asarray(rng.integers(0, CFG.vocab_size, ROWS), jnp.int32)
    return params, embed, lm_head, pools, table, ctx_lens, last


def _loop(params, embed, lm_head, pools, table, ctx_lens, last, schedule):
    """The denoising loop written out: one forward per step on the current block, then the
    `count` masked positions with the highest softmax probability take their argmax."""
    tokens, positions = _masked_block(last, ctx_lens, CFG.block_size)
    tokens = np.array(tokens)
    attend = _block_attention(pools, table, ctx_lens, kernels=False)
    for count in schedule:
        logits = np.asarray(
            vocab_logits(block_forward(params, CFG, embed, jnp.asarray(tokens), positions, attend), lm_head)
        )
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        conf = (probs / probs.sum(-1, keepdims=True)).max(-1)
        pred = logits.argmax(-1)
        for r in range(ROWS):
            masked = np.flatnonzero(tokens[r] == MASK)
            chosen = masked[np.argsort(-conf[r, masked], kind="stable")[:count]]
            tokens[r, chosen] = pred[r, chosen]
    assert (tokens != MASK).all()
    return tokens[:, 1:]


@pytest.mark.parametrize("steps", [1, 2, 4, 7])
def test_multi_step_drafts_follow_the_schedule_and_feed_back(steps):
    args = _inputs(steps)
    schedule = unmask_schedule(CFG.block_size - 1, steps)
    assert sum(schedule) == CFG.block_size - 1 and len(schedule) == steps
    drafts = np.asarray(propose_block(*args, None, cfg=CFG, schedule=schedule, kernels=False))
    np.testing.assert_array_equal(drafts, _loop(*args, schedule))


def test_later_steps_see_the_revealed_tokens():
    """With more than one step the drafts differ from one pass's argmax somewhere: the revealed
    tokens change the later passes (a loop that ignored them would give S = 1's drafts)."""
    args = _inputs(11)
    one = np.asarray(propose_block(*args, None, cfg=CFG, schedule=(CFG.block_size - 1,), kernels=False))
    many = np.asarray(propose_block(*args, None, cfg=CFG, schedule=unmask_schedule(7, 7), kernels=False))
    assert (one != many).any()
    np.testing.assert_array_equal(many, _loop(*args, unmask_schedule(7, 7)))


def test_the_shipped_draft_schedules_its_fifteen_masks():
    """The block is the last token and 15 masks, so S = 4 reveals 5, 5, 3 and 2 of them."""
    assert unmask_schedule(15, 4) == (5, 5, 3, 2)
    assert unmask_schedule(15, 2) == (10, 5)
    assert unmask_schedule(15, 1) == (15,)
