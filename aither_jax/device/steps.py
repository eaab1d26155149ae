"""The step entry points: one model step (prefill chunk or decode), a verify pass, fused decode
steps, and the cache's page copies and sink refills.

A step is two jitted calls. `forward_step` runs the model, picks greedy tokens and only reads
the cache (a batch with sampled rows then draws them in `sample_step`); `write_step` stores the
new keys/values with the cache donated, so XLA updates the pages in place. In a single jitted
function XLA copied the whole KV pool (several times) before the scatter, because the last
layer's page reads do not feed the new keys and so cannot be proven to run before the in-place
write. A verify pass is `verify_forward` (the target over the drafts) and `accept_step` (the
verification), then `write_step`. Shapes come from a bounded set of buckets
chosen by the engine (batch rows, tokens per row, pages read), so steady-state decoding
reuses compiled executables.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from aither_jax.compile.step_jit import step_jit
from aither_jax.device.sampling import SamplingBatch, greedy_tokens, sample_tokens
from aither_jax.device.verify import verify, verify_tree
from models.config import ModelConfig
from models.kv_cache import NULL_PAGE, PagedKVCache
from models.llama import KVUpdate, StepBatch, compact_update, forward, tree_depth_and_mask
from models.llama_invariant import invariant_forward
from models.weights import ModelWeights


def model_forward(
    weights: ModelWeights, cache: PagedKVCache, tokens: jax.Array, batch: StepBatch, *, attention: str, **kwargs
) -> tuple[jax.Array, KVUpdate, jax.Array | None]:
    """`models.llama.forward` (its arguments), or for attention "invariant" its batch-invariant
    twin `models.llama_invariant.invariant_forward`, which reads no shared pages."""
    if attention != "invariant":
        return forward(weights, cache, tokens, batch, attention=attention, **kwargs)
    if kwargs.pop("shared_pages", 0):
        raise ValueError("batch-invariant attention reads every row's own pages; run it without shared pages")
    return invariant_forward(weights, cache, tokens, batch, **kwargs)


@step_jit(static_argnames=("cfg", "num_pages", "all_logits", "attention", "taps", "shared_pages", "mass_layers"))
def forward_step(
    weights: ModelWeights,
    cache: PagedKVCache,
    tokens: jax.Array,  # [B, T] int32
    batch: StepBatch,
    *,
    cfg: ModelConfig,
    num_pages: int,
    all_logits: bool,
    attention: str = "reference",
    taps: tuple[int, ...] = (),
    shared_pages: int = 0,
    mass_layers: tuple[int, ...] = (),
) -> tuple[jax.Array, jax.Array, jax.Array | None, KVUpdate, jax.Array | None]:
    """Runs the model over [B, T] new tokens and picks each row's greedy next token
    (`models.llama.forward` explains `num_pages`, `shared_pages` and `mass_layers`).

    Sampled rows draw from the returned last logits in `sample_step`, a call of its own: the
    sampler (top-k/top-p thresholds, Gumbel draws over the whole vocabulary) compiles in about
    2.5 s on 2 CPU cores, and as a separate program it compiles once per row count instead of
    once per forward shape (tokens per row, pages read, ...), whose programs are then the same
    for greedy and sampled batches.

    Returns:
        greedy next tokens [B] int32; each row's last new position's logits [B, V] float32;
        every position's logits [B, T, V] with `all_logits` (else None); the update to apply
        with `write_step`; the hidden states of the layers in `taps` (or None).
    """
    static = dict(
        cfg=cfg, num_pages=num_pages, all_logits=all_logits, attention=attention, taps=taps, shared_pages=shared_pages,
        mass_layers=mass_layers,
    )  # fmt: skip
    logits, update, hidden = model_forward(weights, cache, tokens, batch, **static)
    if all_logits:
        last = jnp.maximum(batch.num_new - 1, 0)
        last_logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    else:
        last_logits = logits
    return greedy_tokens(last_logits), last_logits, logits if all_logits else None, update, hidden


@step_jit
def sample_step(logits: jax.Array, sampling: SamplingBatch, positions: jax.Array) -> jax.Array:
    """The next token of every row of a forward step with sampled rows: `sample_tokens` of its
    last logits [B, V] at `positions` [B] (the rows' lengths after the step), greedy rows
    included (temperature 0 takes the argmax)."""
    return sample_tokens(logits, sampling, positions, greedy_only=False)


@step_jit(static_argnames=("cfg", "num_pages", "attention", "taps"))
def verify_forward(
    weights: ModelWeights,
    cache: PagedKVCache,
    tokens: jax.Array,  # [B, T] int32: each row's last committed token, then its drafts
    batch: StepBatch,  # num_new = 1 + the row's drafts
    parents: jax.Array | None = None,
    *,
    cfg: ModelConfig,
    num_pages: int,
    attention: str = "reference",
    taps: tuple[int, ...] = (),
) -> tuple[jax.Array, KVUpdate, jax.Array | None]:
    """The target over every row's [last token, drafts] (a tree per row with `parents` [B, T],
    see `models.llama.forward`): (logits [B, T, V] float32, the update, tapped hidden states).
    Verification itself (`accept_step`) is a call of its own: this program, the bulk of the
    compilation, is then the same for greedy and sampled rows and for logits returned or not."""
    tree = None if parents is None else tree_depth_and_mask(parents)
    return model_forward(
        weights, cache, tokens, batch, cfg=cfg, num_pages=num_pages, all_logits=True, attention=attention, taps=taps,
        tree=tree,
    )  # fmt: skip


@step_jit(static_argnames=("greedy_only", "return_logits"), donate_argnames=("update",))
def accept_step(
    logits: jax.Array,  # [B, T, V] float32 from `verify_forward`
    tokens: jax.Array,  # [B, T] int32
    batch: StepBatch,
    sampling: SamplingBatch,
    update: KVUpdate,
    hidden: jax.Array | None,
    parents: jax.Array | None = None,
    *,
    greedy_only: bool,
    return_logits: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None, KVUpdate, jax.Array | None, jax.Array | None]:
    """Verifies the drafts of a `verify_forward` pass.

    With `parents` the drafts are a tree per row, verified by `verify_tree`; the update,
    logits and hidden states are then reordered so that entry j is the accepted path's token
    at depth j, as a chain's would be.

    Returns (accepted drafts [B], the token after them [B], logits [B, T, V] or None, the
    update (lengths count only the last token and the accepted drafts), tapped hidden states,
    the accepted path [B, T] (trees) or None).
    """
    path = None
    if parents is None:
        drafts, num_drafts = tokens[:, 1:], batch.num_new - 1
        accepted, next_tokens = verify(logits, drafts, num_drafts, sampling, batch.start, greedy_only=greedy_only)
    else:
        depth = tree_depth_and_mask(parents)[0]
        accepted, next_tokens, path = verify_tree(
            logits, tokens, parents, depth, batch.num_new, sampling, batch.start, greedy_only=greedy_only
        )
        update = compact_update(update, path)
        logits = jnp.take_along_axis(logits, path[:, :, None], axis=1)
        if hidden is not None:
            hidden = jnp.take_along_axis(hidden, path[:, :, None], axis=1)
    update = update.replace(seq_lens=jnp.minimum(batch.start + 1 + accepted, update.seq_lens))
    return accepted, next_tokens, logits if return_logits else None, update, hidden, path


def verify_step(
    weights: ModelWeights,
    cache: PagedKVCache,
    tokens: jax.Array,
    batch: StepBatch,
    sampling: SamplingBatch,
    *,
    greedy_only: bool,
    return_logits: bool = False,
    parents: jax.Array | None = None,
    **static,
) -> tuple[jax.Array, jax.Array, jax.Array | None, KVUpdate, jax.Array | None, jax.Array | None]:
    """A verify pass: `verify_forward` (which takes the keyword arguments `static`) then
    `accept_step`; returns what `accept_step` returns."""
    logits, update, hidden = verify_forward(weights, cache, tokens, batch, parents, **static)
    return accept_step(
        logits, tokens, batch, sampling, update, hidden, parents, greedy_only=greedy_only, return_logits=return_logits
    )


@step_jit(static_argnames=("cfg", "num_pages", "greedy_only", "attention", "num_steps"), donate_argnames=("cache",))
def decode_steps(
    weights: ModelWeights,
    cache: PagedKVCache,
    tokens: jax.Array,  # [B, 1] int32: each row's last token, not yet in the cache
    batch: StepBatch,  # num_new 1 for live rows, 0 for padding rows
    sampling: SamplingBatch,
    limits: jax.Array,  # [B] int32: steps each row takes, 1 .. num_steps (0 for padding rows)
    *,
    cfg: ModelConfig,
    num_pages: int,
    greedy_only: bool,
    num_steps: int,
    attention: str = "reference",
) -> tuple[jax.Array, PagedKVCache]:
    """`num_steps` decode steps in one call, each row feeding back the token it sampled
    (vLLM's multi-step scheduling): one dispatch and one host sync for `num_steps` tokens.

    Row b takes limits[b] steps (the call runs max(limits)); in the later ones it is a
    padding row (no slot, so nothing is written for it). Each step is `forward_step` (then
    `sample_step`'s sampler on batches with sampled rows) and `write_step`, the functions a
    single step calls, so every token and every page written is what single steps give.
    `num_pages` must cover every row's final length, start + limits.

    Returns (the sampled tokens [B, num_steps] int32: entries j >= limits[b] are not
    meaningful, the cache).
    """
    static = dict(cfg=cfg, num_pages=num_pages, all_logits=False, attention=attention)

    def forward_at(cache, last, j):
        live = j < limits
        slots = jnp.where(live, batch.slots, cache.max_seqs)
        batch_j = StepBatch(slots, batch.start + j, jnp.where(live, batch.num_new, 0), batch.offset)
        # The step functions' bodies (`__wrapped__`): a jit inside a jit takes no compiler options.
        next_tokens, logits, _, update, _ = forward_step.__wrapped__(weights, cache, last, batch_j, **static)
        if not greedy_only:
            next_tokens = sample_step.__wrapped__(logits, sampling, update.seq_lens)
        return next_tokens, update

    def step(j, carry):
        # Step j - 1's keys/values are written first, then step j reads the pool. Written
        # after the reads, the update would need the pool both before and after it in one
        # iteration, and XLA copies the whole pool every step to provide that.
        cache, update, last, out = carry
        cache = write_step.__wrapped__(cache, update)
        next_tokens, update = forward_at(cache, last, j)
        return cache, update, next_tokens[:, None], out.at[:, j].set(next_tokens)

    # Nothing to write before the first step: an update of the right shapes whose rows are
    # all padding (out-of-range slots, the null page), so the write changes nothing.
    shapes = jax.eval_shape(forward_at, cache, tokens, 0)[1]
    nothing = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    nothing = nothing.replace(
        pages=jnp.full_like(nothing.pages, NULL_PAGE), slots=jnp.full_like(nothing.slots, cache.max_seqs)
    )
    out = jnp.zeros((tokens.shape[0], num_steps), jnp.int32)
    # As many steps as the longest row needs (a while loop: the count is not a shape).
    count = jnp.minimum(jnp.max(limits), num_steps)
    cache, update, _, out = jax.lax.fori_loop(0, count, step, (cache, nothing, tokens, out))
    cache = write_step.__wrapped__(cache, update)
    return out, cache


@step_jit(static_argnames=("k",))
def top_log_probs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The `k` most likely next tokens at every position of `logits` [..., V] and their log
    probabilities under the full softmax: ([..., k] int32, [..., k] float32), most likely
    first. On the device, so only k of every V logits reach the host."""
    logp, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), min(k, logits.shape[-1]))
    return ids.astype(jnp.int32), logp


