"""Specification of the validating GGUF reader (`models/gguf_file.py`) and its first users.

A well-formed file parses to exactly what was written (checked against files made by
`gguf.GGUFWriter` and against `gguf.GGUFReader` on the shipped model). Every malformed file,
truncated, lying or hostile, raises one `GGUFError` that says what is wrong: never another
exception, never a huge allocation. Most malformed files are written by hand below with
`struct.pack`, one field at a time, so that each case is a one-liner.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import re
import resource
import struct
import tracemalloc

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from models.config import MAX_CONTEXT, ModelConfig
from models.gguf_file import GGUFError, GGUFFile
from models.registry import resolve_model
from models.weights import check_tensor_shapes, required_tensors

# --------------------------------------------------------------------------------------------
# A hand-written GGUF builder (little-endian, version 3)
# --------------------------------------------------------------------------------------------

# Metadata value type ids.
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)


def gstr(s: str | bytes) -> bytes:
    """A GGUF string: u64 byte length, then the bytes."""
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    """One metadata entry with an already-encoded value."""
    return gstr(key) + struct.pack("<I", vtype) + payload


def kv_u32(key: str, v: int) -> bytes:
    return kv(key, U32, struct.pack("<I", v))


def kv_i32(key: str, v: int) -> bytes:
    return kv(key, I32, struct.pack("<i", v))


def kv_str(key: str, v: str | bytes) -> bytes:
    return kv(key, STR, gstr(v))


def kv_arr(key: str, item_type: int, items: bytes, count: int) -> bytes:
    """An array entry: u32 item type, u64 count (may lie), then the encoded items."""
    return kv(key, ARR, struct.pack("<IQ", item_type, count) + items)


def kv_strs(key: str, strings: list[str]) -> bytes:
    return kv_arr(key, STR, b"".join(gstr(s) for s in strings), len(strings))


def tinfo(name: str | bytes, dims: list[int], ggml_type: int = QT.F32, offset: int = 0) -> bytes:
    """One tensor-table entry; `dims` fastest-first as in the file, `offset` relative to the data section."""
    return gstr(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, int(ggml_type), offset)


def pad(n: int, alignment: int = 32) -> int:
    return -(-n // alignment) * alignment


def build(
    kvs=(),
    infos=(),
    data: bytes = b"",
    *,
    magic: bytes = b"GGUF",
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    alignment: int = 32,
) -> bytes:
    """Header, metadata, tensor table, zero padding to `alignment`, data. Counts default to the truth."""
    n_tensors = len(infos) if n_tensors is None else n_tensors
    n_kv = len(kvs) if n_kv is None else n_kv
    head = magic + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(kvs) + b"".join(infos)
    return head + bytes(pad(len(head), alignment) - len(head)) + data


def f32_tensors(arrays: dict[str, np.ndarray], alignment: int = 32) -> tuple[list[bytes], bytes]:
    """Tensor-table entries and data section for float32 arrays (numpy order), each aligned."""
    infos, data = [], b""
    for name, a in arrays.items():
        data += bytes(pad(len(data), alignment) - len(data))
        infos.append(tinfo(name, list(reversed(a.shape)), QT.F32, len(data)))
        data += np.ascontiguousarray(a, dtype="<f4").tobytes()
    return infos, data


# The small valid file that the malformed cases below are variations of.
KVS = [kv_str("general.name", "tiny"), kv_u32("answer", 42), kv_strs("tokens", ["a", "bc", ""])]
A = np.arange(8, dtype=np.float32).reshape(2, 4)
B = np.arange(8, 16, dtype=np.float32)
INFOS = [tinfo("a", [4, 2], QT.F32, 0), tinfo("b", [8], QT.F32, 32)]
DATA = A.tobytes() + B.tobytes()
KV_START = 24
TI_START = KV_START + sum(map(len, KVS))
TI_END = TI_START + sum(map(len, INFOS))
DATA_START = pad(TI_END)


def valid(**kw) -> bytes:
    return build(KVS, INFOS, DATA, **kw)


def with_infos(*infos: bytes, data: bytes = DATA, kvs=KVS) -> bytes:
    return build(kvs, infos, data)


def with_kvs(*kvs: bytes) -> bytes:
    return build(kvs)


def patch_u64_after(content: bytes, key: str, skip: int, value: int) -> bytes:
    """Overwrites the u64 that lies `skip` bytes after metadata key `key` (e.g. a string or array length)."""
    at = content.index(gstr(key)) + len(gstr(key)) + skip
    return content[:at] + struct.pack("<Q", value) + content[at + 8 :]


@pytest.fixture
def parse(tmp_path):
    """Writes bytes to a fresh .gguf file and parses it."""
    counter = itertools.count()

    def _parse(content: bytes) -> GGUFFile:
        path = tmp_path / f"f{next(counter)}.gguf"
        path.write_bytes(content)
        return GGUFFile(path)

    return _parse


@contextlib.contextmanager
def bounded_memory(limit_mb: int = 100):
    """Fails if the block allocates more than `limit_mb` (Python/numpy heap peak and process max RSS)."""
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        yield
    finally:
        _, peak = tracemalloc.get_traced_memory()
        if started:
            tracemalloc.stop()
        rss_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert peak < limit_mb * 2**20, f"allocated {peak / 2**20:.1f} MiB"
    assert rss_growth_mb < limit_mb, f"max RSS grew by {rss_growth_mb:.1f} MiB"


# --------------------------------------------------------------------------------------------
# Valid files
# --------------------------------------------------------------------------------------------


def test_hand_built_file_parses(parse):
    """The reference file of the malformed cases is itself valid: values, shapes, offsets, data."""
    g = parse(valid())
    assert g.version == 3
    assert g.metadata["general.name"] == "tiny"
    assert g.metadata["answer"] == 42
    assert g.metadata["tokens"] == ["a", "bc", ""]
    assert list(g.tensors) == ["a", "b"]
    assert (g.tensors["a"].shape, g.tensors["a"].offset, g.tensors["a"].nbytes) == ((2, 4), DATA_START, 32)
    assert (g.tensors["b"].shape, g.tensors["b"].offset, g.tensors["b"].nbytes) == ((8,), DATA_START + 32, 32)
    np.testing.assert_array_equal(g.dequantize("a"), A)
    np.testing.assert_array_equal(g.dequantize("b"), B)


def test_header_only_file_parses(parse):
    """24 bytes with no metadata and no tensors is the smallest valid GGUF."""
    g = parse(build())
    assert (g.metadata, g.tensors) == ({}, {})


def test_version_2_is_accepted(parse):
    assert parse(valid(version=2)).version == 2


def test_custom_alignment_is_honoured(parse):
    """general.alignment moves the data section and the unit tensor offsets must respect."""
    a = np.ones((2, 8), np.float32)
    kvs = [kv_u32("general.alignment", 64)]
    infos, data = f32_tensors({"x": a, "y": a}, alignment=64)
    g = parse(build(kvs, infos, data, alignment=64))
    assert g.tensors["x"].offset % 64 == 0 and g.tensors["y"].offset == g.tensors["x"].offset + 64
    np.testing.assert_array_equal(g.dequantize("y"), a)
    with pytest.raises(GGUFError, match="offset 32 is not aligned to 64"):
        parse(build(kvs, [tinfo("x", [8], QT.F32, 32)], bytes(128), alignment=64))


SCALARS = {
    "uint8": (U8, "B", 255),
    "int8": (I8, "b", -128),
    "uint16": (U16, "H", 65535),
    "int16": (I16, "h", -32768),
    "uint32": (U32, "I", 2**32 - 1),
    "int32": (I32, "i", -(2**31)),
    "float32": (F32, "f", -0.375),
    "bool": (BOOL, "?", True),
    "uint64": (U64, "Q", 2**64 - 1),
    "int64": (I64, "q", -(2**63)),
    "float64": (F64, "d", 0.1),
}


@pytest.mark.parametrize(("vtype", "fmt", "value"), SCALARS.values(), ids=SCALARS.keys())
def test_every_scalar_type_decodes_alone_and_in_arrays(parse, vtype, fmt, value):
    """Extremes of each width survive, as a scalar and as array items (a numpy array)."""
    other = False if fmt == "?" else 0
    g = parse(
        with_kvs(
            kv("scalar", vtype, struct.pack("<" + fmt, value)),
            kv_arr("array", vtype, struct.pack(f"<3{fmt}", value, other, value), 3),
        )
    )
    assert g.metadata["scalar"] == value and type(g.metadata["scalar"]) is type(value)
    assert isinstance(g.metadata["array"], np.ndarray)
    assert g.metadata["array"].tolist() == [value, other, value]


def test_nested_arrays_within_the_limit_parse(parse):
    inner = struct.pack("<IQ", U8, 2) + b"\x01\x02"
    g = parse(with_kvs(kv_arr("nested", ARR, inner + inner, 2)))
    assert [x.tolist() for x in g.metadata["nested"]] == [[1, 2], [1, 2]]


def write_with_gguf_writer(path, alignment: int | None = None) -> dict[str, np.ndarray]:
    """A small file from the reference writer; returns the float data of its tensors."""
    rng = np.random.default_rng(0)
    arrays = {
        "f32": rng.standard_normal((3, 64)).astype(np.float32),
        "q8": rng.standard_normal((4, 64)).astype(np.float32),
        "f16": rng.standard_normal((2, 32)).astype(np.float16),
        "vec": np.linspace(-1, 1, 5, dtype=np.float32),
    }
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_string("general.name", "tiny test")
    w.add_uint32("llama.block_count", 3)
    w.add_int32("test.negative", -7)
    w.add_uint64("test.big", 2**40 + 3)
    w.add_float32("test.float", 0.25)
    w.add_bool("test.flag", True)
    w.add_array("test.strings", ["a", "ß", "日本語"])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, 1.5])
    w.add_tensor("f32", arrays["f32"])
    w.add_tensor("q8", gguf.quants.quantize(arrays["q8"], QT.Q8_0), raw_dtype=QT.Q8_0)
    w.add_tensor("f16", arrays["f16"])
    w.add_tensor("vec", arrays["vec"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arrays


@pytest.fixture
def writer_file(tmp_path):
    path = tmp_path / "writer.gguf"
    return path, write_with_gguf_writer(path)


@pytest.mark.parametrize("alignment", [None, 64])
def test_gguf_writer_round_trip(tmp_path, alignment):
    """Metadata, shapes (numpy order), types and data of a GGUFWriter file come back as written."""
    path = tmp_path / "w.gguf"
    arrays = write_with_gguf_writer(path, alignment)
    g = GGUFFile(path)
    md = g.metadata
    assert md["general.architecture"] == "llama"
    assert md["general.name"] == "tiny test"
    assert md["llama.block_count"] == 3
    assert md["test.negative"] == -7
    assert md["test.big"] == 2**40 + 3
    assert md["test.float"] == 0.25
    assert md["test.flag"] is True
    assert md["test.strings"] == ["a", "ß", "日本語"]
    assert isinstance(md["test.ints"], np.ndarray) and md["test.ints"].tolist() == [1, -2, 3]
    assert md["test.floats"].tolist() == [0.5, 1.5]
    assert md.get("general.alignment") == alignment

    assert list(g.tensors) == ["f32", "q8", "f16", "vec"]
    types = {name: t.ggml_type for name, t in g.tensors.items()}
    assert types == {"f32": QT.F32, "q8": QT.Q8_0, "f16": QT.F16, "vec": QT.F32}
    for name, a in arrays.items():
        assert g.tensors[name].shape == a.shape
        assert g.tensors[name].num_elements == a.size
        assert g.tensors[name].offset % (alignment or 32) == 0
    assert g.raw("q8").shape == (4, 2 * 34)  # two Q8_0 blocks of 34 bytes per row

    for name in ("f32", "f16", "vec"):
        out = g.dequantize(name)
        assert out.dtype == np.float32
        np.testing.assert_array_equal(out, arrays[name].astype(np.float32))
    q8 = g.dequantize("q8")
    assert q8.shape == (4, 64) and q8.dtype == np.float32
    step = np.abs(arrays["q8"]).max(axis=1, keepdims=True) / 127  # one quantization step per row
    assert np.all(np.abs(q8 - arrays["q8"]) <= step)
    assert not np.array_equal(q8, arrays["q8"])  # it really went through Q8_0


def test_types_we_cannot_dequantize_parse_but_refuse_to_dequantize(parse):
    """An IQ2_XXS or I32 tensor of correct size is a valid file; only dequantize() refuses, naming the type."""
    block, type_size = gguf.constants.GGML_QUANT_SIZES[QT.IQ2_XXS]
    infos = [tinfo("iq", [block, 2], QT.IQ2_XXS, 0), tinfo("ints", [8], QT.I32, pad(2 * type_size))]
    g = parse(build(infos=infos, data=bytes(pad(2 * type_size) + 32)))
    assert g.tensors["iq"].ggml_type == QT.IQ2_XXS and g.tensors["iq"].nbytes == 2 * type_size
    assert g.raw("iq").shape == (2, type_size)
    with pytest.raises(GGUFError, match="'iq' has type IQ2_XXS, which we cannot dequantize"):
        g.dequantize("iq")
    with pytest.raises(GGUFError, match="type I32"):
        g.dequantize("ints")
    with pytest.raises(GGUFError, match="missing tensor 'nope'"):
        g.dequantize("nope")


# --------------------------------------------------------------------------------------------
# The shipped model, cross-checked against the gguf package's own reader
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped():
    path = resolve_model("smollm2-135m")
    return GGUFFile(path), gguf.GGUFReader(path)


def test_shipped_model_tensor_table_matches_gguf_reader(shipped):
    ours, ref = shipped
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape)), t.name  # reader lists fastest-first
        assert info.ggml_type == t.tensor_type, t.name
        assert info.offset == t.data_offset, t.name
        assert info.nbytes == t.n_bytes, t.name


def test_shipped_model_metadata_matches_gguf_reader(shipped):
    ours, ref = shipped
    assert ours.metadata["llama.block_count"] == 30
    assert ours.metadata["tokenizer.ggml.eos_token_id"] == ref.fields["tokenizer.ggml.eos_token_id"].contents()
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == len(ref.fields["tokenizer.ggml.tokens"].data) == 49152
    ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == ref_keys
    for key in ref_keys:
        value = ours.metadata[key]
        value = value.tolist() if isinstance(value, np.ndarray) else value
        assert value == ref.fields[key].contents(), key


@pytest.mark.parametrize(
    "name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.3.ffn_down.weight", "output_norm.weight"]
)
def test_shipped_model_dequantize_matches_gguf(shipped, name):
    """Q8_0, Q4_1 and F32 tensors dequantize exactly as gguf.quants does."""
    ours, ref = shipped
    t = next(t for t in ref.tensors if t.name == name)
    expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ours.tensors[name].shape)
    np.testing.assert_array_equal(ours.dequantize(name), expected)


def test_shipped_model_types_cover_q8_q4_1_and_f32(shipped):
    assert {t.ggml_type for t in shipped[0].tensors.values()} == {QT.F32, QT.Q4_1, QT.Q8_0}


# --------------------------------------------------------------------------------------------
# Malformed files: every one is a GGUFError saying what is wrong
# --------------------------------------------------------------------------------------------


def test_every_truncation_of_a_valid_file_is_rejected(parse):
    """Cutting the valid file anywhere (header, metadata, tensor table, padding, data) is a GGUFError."""
    content = valid()
    for cut in range(len(content)):
        with pytest.raises(GGUFError, match="too small|truncated"):
            parse(content[:cut])


TRUNCATIONS = {
    "empty": (0, "file is 0 bytes, too small to be GGUF"),
    "inside magic": (3, "too small"),
    "inside counts": (20, "too small"),
    "after header": (24, r"truncated while reading length of metadata key #0 at byte 24"),
    "inside key": (KV_START + 12, "truncated while reading metadata key #0"),
    "inside value type": (KV_START + 8 + 12 + 2, "truncated while reading type of metadata 'general.name'"),
    "inside string value": (KV_START + len(KVS[0]) - 1, "truncated while reading metadata 'general.name'"),
    "inside string array": (TI_START - 1, r"truncated while reading length of metadata 'tokens'\[2\]"),
    "inside tensor name length": (TI_START + 4, "truncated while reading length of name of tensor #0"),
    "inside dims": (TI_START + 8 + 1 + 4 + 12, "truncated while reading dimension 1 of tensor 'a'"),
    "inside tensor offset": (TI_START + len(INFOS[0]) - 1, "truncated while reading offset of tensor 'a'"),
    "inside padding": (TI_END + 1, r"tensor 'a' needs bytes .* \(truncated file or lying size\)"),
    "inside first tensor": (DATA_START + 16, "tensor 'a' needs bytes"),
    "inside last tensor": (DATA_START + 63, f"tensor 'b' needs bytes {DATA_START + 32}..{DATA_START + 64} but"),
}


@pytest.mark.parametrize(("cut", "message"), TRUNCATIONS.values(), ids=TRUNCATIONS.keys())
def test_truncated_file_says_where(parse, cut, message):
    assert TI_END < DATA_START  # the layout this table assumes: there is padding before the data
    with pytest.raises(GGUFError, match=message):
        parse(valid()[:cut])


HEADERS = {
    "wrong magic": (valid(magic=b"GGML"), r"not a GGUF file \(magic b'GGML'"),
    "text file": (b"hello, this is not a model file at all\n", "not a GGUF file"),
    "version 1": (valid(version=1), r"GGUF version 1 is not supported \(supported: \(2, 3\)\)"),
    "version 4": (valid(version=4), "GGUF version 4 is not supported"),
    "big-endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), f"GGUF version {3 << 24} is not supported"),
}


@pytest.mark.parametrize(("content", "message"), HEADERS.values(), ids=HEADERS.keys())
def test_bad_header_is_rejected(parse, content, message):
    with pytest.raises(GGUFError, match=message):
        parse(content)


HUGE = {
    "2**40 tensors": (valid(n_tensors=2**40), "declares 1099511627776 tensors"),
    "2**64-1 tensors": (valid(n_tensors=2**64 - 1), f"declares {2**64 - 1} tensors"),
    "2**40 metadata entries": (valid(n_kv=2**40), "declares 1099511627776 metadata entries"),
    "more metadata than present": (
        build(KVS, n_kv=4, alignment=1),
        "truncated while reading length of metadata key #3",
    ),
    "more tensors than present": (
        build(KVS, INFOS, n_tensors=3, alignment=1),
        "truncated while reading length of name of tensor #2",
    ),
    "key length 2**62": (with_kvs(struct.pack("<Q", 2**62) + b"key"), "truncated while reading metadata key #0"),
    "string length 2**62": (
        patch_u64_after(valid(), "general.name", 4, 2**62),
        rf"truncated while reading metadata 'general.name' at byte {KV_START + 32} \(needs {2**62} bytes",
    ),
    "u32 array count 2**62": (with_kvs(kv_arr("xs", U32, b"\0" * 8, 2**62)), "truncated while reading metadata 'xs'"),
    "u64 array count 2**61": (with_kvs(kv_arr("xs", U64, b"\0" * 8, 2**61)), f"needs {2**64} bytes"),
    "string array count 2**62": (patch_u64_after(valid(), "tokens", 8, 2**62), "reading metadata 'tokens'"),
    "nested array count 2**62": (with_kvs(kv_arr("xs", ARR, b"", 2**62)), "reading metadata 'xs'"),
    "dims 2**40 x 2**40": (with_infos(tinfo("a", [2**40, 2**40])), r"'a' declares 1208925819614629174706176 elements"),
    "dims 4 x 2**63": (with_infos(tinfo("a", [2**63] * 4)), "elements .* too many"),
    "dim 2**64-1": (with_infos(tinfo("a", [2**64 - 1])), "too many"),
    "2**40 f32 elements": (with_infos(tinfo("a", [2**20, 2**20])), "truncated file or lying size"),
    "name length 2**62": (with_infos(struct.pack("<Q", 2**62)), "truncated while reading name of tensor #0"),
}


@pytest.mark.parametrize(("content", "message"), HUGE.values(), ids=HUGE.keys())
def test_huge_counts_and_sizes_are_rejected_without_allocating(parse, content, message):
    """Lengths, counts and dimensions are checked against the file before anything is allocated."""
    with bounded_memory(100), pytest.raises(GGUFError, match=message):
        parse(content)


@pytest.mark.parametrize(
    ("key", "skip", "value", "message"),
    [
        ("general.name", 4, 2**62, r"reading metadata 'general.name' at byte \d+ \(needs 4611686018427387904 bytes"),
        ("test.strings", 8, 2**62, "truncated while reading metadata 'test.strings'"),
        ("test.ints", 8, 2**62, "truncated while reading metadata 'test.ints'"),
        ("test.strings", 8, 150, r"metadata 'test.strings'\[\d+\]"),  # passes the coarse bound, then lies
    ],
)
def test_lying_lengths_in_a_gguf_writer_file_are_rejected(writer_file, parse, key, skip, value, message):
    """A string length or array count patched into a real writer's file is caught before it is believed."""
    path, _ = writer_file
    GGUFFile(path)  # the unpatched file is fine
    with bounded_memory(100), pytest.raises(GGUFError, match=message):
        parse(patch_u64_after(path.read_bytes(), key, skip, value))


