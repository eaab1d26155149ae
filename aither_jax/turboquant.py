"""TurboQuant KV codec for notebooks: `from aither_jax.turboquant import TurboQuant`.

    tq = TurboQuant(head_dim=64, bits=4, seed=0)
    codes, norms = tq.encode(x)  # uint8 [..., 32] packed codes, float16 [...] norms
    x_hat = tq.decode(codes, norms)
    tree = tq.encode_tree(x)     # the same arrays as a dict, as a cache pool stores them
    tq.validate(num_vectors=10_000)   # MSE, inner-product error, ratio to the 4^-b bound
    split = make_codec(64, 3.5)       # half-integer bits: SplitTurboQuant (two channel halves)

The implementation lives with the kernels that read its packed format
(`pallas_kernels/turboquant.py`).
"""

from pallas_kernels.turboquant import (
    ROTATIONS,
    SUPPORTED_BITS,
    SplitTurboQuant,
    TurboQuant,
    coordinate_density,
    haar_rotation,
    hadamard_rotation,
    is_split_bits,
    lloyd_max_codebook,
    make_codec,
    pack_bits,
    split_channels,
    tq_vector_bytes,
    unpack_bits,
)

__all__ = [
    "ROTATIONS",
    "SUPPORTED_BITS",
    "SplitTurboQuant",
    "TurboQuant",
    "coordinate_density",
    "haar_rotation",
    "hadamard_rotation",
    "is_split_bits",
    "lloyd_max_codebook",
    "make_codec",
    "pack_bits",
    "split_channels",
    "tq_vector_bytes",
    "unpack_bits",
]
