"""The conversion itself: plan everything from headers, then stream tensors into a temporary GGUF and rename it.

Peak memory stays near the largest tensor (plus its converted copy): the plan needs only the safetensors headers,
and each tensor is read from its memory-mapped shard, transformed, converted and written before the next one.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import quant_shape_to_byte_shape, quantize

from . import constants as C
from .errors import ConvertError
from .models import ModelClass, TensorPlan, model_class_for
from .settings import default_settings, validate_settings
from .source import BIN_INDEX, SAFETENSORS_INDEX, CheckpointTensors, load_config
from .vocab import VocabExport, export_vocab

OUTTYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
}
_BLOCK = 32  # elements per Q8_0 / Q4_0 block
# What the routed experts' matrices may be stored as apart from the outtype (llama.cpp's gpt-oss files: MXFP4).
EXPERT_TYPES: dict[str, GGMLQuantizationType] = {"mxfp4": GGMLQuantizationType.MXFP4}
EXPERT_TENSORS = (C.BLK_FFN_GATE_EXPS, C.BLK_FFN_UP_EXPS, C.BLK_FFN_DOWN_EXPS)


def tensor_type(plan: TensorPlan, outtype: str, expert_type: str | None = None) -> GGMLQuantizationType:
    """The GGUF type of one tensor: vectors stay F32; matrices (and a MoE layer's stack of expert matrices) take
    the outtype.

    Matrices whose rows do not split into 32-element blocks fall back to F16 for the block types, and with q4_0
    the embedding and output matrices are kept at Q8_0 (they are the most sensitive to quantisation). With an
    expert_type (EXPERT_TYPES) the experts' stacked matrices take it instead, where their rows are whole blocks.
    """
    if expert_type is not None and plan.name.endswith(EXPERT_TENSORS) and plan.shape[-1] % _BLOCK == 0:
        return EXPERT_TYPES[expert_type]
    target = OUTTYPES[outtype][0]
    if len(plan.shape) not in (2, 3) or plan.name.endswith(".bias"):  # experts' stacked biases too
        return GGMLQuantizationType.F32
    if target in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0):
        if plan.shape[-1] % _BLOCK != 0:
            return GGMLQuantizationType.F16
        if target == GGMLQuantizationType.Q4_0 and plan.name in (C.TENSOR_TOKEN_EMBD, C.TENSOR_OUTPUT):
            return GGMLQuantizationType.Q8_0
    return target


def encode_tensor(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 data -> the array GGUF stores (float32, float16, or uint8 blocks for BF16 / quantised types)."""
    if qtype == GGMLQuantizationType.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == GGMLQuantizationType.F16:
        return np.ascontiguousarray(data, dtype=np.float16)
    return np.ascontiguousarray(quantize(np.ascontiguousarray(data, dtype=np.float32), qtype))


def _stored_shape(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> tuple[tuple[int, ...], np.dtype[Any]]:
    if qtype == GGMLQuantizationType.F32:
        return shape, np.dtype(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return shape, np.dtype(np.float16)
    return tuple(quant_shape_to_byte_shape(shape, qtype)), np.dtype(np.uint8)


@dataclass
class ConvertResult:
    """What a conversion wrote (or, for a dry run, would write)."""

    output: Path
    architecture: str
    tensors: list[tuple[str, str, tuple[int, ...]]]  # (GGUF name, type name, numpy-order shape)
    metadata: dict[str, Any]
    dry_run: bool


def _add_value(writer: GGUFWriter, key: str, value: Any) -> None:
    """Writes one metadata value with the GGUF type llama.cpp expects for it."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        if not value:
            return
        if isinstance(value[0], str):
            writer.add_key_value(key, value, GGUFValueType.ARRAY, GGUFValueType.STRING)
        elif isinstance(value[0], float):
            writer.add_key_value(key, value, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
        else:
            writer.add_key_value(key, value, GGUFValueType.ARRAY, GGUFValueType.INT32)
    else:
        raise TypeError(f"metadata {key}: unsupported value {value!r}")


def _add_kvcmas(writer: GGUFWriter, values: dict[str, Any]) -> None:
    for key, value in values.items():
        kind = C.KVCMAS_SETTINGS_BY_KEY[key].type
        if kind == "bool":
            writer.add_bool(key, bool(value))
        elif kind == "uint32":
            writer.add_uint32(key, int(value))
        else:
            writer.add_float32(key, float(value))


def temp_path_for(output: Path) -> Path:
    """The temporary file a write goes to before the atomic rename (same folder, so rename is atomic)."""
    return output.with_name(f".{output.name}.{os.getpid()}.tmp")


# Files of a checkpoint folder a conversion reads besides the weights.
_READ_FILES = ("config.json", SAFETENSORS_INDEX, BIN_INDEX, "tokenizer.json", "tokenizer.model",
               "tokenizer_config.json", "chat_template.jinja", "chat_template.json")  # fmt: skip


def input_files(model_dir: Path, tensors: CheckpointTensors) -> list[Path]:
    """Every file a conversion of ``model_dir`` reads: config, index, tokenizer files and each weight shard."""
    files = {model_dir / name for name in _READ_FILES if (model_dir / name).exists()}
    files.update(ref.path for ref in tensors.refs.values())
    return sorted(files)


def check_output(out: Path, inputs: Iterable[Path], overwrite: bool) -> None:
    """Refuses an output that would replace (or lie inside) one of the files being read, a folder, or, without
    ``overwrite``, an existing file. Symbolic links are resolved and hard links compared by inode."""
    target = out.resolve()
    for src in inputs:
        real = src.resolve()
        same = target == real or (out.exists() and src.exists() and os.path.samefile(out, src))
        if same or real in target.parents:
            what = "is" if same else "lies inside"
            raise ConvertError(f"{out}: {what} the input file {src}; write the output elsewhere")
    if out.is_dir():
        raise ConvertError(f"{out}: is a directory (give the output file name)")
    if not out.parent.is_dir():
        raise ConvertError(f"{out.parent}: output folder does not exist")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise ConvertError(f"{out}: exists (pass --force to replace it)")


class _Terminated(BaseException):
    """A termination signal received while a temporary output existed (raised from the signal handler)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated(signum)


@contextmanager
def temporary_output(out: Path) -> Iterator[Path]:
    """Yields the temporary path to write ``out`` through; the caller renames it into place at the end.

    On any exception, Ctrl-C, SIGTERM or SIGHUP the temporary file is removed; a signal is then delivered again
    with its previous handler, so the process ends the way it would have (SIGKILL cannot be caught: it leaves the
    hidden ``.<name>.<pid>.tmp`` behind). Signal handlers are installed only from the main thread.
    """
    tmp = temp_path_for(out)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            handler = signal.getsignal(sig)
            if handler not in (signal.SIG_IGN, None):  # None: installed outside Python; leave it alone
                previous[sig] = handler
                signal.signal(sig, _raise_terminated)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        previous.clear()

    try:
        yield tmp
    except _Terminated as e:
        tmp.unlink(missing_ok=True)
        restore()
        signal.raise_signal(e.signum)  # the default action ends the process here
        raise SystemExit(128 + e.signum) from None  # a Python handler returned
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        restore()


def convert(
    model_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    outtype: str = "f16",
    kvcmas: dict[str, Any] | None = None,
    vocab: bool = True,
    vocab_pre: str | None = None,
    name: str | None = None,
    dry_run: bool = False,
    progress: bool = True,
    overwrite: bool = False,
    log: TextIO | None = None,
    expert_type: str | None = None,
) -> ConvertResult:
    """Converts a Hugging Face checkpoint folder to a GGUF file.

    Args:
        model_dir: folder with config.json, the weights (safetensors, sharded or not, or .bin) and tokenizer files.
        output: the GGUF file to write. Written to a temporary file in the same folder and renamed at the end, so a
            failed or interrupted conversion leaves no output behind (and an existing file untouched). Never one of
            the files being read.
        outtype: f32, f16, bf16, q8_0 or q4_0 (see ``tensor_type``).
        kvcmas: ``kvcmas.*`` settings overriding the defaults (full or short keys).
        vocab: export the tokenizer (tokenizer.json or tokenizer.model must then exist).
        vocab_pre: override the detected ``tokenizer.ggml.pre``.
        name: ``general.name`` (default: the folder name).
        dry_run: plan and validate everything and report what would be written, writing nothing.
        progress: show a tqdm progress bar on stderr.
        overwrite: replace an existing output file (the CLI's ``--force``); without it an existing file is an error.
        expert_type: "mxfp4" stores the routed experts' matrices as MXFP4 (the rest as outtype), as llama.cpp's
            gpt-oss files hold them; None: the outtype.

    Raises:
        ConvertError: a message naming the file or tensor at fault.
    """
    model_dir = Path(model_dir)
    out = Path(output)
    log = log if log is not None else sys.stderr
    if outtype not in OUTTYPES:
        raise ConvertError(f"--outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    if expert_type is not None and expert_type not in EXPERT_TYPES:
        raise ConvertError(f"--expert-type {expert_type!r} is not one of {', '.join(EXPERT_TYPES)}")
    config = load_config(model_dir)
    model: ModelClass = model_class_for(config, str(model_dir / "config.json"))
    tensors = CheckpointTensors(model_dir)
    try:
        plans = model.plan(tensors)
        vocab_export: VocabExport | None = export_vocab(model_dir, model.n_vocab, config, vocab_pre) if vocab else None
        settings = default_settings()
        settings.update(validate_settings(kvcmas or {}, "kvcmas settings"))
        metadata: dict[str, Any] = {
            C.KEY_ARCHITECTURE: model.gguf_architecture,
            C.KEY_NAME: name or model_dir.resolve().name,
            C.KEY_FILE_TYPE: int(OUTTYPES[outtype][1]),
            C.KEY_QUANTIZATION_VERSION: GGML_QUANT_VERSION,  # llama.cpp's converter writes it for every type
        }
        if vocab_export is not None:
            metadata.update(vocab_export.values)
        metadata.update(settings)
        types = [tensor_type(p, outtype, expert_type) for p in plans]
        listing = [(p.name, t.name, p.shape) for p, t in zip(plans, types, strict=True)]
        result = ConvertResult(out, model.gguf_architecture, listing, metadata, dry_run)
        if dry_run:
            return result
        check_output(out, input_files(model_dir, tensors), overwrite)
        with temporary_output(out) as tmp:
            _write(tmp, model, plans, types, metadata, settings, tensors, progress)
            os.replace(tmp, out)
        return result
    finally:
        tensors.close()


def _write(
    tmp: Path,
    model: ModelClass,
    plans: list[TensorPlan],
    types: list[GGMLQuantizationType],
    metadata: dict[str, Any],
    settings: dict[str, Any],
    tensors: CheckpointTensors,
    progress: bool,
) -> None:
    writer = GGUFWriter(tmp, model.gguf_architecture)  # writes general.architecture itself
    try:
        writer.add_string(C.KEY_NAME, metadata[C.KEY_NAME])
        writer.add_uint32(C.KEY_FILE_TYPE, metadata[C.KEY_FILE_TYPE])
        writer.add_uint32(C.KEY_QUANTIZATION_VERSION, metadata[C.KEY_QUANTIZATION_VERSION])
        model.write_params(writer)
        for key, value in metadata.items():
            if key.startswith("tokenizer."):
                _add_value(writer, key, value)
        _add_kvcmas(writer, settings)
        for plan, qtype in zip(plans, types, strict=True):
            shape, dtype = _stored_shape(plan.shape, qtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            writer.add_tensor_info(plan.name, shape, dtype, nbytes, raw_dtype=qtype)
        try:
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
        except OSError as e:
            raise ConvertError(f"{tmp}: cannot write: {e}") from e
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(plans), unit="tensor", desc=f"writing {tmp.name}", file=sys.stderr, leave=False)
        for plan, qtype in zip(plans, types, strict=True):
            if plan.compute is not None:
                data = plan.compute()
            else:
                assert plan.source is not None
                data = tensors.load(plan.source)
                if plan.transform is not None:
                    data = plan.transform(data)
            if data.shape != plan.shape:
                raise ConvertError(
                    f"tensor {plan.name!r}: produced shape {list(data.shape)}, expected {list(plan.shape)}"
                )
            try:
                writer.write_tensor_data(encode_tensor(data, qtype))
            except OSError as e:
                raise ConvertError(f"{tmp}: cannot write tensor {plan.name!r}: {e}") from e
            del data
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
    finally:
        writer.close()
