"""Reading a Hugging Face checkpoint folder: config.json and weights, one tensor at a time.

Safetensors files are parsed here (8-byte little-endian header size, a JSON header of dtype / shape / byte offsets,
then the raw data) and memory-mapped, so a tensor is read only when asked for and BF16 needs no torch. ``.bin``
checkpoints need torch and are loaded with ``mmap=True``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConvertError

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"

# safetensors dtype name -> (numpy storage dtype, element size). BF16 is stored as uint16 and widened on read.
_ST_DTYPES: dict[str, np.dtype[Any]] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
    "U8": np.dtype("u1"),  # packed codes (gpt-oss's MXFP4 release: *_blocks, *_scales)
}
_MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class TensorRef:
    """Where one source tensor lives: its file, dtype name ("F32", "F16", "BF16"), shape and byte range."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int = 0  # absolute byte offsets in the file (safetensors only)
    end: int = 0


def read_json(path: Path) -> Any:
    """A JSON file's value; ConvertError naming the file when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: unreadable: {e}") from e


def load_config(model_dir: Path) -> dict[str, Any]:
    """config.json of a checkpoint folder, with a clear error when it is missing or not JSON."""
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise ConvertError(f"{model_dir}: not a directory (expected a Hugging Face checkpoint folder)")
    if not path.is_file():
        raise ConvertError(f"{path}: missing (every Hugging Face checkpoint folder has a config.json)")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ConvertError(f"{path}: expected a JSON object")
    return config


def _read_safetensors_header(path: Path) -> dict[str, TensorRef]:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ConvertError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n_header,) = struct.unpack("<Q", raw)
            if n_header > min(_MAX_HEADER_BYTES, size - 8):
                raise ConvertError(f"{path}: not a safetensors file (header size {n_header} exceeds the file)")
            header = json.loads(f.read(n_header).decode("utf-8"))
    except OSError as e:
        raise ConvertError(f"{path}: unreadable: {e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: not a safetensors file (bad JSON header: {e})") from e
    if not isinstance(header, dict):
        raise ConvertError(f"{path}: not a safetensors file (header is not a JSON object)")
    data_start = 8 + n_header
    refs: dict[str, TensorRef] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(info["dtype"])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConvertError(f"{path}: tensor {name!r} has a malformed header entry") from e
        if dtype not in _ST_DTYPES:
            raise ConvertError(f"{path}: tensor {name!r} has dtype {dtype}; supported: F32, F16, BF16, F64, U8")
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end - begin != n * _ST_DTYPES[dtype].itemsize or begin < 0 or data_start + end > size:
            raise ConvertError(
                f"{path}: tensor {name!r} has byte range [{begin}, {end}) inconsistent with "
                f"its shape {list(shape)} / dtype {dtype} or the file size"
            )
        refs[name] = TensorRef(name, path, dtype, shape, data_start + begin, data_start + end)
    return refs


class CheckpointTensors:
    """The weights of a checkpoint folder, indexed by Hugging Face tensor name; ``load`` reads one as float32.

    Finds, in this order: ``model.safetensors.index.json`` (sharded), ``model.safetensors``, any other ``*.safetensors``
    files, ``pytorch_model.bin.index.json``, ``pytorch_model.bin``.
    """

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.refs: dict[str, TensorRef] = {}
        self._bin_cache: tuple[Path, dict[str, Any]] | None = None
        self._maps: dict[Path, np.memmap[Any, Any]] = {}
        index = model_dir / SAFETENSORS_INDEX
        if index.is_file():
            for shard in self._index_shards(index):
                self._add_safetensors(shard)
        elif (model_dir / SAFETENSORS_SINGLE).is_file():
            self._add_safetensors(model_dir / SAFETENSORS_SINGLE)
        elif files := sorted(model_dir.glob("*.safetensors")):
            for path in files:
                self._add_safetensors(path)
        elif (model_dir / BIN_INDEX).is_file():
            for shard in self._index_shards(model_dir / BIN_INDEX):
                self._add_bin(shard)
        elif (model_dir / BIN_SINGLE).is_file():
            self._add_bin(model_dir / BIN_SINGLE)
        else:
            raise ConvertError(
                f"{model_dir}: no weights found (expected {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX}, "
                f"{BIN_SINGLE} or {BIN_INDEX})"
            )

    def _index_shards(self, index: Path) -> list[Path]:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted({str(v) for v in weight_map.values()})
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConvertError(f"{index}: unreadable index file: {e}") from e
        paths = []
        for shard in shards:
            path = self.model_dir / shard
            if not path.is_file():
                raise ConvertError(f"{path}: shard listed in {index.name} is missing")
            paths.append(path)
        return paths

    def _add(self, ref: TensorRef) -> None:
        if ref.name in self.refs:
            raise ConvertError(f"{ref.path}: tensor {ref.name!r} also appears in {self.refs[ref.name].path.name}")
        self.refs[ref.name] = ref

    def _add_safetensors(self, path: Path) -> None:
        for ref in _read_safetensors_header(path).values():
            self._add(ref)

    def _load_bin(self, path: Path) -> dict[str, Any]:
        if self._bin_cache is not None and self._bin_cache[0] == path:
            return self._bin_cache[1]
        try:
            import torch
        except ImportError as e:
            raise ConvertError(f"{path}: reading .bin checkpoints needs torch (pip install torch)") from e
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise ConvertError(f"{path}: unreadable PyTorch checkpoint: {e}") from e
        if not isinstance(state, dict):
            raise ConvertError(f"{path}: expected a state dict")
        self._bin_cache = (path, state)
        return state

    def _add_bin(self, path: Path) -> None:
        names = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16", "torch.float64": "F64"}
        for name, t in self._load_bin(path).items():
            dtype = names.get(str(t.dtype))
            if dtype is None:
                raise ConvertError(f"{path}: tensor {name!r} has dtype {t.dtype}; supported: float32/16, bfloat16")
            self._add(TensorRef(name, path, dtype, tuple(int(d) for d in t.shape)))

    def __contains__(self, name: str) -> bool:
        return name in self.refs

    def __iter__(self) -> Iterator[str]:
        return iter(self.refs)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.refs[name].shape

    def require(self, name: str, shape: tuple[int, ...], where: str | Path, purpose: str = "") -> None:
        """ConvertError unless the checkpoint holds ``name`` with ``shape`` (the shape config.json implies);
        ``where`` names the checkpoint in the missing-tensor message, ``purpose`` what the tensor is for."""
        what = f"tensor {name!r}" + (f" (for {purpose!r})" if purpose else "")
        if name not in self.refs:
            raise ConvertError(f"{where}: {what} is missing from the checkpoint")
        if self.refs[name].shape != shape:
            got = list(self.refs[name].shape)
            raise ConvertError(f"{self.refs[name].path}: {what} has shape {got}, config.json implies {list(shape)}")

    def load(self, name: str) -> np.ndarray:
        """The tensor as a float32 array in its Hugging Face shape."""
        ref = self.refs[name]
        if ref.path.suffix == ".bin":
            import torch

            t = self._load_bin(ref.path)[name]
            return t.to(torch.float32).numpy().copy()
        try:
            mm = self._maps.get(ref.path)
            if mm is None:
                mm = self._maps[ref.path] = np.memmap(ref.path, dtype=np.uint8, mode="r")
            raw = np.asarray(mm[ref.begin : ref.end])
        except (OSError, ValueError) as e:
            raise ConvertError(f"{ref.path}: cannot read tensor {name!r}: {e}") from e
        data = raw.view(_ST_DTYPES[ref.dtype]).reshape(ref.shape)
        if ref.dtype == "BF16":
            return (data.astype(np.uint32) << 16).view(np.float32)
        return data.astype(np.float32)

    def close(self) -> None:
        self._maps.clear()
        self._bin_cache = None