def test_memory_guard_detects_a_large_allocation():
    """The guard used above is not vacuous."""
    with pytest.raises(AssertionError, match="allocated"), bounded_memory(100):
        np.ones(200 * 2**20, np.uint8)


def nested(depth: int) -> bytes:
    """An array nested `depth` levels deep (innermost: an empty u8 array)."""
    value = struct.pack("<IQ", U8, 0)
    for _ in range(depth - 1):
        value = struct.pack("<IQ", ARR, 1) + value
    return kv("deep", ARR, value)


METADATA = {
    "unknown value type": (with_kvs(kv("k", 13, b"\0" * 8)), "metadata 'k' has unknown value type 13"),
    "value type 2**32-1": (with_kvs(kv("k", 2**32 - 1, b"")), "unknown value type 4294967295"),
    "unknown array item type": (with_kvs(kv_arr("k", 13, b"", 1)), "metadata 'k' has unknown array item type 13"),
    "key not UTF-8": (with_kvs(kv(b"\xff\xfe", U32, b"\0" * 4)), "metadata key #0 is not valid UTF-8"),
    "string not UTF-8": (with_kvs(kv_str("k", b"\xc3\x28")), "metadata 'k' is not valid UTF-8"),
    "string array item not UTF-8": (
        with_kvs(kv_arr("k", STR, gstr("ok") + gstr(b"\xff"), 2)),
        r"metadata 'k'\[1\] is not valid UTF-8",
    ),
    "duplicate key": (with_kvs(kv_u32("k", 1), kv_u32("k", 2)), "metadata key 'k' appears twice"),
    "arrays nested 5000 deep": (with_kvs(nested(5000)), "nests arrays more than 8 deep"),
}


