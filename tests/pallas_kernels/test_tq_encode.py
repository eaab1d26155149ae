"""Quantize-on-write kernel (Pallas, interpret mode) against the codec's own jnp encode.

Codes must agree exactly except at coordinates whose rotated value lies within float rounding
of a cell boundary (the kernel's matmul may round differently there); the check recomputes the
rotated coordinates in float64 to know which those are and fails on any other difference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tq_encode import tq_encode, tq_encode_reference
from pallas_kernels.turboquant import TurboQuant, unpack_bits

NEAR = 1e-5  # a coordinate this close to a boundary (or a QJL projection this close to 0) may round either way
MAX_MISMATCH = 1e-3  # ... and such coordinates must stay a tiny fraction of all coordinates (or a single one)

# Jitted once per codec: op-by-op dispatch of the reference would dominate the test time.
_reference = jax.jit(tq_encode_reference, static_argnums=1)
_unpack = jax.jit(unpack_bits, static_argnums=(1, 2))


def _codec(head_dim, bits, rotation="haar", qjl=False):
    return TurboQuant(head_dim, bits, seed=3, rotation=rotation, qjl=qjl)


def _gaussian(lead, head_dim, seed=0):
    return np.random.default_rng(seed).standard_normal((*lead, head_dim)).astype(np.float32)


def _heavy_tailed(rows, head_dim, seed=0):
    """Vectors whose rotated coordinates spread over the whole [-1, 1] range, so every code
    level (and every bit of every plane) shows up, not only the central cells."""
    rng = np.random.default_rng(seed)
    y = rng.standard_normal((rows, head_dim)) * np.exp(rng.uniform(-4, 4, (rows, head_dim)))
    return y, rng


def _rotated(x, codec):
    """float64 rotated unit vectors y = u R^T of the reference encode."""
    x = np.asarray(x, np.float64)
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return (x / np.maximum(n, 1e-30)) @ codec.rotation_matrix.astype(np.float64).T


def assert_matches_reference(x, codec, out, ref):
    """Kernel output `out` vs reference `ref` for inputs x (see the module doc)."""
    assert sorted(out) == sorted(ref)
    for name in ref:
        assert out[name].shape == ref[name].shape, name
        assert out[name].dtype == ref[name].dtype, name
    d, lead = codec.head_dim, np.shape(x)[:-1]
    np.testing.assert_allclose(np.asarray(out["norms"]), np.asarray(ref["norms"]), rtol=1e-5, atol=1e-30)

    got = np.asarray(_unpack(out["codes"], codec.bits, d))
    want = np.asarray(_unpack(ref["codes"], codec.bits, d))
    y = _rotated(x, codec)
    near = np.min(np.abs(y[..., None] - codec.boundaries.astype(np.float64)), axis=-1) < NEAR
    bad = got != want
    assert not np.any(bad & ~near), f"{np.sum(bad & ~near)} codes differ away from any boundary"
    assert np.all(np.abs(got - want)[bad] == 1), "a boundary case may only move to the neighbouring cell"
    assert bad.sum() <= max(1, MAX_MISMATCH * bad.size), f"{bad.sum()} of {bad.size} codes differ"
    rows_ok = ~np.any(bad, axis=-1)  # [...]

    if codec.qjl:
        got_s = np.asarray(_unpack(out["qjl_signs"], 1, d))
        want_s = np.asarray(_unpack(ref["qjl_signs"], 1, d))
        # The reference's projection S (u - c[idx] R) in float64, with the reference's codes.
        u_hat = codec.centroids.astype(np.float64)[want] @ codec.rotation_matrix.astype(np.float64)
        u = np.asarray(x, np.float64) / np.maximum(np.linalg.norm(np.asarray(x, np.float64), axis=-1), 1e-30)[..., None]
        projected = (u - u_hat) @ codec.qjl_matrix.astype(np.float64).T
        bad_s = (got_s != want_s) & rows_ok[..., None]
        assert not np.any(bad_s & (np.abs(projected) >= NEAR)), "QJL signs differ away from zero"
        assert bad_s.sum() <= max(1, MAX_MISMATCH * bad_s.size), f"{bad_s.sum()} of {bad_s.size} signs differ"
        np.testing.assert_allclose(
            np.asarray(out["qjl_norms"])[rows_ok], np.asarray(ref["qjl_norms"])[rows_ok], rtol=1e-5, atol=1e-7
        )
        rows_ok &= ~np.any(bad_s, axis=-1)

    assert np.mean(rows_ok) > 0.5 or np.size(rows_ok) < 4  # most vectors are compared in full below
    decode = jax.jit(codec.decode)
    dec_out, dec_ref = np.asarray(decode(out)).reshape(*lead, d), np.asarray(decode(ref)).reshape(*lead, d)
    scale = np.asarray(ref["norms"])[..., None] + 1e-30
    np.testing.assert_allclose((dec_out / scale)[rows_ok], (dec_ref / scale)[rows_ok], rtol=0, atol=1e-5)


def _run(x, codec, **kwargs):
    out = tq_encode(jnp.asarray(x), codec, **kwargs)
    ref = _reference(jnp.asarray(x, jnp.float32), codec)
    assert_matches_reference(np.asarray(x, np.float32), codec, out, ref)
    return out, ref


# bits 2..8 at both head dims, alternating leading shapes (neither a multiple of the block)
# and rotations so that every combination of two of them appears.
CASES = [
    pytest.param(bits, dim, (5,) if (bits + i) % 2 else (3, 7, 2), ("haar", "hadamard")[bits % 2], id=f"b{bits}-d{dim}")
    for bits in range(2, 9)
    for i, dim in enumerate((64, 128))
]


@pytest.mark.parametrize("bits, head_dim, lead, rotation", CASES)
def test_matches_reference(bits, head_dim, lead, rotation):
    codec = _codec(head_dim, bits, rotation)
    _run(_gaussian(lead, head_dim, seed=bits), codec)


@pytest.mark.parametrize("bits, lead", [(3, (5,)), (5, (3, 7, 2)), (8, (40,))])
def test_matches_reference_at_gemma_head_width(bits, lead):
    """head_dim 256 (Gemma 3): four column blocks per row block, each packing its own bytes of
    every plane; 40 rows make two row blocks of 32."""
    codec = _codec(256, bits, ("haar", "hadamard")[bits % 2])
    _run(_gaussian(lead, 256, seed=20 + bits), codec)


@pytest.mark.parametrize(
    "bits, head_dim, lead, rotation",
    [
        (1, 64, (5,), "haar"),
        (2, 64, (3, 7, 2), "hadamard"),
        (3, 128, (), "haar"),
        (4, 128, (3, 7, 2), "hadamard"),
        (8, 64, (3, 7, 2), "haar"),
    ],
)
def test_matches_reference_with_qjl(bits, head_dim, lead, rotation):
    """QJL on; batches of several vectors hold zero vectors too (a zero vector's residual is a
    whole centroid vector, its norms must stay finite and its decode exactly 0)."""
    codec = _codec(head_dim, bits, rotation, qjl=True)
    x = _gaussian(lead, head_dim, seed=10 + bits)
    zero = np.zeros(x.shape[:-1], bool)
    if zero.size > 1:
        zero.reshape(-1)[[0, zero.size // 2]] = True
        x[zero] = 0.0
    out, _ = _run(x, codec)
    for name, a in out.items():
        assert np.all(np.isfinite(np.asarray(a, np.float64))), name
    np.testing.assert_array_equal(np.asarray(out["norms"])[zero], 0.0)
    decoded = np.asarray(codec.decode_tree(out))
    assert np.all(np.isfinite(decoded)) and np.all(decoded[zero] == 0.0)


@pytest.mark.parametrize("bits, head_dim, qjl", [(8, 64, False), (5, 64, True)])
def test_every_code_level_round_trips(bits, head_dim, qjl):
    """Heavy-tailed inputs reach the extreme cells: nearly every level, hence every bit of
    every byte plane, is exercised, with a bfloat16 input, several blocks and a ragged tail."""
    codec = _codec(head_dim, bits, qjl=qjl)
    y, rng = _heavy_tailed(72, head_dim, seed=bits)
    x = (y @ codec.rotation_matrix.astype(np.float64)) * np.exp(rng.uniform(-2, 2, (72, 1)))
    x = jnp.asarray(x, jnp.bfloat16)
    out, _ = _run(x, codec, block_rows=16)
    levels = np.unique(np.asarray(_unpack(out["codes"], bits, head_dim)))
    assert len(levels) >= 0.9 * (1 << bits)


def test_empty_batch():
    empty = tq_encode(jnp.zeros((0, 3, 64), jnp.float32), _codec(64, 2, qjl=True))
    assert empty["codes"].shape == (0, 3, 16) and empty["norms"].shape == (0, 3)
    assert empty["qjl_signs"].shape == (0, 3, 8) and empty["qjl_norms"].shape == (0, 3)


def test_traced_under_jit():
    """The wrapper works on tracers (shape checks only, codec closed over), e.g. inside a model step."""
    codec = _codec(64, 2)
    x = jnp.asarray(_gaussian((5,), 64, seed=12))
    traced = jax.jit(lambda v: tq_encode(v * 2.0, codec))(x)
    eager = tq_encode(x * 2.0, codec)
    for name in eager:
        np.testing.assert_array_equal(np.asarray(traced[name]), np.asarray(eager[name]))


def test_bad_inputs_raise():
    codec = _codec(64, 4)
    with pytest.raises(ValueError, match="dimension 64"):
        tq_encode(jnp.zeros((3, 32), jnp.float32), codec)
    with pytest.raises(ValueError, match="floating"):
        tq_encode(jnp.zeros((3, 64), jnp.int32), codec)
    with pytest.raises(ValueError, match="block_rows"):
        tq_encode(jnp.zeros((3, 64), jnp.float32), codec, block_rows=24)
    with pytest.raises(ValueError, match="TurboQuant"):
        tq_encode(jnp.zeros((3, 64), jnp.float32), object())


@pytest.mark.parametrize("plane", [0, 2])
def test_corrupted_plane_is_caught(plane):
    """The comparison is not vacuous: flipping one bit of one byte plane in the kernel's output
    changes one code per flipped byte, the check rejects it and the decode moves visibly."""
    codec = _codec(64, 3)
    x = _gaussian((6,), 64, seed=11)
    out, ref = _run(x, codec)
    codes = np.asarray(out["codes"]).copy()
    c = 64 // 8
    # Word bit 8r + 4: bit 1 of chunk 1's codes (plane 0) or bit 2 of chunk 6's (plane 2).
    codes[:, plane * c : (plane + 1) * c] ^= np.uint8(0x10)
    corrupted = dict(out, codes=jnp.asarray(codes))
    with pytest.raises(AssertionError):
        assert_matches_reference(x, codec, corrupted, ref)
    diff = np.abs(np.asarray(codec.decode_tree(corrupted)) - np.asarray(codec.decode_tree(ref)))
    assert diff.max() > 1e-2 * float(np.min(np.asarray(ref["norms"])))


@pytest.mark.parametrize("bits, qjl", [(4, False), (6, False), (3, True)])
def test_kernel_lowers_to_triton_for_cuda(bits, qjl):
    """Without a GPU, at least the Pallas -> Triton lowering must accept the kernel body."""
    from pallas_kernels.tq_encode import _tq_encode

    codec = TurboQuant(head_dim=64, bits=bits, qjl=qjl)
    x = jnp.zeros((3, 40, 64), jnp.float32)
    lowered = _tq_encode.trace(x, codec=codec, block_rows=32, num_warps=4, interpret=False)
    assert "tq_encode" in lowered.lower(lowering_platforms=("cuda",)).as_text()
