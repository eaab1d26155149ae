"""Rotated-domain attention over TurboQuant pages: the Pallas kernel (interpret mode on CPU)
and the jnp rotated-domain path (`xla`) against the reference, which decodes the pages and
runs plain paged attention.

Cases, codecs and reference outputs are built once per module and shared, read only, by the
tests that use them: the interpreted kernel and the jnp path compile once per codec, shape
and option, and the reference runs once per case however many implementations meet it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.llama import tree_depth_and_mask
from pallas_kernels.paged_attention import merge_attention
from pallas_kernels.tq_attention import (
    DOT_PRECISION,
    Sinks,
    tq_paged_attention,
    tq_paged_attention_reference,
    tq_paged_attention_xla,
    tq_shared_prefix_attention,
)
from pallas_kernels.turboquant import TurboQuant

gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
IMPLS = {"pallas": tq_paged_attention, "xla": tq_paged_attention_xla}
both_impls = pytest.mark.parametrize("impl", sorted(IMPLS))
# The reference as one compiled program (dispatched op by op it compiles every op per shape).
reference = jax.jit(tq_paged_attention_reference, static_argnames=("k_codec", "v_codec", "return_lse", "window"))


@functools.cache
def codec(head_dim, bits, seed, rotation):
    return TurboQuant(head_dim=head_dim, bits=bits, seed=seed, rotation=rotation)


@functools.cache
def encoder(codec):
    return jax.jit(codec.encode_tree)


@functools.cache
def make_case(
    *, k_bits, v_bits, head_dim=64, hkv=3, group=3, page_size=8, ctx_lens=(0, 5, 19), t=1, layers=2, seed=0,
    rotations=("haar", "haar"),
):  # fmt: skip
    """Pools of `layers` layers filled with encoded random vectors; pages no row owns hold NaN
    norms, so an unmasked read of them poisons the output. Built once per set of arguments:
    the arrays and codecs are shared, read only."""
    rng = np.random.default_rng(seed)
    k_codec = codec(head_dim, k_bits, seed, rotations[0])
    v_codec = codec(head_dim, v_bits, seed + 1, rotations[1])
    b = len(ctx_lens)
    pages_per_row = max(-(-(c + t) // page_size) for c in ctx_lens) + 1
    num_pages = 1 + b * pages_per_row + 3
    lead = (num_pages, layers, page_size, hkv)

    def pool(codec, scale):
        x = rng.standard_normal((*lead, head_dim)).astype(np.float32) * scale
        enc = {k: np.array(a) for k, a in encoder(codec)(jnp.asarray(x)).items()}
        return enc

    k_pool, v_pool = pool(k_codec, 2.0), pool(v_codec, 1.0)
    free = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((b, pages_per_row), np.int32)
    used = set()
    for row, c in enumerate(ctx_lens):
        n = -(-c // page_size)
        table[row, :n] = free[row * pages_per_row : row * pages_per_row + n]
        used.update(table[row, :n].tolist())
    unused = [p for p in range(num_pages) if p not in used]
    for enc in (k_pool, v_pool):
        enc["norms"][unused] = np.nan
    q = rng.standard_normal((b, t, hkv * group, head_dim)).astype(np.float32) * 2
    k_new = encoder(k_codec)(jnp.asarray(rng.standard_normal((b, t, hkv, head_dim)).astype(np.float32) * 2))
    v_new = encoder(v_codec)(jnp.asarray(rng.standard_normal((b, t, hkv, head_dim)).astype(np.float32)))
    num_new = np.full((b,), t, np.int32)
    args = (
        jnp.asarray(q),
        k_new,
        v_new,
        {k: jnp.asarray(a) for k, a in k_pool.items()},
        {k: jnp.asarray(a) for k, a in v_pool.items()},
        jnp.asarray(table),
        1 if layers > 1 else 0,
        jnp.asarray(np.array(ctx_lens, np.int32)),
        jnp.asarray(num_new),
    )
    return args, {"k_codec": k_codec, "v_codec": v_codec}


_REFERENCES = {}  # id(args) -> (args, codecs, output): holding args keeps its id from being reused


def case_reference(args, codecs):
    """The reference's output for `args`, computed once per args tuple and codecs."""
    hit = _REFERENCES.get(id(args))
    if hit is None or hit[0] is not args or hit[1] != codecs:
        hit = _REFERENCES[id(args)] = (args, codecs, np.asarray(reference(*args, **codecs)))
    return hit[2]


