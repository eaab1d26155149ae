"""The TurboQuant attention kernel built for sm_90 on this machine (scripts/kernel_resources.py):
at the engine's shapes it must fit an H100/H200 program without spilling registers. A kernel
that spills also builds for minutes, which on a GPU shows only as a stalled warm-up."""

import sys

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "scripts"))
import kernel_resources  # noqa: E402

from pallas_kernels.tq_attention import DOT_PRECISION  # noqa: E402
from pallas_kernels.turboquant import TurboQuant  # noqa: E402


def build(tokens, k_bits, v_bits, batch=1, **knobs):
    fn, args = kernel_resources.attention_case(tokens, k_bits, v_bits, batch=batch, pages=64, **knobs)
    kernels = kernel_resources.triton_kernels(fn, *args)
    assert [k["name"] for k in kernels] == [f"tq_paged_attention_{knobs.get('dot_precision', DOT_PRECISION)}"]
    found = kernel_resources.compile_sm90(kernels[0], timeout=240)
    assert "error" not in found, found
    return found


@pytest.mark.parametrize("dot_precision", ["float32", "bf16x3", "rows"])
@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_kernel_fits_a_hopper_program_at_engine_shapes(tokens, dot_precision):
    """Decode (1 token), a verify pass (16) and a prefill chunk (256) in the default format's
    widest pair, with float32 (the default), tensor-core and multiply-reduce products: no
    spills, shared memory within an SM's, and the products on the units `dot_precision` names
    ("rows": FMAs for 4 query rows, not a dot's 16 padded ones, on 1-page tiles)."""
    # Decode at 32 rows: splits of 64 pages, so the loop runs 16 steps and Triton pipelines it
    # (one row's 4-page split is a single step, which built without spills where 32 rows did not).
    found = build(tokens, 6, 5, batch=32 if tokens == 1 else 1, dot_precision=dot_precision)
    assert found["spill_store_bytes"] == found["spill_load_bytes"] == 0
    assert found["shared_bytes"] <= kernel_resources.MAX_SHARED_BYTES
    if dot_precision == "rows":
        assert found["mma"] == 0 and 0 < found["fma"] < 200  # a 1-page tile: 4 rows x 16 x 64 x 2 over 128 threads
    elif dot_precision == "float32":
        assert found["mma"] == 0 and found["fma"] > 1000
    else:
        assert found["mma"] > 0 and found["fma"] < 100


def test_default_kernel_fits_at_gemma_head_width():
    """Gemma 3's shape (head_dim 256, one KV head of four query heads), a verify pass: the
    default holds 16 query rows there, where 64 spilled."""
    fn, args = kernel_resources.attention_case(16, 5, 4, batch=1, pages=64, kv_heads=1, group=4, head_dim=256)
    [kernel] = kernel_resources.triton_kernels(fn, *args)
    found = kernel_resources.compile_sm90(kernel, timeout=240)
    assert "error" not in found, found
    assert found["spill_store_bytes"] == found["spill_load_bytes"] == 0


def test_an_oversized_query_block_is_seen_to_spill():
    """The check can fail: 64 tokens x 3 heads in one float32 program (query_rows 256, what
    every prefill chunk got before query blocks) spill."""
    found = build(64, 6, 5, dot_precision="float32", query_rows=256)
    assert found["spill_store_bytes"] > 0
    assert found["fma"] > 1000 and found["mma"] == 0


@pytest.mark.parametrize("block", [16, 12])
def test_draft_kernels_build_for_hopper_at_dflash_shapes(block):
    """The draft's attention (a block of 16 positions x 9 query heads over 64 pages of a
    256-page pool) and its unmasking step build with Triton: padded to powers of two, and
    not Mosaic GPU, which cannot hold a KV head's whole pool in shared memory."""
    import jax.numpy as jnp

    from pallas_kernels.draft_attention import draft_attention
    from pallas_kernels.unmask import confidence_unmask

    q, kb, kp = jnp.zeros((1, block, 9, 64)), jnp.zeros((1, block, 3, 64)), jnp.zeros((256, 16, 3, 64))
    table, lens = jnp.zeros((1, 64), jnp.int32), jnp.full((1,), 1000, jnp.int32)
    tokens, conf = jnp.zeros((4, block), jnp.int32), jnp.zeros((4, block))
    cases = [
        (lambda q, kb, kp: draft_attention(q, kb, kb, kp, kp, table, lens), (q, kb, kp)),
        (lambda t, c: confidence_unmask(t, t, c, 5), (tokens, conf)),
    ]
    for fn, args in cases:
        [kernel] = kernel_resources.triton_kernels(fn, *args)
        found = kernel_resources.compile_sm90(kernel, timeout=240)
        assert "error" not in found, found
        assert found["spill_store_bytes"] == 0
        assert found["shared_bytes"] <= kernel_resources.MAX_SHARED_BYTES


@pytest.mark.parametrize("head_dim, bits", [(64, 7), (64, 8), (128, 6), (256, 6)])
def test_encoder_fits_a_hopper_program_at_every_head_width(head_dim, bits):
    """The quantize-on-write kernel at SmolLM2's width (the default format's widest keys, and
    tq8, whose 255 boundary compares spilled before the binary search) and at 128 and 256
    (Gemma 3), for a decode step's few vectors: no spills, and shared memory within an SM's
    (the whole 256 x 256 rotation in one program needed 288 KiB)."""
    import jax.numpy as jnp

    from pallas_kernels.tq_encode import tq_encode

    codec = TurboQuant(head_dim=head_dim, bits=bits, seed=0)
    [kernel] = kernel_resources.triton_kernels(lambda x: tq_encode(x, codec, interpret=False), jnp.zeros((8, head_dim)))
    found = kernel_resources.compile_sm90(kernel, timeout=240)
    assert "error" not in found, found
    assert found["spill_store_bytes"] == 0
    assert found["shared_bytes"] <= kernel_resources.MAX_SHARED_BYTES
