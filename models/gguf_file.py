"""A validating GGUF reader.

The whole header (metadata and tensor table) is parsed and checked against the file size
before any tensor memory is touched: every count, string length, dimension and byte range
is bounded with Python integers (no int64 overflow), unknown value and tensor types are
rejected, and tensors must lie inside the data section without overlapping. A malformed or
hostile file therefore raises one `GGUFError` naming what is wrong, never a crash or a huge
allocation. Tensor payloads are then read lazily from a read-only memory map and
dequantized with the `gguf` package.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_TENSORS = 1 << 16
MAX_METADATA_ENTRIES = 1 << 16
MAX_DIMS = 4
MAX_ARRAY_DEPTH = 8  # arrays of arrays: bounded so a hostile file cannot exhaust the Python stack
MAX_ELEMENTS = 1 << 40  # far above any model we load; keeps shapes well inside int64

# Tensor types we can turn into floats: plain floats and the block quantizations the shipped
# models use (SmolLM2: Q4_1/Q8_0/F32; Gemma 3: Q5_0/Q8_0/Q4_K/Q6_K), plus close relatives.
DEQUANTIZABLE_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
)

# GGUF metadata value type ids -> (struct format, size) for fixed-size scalars.
_SCALAR_FORMATS = {
    0: ("<B", 1),  # uint8
    1: ("<b", 1),  # int8
    2: ("<H", 2),  # uint16
    3: ("<h", 2),  # int16
    4: ("<I", 4),  # uint32
    5: ("<i", 4),  # int32
    6: ("<f", 4),  # float32
    7: ("<?", 1),  # bool
    10: ("<Q", 8),  # uint64
    11: ("<q", 8),  # int64
    12: ("<d", 8),  # float64
}
_NUMPY_SCALARS = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file is malformed, truncated, or uses something we do not support."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table, already checked against the file."""

    name: str
    shape: tuple[int, ...]  # numpy order (slowest dimension first), the reverse of the file's order
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def num_elements(self) -> int:
        return int(np.prod(self.shape, dtype=object))