def run_both(args, codecs, impl="pallas", **knobs):
    out = np.asarray(IMPLS[impl](*args, **codecs, **knobs))
    return out, case_reference(args, codecs)


# The shipped SmolLM2 default's width pairs are 5:4, 5:5, 6:4, 6:5, 6:6 and 7:5 (checked below);
# every one runs through the kernel.
BIT_PAIRS = [(2, 2), (3, 3), (4, 4), (6, 4), (5, 3), (8, 8), (5, 4), (5, 5), (6, 5), (6, 6), (7, 5)]


def test_the_default_formats_width_pairs_are_all_tested():
    from models.kv_spec import parse_kv_spec
    from models.registry import SMOLLM2_KV

    spec = parse_kv_spec(SMOLLM2_KV)
    pairs = set(zip(spec.layer_bits("k", 30), spec.layer_bits("v", 30), strict=True))
    assert len(pairs) == 6 and pairs <= set(BIT_PAIRS)


@pytest.mark.parametrize("k_bits, v_bits", BIT_PAIRS)
@both_impls
def test_decode_matches_reference_over_bit_widths(impl, k_bits, v_bits):
    args, codecs = make_case(k_bits=k_bits, v_bits=v_bits)
    out, ref = run_both(args, codecs, impl, pages_per_split=2)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("rotations", [("hadamard", "haar"), ("haar", "hadamard"), ("hadamard", "hadamard")])
@both_impls
def test_hadamard_rotations_match_reference(impl, rotations):
    """The -hadk / -hadv / -had formats: the kernel rotates queries and outputs by whatever
    orthogonal matrix the codec carries."""
    args, codecs = make_case(k_bits=5, v_bits=4, rotations=rotations, ctx_lens=(3, 0, 21))
    assert (codecs["k_codec"].rotation, codecs["v_codec"].rotation) == rotations
    out, ref = run_both(args, codecs, impl, pages_per_split=2)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize(
    "head_dim, hkv, group, page_size, pages_per_split",
    [(64, 3, 3, 8, 1), (64, 3, 3, 16, 4), (128, 2, 4, 8, 3), (64, 1, 8, 4, 16), (256, 1, 4, 8, 2), (64, 3, 3, 8, 6)],
)
@both_impls
def test_decode_matches_reference_over_shapes_and_splits(impl, head_dim, hkv, group, page_size, pages_per_split):
    args, codecs = make_case(
        k_bits=4, v_bits=4, head_dim=head_dim, hkv=hkv, group=group, page_size=page_size, ctx_lens=(7, 0, 33, 16)
    )
    out, ref = run_both(args, codecs, impl, pages_per_split=pages_per_split)
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize(
    "pages_per_split, page_size, head_dim, expected",
    [(16, 16, 64, 4), (6, 8, 64, 2), (3, 16, 64, 1), (16, 16, 256, 1), (2, 8, 256, 2), (64, 4, 64, 4), (5, 64, 128, 1)],
)
def test_default_pages_per_step_divides_the_split_and_bounds_the_tile(pages_per_split, page_size, head_dim, expected):
    from pallas_kernels.tq_attention import TILE_ELEMENTS, default_pages_per_step

    step = default_pages_per_step(pages_per_split, page_size, head_dim)
    assert step == expected
    assert pages_per_split % step == 0
    assert step == 1 or step * page_size * head_dim <= TILE_ELEMENTS


