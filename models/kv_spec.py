"""KV cache storage formats by name (`--kv-cache-dtype`), and their size per token.

Names:
    bf16, fp32            unquantized keys and values
    tq<b>                 TurboQuant, b bits for keys and values (b in 2..8)
    tq-k<kb>v<vb>         TurboQuant with separate key and value bit widths
    tq3.5, tq-k4.5v3, ... half-integer bits (2.5..7.5): the split-group format, two channel
                          halves at ceil/floor bits, each with its own rotation, codebook and
                          float16 norm (pallas_kernels/turboquant.py, `SplitTurboQuant`)
    ...-qjlk / -qjlv / -qjl
                          add the 1-bit QJL residual to keys / values / both
    ...-b<n>              keep the first and last n layers unquantized (bf16)
    ...-s<n>              keep the first n tokens of every sequence ("sinks") unquantized too
    ...-pc                store keys through the model's fitted query-aware transform
                          (models/kv_transform.py): same bytes, less score error
    ...-hadk / -hadv / -had
                          randomized Hadamard rotation for keys / values / both instead of
                          the default Haar rotation (integer bit widths)
    ...-k<b>@<layers>     keys of the listed layers (e.g. 1,2,10) at b bits, or bf16 with
    ...-v<b>@<layers>     b = "bf16"; later modifiers override earlier ones

so `tq-k5v4-k8@1,2,10` stores keys at 5 bits except in layers 1, 2 and 10 (8 bits), values at
4 bits. Sink tokens cost a fixed n x layers x kv_heads x head_dim x 4 bytes per sequence
slot (bf16 keys and values), not bytes per token. A TurboQuant vector of dimension d costs
d*b/8 bytes of codes plus a float16 norm, and with QJL another d/8 bytes of signs plus a
float16 residual norm.
"""

from __future__ import annotations

import dataclasses
import math
import re

from models.config import ModelConfig
from pallas_kernels.turboquant import is_split_bits, tq_vector_bytes

UNQUANTIZED_BYTES = {"bf16": 2, "fp32": 4}
TQ_BITS = range(2, 9)
_BITS = r"\d(?:\.5)?"

_TQ = re.compile(
    rf"^tq(?:(?P<bits>{_BITS})|-k(?P<kbits>{_BITS})v(?P<vbits>{_BITS}))(?P<qjl>-qjl[kv]?)?(?P<mods>(?:-[^-]+)*)$"
)
_BOUNDARY = re.compile(r"^b(?P<n>\d+)$")
_SINKS = re.compile(r"^s(?P<n>\d+)$")
_PRECONDITION = "pc"
_HADAMARD = {"hadk": ("k",), "hadv": ("v",), "had": ("k", "v")}
MAX_SINK_TOKENS = 64
_OVERRIDE = re.compile(rf"^(?P<side>[kv])(?P<bits>{_BITS}|\d+|bf16)@(?P<layers>\d+(?:,\d+)*)$")

# A layer's format on one side: TurboQuant bits (a half-integer for the split-group format),
# or None for unquantized.
LayerBits = int | float | None


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """How keys and values are stored. `key_bits`/`value_bits` None means unquantized.

    `boundary_layers` and `overrides` ((side, bits or None, layers) in order) make the bits
    differ per layer; `layer_bits` resolves them for a model.
    """

    name: str
    key_bits: int | float | None = None
    value_bits: int | float | None = None
    key_qjl: bool = False
    value_qjl: bool = False
    unquantized_bytes: int = 2  # per element when unquantized
    boundary_layers: int = 0
    sink_tokens: int = 0  # first tokens of each sequence also kept unquantized, per slot
    precondition: bool = False  # keys stored through the model's key transform (models/kv_transform.py)
    overrides: tuple[tuple[str, LayerBits, tuple[int, ...]], ...] = ()
    key_rotation: str = "haar"  # "haar" or "hadamard" (pallas_kernels/turboquant.py: ROTATIONS)
    value_rotation: str = "haar"

    @property
    def quantized(self) -> bool:
        return self.key_bits is not None

    def layer_bits(self, side: str, num_layers: int) -> tuple[LayerBits, ...]:
        """Bits of every layer's keys ("k") or values ("v"); None = unquantized."""
        bits: list[LayerBits] = [self.key_bits if side == "k" else self.value_bits] * num_layers
        n = min(self.boundary_layers, num_layers)
        for i in [*range(n), *range(num_layers - n, num_layers)]:
            bits[i] = None
        for s, b, layers in self.overrides:
            for i in layers:
                if i >= num_layers:
                    raise ValueError(f"{self.name!r} names layer {i}, but the model has {num_layers} layers")
                if s == side:
                    bits[i] = b
        return tuple(bits)

    def qjl(self, side: str) -> bool:
        return self.key_qjl if side == "k" else self.value_qjl

    def rotation(self, side: str) -> str:
        return self.key_rotation if side == "k" else self.value_rotation

    def vector_bytes(self, head_dim: int, side: str, bits: LayerBits) -> int:
        """Bytes stored for one key ("k") or value ("v") vector of `head_dim` elements at
        `bits` (None = unquantized)."""
        if bits is None:
            return head_dim * (self.unquantized_bytes if not self.quantized else 2)
        return tq_vector_bytes(head_dim, bits, self.qjl(side))

    def bytes_per_token(self, cfg: ModelConfig) -> int:
        """Cache bytes for one token across all layers and KV heads."""
        total = 0
        for side in ("k", "v"):
            total += sum(self.vector_bytes(cfg.head_dim, side, b) for b in self.layer_bits(side, cfg.num_layers))
        return total * cfg.num_kv_heads

    def bytes_per_sequence(self, cfg: ModelConfig) -> int:
        """Fixed bytes per sequence slot: the sink tokens' bf16 keys and values."""
        return self.sink_tokens * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * 2