@step_jit(donate_argnames=("cache",))
def write_step(cache: PagedKVCache, update: KVUpdate) -> PagedKVCache:
    """Stores a step's keys/values and lengths in place."""
    cache = cache.write(update.pages, update.offsets, update.k, update.v)
    if cache.num_sinks:
        cache = cache.write_sinks(update.slots, update.start, update.num_new, update.sink_k, update.sink_v)
    return cache.replace(seq_lens=cache.seq_lens.at[update.slots].set(update.seq_lens, mode="drop"))


@step_jit(static_argnames=("cfg", "num_pages", "attention"), donate_argnames=("cache",))
def refill_sinks(
    weights: ModelWeights,
    cache: PagedKVCache,
    tokens: jax.Array,  # [B, T] int32: each row's first tokens
    batch: StepBatch,  # start 0; num_new = the sink positions to fill
    *,
    cfg: ModelConfig,
    num_pages: int,
    attention: str = "reference",
) -> PagedKVCache:
    """Recomputes the sink keys/values of slots whose first tokens sit in prefix-cache pages.

    A sink position's key and value depend only on the tokens up to it, so the rows run from
    position 0 as a prefill would (the same `forward`, no pages read: `num_pages` 0), with
    every block-table entry on the null page, so no page is written either: the shared pages
    are read-only. Only the slots' sink buffers change.
    """
    view = cache.replace(block_tables=jnp.full_like(cache.block_tables, NULL_PAGE))
    _, update, _ = model_forward(
        weights, view, tokens, batch, cfg=cfg, num_pages=num_pages, all_logits=False, attention=attention
    )
    return cache.write_sinks(update.slots, update.start, update.num_new, update.sink_k, update.sink_v)