@pytest.mark.parametrize("pages_per_step", [1, 2, 8])
def test_every_pages_per_step_matches_reference(pages_per_step):
    """The tile size is a tuning knob (`bench_attention.py --pages-per-step`): any divisor of
    the split gives the reference's result, tiles past the default's bound included."""
    args, codecs = make_case(k_bits=3, v_bits=5, page_size=8, ctx_lens=(61, 0, 17))
    out, ref = run_both(args, codecs, "pallas", pages_per_split=8, pages_per_step=pages_per_step)
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize(
    "k_bits, v_bits, head_dim, page_size, pages_per_split, t",
    [(4, 4, 64, 16, 4, 1), (3, 5, 64, 8, 2, 1), (6, 2, 128, 8, 3, 1), (8, 4, 256, 8, 2, 1), (5, 3, 64, 8, 4, 6)],
)
def test_plane_loads_match_reference(k_bits, v_bits, head_dim, page_size, pages_per_split, t):
    """code_loads="planes": whole byte planes loaded, the chunks joined into one permuted tile."""
    args, codecs = make_case(
        k_bits=k_bits, v_bits=v_bits, head_dim=head_dim, hkv=2, group=4, page_size=page_size, ctx_lens=(7, 0, 45), t=t
    )
    out, ref = run_both(args, codecs, "pallas", pages_per_split=pages_per_split, code_loads="planes")
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize(
    "batch, kv_heads, num_pages, expected",
    [(32, 3, 512, 64), (1, 3, 32, 4), (8, 3, 2048, 64), (16, 3, 12, 4), (256, 3, 12, 4), (64, 3, 48, 16), (4, 1, 7, 4)],
)
def test_default_split_fills_the_grid_before_it_grows(batch, kv_heads, num_pages, expected):
    """The largest split that divides the pages and leaves MIN_PROGRAMS programs, else 4:
    32 x 8192 tokens (512 pages) gets 64, one row of 512 tokens gets 4."""
    from pallas_kernels.tq_attention import MIN_PROGRAMS, default_pages_per_split

    size = default_pages_per_split(batch, kv_heads, num_pages)
    assert size == expected
    if size > 4:
        assert num_pages % size == 0 and batch * kv_heads * num_pages // size >= MIN_PROGRAMS


def test_defaults_pick_planes_for_byte_aligned_widths_and_match_reference(monkeypatch):
    """With no split or load given, the kernel takes `default_pages_per_split` and
    `default_code_loads` (planes at 4:4 and 2:4, gathers where codes straddle bytes) and still
    equals the reference."""
    from pallas_kernels import tq_attention

    assert [tq_attention.default_code_loads(*b) for b in [(4, 4), (2, 4), (8, 2), (6, 5), (4, 3)]] == [
        "planes",
        "planes",
        "planes",
        "gather",
        "gather",
    ]
    seen = []
    inner = tq_attention._tq_paged_attention
    monkeypatch.setattr(
        tq_attention,
        "_tq_paged_attention",
        lambda *a, **kw: seen.append((kw["pages_per_split"], kw["code_loads"])) or inner(*a, **kw),
    )
    for k_bits, v_bits in [(4, 4), (5, 3)]:
        args, codecs = make_case(k_bits=k_bits, v_bits=v_bits, page_size=8, ctx_lens=(61, 0, 17))
        out, ref = run_both(args, codecs, "pallas")
        np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4)
    assert seen == [(4, "planes"), (4, "gather")]


def test_joined_order_is_the_join_of_the_planar_chunks():
    from pallas_kernels.tq_attention import _join, joined_order

    chunks = [jnp.full((3, 8), m, jnp.int32) * 8 + jnp.arange(8) for m in range(8)]  # coordinate ids
    np.testing.assert_array_equal(np.asarray(_join(chunks))[0], joined_order(64))
    assert sorted(joined_order(256)) == list(range(256))


@functools.cache
def prefill_case(t, ctx_lens):
    args, codecs = make_case(k_bits=6, v_bits=4, t=t, ctx_lens=ctx_lens)
    num_new = np.array(args[8])
    num_new[0] = t - 2  # a row with a shorter chunk: its padding tokens must not be seen
    return (*args[:8], jnp.asarray(num_new)), codecs


@pytest.mark.parametrize("t, ctx_lens", [(5, (0, 11, 24)), (16, (3, 40))])
@both_impls
def test_prefill_chunk_attends_to_stored_pages_and_itself(impl, t, ctx_lens):
    args, codecs = prefill_case(t, ctx_lens)
    num_new = np.asarray(args[8])
    out, ref = run_both(args, codecs, impl, pages_per_split=2)
    valid = np.arange(t)[None, :] < num_new[:, None]
    np.testing.assert_allclose(out[valid], ref[valid], rtol=2e-4, atol=2e-4)


