"""TurboQuant vector codec: random rotation + Lloyd-Max scalar codebooks (+ optional QJL residual).

The packed format that quantized KV pages hold and that kernels read. Per vector x of
dimension d (a power of two):

1. n = ||x||, stored as float16 (relative error below 2^-11, far under the codes'); u = x / n.
2. y = R u for a fixed random orthogonal R (Haar, or randomized Hadamard H D3 H D2 H D1).
   Each coordinate of a rotated unit vector follows f(t) ~ (1 - t^2)^((d - 3) / 2) on
   [-1, 1], whatever the data, so one codebook serves every vector without calibration.
3. Each y_i becomes the index of its Lloyd-Max cell for f (2^b centroids, boundaries at
   midpoints), packed b bits per coordinate.
4. Optional QJL residual: the sign bits of S (u - u_hat) for a second random orthogonal S of
   size d, plus the residual's norm; it adds sqrt(pi/2)/sqrt(d) * |r| * S^T sign(S r) back.

Decoding is centroid lookup, R^T, times n. Attention can stay in the rotated domain instead
(rotate the query once); that is the kernels' business, this module is the reference.

The rotation matrices are data of the format, not a seed: `TurboQuant.fingerprint` hashes
them with the codebook so stored pages can be checked against the codec that reads them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_BITS = range(1, 9)
NORM_DTYPE = jnp.float16  # stored norms: 2 bytes per vector
_NORM_MAX = float(np.finfo(np.float16).max)
_GRID_POINTS = 1 << 20  # quadrature grid for the Lloyd iterations on [-1, 1]


# -- codebooks -------------------------------------------------------------------------------


def coordinate_density(t: np.ndarray, dim: int) -> np.ndarray:
    """Density of one coordinate of a uniformly random unit vector in R^dim (unnormalized)."""
    return np.clip(1.0 - t * t, 0.0, None) ** ((dim - 3) / 2.0)


def _lloyd_max(grid: np.ndarray, weights: np.ndarray, levels: int, init: np.ndarray, iters: int) -> np.ndarray:
    """Lloyd-Max centroids for a density sampled on `grid` (weights = density * spacing)."""
    cum_w = np.concatenate([[0.0], np.cumsum(weights)])
    cum_tw = np.concatenate([[0.0], np.cumsum(weights * grid)])
    centroids = np.sort(init.astype(np.float64))
    for _ in range(iters):
        bounds = (centroids[1:] + centroids[:-1]) / 2
        cut = np.concatenate([[0], np.searchsorted(grid, bounds), [len(grid)]])
        mass = cum_w[cut[1:]] - cum_w[cut[:-1]]
        first = cum_tw[cut[1:]] - cum_tw[cut[:-1]]
        new = np.where(mass > 0, first / np.maximum(mass, 1e-300), centroids)
        if np.max(np.abs(new - centroids)) < 1e-12:
            centroids = new
            break
        centroids = new
    return centroids


def _mse_of(grid: np.ndarray, weights: np.ndarray, centroids: np.ndarray) -> float:
    """Expected squared error of one coordinate quantized with `centroids` (weights sum to 1)."""
    bounds = (centroids[1:] + centroids[:-1]) / 2
    q = centroids[np.searchsorted(bounds, grid)]
    return float(np.sum(weights * (grid - q) ** 2))


@functools.lru_cache(maxsize=64)
def lloyd_max_codebook(dim: int, bits: int, kind: str = "exact") -> tuple[np.ndarray, float]:
    """Centroids (ascending, float64) for `bits`-bit quantization of a rotated unit vector's
    coordinate, and the expected squared error per coordinate.

    Args:
        dim: vector dimension d.
        bits: 1..8.
        kind: "exact" (Lloyd-Max on the exact coordinate density, the default) or "gaussian"
            (Lloyd-Max for N(0, 1/d), the common approximation, for comparison).
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if dim < 4 or dim & (dim - 1):
        raise ValueError(f"dim must be a power of two >= 4, got {dim}")
    if kind not in ("exact", "gaussian"):
        raise ValueError(f"kind must be 'exact' or 'gaussian', got {kind!r}")
    levels = 1 << bits
    grid = np.linspace(-1.0, 1.0, _GRID_POINTS)
    density = coordinate_density(grid, dim)
    exact_weights = density / density.sum()
    if kind == "gaussian":
        # Lloyd-Max for the standard normal, computed on its own grid, then scaled by 1/sqrt(d).
        z = np.linspace(-12.0, 12.0, _GRID_POINTS)
        gw = np.exp(-0.5 * z * z)
        gw /= gw.sum()
        init = _normal_quantiles(levels)
        centroids = _lloyd_max(z, gw, levels, init, iters=20000) / math.sqrt(dim)
    else:
        init = _normal_quantiles(levels) / math.sqrt(dim)
        centroids = _lloyd_max(grid, exact_weights, levels, init, iters=20000)
    return centroids, _mse_of(grid, exact_weights, centroids)


