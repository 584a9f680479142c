"""Tests of the C++ GGUF reader (``_core.GgufFile``) against gguf-py as the independent reference.

Valid files come from the real default model and from ``gguf.GGUFWriter``; malformed files are built with a small
struct-based encoder (``_enc_*``) whose valid output is itself checked against ``gguf.GGUFReader``.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from kvcmas_cpp._native import core

KvcmasError = core.KvcmasError
# Written by models/make_test_models.py, which the README's set-up (scripts/setup.sh --test) runs.
SETUP_STAMP = Path(__file__).resolve().parent.parent / "models" / "generated" / "VERSION.tiny"
FUZZ_WORKER = Path(__file__).with_name("gguf_fuzz_worker.py")

# ---------------------------------------------------------------------------------------------------------------
# Reference: gguf.GGUFReader, regrouped into nested Python values. GGUFReader.contents() flattens nested arrays and
# decodes strings strictly, so the raw parts it parsed are walked here instead.


def _walk_parts(parts: list[np.ndarray], i: int, vtype: GGUFValueType) -> tuple[Any, int, str]:
    """Decodes one value of ``vtype`` from GGUFReader field parts starting at ``i``: (value, next index, type name)."""
    if vtype == GGUFValueType.STRING:
        return bytes(parts[i + 1]).decode("utf-8", errors="replace"), i + 2, "string"
    if vtype == GGUFValueType.ARRAY:
        item_type = GGUFValueType(int(parts[i][0]))
        n = int(parts[i + 1][0])
        i += 2
        items, names = [], []
        for _ in range(n):
            item, i, name = _walk_parts(parts, i, item_type)
            items.append(item)
            names.append(name)
        if item_type != GGUFValueType.ARRAY:
            inner = item_type.name.lower()
        else:
            inner = names[0] if names and all(n == names[0] for n in names) else "array"
        return items, i, f"array[{inner}]"
    return parts[i][0].item(), i + 1, vtype.name.lower()


def reference(path: Path) -> dict[str, Any]:
    """Everything gguf.GGUFReader reads from ``path``, in the shapes ``_core.GgufFile`` reports."""
    r = gguf.GGUFReader(path)
    meta, types = {}, {}
    for name, field in r.fields.items():
        if name.startswith("GGUF."):
            continue  # the reader's pseudo-fields for the header
        value, end, type_name = _walk_parts(field.parts, 3, GGUFValueType(int(field.parts[2][0])))
        assert end == len(field.parts)
        meta[name] = value
        types[name] = type_name
    tensors = [
        {
            "name": t.name,
            "type": int(t.tensor_type),
            "type_name": t.tensor_type.name.lower().replace("_k", "_K"),
            "shape": [int(d) for d in t.shape],
            "offset": int(t.data_offset) - r.data_offset,
            "n_bytes": int(t.n_bytes),
        }
        for t in r.tensors
    ]
    data = {t.name: t.data.tobytes() for t in r.tensors}
    return {
        "meta": meta,
        "types": types,
        "tensors": tensors,
        "data": data,
        "data_offset": r.data_offset,
        "alignment": int(r.alignment),
    }


def assert_matches_reference(path: Path) -> core.GgufFile:
    f = core.GgufFile(str(path))
    ref = reference(path)
    meta = f.metadata()
    assert list(meta) == list(ref["meta"])  # file order
    assert meta == ref["meta"]
    assert f.value_types() == ref["types"]
    assert f.tensors() == ref["tensors"]
    assert f.data_offset == ref["data_offset"]
    assert f.alignment == ref["alignment"]
    assert f.file_size == path.stat().st_size
    for name, data in ref["data"].items():
        assert f.tensor_bytes(name) == data, name
    return f


# ---------------------------------------------------------------------------------------------------------------
# The real default model.


@pytest.fixture(scope="module")
def default_model() -> Path:
    """The installed default model (kvcmas_cpp.default_model_path(), so on any interpreter or venv). Skips when
    it is absent on a machine where the README's set-up never ran; fails when the set-up ran and it is still absent."""
    from kvcmas_cpp import default_model_path

    try:
        return Path(default_model_path())
    except FileNotFoundError as exc:
        if SETUP_STAMP.exists():
            pytest.fail(f"the README's set-up ran ({SETUP_STAMP} exists) but the default model is missing: {exc}")
        pytest.skip(f"default model not installed (set-up not run): {exc}")