@functools.cache
def fresh_case(t, num_sinks):
    """A first chunk's case (the table of pages and the table of none), knobs and reference."""
    args, codecs = make_case(k_bits=5, v_bits=4, t=t, ctx_lens=(0, 0, 0))
    num_new = jnp.asarray(np.array([t, t - 2, 1], np.int32))
    args = (*args[:8], num_new)
    knobs = {}
    if num_sinks:
        rng = np.random.default_rng(7)
        shapes = [(3, num_sinks, 3, 64)] * 2 + [(3, t, 3, 64)] * 2
        knobs["sinks"] = Sinks(*(jnp.asarray(rng.standard_normal(x).astype(np.float32)) for x in shapes))
    empty = (*args[:5], args[5][:, :0], *args[6:])
    return args, empty, codecs, knobs, np.asarray(reference(*empty, **codecs, **knobs))


@pytest.mark.parametrize("num_sinks", [0, 4])
@both_impls
def test_fresh_chunk_with_no_pages_to_read(impl, num_sinks):
    """A first chunk (nothing stored) may pass a block table of no pages: the result equals
    reading a table of pages that lie past every row's length, and the reference."""
    t = 6
    args, empty, codecs, knobs, ref = fresh_case(t, num_sinks)
    num_new = args[8]
    out = np.asarray(IMPLS[impl](*empty, **codecs, **knobs, pages_per_split=2))
    paged = np.asarray(IMPLS[impl](*args, **codecs, **knobs, pages_per_split=2))
    valid = np.arange(t)[None, :] < np.asarray(num_new)[:, None]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[valid], ref[valid], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(out[valid], paged[valid], rtol=2e-4, atol=2e-4)


@functools.cache
def padding_case():
    args, codecs = make_case(k_bits=4, v_bits=4, ctx_lens=(9, 9))
    num_new = jnp.asarray(np.array([1, 0], np.int32))
    ctx = jnp.asarray(np.array([9, 0], np.int32))
    return (*args[:7], ctx, num_new), codecs


@both_impls
def test_padding_row_gives_zeros_and_layer_index_selects_the_layer(impl):
    args, codecs = padding_case()
    out, ref = run_both(args, codecs, impl)
    np.testing.assert_allclose(out[1], 0.0, atol=1e-7)
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4)
    other_layer = np.asarray(IMPLS[impl](*args[:6], 0, *args[7:], **codecs))
    assert np.abs(other_layer[0] - out[0]).max() > 1e-3