def _normal_quantiles(levels: int) -> np.ndarray:
    """Midpoint quantiles of N(0, 1): a good starting point for Lloyd's iterations."""
    from statistics import NormalDist

    nd = NormalDist()
    return np.array([nd.inv_cdf((i + 0.5) / levels) for i in range(levels)])


# -- rotations -------------------------------------------------------------------------------


def _rng(seed: int, purpose: str) -> np.random.Generator:
    """A generator for one purpose: the tag keeps the codec's random streams apart from each
    other and from user data drawn with the same integer seed."""
    return np.random.default_rng([seed, int.from_bytes(hashlib.sha256(purpose.encode()).digest()[:4], "little")])


def haar_rotation(dim: int, seed: int, purpose: str = "rotation") -> np.ndarray:
    """A Haar-distributed orthogonal matrix: QR of a Gaussian matrix, columns sign-corrected."""
    g = _rng(seed, purpose).standard_normal((dim, dim))
    q, r = np.linalg.qr(g)
    return (q * np.sign(np.diag(r))[None, :]).astype(np.float32)


def hadamard_rotation(dim: int, seed: int) -> np.ndarray:
    """Randomized Hadamard transform H D3 H D2 H D1 as a matrix (H normalized Walsh-Hadamard)."""
    if dim & (dim - 1):
        raise ValueError(f"Hadamard rotations need a power-of-two dimension, got {dim}")
    h = np.ones((1, 1))
    while h.shape[0] < dim:
        h = np.block([[h, h], [h, -h]])
    h /= math.sqrt(dim)
    signs = _rng(seed, "hadamard").choice([-1.0, 1.0], size=(3, dim))
    m = np.eye(dim)
    for d in signs:
        m = h @ (d[:, None] * m)
    return m.astype(np.float32)


ROTATIONS = {"haar": haar_rotation, "hadamard": hadamard_rotation}


# -- bit packing -------------------------------------------------------------------------------
#
# Planar layout, chosen so a kernel unpacks with contiguous loads and whole-vector shifts and
# gets the coordinates back in their natural order. A vector of d codes of b bits is cut into 8
# chunks of c = d / 8 consecutive coordinates. For each p < c the 8 codes chunk_0[p] ..
# chunk_7[p] form one 8b-bit word, chunk m at bits m*b .. m*b + b - 1; byte plane r (r < b)
# holds bits 8r .. 8r + 7 of the words of every p. The packed vector is the b planes, each of
# c bytes, one after another: d * b / 8 bytes.


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
    """Packs integer codes [..., d] < 2^bits into uint8 [..., d * bits / 8] (planar layout above)."""
    d = codes.shape[-1]
    if d % 8:
        raise ValueError(f"the planar layout needs a multiple of 8 codes, got {d}")
    lead, c = codes.shape[:-1], d // 8
    chunks = jnp.swapaxes(codes.astype(jnp.uint32).reshape(*lead, 8, c), -1, -2)  # [..., c, 8]
    stream = (chunks[..., None] >> jnp.arange(bits, dtype=jnp.uint32)) & 1  # [..., c, 8, b]
    stream = stream.reshape(*lead, c, bits, 8)  # word bit 8r + j at [..., r, j]
    planes = jnp.sum(stream << jnp.arange(8, dtype=jnp.uint32), axis=-1)  # [..., c, b]
    return jnp.swapaxes(planes, -1, -2).reshape(*lead, bits * c).astype(jnp.uint8)