def parse_kv_spec(name: str) -> KVSpec:
    """Parses a `--kv-cache-dtype` name. Raises ValueError listing the accepted forms."""
    if not isinstance(name, str):
        raise ValueError(f"kv cache dtype must be a string, got {name!r}")
    if name in UNQUANTIZED_BYTES:
        return KVSpec(name, unquantized_bytes=UNQUANTIZED_BYTES[name])
    m = _TQ.match(name)
    if m is None:
        raise ValueError(
            f"unknown kv cache dtype {name!r}: use bf16, fp32, tq<bits> (e.g. tq4, or tq3.5 for the "
            "split-group format), tq-k<bits>v<bits> (e.g. tq-k6v4), optionally with -qjlk, -qjlv or -qjl, "
            "then -b<n> (first/last n layers unquantized), -s<n> (first n tokens unquantized) and "
            "-k<bits>@<layers> / -v<bits>@<layers> (e.g. -k8@1,2,10 or -kbf16@0); -pc: the fitted key transform; "
            "-hadk, -hadv, -had: Hadamard rotations"
        )
    kbits = _bits(m["bits"] or m["kbits"])
    vbits = _bits(m["bits"] or m["vbits"])
    for side, bits in (("key", kbits), ("value", vbits)):
        _check_bits(name, side, bits)
    boundary, sinks, overrides, precondition, hadamard = 0, 0, [], False, set()
    for mod in m["mods"].split("-")[1:]:
        if mod == _PRECONDITION:
            precondition = True
        elif mod in _HADAMARD:
            hadamard.update(_HADAMARD[mod])
        elif b := _BOUNDARY.match(mod):
            boundary = int(b["n"])
        elif m_sinks := _SINKS.match(mod):
            sinks = int(m_sinks["n"])
            if not 1 <= sinks <= MAX_SINK_TOKENS:
                raise ValueError(f"{name!r}: sink tokens must be in 1..{MAX_SINK_TOKENS}, got {sinks}")
        elif o := _OVERRIDE.match(mod):
            bits = None if o["bits"] == "bf16" else _bits(o["bits"])
            if bits is not None:
                _check_bits(name, "key" if o["side"] == "k" else "value", bits)
            overrides.append((o["side"], bits, tuple(sorted({int(i) for i in o["layers"].split(",")}))))
        else:
            raise ValueError(
                f"{name!r}: unknown modifier {mod!r} (use b<n>, s<n>, pc, hadk, hadv, had, k<bits>@<layers> "
                "or v<bits>@<layers>)"
            )
    qjl = m["qjl"] or ""
    widths = [("k", kbits), ("v", vbits), *((side, b) for side, b, _ in overrides)]
    if any(side in hadamard and b is not None and is_split_bits(b) for side, b in widths):
        raise ValueError(f"{name!r}: the Hadamard rotation is for integer bit widths (split-group halves are Haar)")
    return KVSpec(
        name,
        key_bits=kbits,
        value_bits=vbits,
        key_qjl=qjl in ("-qjl", "-qjlk"),
        value_qjl=qjl in ("-qjl", "-qjlv"),
        boundary_layers=boundary,
        sink_tokens=sinks,
        precondition=precondition,
        overrides=tuple(overrides),
        key_rotation="hadamard" if "k" in hadamard else "haar",
        value_rotation="hadamard" if "v" in hadamard else "haar",
    )


def _bits(text: str) -> int | float:
    value = float(text)
    return value if is_split_bits(value) else int(value)


def _check_bits(name: str, side: str, bits: int | float) -> None:
    whole = math.floor(bits)
    if whole not in TQ_BITS or (is_split_bits(bits) and whole + 1 not in TQ_BITS):
        raise ValueError(
            f"{name!r}: {side} bits must be in {TQ_BITS.start}..{TQ_BITS.stop - 1} "
            f"(or a half-integer between them for the split-group format), got {bits}"
        )