def past_shared_pages(impl, whole, codecs, shared_len):
    """Each row's attention over its pages past the first `shared_len` positions of its table
    (page aligned) and its new tokens, with the log-sum-exp, from the reference's arguments."""
    q, k_new, v_new, k_pool, v_pool, table, layer, ctx_lens, num_new = whole
    page_size = k_pool["codes"].shape[2]
    rest = (table[:, shared_len // page_size :], layer, ctx_lens - shared_len, num_new)
    return IMPLS[impl](q, k_new, v_new, k_pool, v_pool, *rest, **codecs, pages_per_split=2, return_lse=True)


@functools.cache
def shared_prefix_case(t, page_size, shared):
    """Four rows whose tables start with the same `shared` pages; the last row is padding."""
    args, codecs = make_case(k_bits=5, v_bits=3, page_size=page_size, ctx_lens=(24, 29, 45, 40), t=t)
    table = np.array(args[5])
    table[:, :shared] = table[0, :shared]
    ctx_lens = np.array([24, 29, 45, 0], np.int32)
    num_new = np.array([t, 1, t, 0], np.int32)
    q, k_new, v_new, k_pool, v_pool, _, layer = args[:7]
    whole = (q, k_new, v_new, k_pool, v_pool, jnp.asarray(table), layer, jnp.asarray(ctx_lens), jnp.asarray(num_new))
    return whole, codecs


@pytest.mark.parametrize("t, rows_per_program", [(1, None), (3, None), (3, 5)])
@both_impls
def test_shared_pages_read_once_then_merged_match_reading_every_row(impl, t, rows_per_program):
    """Rows whose tables start with the same 3 pages: those pages attended once for the batch
    (`tq_shared_prefix_attention`, all rows' queries as one; the kernel in chunks of
    `rows_per_program` (row, token) pairs, 5 of 12 leaving a padded last chunk), merged with
    each row's attention over its remaining pages and new tokens, equal the reference over
    whole tables. The last row is padding. Unused pages hold NaN norms."""
    page_size, shared = 8, 3
    whole, codecs = shared_prefix_case(t, page_size, shared)
    ref = case_reference(whole, codecs)
    q, _, _, k_pool, v_pool, table, layer, _, num_new = whole
    table, num_new = np.asarray(table), np.asarray(num_new)
    own = past_shared_pages(impl, whole, codecs, shared * page_size)
    prefix = tq_shared_prefix_attention(
        q,
        k_pool,
        v_pool,
        jnp.asarray(table[0, :shared]),
        layer,
        shared * page_size,
        kernel=impl == "pallas",
        rows_per_program=rows_per_program,
        **codecs,
    )
    out = np.asarray(merge_attention([own, prefix]))
    assert np.isfinite(out).all()
    valid = np.arange(t)[None, :] < num_new[:, None]
    np.testing.assert_allclose(out[valid], ref[valid], rtol=2e-4, atol=2e-4)
    no_prefix = np.asarray(own[0])  # the merge matters: without the prefix the rows differ
    assert np.abs(no_prefix[valid] - ref[valid]).max() > 1e-2


def test_kernel_differs_from_reference_of_other_codebook():
    """The comparison can fail: reading the pages with a codec of different bits changes the result."""
    args, codecs = make_case(k_bits=4, v_bits=4)
    out = np.asarray(tq_paged_attention(*args, **codecs))
    wrong = {"k_codec": codecs["k_codec"], "v_codec": TurboQuant(head_dim=64, bits=4, seed=7)}
    ref = np.asarray(reference(*args, **wrong))
    assert np.abs(out - ref).max() > 1e-2


@pytest.mark.parametrize("t, ctx_lens", [(1, (0, 5, 19)), (16, (3, 40))])
def test_dot_precisions_match_reference_within_their_rounding(t, ctx_lens):
    """float32 and bf16x3 stay within the kernel's usual tolerance; bf16 rounds its operands,
    so it is farther off, but by far less than a wrong read would be. bf16x3's split must
    recover most of what bf16 loses (a dropped remainder term shows as bf16's error)."""
    args, codecs = make_case(k_bits=4, v_bits=4, t=t, ctx_lens=ctx_lens)
    err = {}
    for precision in ("float32", "bf16x3", "bf16", "rows"):
        out, ref = run_both(args, codecs, pages_per_split=2, dot_precision=precision)
        valid = np.arange(t)[None, :] < np.asarray(args[8])[:, None]
        err[precision] = np.abs(out[valid] - ref[valid]).max()
    assert err["float32"] < 2e-5 and err["rows"] < 2e-5
    assert err["bf16x3"] < 2e-4
    assert 2e-3 < err["bf16"] < 0.1
    assert err["bf16x3"] < err["bf16"] / 50


@pytest.mark.parametrize("dot_precision", ["float32", "bf16x3"])
def test_query_blocks_split_a_long_chunk_across_programs(dot_precision):
    """37 new tokens x 3 query heads = 111 query rows: 7 blocks of 16 or 2 of 64, every block a
    program that reads the row's pages; any split gives the reference's result."""
    args, codecs = make_case(k_bits=5, v_bits=3, t=37, ctx_lens=(0, 21, 9), page_size=8)
    valid = np.arange(37)[None, :] < np.asarray(args[8])[:, None]
    outs = []
    for rows in (16, 64, 128):
        out, ref = run_both(args, codecs, pages_per_split=2, dot_precision=dot_precision, query_rows=rows)
        np.testing.assert_allclose(out[valid], ref[valid], rtol=2e-4, atol=2e-4)
        outs.append(out[valid])
    np.testing.assert_allclose(outs[0], outs[2], rtol=1e-5, atol=1e-5)


def test_rows_products_keep_each_query_row_apart():
    """The "rows" products: every query row its own running softmax, put back together in
    order. 5 tokens x 3 heads = 15 rows in programs of 1, 2 and 4 rows (a padded block
    included), over pages of 8 in tiles of 1 and 2 pages, match the reference."""
    args, codecs = make_case(k_bits=6, v_bits=5, t=5, ctx_lens=(0, 29, 11), page_size=8)
    valid = np.arange(5)[None, :] < np.asarray(args[8])[:, None]
    for rows in (1, 2, 4):
        for step in (1, 2):
            out, ref = run_both(
                args, codecs, pages_per_split=2, pages_per_step=step, dot_precision="rows", query_rows=rows
            )
            np.testing.assert_allclose(out[valid], ref[valid], rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="power of two >= 16"):
        run_both(args, codecs, pages_per_split=2, dot_precision="float32", query_rows=4)
    # Whole byte planes (4:4's default loads): the tile's columns come joined, the queries follow.
    args, codecs = make_case(k_bits=4, v_bits=4, t=5, ctx_lens=(0, 29, 11), page_size=8)
    out, ref = run_both(args, codecs, pages_per_split=2, dot_precision="rows", code_loads="planes")
    np.testing.assert_allclose(out[valid], ref[valid], rtol=2e-5, atol=2e-5)


def test_default_query_rows_bound_each_program():
    """At head_dim 64 the defaults hold at most 16 query rows per program for float32 FMA
    products and 64 for the tensor-core ones (more spill registers when built for sm_90), and
    proportionally fewer for wider heads, never under Triton's 16."""
    from pallas_kernels.tq_attention import DOT_PRECISION, DOT_PRECISIONS, default_query_rows

    assert DOT_PRECISION in DOT_PRECISIONS
    assert [default_query_rows(p) for p in DOT_PRECISIONS] == [16, 64, 64, 4]
    assert default_query_rows("rows", 256) == 4  # no dot: a few unrolled rows at any width
    assert [default_query_rows("bf16x3", d) for d in (64, 128, 256)] == [64, 32, 16]
    assert default_query_rows("float32", 256) == 16


def test_bad_arguments_raise_clear_errors():
    args, codecs = make_case(k_bits=4, v_bits=4)
    with pytest.raises(ValueError, match="QJL"):
        tq_paged_attention(*args, k_codec=TurboQuant(head_dim=64, bits=4, qjl=True), v_codec=codecs["v_codec"])
    with pytest.raises(ValueError, match="head_dim"):
        tq_paged_attention(*args, k_codec=TurboQuant(head_dim=128, bits=4), v_codec=codecs["v_codec"])
    with pytest.raises(ValueError, match="pages_per_split"):
        tq_paged_attention(*args, **codecs, pages_per_split=0)
    for step in (0, 3, 2.0):
        with pytest.raises(ValueError, match="pages_per_step must be a positive divisor of pages_per_split"):
            tq_paged_attention(*args, **codecs, pages_per_split=4, pages_per_step=step)
    with pytest.raises(ValueError, match="code_loads must be one of"):
        tq_paged_attention(*args, **codecs, code_loads="rows")
    with pytest.raises(ValueError, match="dot_precision must be one of"):
        tq_paged_attention(*args, **codecs, dot_precision="tf32")
    for rows in (8, 24, 32.0):
        with pytest.raises(ValueError, match="query_rows must be a power of two >= 16"):
            tq_paged_attention(*args, **codecs, query_rows=rows)
    with pytest.raises(ValueError, match="q must be"):
        tq_paged_attention(args[0][0], *args[1:], **codecs)
    with pytest.raises(ValueError, match="QJL"):
        tq_paged_attention_xla(*args, k_codec=TurboQuant(head_dim=64, bits=4, qjl=True), v_codec=codecs["v_codec"])
    for window in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window must be a positive int or None"):
            tq_paged_attention_xla(*args, **codecs, window=window)
    with pytest.raises(ValueError, match="positions must be"):
        tq_paged_attention_xla(*args, **codecs, window=4, positions=jnp.zeros((3, 2), jnp.int32))


# A draft tree of six nodes: each node's parent (-1: the root).
TREE_PARENTS = (-1, 0, 0, 1, 2, 3)


@functools.cache
def window_case(t, ctx_lens, window, tree, num_sinks):
    """A sliding-window case, its knobs, and the reference with and without the window."""
    args, codecs = make_case(k_bits=6, v_bits=5, t=t, ctx_lens=ctx_lens)
    b, hkv = len(ctx_lens), 3
    knobs = {"window": window}
    if tree:
        depth, knobs["new_mask"] = tree_depth_and_mask(jnp.tile(jnp.asarray(TREE_PARENTS, jnp.int32), (b, 1)))
        knobs["positions"] = args[7][:, None] + depth
    if num_sinks:
        rng = np.random.default_rng(11)
        shapes = [(b, num_sinks, hkv, 64)] * 2 + [(b, t, hkv, 64)] * 2
        knobs["sinks"] = Sinks(*(jnp.asarray(rng.standard_normal(shape).astype(np.float32)) for shape in shapes))
    ref = np.asarray(reference(*args, **codecs, **knobs))
    whole = np.asarray(reference(*args, **codecs, **dict(knobs, window=None)))
    return args, codecs, knobs, ref, whole


@pytest.mark.parametrize(
    "t, ctx_lens, window", [(1, (0, 5, 19), 4), (6, (0, 2, 13), 5), (6, (3, 9, 30), 1), (6, (1, 8, 21), 16)]
)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("num_sinks", [0, 2])
@pytest.mark.parametrize("impl", ["xla", "pallas", "pallas-rows"])
def test_sliding_window_in_the_rotated_domain_matches_reference(impl, t, ctx_lens, window, tree, num_sinks):
    """Both rotated-domain paths (the kernel with its dot and its "rows" products) with a
    sliding window (Gemma's local layers) against the reference, which decodes the pages and
    masks by position: stored keys, the new tokens (a chain, or a tree whose nodes sit at
    their depths) and unquantized sinks alike. The window changes the output wherever keys
    fall outside it."""
    if tree and t == 1:
        pytest.skip("a one-node tree is a chain")
    args, codecs, knobs, ref, whole = window_case(t, ctx_lens, window, tree, num_sinks)
    kernel = {}
    if impl != "xla":
        kernel = {"pages_per_split": 2, "dot_precision": "rows" if impl == "pallas-rows" else DOT_PRECISION}
    out = np.asarray(IMPLS[impl.split("-")[0]](*args, **codecs, **knobs, **kernel))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4)
    assert np.abs(out - whole).max() > 1e-2  # keys outside the window were left out


@gpu
@pytest.mark.parametrize("k_bits, v_bits", [(4, 4), (6, 4), (3, 3)])
def test_gpu_kernel_matches_reference(k_bits, v_bits):
    args, codecs = make_case(k_bits=k_bits, v_bits=v_bits, ctx_lens=(100, 1, 513, 64), page_size=16)
    out, ref = run_both(args, codecs, pages_per_split=8, interpret=False)
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-3)


