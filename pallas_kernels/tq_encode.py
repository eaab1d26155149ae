"""TurboQuant quantize-on-write: a Pallas kernel that encodes vectors into the packed format.

`tq_encode(x, codec)` returns exactly what `TurboQuant.encode` returns (pallas_kernels/
turboquant.py): per vector the planar-packed codes and the float16 norm, and with QJL the
packed residual sign bits and the residual's norm. One kernel program takes a block of rows
[R, d] and does the whole encode in registers: norm, normalize, rotate (one matmul), count the
boundaries below each coordinate (a static loop of compares, or at 7-8 bits a binary search of
b gathered compares: `SEARCH_FROM_BITS`), pack the byte planes with shifts and masks, and for
QJL rebuild the centroid values (by selects, or one gather), take the residual and its
projection, and pack the signs.

Wider heads go in blocks of `COLUMN_BLOCK` rotated coordinates, one program each (the norm is
computed in every one, written by the first): column block j holds positions 8j .. 8j + 7 of
every chunk, so it packs bytes 8j .. 8j + 7 of every plane. With QJL a program takes every
coordinate (the residual needs the whole decoded vector).

Triton has no lowering for slicing a loaded value (`lax.slice`), so the planar chunks are not
cut out of the codes. The kernel gets the rotation (and QJL) matrix with its rows permuted so
that output column p * 8 + m is coordinate m * c + p (chunk m, position p, c = d / 8): a
reshape [R, d] -> [R, c, 8] then lines the 8 chunks up on the last axis, and byte plane r is a
sum over that axis of the chunks shifted into place (their bits are disjoint, so the sum is
the OR of the layout). Permuting rows does not change any coordinate's value.

`tq_encode_reference` is the codec's own jnp encode: the kernel must match it, bit for bit up
to float rounding at cell boundaries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.turboquant import NORM_DTYPE, TurboQuant, store_norms

_HI = jax.lax.Precision.HIGHEST
# Rows a program holds at least, fewer rows padded (Triton's dot wants every dimension >= 16).
# 32, not 16: built for sm_90, a 16-row block at head_dim 256 kept a 3.4 KB array in local
# memory (32 registers, ~4 KB spilled); 32 rows build with none at every head width up to 6 bits.
_MIN_ROWS = 32
# Rotated coordinates one program computes, packs and stores (a second grid axis covers the
# rest). The whole [d, d] rotation in one program needed 288 KiB of shared memory at head_dim
# 256, more than an H100/H200 SM has, and spilled 1,952 bytes a thread at 128; blocks of 32
# rotation rows need 64 KiB at 256 and spill nothing up to 6 bits at head_dim 64, 128 or 256
# (scripts/kernel_resources.py; tests/pallas_kernels/test_kernel_resources.py).
COLUMN_BLOCK = 32
# From which width, by head width, the kernel finds a code by binary search over the boundaries
# (b gathered compares) instead of one compare per boundary (2^b - 1, unrolled). Built for sm_90
# (32 vectors): at head_dim 64 the search takes 126 registers at 6-8 bits, where the compares
# took 110 / 183 / 255 and spilled 448 bytes at 8 bits; at 128 the search spills 200 bytes at
# every width, the compares 40 at 7 bits and 512 at 8; at 256 the search's gathers put an 8 KB
# array in local memory, so the compares stay (2.8 and 1.4 KB spilled at 7 and 8 bits).
SEARCH_FROM_BITS = {64: 7, 128: 8}


def tq_encode_reference(x: jax.Array, codec: TurboQuant) -> dict[str, jax.Array]:
    """`codec.encode_tree(x)`: x [..., d] -> {"codes": uint8 [..., d*b/8], "norms": float16 [...]}
    (+ "qjl_signs" uint8 [..., d/8], "qjl_norms" float16 [...] with QJL)."""
    return codec.encode_tree(x)


def tq_encode(
    x: jax.Array,  # [..., d] vectors to store (any float dtype; encoded in float32)
    codec: TurboQuant,
    *,
    block_rows: int = 32,
    num_warps: int | None = None,
    interpret: bool | None = None,
) -> dict[str, jax.Array]:
    """Encodes x with a Pallas kernel; same result as `tq_encode_reference`.

    Args:
        block_rows: vectors per kernel program, at most (a power of two; fewer vectors are
            padded to min(block_rows, 32) rows).
        num_warps: Triton warps per program (default 4; ignored in interpret mode).
        interpret: run the kernel in the Pallas interpreter (default: on CPU).
    """
    if not isinstance(codec, TurboQuant):
        raise ValueError(f"codec must be a TurboQuant codec, got {type(codec).__name__}")
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 1 or shape[-1] != codec.head_dim:
        raise ValueError(f"expected vectors of dimension {codec.head_dim} (the codec's head_dim), got shape {shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must have a floating dtype, got {x.dtype}")
    if codec.head_dim % 8:
        raise ValueError(f"the planar layout needs head_dim a multiple of 8, got {codec.head_dim}")
    if not isinstance(block_rows, int) or block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a positive power of two, got {block_rows!r}")
    if num_warps is None:
        num_warps = 4
    if not isinstance(num_warps, int) or num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a positive power of two, got {num_warps!r}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return _tq_encode(x, codec=codec, block_rows=block_rows, num_warps=num_warps, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("codec", "block_rows", "num_warps", "interpret"))
def _tq_encode(x, *, codec, block_rows, num_warps, interpret):
    d, bits, c = codec.head_dim, codec.bits, codec.head_dim // 8
    lead = x.shape[:-1]
    n = int(np.prod(lead, dtype=np.int64))
    if n == 0:
        out = {"codes": jnp.zeros((*lead, bits * c), jnp.uint8), "norms": jnp.zeros(lead, NORM_DTYPE)}
        if codec.qjl:
            out["qjl_signs"] = jnp.zeros((*lead, c), jnp.uint8)
            out["qjl_norms"] = jnp.zeros(lead, NORM_DTYPE)
        return out

    rows = min(block_rows, max(_MIN_ROWS, pl.next_power_of_2(n)))
    cols = COLUMN_BLOCK if d % COLUMN_BLOCK == 0 and not codec.qjl else d
    n_pad = -(-n // rows) * rows
    flat = x.reshape(n, d)
    if n_pad != n:
        flat = jnp.pad(flat, ((0, n_pad - n), (0, 0)))  # zero rows encode to finite garbage, cut below

    # Row p * 8 + m of a permuted matrix is row m * c + p of the original (see the module doc).
    perm = np.arange(d).reshape(8, c).T.reshape(d)
    operands = [
        flat,
        jnp.asarray(codec.rotation_matrix[perm]),
        jnp.asarray(codec.boundaries),
        jnp.asarray(codec.centroids),
    ]
    full = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))  # noqa: E731
    in_specs = [
        pl.BlockSpec((rows, d), lambda i, j: (i, 0)),
        pl.BlockSpec((cols, d), lambda i, j: (j, 0)),  # the rotation rows of column block j
        full(codec.boundaries.shape),
        full(codec.centroids.shape),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((n_pad, bits, c), jnp.uint8),
        jax.ShapeDtypeStruct((n_pad,), jnp.float32),
    ]
    out_specs = [
        pl.BlockSpec((rows, bits, cols // 8), lambda i, j: (i, 0, j)),
        pl.BlockSpec((rows,), lambda i, j: (i,)),
    ]
    if codec.qjl:
        operands.append(jnp.asarray(codec.qjl_matrix[perm]))
        in_specs.append(full((d, d)))
        out_shape += [jax.ShapeDtypeStruct((n_pad, 1, c), jnp.uint8), jax.ShapeDtypeStruct((n_pad,), jnp.float32)]
        out_specs += [pl.BlockSpec((rows, 1, c), lambda i, j: (i, 0, 0)), pl.BlockSpec((rows,), lambda i, j: (i,))]

    search = bits >= SEARCH_FROM_BITS.get(d, bits + 1)
    kernel = functools.partial(_encode_kernel, bits=bits, qjl=codec.qjl, search=search)
    outs = pl.pallas_call(
        kernel,
        grid=(n_pad // rows, d // cols),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name="tq_encode",
    )(*operands)

    # [N, b, c] is the b planes of c bytes one after another: the packed layout as is.
    out = {"codes": outs[0][:n].reshape(*lead, bits * c), "norms": store_norms(outs[1][:n].reshape(lead))}
    if codec.qjl:
        out["qjl_signs"] = outs[2][:n].reshape(*lead, c)
        out["qjl_norms"] = store_norms(outs[3][:n].reshape(lead))
    return out


def _pack_planes(codes: jax.Array, bits: int) -> list[jax.Array]:
    """int32 codes [R, d] < 2^bits in chunk-interleaved order (column p * 8 + m = chunk m,
    position p) -> the `bits` byte planes of the planar layout, int32 [R, d / 8] each."""
    r_rows, d = codes.shape
    chunks = codes.reshape(r_rows, d // 8, 8)  # [R, c, 8]: chunk m on the last axis
    m = jax.lax.broadcasted_iota(jnp.int32, (1, 1, 8), 2)
    planes = []
    for r in range(bits):
        # Chunk m sits at word bits m*b .. m*b + b - 1; plane r is word bits 8r .. 8r + 7. The
        # clamped shifts stay in 0..8 (no over-wide shifts), which still zero whatever falls out.
        shift = m * bits - 8 * r
        left, right = jnp.clip(shift, 0, 8), jnp.clip(-shift, 0, 8)
        part = ((chunks << left) >> right) & 255
        planes.append(jnp.sum(part, axis=-1))  # disjoint bits: the sum is the OR
    return planes


def _encode_kernel(
    x_ref,  # [R, d] vectors, any float dtype
    rot_ref,  # [C, d] float32 rows of the rotation R (permuted, see the module doc) for this column block
    bnd_ref,  # [2^b - 1] float32 cell boundaries, ascending
    cb_ref,  # [2^b] float32 centroids, ascending
    *refs,  # (qjl_ref [d, d] permuted S), codes_ref [R, b, C/8], norms_ref [R], (signs_ref [R, 1, c], qn_ref [R])
    bits: int,
    qjl: bool,
    search: bool,
):
    if qjl:
        qjl_ref, codes_ref, norms_ref, signs_ref, qn_ref = refs
    else:
        codes_ref, norms_ref = refs

    x = x_ref[...].astype(jnp.float32)
    norms = jnp.sqrt(jnp.sum(x * x, axis=-1))  # [R]
    u = x / jnp.maximum(norms, 1e-30)[:, None]  # a zero (padding) row stays zero
    rot = rot_ref[...]
    y = jax.lax.dot_general(u, rot, (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=jnp.float32)

    # Code = number of boundaries strictly below y; with QJL also its centroid.
    if not search:  # a compare per boundary, the centroid by selects
        idx = jnp.zeros(y.shape, jnp.int32)
        values = jnp.full(y.shape, cb_ref[0], jnp.float32) if qjl else None
        for k in range((1 << bits) - 1):
            above = y > bnd_ref[k]
            idx = idx + above.astype(jnp.int32)
            if qjl:
                values = jnp.where(above, cb_ref[k + 1], values)
    else:  # binary search over the ascending boundaries: a gathered compare per bit
        idx = jnp.zeros(y.shape, jnp.int32)
        for level in reversed(range(bits)):
            step = idx + (1 << level)
            idx = jnp.where(y > bnd_ref[step - 1], step, idx)
        values = cb_ref[idx] if qjl else None

    for r, plane in enumerate(_pack_planes(idx, bits)):
        codes_ref[:, r, :] = plane.astype(jnp.uint8)

    @pl.when(pl.program_id(1) == 0)
    def _():
        norms_ref[...] = norms

    if qjl:
        u_hat = jax.lax.dot_general(
            values, rot, (((1,), (0,)), ((), ())), precision=_HI, preferred_element_type=jnp.float32
        )
        residual = u - u_hat
        projected = jax.lax.dot_general(
            residual, qjl_ref[...], (((1,), (1,)), ((), ())), precision=_HI, preferred_element_type=jnp.float32
        )
        (signs,) = _pack_planes((projected >= 0).astype(jnp.int32), 1)
        signs_ref[:, 0, :] = signs.astype(jnp.uint8)
        qn_ref[...] = jnp.sqrt(jnp.sum(residual * residual, axis=-1))