@pytest.mark.parametrize(("content", "message"), METADATA.values(), ids=METADATA.keys())
def test_bad_metadata_is_rejected(parse, content, message):
    with bounded_memory(100), pytest.raises(GGUFError, match=message):
        parse(content)


ALIGNMENTS = {
    "zero": kv_u32("general.alignment", 0),
    "not a power of two": kv_u32("general.alignment", 48),
    "three": kv_u32("general.alignment", 3),
    "above 1 MiB": kv_u32("general.alignment", 1 << 21),
    "negative": kv_i32("general.alignment", -32),
    "2**63": kv("general.alignment", U64, struct.pack("<Q", 2**63)),
    "a string": kv_str("general.alignment", "32"),
    "a float": kv("general.alignment", F32, struct.pack("<f", 32.0)),
    "a bool": kv("general.alignment", BOOL, b"\x01"),
    "an array": kv_arr("general.alignment", U32, struct.pack("<I", 32), 1),
}


@pytest.mark.parametrize("entry", ALIGNMENTS.values(), ids=ALIGNMENTS.keys())
def test_bad_alignment_is_rejected(parse, entry):
    with pytest.raises(GGUFError, match="general.alignment must be a power of two up to 1 MiB"):
        parse(build([entry], INFOS, DATA))


TENSORS = {
    "rank 0": (with_infos(tinfo("a", [])), r"tensor 'a' has rank 0 \(1..4 allowed\)"),
    "rank 5": (with_infos(tinfo("a", [1] * 5)), "tensor 'a' has rank 5"),
    "rank 9": (with_infos(tinfo("a", [1] * 9)), "tensor 'a' has rank 9"),
    "rank 2**32-1": (with_infos(gstr("a") + struct.pack("<I", 2**32 - 1)), "rank 4294967295"),
    "zero dimension": (with_infos(tinfo("a", [4, 0])), r"tensor 'a' has a zero dimension \[4, 0\]"),
    "unknown type 9999": (with_infos(tinfo("a", [8], 9999)), "tensor 'a' has unknown tensor type id 9999"),
    "removed type Q4_2": (with_infos(tinfo("a", [32], 4)), "unknown tensor type id 4"),
    "row not whole blocks": (
        with_infos(tinfo("a", [33, 1], QT.Q8_0)),
        "row length 33 is not a multiple of the Q8_0 block size 32",
    ),
    "offset past the end": (with_infos(tinfo("a", [8], QT.F32, 2**40)), "lying size"),
    "offset near 2**64": (with_infos(tinfo("a", [8], QT.F32, 2**64 - 32)), "lying size"),
    "size past the end": (
        with_infos(INFOS[0], tinfo("b", [9], QT.F32, 32)),
        rf"tensor 'b' needs bytes {DATA_START + 32}..{DATA_START + 68} but the file has {DATA_START + 64} bytes",
    ),
    "misaligned offset": (with_infos(tinfo("a", [4], QT.F32, 4)), "tensor 'a' offset 4 is not aligned to 32"),
    "same offset": (with_infos(tinfo("a", [8]), tinfo("b", [8])), "tensors 'a' and 'b' overlap"),
    "partial overlap": (with_infos(tinfo("a", [16], QT.F32, 0), tinfo("b", [8], QT.F32, 32)), "overlap"),
    "overlap by one byte": (
        build([kv_u32("general.alignment", 1)], [tinfo("a", [8], QT.F32, 0), tinfo("b", [8], QT.F32, 31)], DATA),
        "tensors 'a' and 'b' overlap",
    ),
    "overlap out of order": (
        with_infos(tinfo("b", [8], QT.F32, 32), tinfo("c", [4], QT.F32, 0), tinfo("a", [16], QT.F32, 0)),
        "tensors '[ac]' and '[ac]' overlap",
    ),
    "duplicate name": (with_infos(tinfo("a", [8], QT.F32, 0), tinfo("a", [8], QT.F32, 32)), "'a' appears twice"),
    "name not UTF-8": (with_infos(tinfo(b"\xff", [8])), "name of tensor #0 is not valid UTF-8"),
}