def test_default_model_matches_gguf_py(default_model: Path) -> None:
    f = assert_matches_reference(default_model)
    assert f.version == 3
    assert f.path == str(default_model)
    meta = f.metadata()
    # The shapes the Python tokenizer relies on.
    assert len(meta["tokenizer.ggml.tokens"]) == meta["llama.vocab_size"] == 49152
    assert all(isinstance(t, str) for t in meta["tokenizer.ggml.tokens"])
    assert all(isinstance(t, str) for t in meta["tokenizer.ggml.merges"])
    assert all(isinstance(t, int) for t in meta["tokenizer.ggml.token_type"])
    assert isinstance(meta["tokenizer.ggml.add_bos_token"], bool)
    assert isinstance(meta["llama.rope.freq_base"], float)


def test_default_model_loads_fast(default_model: Path) -> None:
    """mmap + parse of the 98 MB model with its 49k-token vocabulary takes milliseconds, not a read of the file."""
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("timing is meaningless under AddressSanitizer")
    best_open = best_meta = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        f = core.GgufFile(str(default_model))
        t1 = time.perf_counter()
        f.metadata()
        t2 = time.perf_counter()
        best_open, best_meta = min(best_open, t1 - t0), min(best_meta, t2 - t1)
    assert best_open < 0.1, best_open
    assert best_meta < 0.25, best_meta  # building ~100k Python strings


# ---------------------------------------------------------------------------------------------------------------
# Files written by gguf.GGUFWriter.