class _Cursor:
    """Bounds-checked little-endian reads over a bytes-like header buffer."""

    def __init__(self, buf: memoryview, path: str, file_size: int):
        self.buf = buf
        self.pos = 0
        self.path = path
        self.file_size = file_size

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(
                f"{self.path}: truncated while reading {what} at byte {self.pos} "
                f"(needs {n} bytes, file has {self.file_size})"
            )

    def scalar(self, type_id: int, what: str) -> Any:
        fmt, size = _SCALAR_FORMATS[type_id]
        self._need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        length = self.u64(f"length of {what}")
        self._need(length, what)
        raw = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8 ({e})") from None

    def value(self, type_id: int, what: str, depth: int = 0) -> Any:
        if type_id in _SCALAR_FORMATS:
            return self.scalar(type_id, what)
        if type_id == _STRING:
            return self.string(what)
        if type_id == _ARRAY:
            item_type = self.u32(f"item type of {what}")
            count = self.u64(f"length of {what}")
            if item_type in _SCALAR_FORMATS:
                size = _SCALAR_FORMATS[item_type][1]
                self._need(count * size, what)
                arr = np.frombuffer(self.buf, dtype=_NUMPY_SCALARS[item_type], count=count, offset=self.pos)
                self.pos += count * size
                return arr.copy()
            if item_type == _STRING:
                # Every string costs at least its 8-byte length: bound the count before looping.
                self._need(count * 8, what)
                return [self.string(f"{what}[{i}]") for i in range(count)]
            if item_type == _ARRAY:
                if depth >= MAX_ARRAY_DEPTH:
                    raise GGUFError(f"{self.path}: {what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
                self._need(count * 12, what)
                return [self.value(_ARRAY, f"{what}[{i}]", depth + 1) for i in range(count)]
            raise GGUFError(f"{self.path}: {what} has unknown array item type {item_type}")
        raise GGUFError(f"{self.path}: {what} has unknown value type {type_id}")


class GGUFFile:
    """A parsed, validated GGUF file.

    Attributes:
        path: the file's path.
        version: GGUF format version (2 or 3).
        metadata: key -> value (ints, floats, strings, numpy arrays or lists of strings).
        tensors: name -> `TensorInfo`, in file order.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise GGUFError(f"{self.path}: no such file")
        self.file_size = os.path.getsize(self.path)
        self._mmap: np.memmap | None = None
        self.version, self.metadata, self.tensors = self._parse()

    def _parse(self) -> tuple[int, dict[str, Any], dict[str, TensorInfo]]:
        path = self.path
        if self.file_size < 24:
            raise GGUFError(f"{path}: file is {self.file_size} bytes, too small to be GGUF")
        with open(path, "rb") as f:
            raw = np.memmap(f, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(raw), path, self.file_size)
        magic = bytes(raw[:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        cur.pos = 4
        version = cur.u32("version")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{path}: GGUF version {version} is not supported (supported: {SUPPORTED_VERSIONS})")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        if n_tensors > MAX_TENSORS:
            raise GGUFError(f"{path}: declares {n_tensors} tensors (at most {MAX_TENSORS} allowed)")
        if n_kv > MAX_METADATA_ENTRIES:
            raise GGUFError(f"{path}: declares {n_kv} metadata entries (at most {MAX_METADATA_ENTRIES} allowed)")

        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            if key in metadata:
                raise GGUFError(f"{path}: metadata key {key!r} appears twice")
            type_id = cur.u32(f"type of metadata {key!r}")
            metadata[key] = cur.value(type_id, f"metadata {key!r}")

        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        is_int = isinstance(alignment, int) and not isinstance(alignment, bool)
        if not is_int or alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 20:
            raise GGUFError(f"{path}: general.alignment must be a power of two up to 1 MiB, got {alignment!r}")

        entries = []
        for i in range(n_tensors):
            name = cur.string(f"name of tensor #{i}")
            n_dims = cur.u32(f"rank of tensor {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"{path}: tensor {name!r} has rank {n_dims} (1..{MAX_DIMS} allowed)")
            dims = [cur.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
            type_id = cur.u32(f"type of tensor {name!r}")
            rel_offset = cur.u64(f"offset of tensor {name!r}")
            entries.append((name, dims, type_id, rel_offset))

        data_start = -(-cur.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, rel_offset in entries:
            info = self._check_tensor(name, dims, type_id, rel_offset, data_start, alignment)
            if name in tensors:
                raise GGUFError(f"{path}: tensor {name!r} appears twice")
            tensors[name] = info
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
        for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:], strict=False):
            if start_b < end_a:
                raise GGUFError(f"{path}: tensors {name_a!r} and {name_b!r} overlap")
        del raw
        return version, metadata, tensors

    def _check_tensor(
        self, name: str, dims: list[int], type_id: int, rel_offset: int, data_start: int, alignment: int
    ) -> TensorInfo:
        path = self.path
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has unknown tensor type id {type_id}") from None
        if ggml_type not in GGML_QUANT_SIZES:
            raise GGUFError(f"{path}: tensor {name!r} has tensor type {ggml_type.name} with no known block size")
        if any(d < 1 for d in dims):
            raise GGUFError(f"{path}: tensor {name!r} has a zero dimension {dims}")
        n_elements = 1
        for d in dims:
            n_elements *= d  # Python ints: no overflow, checked below
        if n_elements > MAX_ELEMENTS:
            raise GGUFError(f"{path}: tensor {name!r} declares {n_elements} elements (dims {dims}), too many")
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        if dims[0] % block_size:
            raise GGUFError(
                f"{path}: tensor {name!r} row length {dims[0]} is not a multiple of the "
                f"{ggml_type.name} block size {block_size}"
            )
        nbytes = n_elements // block_size * type_size
        if rel_offset % alignment:
            raise GGUFError(f"{path}: tensor {name!r} offset {rel_offset} is not aligned to {alignment}")
        start = data_start + rel_offset
        if start + nbytes > self.file_size:
            raise GGUFError(
                f"{path}: tensor {name!r} needs bytes {start}..{start + nbytes} but the file has "
                f"{self.file_size} bytes (truncated file or lying size)"
            )
        return TensorInfo(name, tuple(reversed(dims)), ggml_type, start, nbytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view, shaped [rows..., bytes_per_row]."""
        info = self.tensor(name)
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        data = self._mmap[info.offset : info.offset + info.nbytes]
        return data.reshape(*info.shape[:-1], -1)

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: missing tensor {name!r}")
        return self.tensors[name]

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in numpy order (slowest dimension first)."""
        info = self.tensor(name)
        if info.ggml_type not in DEQUANTIZABLE_TYPES:
            allowed = ", ".join(sorted(t.name for t in DEQUANTIZABLE_TYPES))
            raise GGUFError(
                f"{self.path}: tensor {name!r} has type {info.ggml_type.name}, which we cannot dequantize "
                f"(supported: {allowed})"
            )
        out = _gguf_dequantize(self.raw(name), info.ggml_type)
        return np.asarray(out, dtype=np.float32).reshape(info.shape)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)