@pytest.mark.parametrize(("content", "message"), TENSORS.values(), ids=TENSORS.keys())
def test_bad_tensor_table_is_rejected(parse, content, message):
    with bounded_memory(100), pytest.raises(GGUFError, match=message):
        parse(content)


def test_adjacent_tensors_do_not_count_as_overlapping(parse):
    """The overlap check is strict: one tensor may start where the previous one ends."""
    g = parse(build([kv_u32("general.alignment", 1)], [tinfo("a", [7], QT.F32, 0), tinfo("b", [8], QT.F32, 28)], DATA))
    assert g.tensors["b"].offset == g.tensors["a"].offset + g.tensors["a"].nbytes


def test_missing_and_non_file_paths_are_rejected(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(tmp_path / "absent.gguf")
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(tmp_path)


def test_random_corruption_never_crashes(parse):
    """Random byte flips of a valid file either still parse or raise GGUFError, nothing else."""
    rng = random.Random(1234)
    content = valid()
    outcomes = {"parsed": 0, "rejected": 0}
    for _ in range(400):
        mutated = bytearray(content)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        try:
            g = parse(bytes(mutated))
        except GGUFError:
            outcomes["rejected"] += 1
            continue
        outcomes["parsed"] += 1
        for name in g.tensors:
            with contextlib.suppress(GGUFError):
                assert g.dequantize(name).shape == g.tensors[name].shape
    assert outcomes["parsed"] > 0 and outcomes["rejected"] > 0


def test_error_is_a_value_error_naming_the_file(parse, tmp_path):
    with pytest.raises(ValueError, match=re.escape(str(tmp_path))):
        parse(valid(magic=b"XXXX"))


# --------------------------------------------------------------------------------------------
# ModelConfig.from_gguf and check_tensor_shapes on tiny llama files
# --------------------------------------------------------------------------------------------

# One layer, D=8, F=16, V=4, 2 query heads sharing 1 KV head of dimension 4.
LLAMA = {
    "general.architecture": "llama",
    "general.name": "tiny-llama",
    "llama.block_count": 1,
    "llama.embedding_length": 8,
    "llama.feed_forward_length": 16,
    "llama.attention.head_count": 2,
    "llama.attention.head_count_kv": 1,
    "llama.context_length": 64,
    "llama.attention.layer_norm_rms_epsilon": 1e-6,
    "tokenizer.ggml.tokens": ["a", "b", "c", "d"],
}
LLAMA_SHAPES = {
    "token_embd.weight": (4, 8),
    "output_norm.weight": (8,),
    "blk.0.attn_norm.weight": (8,),
    "blk.0.attn_q.weight": (8, 8),
    "blk.0.attn_k.weight": (4, 8),
    "blk.0.attn_v.weight": (4, 8),
    "blk.0.attn_output.weight": (8, 8),
    "blk.0.ffn_norm.weight": (8,),
    "blk.0.ffn_gate.weight": (16, 8),
    "blk.0.ffn_up.weight": (16, 8),
    "blk.0.ffn_down.weight": (8, 16),
}


def encode_kv(key: str, value) -> bytes:
    if isinstance(value, str):
        return kv_str(key, value)
    if isinstance(value, float):
        return kv(key, F32, struct.pack("<f", value))
    if isinstance(value, list):
        return kv_strs(key, value)
    return kv_i32(key, value)


def llama_file(parse, metadata_changes=None, shape_changes=None) -> GGUFFile:
    """A tiny llama GGUF; a change to None drops the key or tensor."""
    md = {**LLAMA, **(metadata_changes or {})}
    shapes = {**LLAMA_SHAPES, **(shape_changes or {})}
    kvs = [encode_kv(k, v) for k, v in md.items() if v is not None]
    infos, data = f32_tensors({n: np.zeros(s, np.float32) for n, s in shapes.items() if s is not None})
    return parse(build(kvs, infos, data))


def test_llama_config_from_gguf(parse):
    g = llama_file(parse)
    cfg = ModelConfig.from_gguf(g)
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.ffn_size) == ("llama", 1, 8, 16)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (2, 1, 4, 4)
    assert cfg.max_context == 64 and cfg.name == "tiny-llama" and cfg.tie_embeddings
    assert cfg.rms_norm_eps == pytest.approx(1e-6)
    check_tensor_shapes(g, cfg)  # the complete file passes
    assert sorted(required_tensors(cfg)) == sorted(LLAMA_SHAPES)