def unpack_bits(packed: jax.Array, bits: int, dim: int) -> jax.Array:
    """Inverse of `pack_bits`: uint8 [..., dim * bits / 8] -> int32 codes [..., dim]."""
    c = dim // 8
    planes = packed.astype(jnp.int32).reshape(*packed.shape[:-1], bits, c)
    return jnp.concatenate(unpack_planes([planes[..., r, :] for r in range(bits)], bits), axis=-1)


def unpack_planes(planes: list[jax.Array], bits: int) -> list[jax.Array]:
    """The 8 code chunks of the planar layout from its `bits` byte planes (int32 arrays of one
    shape): shifts and masks only."""
    mask = (1 << bits) - 1
    chunks = []
    for m in range(8):
        lo, shift = divmod(m * bits, 8)
        code = planes[lo] >> shift
        if shift + bits > 8:
            code = code | (planes[lo + 1] << (8 - shift))
        chunks.append(code & mask)
    return chunks


# -- the codec ---------------------------------------------------------------------------------


def _hi_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b in full float32: on GPUs the default precision is TF32, whose 10-bit mantissa
    moves rotated coordinates by ~1e-4 and so across codebook boundaries."""
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _vectors(x: jax.Array, dim: int) -> jax.Array:
    """x as float32, checked to be vectors [..., dim]."""
    if x.shape[-1] != dim:
        raise ValueError(f"expected vectors of dimension {dim}, got shape {x.shape}")
    return jnp.asarray(x, jnp.float32)


def _qjl_encode(residual: jax.Array, matrix: np.ndarray) -> dict[str, jax.Array]:
    """The 1-bit QJL sketch of `residual` [..., d]: sign bits of S r, and |r|."""
    projected = _hi_matmul(residual, jnp.asarray(matrix).T)
    return {
        "qjl_signs": pack_bits((projected >= 0).astype(jnp.int32), 1),
        "qjl_norms": store_norms(jnp.linalg.norm(residual, axis=-1)),
    }


def store_norms(norms: jax.Array) -> jax.Array:
    """Vector norms as stored: float16, clipped to its largest finite value."""
    return jnp.minimum(norms, _NORM_MAX).astype(NORM_DTYPE)


def _qjl_decode(encoded: dict[str, jax.Array], matrix: np.ndarray) -> jax.Array:
    """The residual estimate sqrt(pi/2)/sqrt(d) * |r| * S^T sign(S r)."""
    d = matrix.shape[0]
    signs = unpack_bits(encoded["qjl_signs"], 1, d).astype(jnp.float32) * 2 - 1
    # For an orthonormal S of d rows, E|<s_i, r>| = |r| sqrt(2/pi)/sqrt(d): scaling the sign
    # vector back by sqrt(pi/2)/sqrt(d) * |r| makes inner products unbiased.
    scale = math.sqrt(math.pi / 2) / math.sqrt(d)
    return scale * encoded["qjl_norms"].astype(jnp.float32)[..., None] * _hi_matmul(signs, jnp.asarray(matrix))


def tq_vector_bytes(head_dim: int, bits: float, qjl: bool = False) -> int:
    """Stored bytes per vector: packed codes and a float16 norm; with QJL, d sign bits and a
    float16 residual norm more. Half-integer bits are the split-group format (`SplitTurboQuant`):
    two halves at ceil and floor bits and two float16 group norms."""
    extra = (head_dim // 8 + 2) if qjl else 0
    if is_split_bits(bits):
        half = head_dim // 2
        return half * math.ceil(bits) // 8 + half * math.floor(bits) // 8 + 4 + extra
    return head_dim * int(bits) // 8 + 2 + extra


def is_split_bits(bits: float) -> bool:
    """Whether `bits` names the split-group format (a half-integer such as 3.5)."""
    return float(bits) != int(bits)


class _Codec:
    """What both codecs share: the QJL transform, the byte count, the tuple form of encode and
    decode, and the quality report. A subclass defines head_dim, bits, seed, qjl, FIELDS,
    encode_tree and decode_tree (the dict of arrays a cache pool stores)."""

    FIELDS: tuple[str, ...]  # the stored arrays in the order of `encode`'s tuple, before QJL's

    @property
    def fields(self) -> tuple[str, ...]:
        """Names of the arrays one encoded vector is stored as, in `encode`'s order."""
        return self.FIELDS + (("qjl_signs", "qjl_norms") if self.qjl else ())

    def encode(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """x [..., d] -> (codes, norms): packed codes uint8 [..., bytes] and float16 norms;
        with QJL also (qjl_signs, qjl_norms). `fields` names them."""
        tree = self.encode_tree(x)
        return tuple(tree[name] for name in self.fields)

    def decode(self, codes, *rest: jax.Array) -> jax.Array:
        """The reconstruction x_hat [..., d] float32 of `decode(codes, norms)` (with QJL,
        `decode(codes, norms, qjl_signs, qjl_norms)`). The tuple `encode` returns, or
        `encode_tree`'s dict, may be passed whole."""
        if isinstance(codes, dict) and not rest:
            return self.decode_tree(codes)
        if isinstance(codes, tuple) and not rest:
            codes, *rest = codes
        arrays = (codes, *rest)
        if len(arrays) != len(self.fields):
            raise ValueError(f"decode takes {len(self.fields)} arrays {self.fields}, got {len(arrays)}")
        return self.decode_tree(dict(zip(self.fields, arrays, strict=True)))

    def _init_qjl(self) -> None:
        qjl = haar_rotation(self.head_dim, self.seed, purpose="qjl") if self.qjl else None
        object.__setattr__(self, "qjl_matrix", qjl)

    @property
    def bytes_per_vector(self) -> int:
        """Stored bytes per vector (`tq_vector_bytes`)."""
        return tq_vector_bytes(self.head_dim, self.bits, self.qjl)

    def validate(self, num_vectors: int = 10_000, seed: int = 1) -> dict[str, float]:
        """Quality on random unit vectors: per-vector MSE, inner-product error, ratio to 4^-b.

        Returns:
            mse: mean ||x - x_hat||^2 over unit vectors x.
            mse_lower_bound: 4^-b, the information-theoretic lower bound.
            mse_ratio: mse / 4^-b.
            inner_product_rmse: RMS of <q, x> - <q, x_hat> for random unit queries q.
            inner_product_bias: mean of that difference.
            bytes_per_vector: storage per vector.
        """
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((num_vectors, self.head_dim)).astype(np.float32)
        x /= np.linalg.norm(x, axis=-1, keepdims=True)
        q = rng.standard_normal((num_vectors, self.head_dim)).astype(np.float32)
        q /= np.linalg.norm(q, axis=-1, keepdims=True)
        x_hat = np.asarray(jax.jit(lambda v: self.decode_tree(self.encode_tree(v)))(x))
        mse = float(np.mean(np.sum((x - x_hat) ** 2, axis=-1)))
        err = np.sum(q * x, axis=-1) - np.sum(q * x_hat, axis=-1)
        bound = 4.0**-self.bits
        return {
            "mse": mse,
            "mse_lower_bound": bound,
            "mse_ratio": mse / bound,
            "inner_product_rmse": float(np.sqrt(np.mean(err**2))),
            "inner_product_bias": float(np.mean(err)),
            "bytes_per_vector": self.bytes_per_vector,
        }


@dataclasses.dataclass(frozen=True, eq=False)
class TurboQuant(_Codec):
    """Encoder/decoder for vectors of one dimension at one bit width.

    Args:
        head_dim: vector dimension (power of two).
        bits: bits per coordinate, 1..8.
        seed: seeds the rotation (and the QJL transform).
        rotation: "haar" or "hadamard".
        codebook: "exact" (Lloyd-Max on the exact density) or "gaussian".
        qjl: add the 1-bit QJL residual (d extra bits + a float16 norm per vector).
    """

    FIELDS = ("codes", "norms")

    head_dim: int
    bits: int
    seed: int = 0
    rotation: str = "haar"
    codebook: str = "exact"
    qjl: bool = False

    def __post_init__(self):
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {sorted(ROTATIONS)}, got {self.rotation!r}")
        centroids, mse = lloyd_max_codebook(self.head_dim, self.bits, self.codebook)
        object.__setattr__(self, "centroids", centroids.astype(np.float32))
        object.__setattr__(self, "boundaries", ((centroids[1:] + centroids[:-1]) / 2).astype(np.float32))
        object.__setattr__(self, "coordinate_mse", mse)
        object.__setattr__(self, "rotation_matrix", ROTATIONS[self.rotation](self.head_dim, self.seed))
        self._init_qjl()

    @property
    def fingerprint(self) -> str:
        """SHA-256 over the codebook and rotation(s): identifies the stored format exactly."""
        h = hashlib.sha256()
        h.update(f"tq:{self.head_dim}:{self.bits}:{self.codebook}:{self.qjl}".encode())
        h.update(self.centroids.tobytes())
        h.update(self.rotation_matrix.tobytes())
        if self.qjl_matrix is not None:
            h.update(self.qjl_matrix.tobytes())
        return h.hexdigest()

    def encode_tree(self, x: jax.Array) -> dict[str, jax.Array]:
        """x [..., d] -> {"codes": uint8 [..., d*b/8], "norms": float16 [...]} (+ "qjl_signs",
        "qjl_norms" with QJL)."""
        x = _vectors(x, self.head_dim)
        norms = jnp.linalg.norm(x, axis=-1)
        u = x / jnp.maximum(norms, 1e-30)[..., None]
        y = _hi_matmul(u, jnp.asarray(self.rotation_matrix).T)
        idx = jnp.sum(y[..., None] > jnp.asarray(self.boundaries), axis=-1)  # count of boundaries below
        out = {"codes": pack_bits(idx, self.bits), "norms": store_norms(norms)}
        if self.qjl:
            out |= _qjl_encode(
                u - _hi_matmul(jnp.asarray(self.centroids)[idx], jnp.asarray(self.rotation_matrix)), self.qjl_matrix
            )
        return out

    def decode_tree(self, encoded: dict[str, jax.Array]) -> jax.Array:
        """The reconstruction x_hat [..., d] float32 from `encode_tree`'s dict."""
        idx = unpack_bits(encoded["codes"], self.bits, self.head_dim)
        u_hat = _hi_matmul(jnp.asarray(self.centroids)[idx], jnp.asarray(self.rotation_matrix))
        if self.qjl:
            u_hat = u_hat + _qjl_decode(encoded, self.qjl_matrix)
        return u_hat * encoded["norms"].astype(jnp.float32)[..., None]


# -- the split-group (hybrid) format ---------------------------------------------------------------


def split_channels(head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(heavy, light) channel halves of the split-group format. Keys are stored after RoPE in
    the rotate-half layout, where channels i and i + d/2 turn at frequency base^(-2i/d): the
    heavy half is the low-frequency pairs (i >= d/4 and their partners), which hold most of a
    key's energy in the models measured (3/4 of it in SmolLM2-135M), the light half the rest.
    Values carry no such structure; the same split simply gives them fractional bits."""
    pair = np.arange(head_dim) % (head_dim // 2)
    heavy = pair >= head_dim // 4
    return np.flatnonzero(heavy), np.flatnonzero(~heavy)


@dataclasses.dataclass(frozen=True, eq=False)
class SplitTurboQuant(_Codec):
    """The split-group (hybrid) format for half-integer bit widths such as 3.5 or 2.5.

    The vector is cut into the two channel halves of `split_channels`; each half is a
    TurboQuant vector of dimension d/2 with its own rotation, its own exact-density codebook
    for d/2 and its own norm (stored as float16, the pair costing one float32): the heavy half
    at ceil(bits), the light half at floor(bits). With `qjl`, the 1-bit QJL sketch of the whole
    vector's residual (a d x d transform) is added, as in `TurboQuant`.

    Args:
        head_dim: vector dimension (a power of two, at least 16).
        bits: half-integer average bits per coordinate, 1.5..7.5.
        seed: seeds the two rotations (and the QJL transform).
        qjl: add the QJL residual (d sign bits + a float16 norm per vector).
    """

    FIELDS = ("codes", "group_norms")

    head_dim: int
    bits: float
    seed: int = 0
    qjl: bool = False

    def __post_init__(self):
        if not is_split_bits(self.bits) or not 1 < self.bits < 8 or self.bits * 2 != int(self.bits * 2):
            raise ValueError(f"split-group bits must be a half-integer in 1.5..7.5, got {self.bits!r}")
        if self.head_dim < 16 or self.head_dim & (self.head_dim - 1):
            raise ValueError(f"split-group head_dim must be a power of two >= 16, got {self.head_dim}")
        half = self.head_dim // 2
        object.__setattr__(self, "channels", split_channels(self.head_dim))
        # The decoded halves, concatenated, back in channel order.
        object.__setattr__(self, "order", np.argsort(np.concatenate(self.channels)))
        groups = (
            TurboQuant(head_dim=half, bits=math.ceil(self.bits), seed=2 * self.seed),
            TurboQuant(head_dim=half, bits=math.floor(self.bits), seed=2 * self.seed + 1),
        )
        object.__setattr__(self, "groups", groups)
        self._init_qjl()

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256(f"tq-split:{self.head_dim}:{self.bits}:{self.qjl}".encode())
        for channels, group in zip(self.channels, self.groups, strict=True):
            h.update(channels.tobytes())
            h.update(group.fingerprint.encode())
        if self.qjl_matrix is not None:
            h.update(self.qjl_matrix.tobytes())
        return h.hexdigest()

    def encode_tree(self, x: jax.Array) -> dict[str, jax.Array]:
        """x [..., d] -> {"codes": uint8 [..., bytes of both halves], "group_norms": float16
        [..., 2]} (+ "qjl_signs", "qjl_norms" with QJL)."""
        x = _vectors(x, self.head_dim)
        parts = [g.encode_tree(x[..., c]) for c, g in zip(self.channels, self.groups, strict=True)]
        out = {
            "codes": jnp.concatenate([p["codes"] for p in parts], axis=-1),
            "group_norms": jnp.stack([p["norms"] for p in parts], axis=-1),
        }
        if self.qjl:
            out |= _qjl_encode(x - self._decode_groups(out), self.qjl_matrix)
        return out

    def decode_tree(self, encoded: dict[str, jax.Array]) -> jax.Array:
        """The reconstruction x_hat [..., d] float32 from `encode_tree`'s dict."""
        x_hat = self._decode_groups(encoded)
        if self.qjl:
            x_hat = x_hat + _qjl_decode(encoded, self.qjl_matrix)
        return x_hat

    def _decode_groups(self, encoded: dict[str, jax.Array]) -> jax.Array:
        heavy_bytes = self.groups[0].head_dim * self.groups[0].bits // 8
        codes = (encoded["codes"][..., :heavy_bytes], encoded["codes"][..., heavy_bytes:])
        norms = encoded["group_norms"].astype(jnp.float32)
        halves = [
            group.decode_tree({"codes": c, "norms": norms[..., i]})
            for i, (c, group) in enumerate(zip(codes, self.groups, strict=True))
        ]
        return jnp.concatenate(halves, axis=-1)[..., self.order]


def make_codec(
    head_dim: int, bits: float, seed: int = 0, qjl: bool = False, rotation: str = "haar"
) -> TurboQuant | SplitTurboQuant:
    """The codec of a stored format: `TurboQuant` for integer bits, `SplitTurboQuant` for
    half-integer ones (whose halves are always Haar-rotated)."""
    if is_split_bits(bits):
        if rotation != "haar":
            raise ValueError(f"split-group formats use Haar rotations, got rotation {rotation!r}")
        return SplitTurboQuant(head_dim=head_dim, bits=bits, seed=seed, qjl=qjl)
    return TurboQuant(head_dim=head_dim, bits=int(bits), seed=seed, qjl=qjl, rotation=rotation)