@gpu
@pytest.mark.parametrize("t", [1, 16])
def test_gpu_kernel_applies_the_window(t):
    """Gemma's shape (one KV head of 256, four query heads) with a window shorter than most
    rows' context, compiled for the GPU."""
    args, codecs = make_case(
        k_bits=6, v_bits=5, t=t, head_dim=256, hkv=1, group=4, ctx_lens=(100, 1, 513, 64), page_size=16
    )
    out = np.asarray(tq_paged_attention(*args, **codecs, pages_per_split=8, interpret=False, window=64))
    ref = np.asarray(reference(*args, **codecs, window=64))
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-3)


@functools.cache
def sinks_case(t, ctx_lens, n):
    """A case, `n` sink tokens' unquantized keys and values, and the reference with them."""
    args, codecs = make_case(k_bits=3, v_bits=3, t=t, ctx_lens=ctx_lens)
    rng = np.random.default_rng(5)
    b, hkv = len(ctx_lens), 3
    sinks = Sinks(
        *(
            jnp.asarray(rng.standard_normal(shape).astype(np.float32))
            for shape in [(b, n, hkv, 64)] * 2 + [(b, t, hkv, 64)] * 2
        )
    )
    return args, codecs, sinks, np.asarray(reference(*args, **codecs, sinks=sinks))