BAD_LLAMA = {
    "mamba": ({"general.architecture": "mamba"}, r"architecture 'mamba' is not supported \(supported: llama, gemma3\)"),
    "no architecture": ({"general.architecture": None}, "architecture None is not supported"),
    "no block count": ({"llama.block_count": None}, "missing metadata 'llama.block_count'"),
    "no embedding length": ({"llama.embedding_length": None}, "missing metadata 'llama.embedding_length'"),
    "zero heads": ({"llama.attention.head_count": 0}, "'llama.attention.head_count' must be a positive integer, got 0"),
    "negative heads": ({"llama.attention.head_count": -2}, "'llama.attention.head_count' must be a positive integer"),
    "negative kv heads": ({"llama.attention.head_count_kv": -1}, "'llama.attention.head_count_kv' must be a positive"),
    "string block count": ({"llama.block_count": "1"}, "'llama.block_count' must be a positive integer, got '1'"),
    "heads not grouped": ({"llama.attention.head_count_kv": 3}, "2 query heads are not a multiple of 3 KV heads"),
    "negative epsilon": ({"llama.attention.layer_norm_rms_epsilon": -1e-6}, "must be a positive number"),
    "no vocabulary": ({"tokenizer.ggml.tokens": None}, "missing metadata 'llama.vocab_size'"),
}