@step_jit(donate_argnames=("cache",))
def copy_pages(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
    """Copies pages src[i] -> dst[i] ([N] int32 each) in every key and value pool, all layers
    (prefix caching's copy on write)."""

    def copy(pool: jax.Array) -> jax.Array:
        return pool.at[dst].set(pool[src])

    return cache.replace(k=jax.tree.map(copy, cache.k), v=jax.tree.map(copy, cache.v))


@step_jit(static_argnames=("num_pages",))
def resize_pools(target, empty, draft, *, num_pages: int):
    """Every pool sharing page ids cut to its first `num_pages` pages or extended with empty
    ones: the target's (`target`, (keys, values) trees, page-major) with copies of `empty`
    (one empty page per leaf), the draft's context (`draft`, layer-major, or None) with zeros.
    Returns (target, draft). A pool that grows is copied: for the call, old and new are held."""

    def fit(leaf: jax.Array, fill: jax.Array, axis: int) -> jax.Array:
        have = leaf.shape[axis]
        if num_pages <= have:
            return jax.lax.slice_in_dim(leaf, 0, num_pages, axis=axis)
        shape = list(leaf.shape)
        shape[axis] = num_pages - have
        return jnp.concatenate([leaf, jnp.broadcast_to(fill, shape).astype(leaf.dtype)], axis=axis)

    target = jax.tree.map(lambda x, e: fit(x, e, 0), target, empty)
    if draft is not None:
        draft = jax.tree.map(lambda x: fit(x, jnp.zeros((), x.dtype), 1), draft)
    return target, draft


def model_step(
    weights: ModelWeights,
    cache: PagedKVCache,
    tokens: jax.Array,
    batch: StepBatch,
    sampling: SamplingBatch,
    **static,
) -> tuple[jax.Array, jax.Array | None, PagedKVCache, jax.Array | None, jax.Array | None]:
    """One full step: `forward_step` (which takes the keyword arguments `static`, but
    `return_logits` ("none", "last" or "all") for its `all_logits`), `sample_step` unless
    `greedy_only`, then `write_step`. Returns (next_tokens, logits by `return_logits`, cache,
    tapped hidden states or None, with `mass_layers` (attention mass per page read, each row's
    query summary) else None)."""
    return_logits, greedy_only = static.pop("return_logits"), static.pop("greedy_only")
    next_tokens, last, every, update, hidden = forward_step(
        weights, cache, tokens, batch, all_logits=return_logits == "all", **static
    )
    if not greedy_only:
        next_tokens = sample_step(last, sampling, update.seq_lens)
    logits = {"none": None, "last": last, "all": every}[return_logits]
    mass = None if update.attention_mass is None else (update.attention_mass, update.query_summary)
    update = update.replace(attention_mass=None, query_summary=None)
    return next_tokens, logits, write_step(cache, update), hidden, mass


@step_jit(static_argnames=("layer",))
def page_key_summaries(cache: PagedKVCache, pages: jax.Array, *, layer: int) -> jax.Array:
    """The mean key of each of `pages` ([N] int32) at `layer`, decoded, heads concatenated:
    [N, Hkv * Dh] float32 (the eviction advisor's SEMANTIC summaries)."""
    k, _ = cache.read(pages[None], layer)  # [1, N * S, Hkv, Dh]
    n = pages.shape[0]
    return k.astype(jnp.float32).reshape(n, cache.page_size, -1).mean(axis=1)


@step_jit(static_argnames=("axis",))
def read_pages(pools: Any, pages: jax.Array, *, axis: int = 0) -> list[jax.Array]:
    """The stored bytes of `pages` ([N] int32) from every leaf of `pools`, whose page axis is
    `axis`: one [N, ...] array per leaf, page-major (the tier mover's device -> host half)."""
    return [jnp.moveaxis(jnp.take(leaf, pages, axis=axis), axis, 0) for leaf in jax.tree.leaves(pools)]


@step_jit(static_argnames=("axis",), donate_argnames=("pools",))
def write_pages(pools: Any, pages: jax.Array, rows: list[jax.Array], *, axis: int = 0) -> Any:
    """Stores `rows` (one [N, ...] array per leaf, as `read_pages` returns them) into `pages`
    of every leaf of `pools` (the host -> device half)."""
    leaves, tree = jax.tree.flatten(pools)

    def put(leaf: jax.Array, row: jax.Array) -> jax.Array:
        index = (slice(None),) * axis + (pages,)
        return leaf.at[index].set(jnp.moveaxis(row, 0, axis))

    return jax.tree.unflatten(tree, [put(leaf, row) for leaf, row in zip(leaves, rows, strict=True)])
