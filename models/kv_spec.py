"""KV cache storage formats by name (`--kv-cache-dtype`), and their size per token.

Names:
    bf16, fp32            unquantized keys and values
    tq<b>                 TurboQuant, b bits for keys and values (b in 2..8)
    tq-k<kb>v<vb>         TurboQuant with separate key and value bit widths
    ...-qjlk / -qjlv / -qjl
                          add the 1-bit QJL residual to keys / values / both

A TurboQuant vector of dimension d costs d*b/8 bytes of codes plus a float32 norm, and with
QJL another d/8 bytes of signs plus a float32 residual norm.
"""

from __future__ import annotations

import dataclasses
import re

from models.config import ModelConfig
from pallas_kernels.turboquant import tq_vector_bytes

UNQUANTIZED_BYTES = {"bf16": 2, "fp32": 4}
TQ_BITS = range(2, 9)

_TQ = re.compile(r"^tq(?:(?P<bits>\d)|-k(?P<kbits>\d)v(?P<vbits>\d))(?P<qjl>-qjl[kv]?)?$")


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """How keys and values are stored. `key_bits`/`value_bits` None means unquantized."""

    name: str
    key_bits: int | None = None
    value_bits: int | None = None
    key_qjl: bool = False
    value_qjl: bool = False
    unquantized_bytes: int = 2  # per element when unquantized

    @property
    def quantized(self) -> bool:
        return self.key_bits is not None

    def vector_bytes(self, head_dim: int, side: str) -> int:
        """Bytes stored for one key ("k") or value ("v") vector of `head_dim` elements."""
        bits, qjl = (self.key_bits, self.key_qjl) if side == "k" else (self.value_bits, self.value_qjl)
        if bits is None:
            return head_dim * self.unquantized_bytes
        return tq_vector_bytes(head_dim, bits, qjl)

    def bytes_per_token(self, cfg: ModelConfig) -> int:
        """Cache bytes for one token across all layers and KV heads."""
        per_head = self.vector_bytes(cfg.head_dim, "k") + self.vector_bytes(cfg.head_dim, "v")
        return cfg.num_layers * cfg.num_kv_heads * per_head


def parse_kv_spec(name: str) -> KVSpec:
    """Parses a `--kv-cache-dtype` name. Raises ValueError listing the accepted forms."""
    if not isinstance(name, str):
        raise ValueError(f"kv cache dtype must be a string, got {name!r}")
    if name in UNQUANTIZED_BYTES:
        return KVSpec(name, unquantized_bytes=UNQUANTIZED_BYTES[name])
    m = _TQ.match(name)
    if m is None:
        raise ValueError(
            f"unknown kv cache dtype {name!r}: use bf16, fp32, tq<bits> (e.g. tq4), tq-k<bits>v<bits> "
            "(e.g. tq-k6v4), optionally with -qjlk, -qjlv or -qjl"
        )
    kbits = int(m["bits"] or m["kbits"])
    vbits = int(m["bits"] or m["vbits"])
    for side, bits in (("key", kbits), ("value", vbits)):
        if bits not in TQ_BITS:
            raise ValueError(f"{name!r}: {side} bits must be in {TQ_BITS.start}..{TQ_BITS.stop - 1}, got {bits}")
    qjl = m["qjl"] or ""
    return KVSpec(
        name,
        key_bits=kbits,
        value_bits=vbits,
        key_qjl=qjl in ("-qjl", "-qjlk"),
        value_qjl=qjl in ("-qjl", "-qjlv"),
    )