@pytest.mark.parametrize(("changes", "message"), BAD_LLAMA.values(), ids=BAD_LLAMA.keys())
def test_bad_llama_metadata_is_rejected(parse, changes, message):
    g = llama_file(parse, metadata_changes=changes)
    with pytest.raises(GGUFError, match=message):
        ModelConfig.from_gguf(g)


@pytest.mark.parametrize(
    ("shape_changes", "message"),
    [
        ({"blk.0.ffn_up.weight": None}, r"missing tensors \['blk.0.ffn_up.weight'\]"),
        ({"token_embd.weight": None, "output_norm.weight": None}, r"\['token_embd.weight', 'output_norm.weight'\]"),
        ({"blk.0.ffn_up.weight": (8, 16)}, r"'blk.0.ffn_up.weight' has shape \(8, 16\), expected \(16, 8\)"),
        ({"blk.0.attn_k.weight": (8, 8)}, r"'blk.0.attn_k.weight' has shape \(8, 8\), expected \(4, 8\)"),
        ({"output.weight": (4, 4)}, r"'output.weight' has shape \(4, 4\), expected \(4, 8\)"),
    ],
)
def test_check_tensor_shapes_rejects_missing_or_misshapen_tensors(parse, shape_changes, message):
    g = llama_file(parse, shape_changes=shape_changes)
    with pytest.raises(GGUFError, match=message):
        check_tensor_shapes(g, ModelConfig.from_gguf(g))


