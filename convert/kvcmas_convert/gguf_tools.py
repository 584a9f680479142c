"""``kvcmas gguf show`` and ``kvcmas gguf set``: inspect a GGUF file, and update metadata without reconverting.

``set`` rewrites the file: all metadata (with the new values) and the tensor data, copied from the memory-mapped
original one tensor at a time, go to a temporary file in the same folder that then replaces the original.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from . import constants as C
from .convert import temporary_output
from .errors import ConvertError
from .settings import parse_setting

_ARRAY_PREVIEW = 8
_SETTING_TYPES = {"bool": GGUFValueType.BOOL, "uint32": GGUFValueType.UINT32}


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """A gguf-py reader for ``path``, with ConvertError for a missing or malformed file."""
    p = Path(path)
    if p.is_dir():  # worded as the engine words it (kvcmas generate -m DIR)
        raise ConvertError(f"{p}: is a directory, not a GGUF file")
    if not p.is_file():
        raise ConvertError(f"{p}: no such file")
    try:
        return GGUFReader(p, "r")
    except Exception as e:  # gguf-py raises ValueError / struct errors / numpy errors on bad input
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ConvertError(f"{p}: not a GGUF file (it starts with {magic!r}, a GGUF file with b'GGUF')") from e
        size = p.stat().st_size
        raise ConvertError(
            f"{p}: a GGUF file that is truncated or corrupt ({size} bytes; an interrupted download or copy?): "
            f"gguf-py could not read it: {e}"
        ) from e


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """All metadata of a GGUF file as Python values (strings, numbers, bools, lists)."""
    reader = open_gguf(path)
    return {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}


def _preview(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.7g}"  # float32 values, without their binary noise
    if isinstance(value, list):
        head = ", ".join(repr(v) for v in value[:_ARRAY_PREVIEW])
        return f"[{head}{', ...' if len(value) > _ARRAY_PREVIEW else ''}] ({len(value)} items)"
    if isinstance(value, str) and len(value) > 200:
        return repr(value[:200]) + f"... ({len(value)} chars)"
    return repr(value)


def show(path: str | os.PathLike[str], out: TextIO, tensors: bool = True) -> None:
    """Prints the metadata (arrays abbreviated) and the tensor table of a GGUF file."""
    reader = open_gguf(path)
    out.write(f"{path}\n")
    fields = [f for f in reader.fields.values() if not f.name.startswith("GGUF.")]
    out.write(f"metadata: {len(fields)} keys\n")
    for f in fields:
        type_name = GGUFValueType(f.types[0]).name.lower() if f.types else "?"
        if f.types and f.types[0] == GGUFValueType.ARRAY:
            type_name = f"array[{GGUFValueType(f.types[-1]).name.lower()}]"
        out.write(f"  {f.name:<44} {type_name:<14} {_preview(f.contents())}\n")
    if tensors:
        total = sum(int(t.n_bytes) for t in reader.tensors)
        out.write(f"tensors: {len(reader.tensors)} ({total / 2**20:.2f} MiB)\n")
        for t in reader.tensors:
            shape = ", ".join(str(int(d)) for d in t.shape)
            out.write(f"  {t.name:<44} {t.tensor_type.name:<6} [{shape}]\n")


def _value_type(field: Any) -> tuple[GGUFValueType, GGUFValueType | None]:
    main = GGUFValueType(field.types[0])
    return main, (GGUFValueType(field.types[-1]) if main == GGUFValueType.ARRAY else None)


def parse_assignments(assignments: list[str]) -> dict[str, Any]:
    """``["kvcmas.rank_k=16", "gate_threshold=0.5"]`` -> typed ``kvcmas.*`` values (short names allowed)."""
    values: dict[str, Any] = {}
    for item in assignments:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConvertError(f"{item!r}: expected KEY=VALUE")
        full, value = parse_setting(key.strip(), text, origin=f"{item!r}")
        values[full] = value
    return values


def set_values(path: str | os.PathLike[str], values: Mapping[str, Any]) -> None:
    """Writes ``kvcmas.*`` values (typed, full keys) into an existing GGUF file; everything else is kept as is."""
    src = Path(path)
    reader = open_gguf(src)
    arch_field = reader.fields.get(C.KEY_ARCHITECTURE)
    if arch_field is None:
        raise ConvertError(f"{src}: has no {C.KEY_ARCHITECTURE}")
    try:
        with temporary_output(src) as tmp:
            writer = GGUFWriter(tmp, str(arch_field.contents()))
            try:
                for field in reader.fields.values():
                    if field.name.startswith("GGUF.") or field.name == C.KEY_ARCHITECTURE or field.name in values:
                        continue
                    main, sub = _value_type(field)
                    if field.name == "general.alignment":
                        writer.add_custom_alignment(int(field.contents()))
                        continue
                    writer.add_key_value(field.name, field.contents(), main, sub)
                for key, value in values.items():
                    kind = C.KVCMAS_SETTINGS_BY_KEY[key].type
                    vtype = _SETTING_TYPES.get(kind, GGUFValueType.FLOAT32)
                    writer.add_key_value(key, value, vtype)
                for t in reader.tensors:
                    data = t.data
                    writer.add_tensor_info(t.name, data.shape, data.dtype, int(data.nbytes), raw_dtype=t.tensor_type)
                writer.write_header_to_file()
                writer.write_kv_data_to_file()
                writer.write_ti_data_to_file()
                for t in reader.tensors:
                    writer.write_tensor_data(np.asarray(t.data))
            finally:
                writer.close()
            os.replace(tmp, src)
    except OSError as e:
        raise ConvertError(f"{src}: cannot rewrite: {e}") from e