# (key, value, type, element type for arrays)
WRITER_KVS: list[tuple[str, Any, GGUFValueType, GGUFValueType | None]] = [
    ("t.u8", 255, GGUFValueType.UINT8, None),
    ("t.i8", -128, GGUFValueType.INT8, None),
    ("t.u16", 65535, GGUFValueType.UINT16, None),
    ("t.i16", -32768, GGUFValueType.INT16, None),
    ("t.u32", 2**32 - 1, GGUFValueType.UINT32, None),
    ("t.i32", -(2**31), GGUFValueType.INT32, None),
    ("t.u64_max", 2**64 - 1, GGUFValueType.UINT64, None),
    ("t.u64_big", 2**63 + 5, GGUFValueType.UINT64, None),
    ("t.i64_min", -(2**63), GGUFValueType.INT64, None),
    ("t.i64_neg", -1, GGUFValueType.INT64, None),
    ("t.f32", 3.14159, GGUFValueType.FLOAT32, None),
    ("t.f32_inf", -math.inf, GGUFValueType.FLOAT32, None),
    ("t.f64", -1.0e300, GGUFValueType.FLOAT64, None),
    ("t.f64_tiny", 5e-324, GGUFValueType.FLOAT64, None),
    ("t.true", True, GGUFValueType.BOOL, None),
    ("t.false", False, GGUFValueType.BOOL, None),
    ("t.empty_str", "", GGUFValueType.STRING, None),
    ("t.unicode", "héllo wörld ✓ 日本語 🎉", GGUFValueType.STRING, None),
    ("t.nul", "a\x00b", GGUFValueType.STRING, None),
    ("t.ключ日本🎉", 1, GGUFValueType.UINT8, None),
    ("t.a_u8", [0, 1, 255], GGUFValueType.ARRAY, GGUFValueType.UINT8),
    ("t.a_i8", [-128, 0, 127], GGUFValueType.ARRAY, GGUFValueType.INT8),
    ("t.a_u16", [0, 65535], GGUFValueType.ARRAY, GGUFValueType.UINT16),
    ("t.a_i16", [-32768, 32767], GGUFValueType.ARRAY, GGUFValueType.INT16),
    ("t.a_u32", [0, 2**32 - 1], GGUFValueType.ARRAY, GGUFValueType.UINT32),
    ("t.a_i32", [-(2**31), 2**31 - 1, 7], GGUFValueType.ARRAY, GGUFValueType.INT32),
    ("t.a_u64", [0, 2**63, 2**64 - 1], GGUFValueType.ARRAY, GGUFValueType.UINT64),
    ("t.a_i64", [-(2**63), 2**63 - 1], GGUFValueType.ARRAY, GGUFValueType.INT64),
    ("t.a_f32", [0.1, -2.5, 1e30], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
    ("t.a_f64", [0.1, -2.5, 1e300], GGUFValueType.ARRAY, GGUFValueType.FLOAT64),
    ("t.a_bool", [True, False, True], GGUFValueType.ARRAY, GGUFValueType.BOOL),
    ("t.a_str", ["a", "", "ü", "Ġthe"], GGUFValueType.ARRAY, GGUFValueType.STRING),
    ("t.nested", [[1, 2], [3], [-4, 5, 6]], GGUFValueType.ARRAY, None),
    ("t.nested_mixed", [[1, 2], ["x", "yz"]], GGUFValueType.ARRAY, None),
    ("t.nested3", [[[1.5], [2.5, 3.5]], [[4.5]]], GGUFValueType.ARRAY, None),
]


def _expected_python(value: Any, vtype: GGUFValueType, sub: GGUFValueType | None) -> Any:
    """What GgufFile.metadata() must return for a value written as ``vtype``: float32 rounding applied."""
    if vtype == GGUFValueType.FLOAT32 or sub == GGUFValueType.FLOAT32:
        return [float(np.float32(v)) for v in value] if isinstance(value, list) else float(np.float32(value))
    if isinstance(value, list) and sub is None:  # nested: inner types are inferred by the writer (int32, float32)
        return [
            _expected_python(v, GGUFValueType.ARRAY, None)
            if isinstance(v, list)
            else (float(np.float32(v)) if isinstance(v, float) else v)
            for v in value
        ]
    return value


def write_with_gguf_py(path: Path, *, alignment: int | None = None, tensors: bool = True) -> dict[str, np.ndarray]:
    """Writes WRITER_KVS and a few tensors of several types; returns the tensors as written (numpy order)."""
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, vtype, sub in WRITER_KVS:
        w.add_key_value(key, value, vtype, sub_type=sub)
    rng = np.random.default_rng(0)
    written: dict[str, np.ndarray] = {}
    if tensors:
        f32 = rng.standard_normal((3, 8)).astype(np.float32)
        f16 = rng.standard_normal((2, 5)).astype(np.float16)
        vec = rng.standard_normal(7).astype(np.float32)
        four_d = rng.standard_normal((2, 1, 3, 4)).astype(np.float32)
        q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
        q4 = gguf.quants.quantize(rng.standard_normal((2, 32)).astype(np.float32), GGMLQuantizationType.Q4_0)
        for name, arr in [("w.f32", f32), ("w.f16", f16), ("w.vec", vec), ("w.4d", four_d)]:
            w.add_tensor(name, arr)
            written[name] = arr
        w.add_tensor("w.q8_0", q8, raw_dtype=GGMLQuantizationType.Q8_0)
        w.add_tensor("w.q4_0", q4, raw_dtype=GGMLQuantizationType.Q4_0)
        written["w.q8_0"], written["w.q4_0"] = q8, q4
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def test_writer_file_all_value_types(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    written = write_with_gguf_py(path)
    f = assert_matches_reference(path)
    assert f.version == 3
    assert f.alignment == 32
    meta = f.metadata()
    assert meta["general.architecture"] == "llama"
    for key, value, vtype, sub in WRITER_KVS:
        expected = _expected_python(value, vtype, sub)
        assert meta[key] == expected, key
        assert type(meta[key]) is type(expected), key  # bool stays bool, int stays int
    assert all(type(v) is bool for v in meta["t.a_bool"])
    assert all(type(v) is float for v in meta["t.a_f64"])
    types = f.value_types()
    assert types["t.u64_big"] == "uint64"
    assert types["t.a_str"] == "array[string]"
    assert types["t.nested"] == "array[array[int32]]"
    assert types["t.nested_mixed"] == "array[array]"
    assert types["t.nested3"] == "array[array[array[float32]]]"

    by_name = {t["name"]: t for t in f.tensors()}
    assert [t["name"] for t in f.tensors()] == list(written)
    for name in ("w.f32", "w.f16", "w.vec", "w.4d"):
        arr = written[name]
        assert by_name[name]["shape"] == list(reversed(arr.shape))  # ggml order
        assert by_name[name]["type_name"] == {np.float32: "f32", np.float16: "f16"}[arr.dtype.type]
        assert f.tensor_bytes(name) == arr.tobytes()
    assert by_name["w.q8_0"]["shape"] == [64, 4]
    assert by_name["w.q8_0"]["type"] == int(GGMLQuantizationType.Q8_0)
    assert by_name["w.q8_0"]["n_bytes"] == 4 * 2 * 34  # 4 rows of two 34-byte blocks
    assert f.tensor_bytes("w.q8_0") == written["w.q8_0"].tobytes()
    assert by_name["w.q4_0"]["type_name"] == "q4_0"
    assert f.tensor_bytes("w.q4_0") == written["w.q4_0"].tobytes()
    for t in f.tensors():
        assert t["offset"] % 32 == 0


def test_custom_alignment(tmp_path: Path) -> None:
    path = tmp_path / "align64.gguf"
    write_with_gguf_py(path, alignment=64)
    f = assert_matches_reference(path)
    assert f.alignment == 64
    assert f.metadata()["general.alignment"] == 64
    assert f.data_offset % 64 == 0
    assert all(t["offset"] % 64 == 0 for t in f.tensors())
    assert any(t["offset"] % 128 != 0 for t in f.tensors())  # really 64, not a coarser alignment by chance


def test_version_2(tmp_path: Path) -> None:
    """v2 and v3 share the layout; v2 is v3's bytes with the version field set to 2."""
    v3 = tmp_path / "v3.gguf"
    write_with_gguf_py(v3)
    v2 = tmp_path / "v2.gguf"
    data = bytearray(v3.read_bytes())
    assert struct.unpack_from("<I", data, 4)[0] == 3
    struct.pack_into("<I", data, 4, 2)
    v2.write_bytes(bytes(data))
    f2 = assert_matches_reference(v2)
    f3 = core.GgufFile(str(v3))
    assert (f2.version, f3.version) == (2, 3)
    assert f2.metadata() == f3.metadata()
    assert f2.tensors() == f3.tensors()


def test_no_tensors(tmp_path: Path) -> None:
    path = tmp_path / "meta-only.gguf"
    write_with_gguf_py(path, tensors=False)
    f = assert_matches_reference(path)
    assert f.tensors() == []


def test_typed_getters(tmp_path: Path) -> None:
    """The C++ getters the engine reads hyperparameters with: kinds accepted, fallbacks, and errors naming the key."""
    path = tmp_path / "get.gguf"
    write_with_gguf_py(path, tensors=False)
    f = core.GgufFile(str(path))
    values = {key: _expected_python(value, vtype, sub) for key, value, vtype, sub in WRITER_KVS}
    for key in ("t.u8", "t.i8", "t.u16", "t.i16", "t.u32", "t.i32", "t.i64_min", "t.i64_neg"):
        assert f.get_int(key) == values[key], key
        assert f.get_int(key, 12345) == values[key], key
        assert f.get_float(key) == float(values[key]), key  # integers widen to float
    assert f.get_float("t.u64_max") == float(2**64 - 1)
    assert f.get_float("t.f32") == values["t.f32"]
    assert f.get_float("t.f64") == values["t.f64"]
    assert f.get_string("general.architecture") == "llama"
    assert f.get_string("t.unicode") == values["t.unicode"]
    assert f.get_bool("t.true", False) is True
    assert f.get_bool("t.false", True) is False
    assert f.get_int("t.nope", 7) == 7
    assert f.get_float("t.nope", 1.5) == 1.5
    assert f.get_bool("t.nope", True) is True

    def error(call: Any, pattern: str) -> None:
        with pytest.raises(KvcmasError, match=pattern) as info:
            call()
        assert str(info.value).startswith(f"{path}: ")

    error(lambda: f.get_int("t.nope"), "metadata key 't.nope' is missing")
    error(lambda: f.get_float("t.nope"), "metadata key 't.nope' is missing")
    error(lambda: f.get_string("t.nope"), "metadata key 't.nope' is missing")
    error(lambda: f.get_int("t.u64_big"), "'t.u64_big' value 9223372036854775813 does not fit int64")
    error(lambda: f.get_int("t.f32"), "'t.f32' has type float32, expected an integer")
    error(lambda: f.get_int("t.true", 0), "'t.true' has type bool, expected an integer")
    error(lambda: f.get_float("t.a_f32"), "'t.a_f32' has type array, expected a number")
    error(lambda: f.get_string("t.u32"), "'t.u32' has type uint32, expected string")
    error(lambda: f.get_bool("t.u8", False), "'t.u8' has type uint8, expected bool")


def test_tensor_bytes_unknown_name(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    write_with_gguf_py(path)
    with pytest.raises(KvcmasError, match="no tensor named 'nope'"):
        core.GgufFile(str(path)).tensor_bytes("nope")


def test_accepts_pathlike(tmp_path: Path) -> None:
    path = tmp_path / "p.gguf"
    write_with_gguf_py(path, tensors=False)
    assert core.GgufFile(path).path == str(path)


# ---------------------------------------------------------------------------------------------------------------
# A struct-based encoder for crafted files. Type ids: see GGUFValueType.


def _enc_str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _enc_kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _enc_str(key) + struct.pack("<I", vtype) + payload


def _enc_array(item_type: int, items: list[bytes]) -> bytes:
    return struct.pack("<IQ", item_type, len(items)) + b"".join(items)


def _enc_tensor(name: str, dims: list[int], type_id: int, offset: int) -> bytes:
    return (
        _enc_str(name)
        + struct.pack("<I", len(dims))
        + struct.pack(f"<{len(dims)}Q", *dims)
        + struct.pack("<IQ", type_id, offset)
    )


def _enc_file(
    kvs: list[bytes],
    infos: list[bytes],
    data: bytes,
    *,
    version: int = 3,
    alignment: int = 32,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    magic: bytes = b"GGUF",
) -> bytes:
    head = magic + struct.pack(
        "<IQQ", version, len(infos) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv
    )
    body = head + b"".join(kvs) + b"".join(infos)
    body += b"\0" * (-len(body) % alignment)
    return body + data


U32, I32, F32, BOOL, STR, ARR, U64 = 4, 5, 6, 7, 8, 9, 10
F32_ID, Q8_0_ID = 0, 8


BOOL_TRUE = struct.pack("<IB", BOOL, 1)  # a value: type bool, byte 1
DEEP_ARRAY = struct.pack("<IQ", ARR, 1) * 40 + struct.pack("<IQ", U32, 0)  # 41 levels of arrays


def _good_parts() -> tuple[list[bytes], list[bytes], bytes]:
    """A small valid file's pieces: scalars, arrays (incl. empty and nested ones) and three tensors, one empty."""
    kvs = [
        _enc_kv("general.architecture", STR, _enc_str("llama")),
        _enc_kv("a.u32", U32, struct.pack("<I", 7)),
        _enc_kv("a.tokens", ARR, _enc_array(STR, [_enc_str(t) for t in ["<s>", "a", "b\xff".encode("latin-1")]])),
        _enc_kv("a.empty", ARR, _enc_array(I32, [])),
        _enc_kv("a.empty_str", ARR, _enc_array(STR, [])),
        _enc_kv("a.nested", ARR, _enc_array(ARR, [_enc_array(F32, [struct.pack("<f", 0.5)]), _enc_array(U32, [])])),
        _enc_kv("a.flag", BOOL, b"\x01"),
    ]
    weight = np.arange(64, dtype=np.float32).reshape(2, 32)
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 32, dtype=np.float32)[None, :], GGMLQuantizationType.Q8_0)
    infos = [
        _enc_tensor("w", [32, 2], F32_ID, 0),
        _enc_tensor("q", [32, 1], Q8_0_ID, 256),
        _enc_tensor("empty", [0, 4], F32_ID, 320),
    ]
    data = weight.tobytes() + q8.tobytes() + b"\0" * (320 - 256 - 34)
    return kvs, infos, data


def test_hand_encoded_file_matches_gguf_py(tmp_path: Path) -> None:
    """The encoder used for the bad-input tests produces files that gguf-py and GgufFile read identically."""
    kvs, infos, data = _good_parts()
    path = tmp_path / "hand.gguf"
    path.write_bytes(_enc_file(kvs, infos, data))
    f = assert_matches_reference(path)
    meta = f.metadata()
    assert meta["a.tokens"] == ["<s>", "a", "b\ufffd"]  # invalid UTF-8 is replaced, not an error
    assert f.string_bytes("a.tokens") == [b"<s>", b"a", b"b\xff"]  # and kept as bytes for those who need it
    assert f.string_bytes("general.architecture") == b"llama"
    with pytest.raises(KvcmasError, match="'a.u32' is not a string or an array of strings"):
        f.string_bytes("a.u32")
    assert meta["a.empty"] == [] and meta["a.empty_str"] == []
    assert meta["a.nested"] == [[0.5], []]
    assert f.value_types()["a.nested"] == "array[array]"
    assert {t["name"]: t["n_bytes"] for t in f.tensors()} == {"w": 256, "q": 34, "empty": 0}


# ---------------------------------------------------------------------------------------------------------------
# Bad input: each raises KvcmasError whose message starts with the path and names the problem.


def _expect_error(path: Path, pattern: str) -> str:
    with pytest.raises(KvcmasError) as info:
        core.GgufFile(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert re.search(pattern, message), message
    return message


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_kvcmas_error_is_value_error() -> None:
    assert issubclass(KvcmasError, ValueError)


def test_missing_directory_empty(tmp_path: Path) -> None:
    _expect_error(tmp_path / "missing.gguf", "cannot open: No such file or directory")
    _expect_error(tmp_path, "is a directory")
    _expect_error(_write(tmp_path, "empty.gguf", b""), "file is empty")


def test_wrong_magic_and_versions(tmp_path: Path) -> None:
    kvs, infos, data = _good_parts()
    _expect_error(_write(tmp_path, "magic.gguf", _enc_file(kvs, infos, data, magic=b"GGML")), "not a GGUF file")
    _expect_error(
        _write(tmp_path, "v1.gguf", _enc_file(kvs, infos, data, version=1)), "GGUF version 1 is not supported"
    )
    _expect_error(
        _write(tmp_path, "v99.gguf", _enc_file(kvs, infos, data, version=99)), "GGUF version 99 is not supported"
    )
    big_endian = bytearray(_enc_file(kvs, infos, data))
    big_endian[4:8] = struct.pack(">I", 3)
    _expect_error(_write(tmp_path, "be.gguf", bytes(big_endian)), "big-endian")
    _expect_error(_write(tmp_path, "short.gguf", b"GGU"), "truncated: magic")


def test_truncated_everywhere(tmp_path: Path) -> None:
    kvs, infos, data = _good_parts()
    full = _enc_file(kvs, infos, data)
    data_start = len(full) - len(data)
    cuts = list(range(1, data_start + 1)) + [data_start + 1, data_start + 100, len(full) - 40, len(full) - 1]
    path = tmp_path / "cut.gguf"
    for cut in cuts:
        path.write_bytes(full[:cut])
        _expect_error(path, r"truncated|runs past the end|can hold|lies past the end")
    path.write_bytes(full)
    core.GgufFile(str(path))  # the uncut file is fine


@pytest.mark.parametrize(
    ("name", "build", "pattern"),
    [
        (
            "tensor_count",
            lambda k, i, d: _enc_file(k, i, d, n_tensors=2**62),
            "tensor count 4611686018427387904 .* can hold",
        ),
        (
            "kv_count",
            lambda k, i, d: _enc_file(k, i, d, n_kv=2**62),
            "metadata key/value count 4611686018427387904 .* can hold",
        ),
        (
            "string_length",
            lambda k, i, d: _enc_file([*k, _enc_kv("s", STR, struct.pack("<Q", 2**63))], i, d),
            "value of 's'.* string length 9223372036854775808 runs past the end",
        ),
        (
            "key_length",
            lambda k, i, d: _enc_file([*k, struct.pack("<Q", 2**64 - 1)], i, d),
            "metadata key #7.* string length 18446744073709551615 runs past the end",
        ),
        (
            "array_length",
            lambda k, i, d: _enc_file([*k, _enc_kv("a", ARR, struct.pack("<IQ", U32, 2**62))], i, d),
            "value of 'a' array length 4611686018427387904 .* can hold",
        ),
        (
            "string_array_length",
            lambda k, i, d: _enc_file([*k, _enc_kv("a", ARR, struct.pack("<IQ", STR, 2**60))], i, d),
            "array length 1152921504606846976 .* can hold",
        ),
        (
            "unknown_value_type",
            lambda k, i, d: _enc_file([*k, _enc_kv("x", 13, b"\0" * 8)], i, d),
            "value of 'x' type at offset \\d+: unknown value type 13",
        ),
        (
            "unknown_array_type",
            lambda k, i, d: _enc_file([*k, _enc_kv("x", ARR, struct.pack("<IQ", 99, 0))], i, d),
            "unknown value type 99",
        ),
        ("bool_byte", lambda k, i, d: _enc_file([*k, _enc_kv("b", BOOL, b"\x02")], i, d), "bool byte is 2"),
        (
            "duplicate_key",
            lambda k, i, d: _enc_file([*k, _enc_kv("a.u32", U32, struct.pack("<I", 8))], i, d),
            "duplicate metadata key 'a.u32'",
        ),
        (
            "key_not_utf8",
            lambda k, i, d: _enc_file([*k, _enc_str(b"k\xff") + BOOL_TRUE], i, d),
            "metadata key #7 at offset \\d+ is not valid UTF-8",
        ),
        (
            "key_overlong_utf8",
            lambda k, i, d: _enc_file([*k, _enc_str(b"\xc0\xaf") + BOOL_TRUE], i, d),
            "metadata key #7 at offset \\d+ is not valid UTF-8",
        ),
        ("deep_nesting", lambda k, i, d: _enc_file([*k, _enc_kv("n", ARR, DEEP_ARRAY)], i, d), "nested deeper than 16"),
    ],
)
def test_bad_metadata(tmp_path: Path, name: str, build: Any, pattern: str) -> None:
    kvs, infos, data = _good_parts()
    _expect_error(_write(tmp_path, f"{name}.gguf", build(kvs, infos, data)), pattern)


@pytest.mark.parametrize(
    ("value", "vtype", "pattern"),
    [
        (struct.pack("<I", 0), U32, "general.alignment must be a power of two .* got 0"),
        (struct.pack("<I", 3), U32, "general.alignment must be a power of two .* got 3"),
        (struct.pack("<i", -64), I32, "general.alignment must be a power of two .* got -64"),
        (struct.pack("<Q", 2**63), U64, "general.alignment must be a power of two"),
        (_enc_str("32"), STR, "general.alignment has type string"),
    ],
)
def test_bad_alignment(tmp_path: Path, value: bytes, vtype: int, pattern: str) -> None:
    kvs, infos, data = _good_parts()
    kvs.append(_enc_kv("general.alignment", vtype, value))
    _expect_error(_write(tmp_path, "align.gguf", _enc_file(kvs, infos, data)), pattern)


@pytest.mark.parametrize(
    ("name", "tensor", "pattern"),
    [
        ("unknown_type", _enc_tensor("t", [32], 42, 0), "tensor 't' has unknown type id 42"),
        ("removed_type", _enc_tensor("t", [32], 4, 0), "tensor 't' has unknown type id 4"),
        ("n_dims_0", _enc_tensor("t", [], F32_ID, 0), "tensor 't' has 0 dimensions \\(must be 1..4\\)"),
        ("n_dims_5", _enc_tensor("t", [1, 1, 1, 1, 1], F32_ID, 0), "tensor 't' has 5 dimensions"),
        ("negative_dim", _enc_tensor("t", [4, 2**63], F32_ID, 0), "tensor 't' dimension 1 is 9223372036854775808"),
        ("overflow", _enc_tensor("t", [2**32, 2**32], F32_ID, 0), "tensor 't': element count overflows"),
        ("bytes_overflow", _enc_tensor("t", [2**62, 1], F32_ID, 0), "tensor 't': byte size overflows"),
        ("partial_block", _enc_tensor("t", [33, 1], Q8_0_ID, 0), "row length 33 is not a multiple of the q8_0 block"),
        ("misaligned", _enc_tensor("t", [4], F32_ID, 4), "tensor 't' offset 4 is not a multiple of the alignment 32"),
        ("past_end", _enc_tensor("t", [32], F32_ID, 320), "tensor 't' data \\[offset 320, 128 bytes\\] lies past"),
        ("huge_offset", _enc_tensor("t", [32], F32_ID, 2**64 - 32), "tensor 't' data .* lies past the end"),
        ("overlap", _enc_tensor("t", [8], F32_ID, 224), "tensor 'w' data .* overlaps tensor 't'"),
        ("duplicate", _enc_tensor("w", [8], F32_ID, 0), "duplicate tensor name 'w'"),
        (
            "name_not_utf8",
            _enc_str(b"\xed\xa0\x80") + struct.pack("<IQIQ", 1, 32, F32_ID, 0),
            "tensor #3 name at offset \\d+ is not valid UTF-8",
        ),
    ],
)
def test_bad_tensor_info(tmp_path: Path, name: str, tensor: bytes, pattern: str) -> None:
    kvs, infos, data = _good_parts()
    _expect_error(_write(tmp_path, f"{name}.gguf", _enc_file(kvs, [*infos, tensor], data)), pattern)


# ---------------------------------------------------------------------------------------------------------------
# Mutation fuzzing in a subprocess: a segfault shows as a negative return code naming the last seed started.

FUZZ_SEEDS = 3000
FUZZ_WORKERS = 2


def _fuzz_base(path: Path) -> None:
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_uint64("big", 2**63 + 1)
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(24)])
    w.add_array("tokenizer.ggml.scores", [float(-i) for i in range(24)])
    w.add_key_value("tokenizer.ggml.token_type", [1] * 24, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    w.add_array("nested", [[1, 2], ["a"]])
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    rng = np.random.default_rng(1)
    w.add_tensor("a", rng.standard_normal((4, 8)).astype(np.float32))
    w.add_tensor("b", rng.standard_normal(16).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 32)).astype(np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor("c", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_mutation_fuzz(tmp_path: Path) -> None:
    base = tmp_path / "base.gguf"
    _fuzz_base(base)
    header_end = core.GgufFile(str(base)).data_offset
    per_worker = FUZZ_SEEDS // FUZZ_WORKERS
    procs = []
    for k in range(FUZZ_WORKERS):
        scratch = tmp_path / f"w{k}"
        scratch.mkdir()
        cmd = [
            sys.executable,
            str(FUZZ_WORKER),
            str(base),
            str(scratch),
            str(header_end),
            str(k * per_worker),
            str(per_worker),
        ]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
        )
    totals = {"ok": 0, "error": 0}
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        lines = out.splitlines()
        seeds = [line for line in lines if line.startswith("seed ")]
        last_seed = seeds[-1] if seeds else "before the first seed"
        assert proc.returncode == 0, f"worker died (code {proc.returncode}) at {last_seed}:\n{err[-2000:]}"
        summary = json.loads(lines[-1].removeprefix("summary "))
        assert summary["unexpected"] == [], summary["unexpected"][:10]
        totals["ok"] += summary["ok"]
        totals["error"] += summary["error"]
    assert totals["ok"] + totals["error"] == per_worker * FUZZ_WORKERS
    # Both outcomes occur, so the mutations reach past the first check and the harness can tell them apart.
    assert totals["ok"] > 50 and totals["error"] > 1000, totals


def test_paths_that_are_not_utf8(default_model_path: str, tmp_path: Path) -> None:
    """A file name with bytes that are not UTF-8 (a surrogate escape in Python) opens, and reports itself, as is."""
    name = os.fsdecode(b"model-\xff.gguf")
    path = tmp_path / name
    os.symlink(default_model_path, path)
    f = core.GgufFile(path)
    assert f.path == str(path) and f.version == 3
    assert core.GgufFile(os.fsencode(path)).version == 3  # bytes paths too
    with pytest.raises(core.KvcmasError, match="gone-\ufffd.gguf: cannot open"):  # the message stays valid text
        core.GgufFile(tmp_path / os.fsdecode(b"gone-\xfe.gguf"))