def test_check_tensor_shapes_lists_the_first_missing_tensors_and_counts_the_rest(parse):
    cfg = ModelConfig.from_gguf(llama_file(parse))
    g = llama_file(parse, shape_changes={n: None for n in LLAMA_SHAPES if n.startswith("blk.0.")})
    with pytest.raises(GGUFError, match=r"missing tensors \['blk.0.attn_norm.weight', .*\] and 4 more"):
        check_tensor_shapes(g, cfg)


def test_untied_output_matrix_is_required_and_checked(parse):
    g = llama_file(parse, shape_changes={"output.weight": (4, 8)})
    cfg = ModelConfig.from_gguf(g)
    assert not cfg.tie_embeddings and "output.weight" in required_tensors(cfg)
    check_tensor_shapes(g, cfg)


def write_llama(path, metadata_changes=None) -> GGUFFile:
    """The tiny llama file above written by gguf.GGUFWriter, integers as uint32 as converters write them."""
    w = gguf.GGUFWriter(path, "llama")
    for key, value in {**LLAMA, **(metadata_changes or {})}.items():
        if key == "general.architecture":
            continue  # the writer adds it
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    for name, shape in LLAMA_SHAPES.items():
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


OVERSIZED_LLAMA = {
    # Listing 9 tensor names for each of 4e9 layers used to exhaust memory in required_tensors.
    "absurd block count": (
        {"llama.block_count": 4_000_000_000},
        "'llama.block_count' is 4000000000, but 4000000000 layers need 36000000000 tensors and the file has 11",
    ),
    "one layer too many": ({"llama.block_count": 2}, "'llama.block_count' is 2, but 2 layers need 18 tensors"),
    # LLM() sizes its block table from the context length by default.
    "absurd context length": (
        {"llama.context_length": 2_000_000_000},
        "'llama.context_length' must be at most 16777216, got 2000000000",
    ),
}


@pytest.mark.parametrize(("changes", "message"), OVERSIZED_LLAMA.values(), ids=OVERSIZED_LLAMA.keys())
def test_counts_the_file_cannot_back_are_rejected_while_reading_the_config(tmp_path, changes, message):
    g = write_llama(tmp_path / "big.gguf", changes)
    with bounded_memory(100), pytest.raises(GGUFError, match=message):
        ModelConfig.from_gguf(g)


def test_context_length_at_the_limit_is_accepted(tmp_path):
    g = write_llama(tmp_path / "long.gguf", {"llama.context_length": MAX_CONTEXT})
    cfg = ModelConfig.from_gguf(g)
    assert cfg.max_context == MAX_CONTEXT == 2**24 and cfg.num_layers == 1
    check_tensor_shapes(g, cfg)


# --------------------------------------------------------------------------------------------
# models.registry.resolve_model
# --------------------------------------------------------------------------------------------


def test_registered_model_resolves_to_an_existing_gguf():
    path = resolve_model("smollm2-135m")
    assert path.endswith(".gguf") and os.path.isfile(path)


def test_unknown_model_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model': use one of \[.*smollm2-135m.*\]"):
        resolve_model("no-such-model")


def test_missing_gguf_path_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(tmp_path / "missing.gguf")


def test_existing_gguf_path_resolves_to_itself(writer_file):
    path, _ = writer_file
    assert resolve_model(path) == str(path)