@pytest.mark.parametrize("t, ctx_lens, n", [(1, (0, 3, 19), 4), (6, (0, 2, 13), 8)])
@both_impls
def test_sink_tokens_are_read_unquantized(impl, t, ctx_lens, n):
    """Positions below n come from `Sinks` (stored ones for the context, the new tokens' own
    values where a new token sits on a sink position), everything else from the pages."""
    args, codecs, sinks, ref = sinks_case(t, ctx_lens, n)
    out = np.asarray(IMPLS[impl](*args, **codecs, sinks=sinks, pages_per_split=2))
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4)
    plain = case_reference(args, codecs)
    assert np.abs(out - plain).max() > 1e-2  # the sinks changed what was read


@functools.cache
def shared_sinks_case(t, page_size, shared, n):
    """Three rows whose tables start with the same `shared` pages, `n` sink tokens, and the
    reference reading whole tables with the sinks."""
    args, codecs = make_case(k_bits=4, v_bits=3, page_size=page_size, ctx_lens=(24, 29, 45), t=t)
    table = np.array(args[5])
    table[:, :shared] = table[0, :shared]
    ctx_lens, num_new = np.array([24, 29, 45], np.int32), np.full(3, t, np.int32)
    q, k_new, v_new, k_pool, v_pool, _, layer = args[:7]
    rng = np.random.default_rng(9)
    stored = [jnp.asarray(rng.standard_normal((3, n, 3, 64)).astype(np.float32)) for _ in range(2)]
    fresh = [jnp.asarray(rng.standard_normal((3, t, 3, 64)).astype(np.float32)) for _ in range(2)]
    sinks = Sinks(*stored, *fresh)  # the new tokens sit past the sinks: `fresh` is never read
    whole = (q, k_new, v_new, k_pool, v_pool, jnp.asarray(table), layer, jnp.asarray(ctx_lens), jnp.asarray(num_new))
    return whole, codecs, sinks, np.asarray(reference(*whole, **codecs, sinks=sinks))