def _q6_k_block(block: np.ndarray) -> np.ndarray:
    """One Q6_K super-block (210 bytes: 128 low nibbles, 64 bytes of high bit pairs, 16 int8
    scales, a float16 scale) as its 256 values, written out from the format itself."""
    ql, qh = block[:128].astype(np.int32), block[128:192].astype(np.int32)
    scales = block[192:208].view(np.int8).astype(np.float32)
    d = float(block[208:210].view(np.float16)[0])
    out = np.zeros(256, np.float32)
    for half in range(2):
        lo, hi, sc = ql[64 * half :][:64], qh[32 * half :][:32], scales[8 * half :][:8]
        for i in range(32):
            quads = (
                (lo[i] & 15) | (hi[i] & 3) << 4,
                (lo[i + 32] & 15) | (hi[i] >> 2 & 3) << 4,
                lo[i] >> 4 | (hi[i] >> 4 & 3) << 4,
                lo[i + 32] >> 4 | (hi[i] >> 6 & 3) << 4,
            )
            for j, q in enumerate(quads):  # element 128 h + 32 j + i uses scale 2 j + i // 16
                out[128 * half + 32 * j + i] = d * sc[2 * j + i // 16] * (q - 32)
    return out


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K])
def test_k_quant_tensors_load_in_shape(tmp_path, qtype):
    """K-quant tensors (Gemma 3's GGUFs use Q4_K and Q6_K): 256-value super-blocks, two per row
    here, written raw with GGUFWriter and read back through GGUFFile. Bytes below 0x3C keep
    every float16 scale finite. Q6_K is checked against the format written out above, the
    others against gguf's own dequantization of the same bytes."""
    block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 2 * block
    raw = np.random.default_rng(int(qtype)).integers(0, 0x3C, (rows, cols // block * size), dtype=np.uint8)
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("w", raw, raw_dtype=qtype)  # shape in bytes: [rows, blocks x block bytes]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFFile(path)
    assert g.tensors["w"].ggml_type == qtype and g.tensors["w"].shape == (rows, cols)
    out = g.dequantize("w")
    assert out.shape == (rows, cols) and out.dtype == np.float32 and np.isfinite(out).all()
    if qtype == QT.Q6_K:
        blocks = raw.reshape(rows * 2, size)
        expected = np.stack([_q6_k_block(b) for b in blocks]).reshape(rows, cols)
    else:
        expected = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    np.testing.assert_array_equal(out, expected)
    assert np.abs(out).max() > 0


def gemma3_file(parse, metadata_changes=None, shape_changes=None) -> GGUFFile:
    """A tiny gemma3 GGUF of 6 layers (the sixth global): the llama keys under `gemma3.`, a
    sliding window, and Gemma's four extra norms per layer."""
    md = {k.replace("llama.", "gemma3."): v for k, v in LLAMA.items()}
    md |= {"general.architecture": "gemma3", "gemma3.block_count": 6, "gemma3.attention.sliding_window": 3}
    shapes = {"token_embd.weight": (4, 8), "output_norm.weight": (8,)}
    for i in range(6):
        shapes |= {n.replace("blk.0.", f"blk.{i}."): s for n, s in LLAMA_SHAPES.items() if n.startswith("blk.0.")}
        shapes |= {f"blk.{i}.attn_q_norm.weight": (4,), f"blk.{i}.attn_k_norm.weight": (4,)}
        shapes |= {f"blk.{i}.post_attention_norm.weight": (8,), f"blk.{i}.post_ffw_norm.weight": (8,)}
    md, shapes = {**md, **(metadata_changes or {})}, {**shapes, **(shape_changes or {})}
    kvs = [encode_kv(k, v) for k, v in md.items() if v is not None]
    infos, data = f32_tensors({n: np.zeros(s, np.float32) for n, s in shapes.items() if s is not None})
    return parse(build(kvs, infos, data))


def test_gemma3_config_and_tensors_from_gguf(parse):
    g = gemma3_file(parse)
    cfg = ModelConfig.from_gguf(g)
    assert (cfg.arch, cfg.num_layers, cfg.sliding_window, cfg.window_layers) == ("gemma3", 6, 3, (0, 1, 2, 3, 4))
    assert (cfg.window(4), cfg.window(5), cfg.layer_rope_base(4), cfg.layer_rope_base(5)) == (3, None, 10000.0, 10000.0)
    assert cfg.qk_norm and cfg.post_norms and cfg.activation == "gelu_tanh"
    assert cfg.embed_scale == pytest.approx(8**0.5)
    check_tensor_shapes(g, cfg)
    assert len(required_tensors(cfg)) == 2 + 6 * 13
    with pytest.raises(GGUFError, match="missing metadata 'gemma3.attention.sliding_window'"):
        ModelConfig.from_gguf(gemma3_file(parse, {"gemma3.attention.sliding_window": None}))
    with pytest.raises(GGUFError, match=r"'blk.2.attn_k_norm.weight' has shape \(8,\), expected \(4,\)"):
        check_tensor_shapes(
            g := gemma3_file(parse, shape_changes={"blk.2.attn_k_norm.weight": (8,)}), ModelConfig.from_gguf(g)
        )
    with pytest.raises(GGUFError, match=r"missing tensors \['blk.0.post_ffw_norm.weight'\]"):
        check_tensor_shapes(
            g := gemma3_file(parse, shape_changes={"blk.0.post_ffw_norm.weight": None}), ModelConfig.from_gguf(g)
        )