@pytest.mark.parametrize("t", [1, 3])
@both_impls
def test_shared_pages_with_sinks_merge_three_parts(impl, t):
    """With sink tokens, the shared part skips the sink positions (`skip_first`) and each
    row's stored sinks are a third part (`Sinks.attend`): merged with the rows' own parts they
    equal the reference reading whole tables with the sinks. Skipping nothing counts the
    quantized copies of the sinks twice over and differs."""
    page_size, shared, n = 8, 3, 4
    whole, codecs, sinks, ref = shared_sinks_case(t, page_size, shared, n)
    q, _, _, k_pool, v_pool, table, layer = whole[:7]
    table = np.asarray(table)
    own = past_shared_pages(impl, whole, codecs, shared * page_size)

    def prefix(skip):
        pages = jnp.asarray(table[0, :shared])
        kernel = impl == "pallas"
        return tq_shared_prefix_attention(
            q, k_pool, v_pool, pages, layer, shared * page_size, skip_first=skip, kernel=kernel, **codecs
        )

    out = np.asarray(merge_attention([own, prefix(n), sinks.attend(q)]))
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4)
    doubled = np.asarray(merge_attention([own, prefix(0), sinks.attend(q)]))
    assert np.abs(doubled - ref).max() > 1e-3
    with pytest.raises(ValueError, match="skip_first"):
        prefix(shared * page_size + 1)


@pytest.mark.parametrize("code_loads", ["gather", "planes"])
@pytest.mark.parametrize("k_bits, v_bits, t", [(4, 4, 1), (6, 4, 1), (3, 3, 16)])
@pytest.mark.parametrize("window", [None, 24])
def test_kernel_lowers_to_triton_for_cuda(k_bits, v_bits, t, code_loads, window):
    """Without a GPU, at least the Pallas -> Triton lowering must accept the kernel body
    (every primitive it uses has a Triton rule), with and without a sliding window.
    Compiling and running it needs a GPU."""
    from pallas_kernels import tq_attention

    args, codecs = make_case(k_bits=k_bits, v_bits=v_bits, t=t, page_size=16, ctx_lens=(40, 3))
    q, k_new, v_new, k_pool, v_pool, table, layer, ctx, num_new = args
    layers = jnp.asarray([layer, layer], jnp.int32)
    positions = ctx[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]

    def run(*a):
        return tq_attention._tq_paged_attention(
            *a, **codecs, pages_per_split=2, interpret=False, code_loads=code_loads, window=window, positions=positions
        )

    lowered = jax.jit(run).trace(q, k_new, v_new, k_pool, v_pool, table, layers, ctx, num_new, None)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "tq_paged_attention" in text


def test_rows_products_take_one_page_tiles():
    """The "rows" products hold their tiles through every row's loops: 1,024-element tiles
    (one page of 16 x 64), where the dot's are up to 4,096 (4 pages)."""
    from pallas_kernels.tq_attention import default_pages_per_step

    assert default_pages_per_step(64, 16, 64) == 4
    assert default_pages_per_step(64, 16, 64, "rows") == 1
    assert default_pages_per_step(64, 8, 64, "rows") == 2
    assert default_pages_per_step(64, 16, 256, "rows") == 1
