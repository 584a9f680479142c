"""PEFT LoRA adapters to GGUF LoRA files as llama.cpp writes them (``convert_lora_to_gguf.py``'s layout).

A PEFT folder holds ``adapter_config.json`` (``peft_type`` "LORA", ``r``, ``lora_alpha``, ``target_modules``) and
``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` [r, n_in] and ``.lora_B.weight``
[n_out, r]). The GGUF file has ``general.type`` "adapter", ``adapter.type`` "lora", ``adapter.lora.alpha``, and per
adapted matrix ``<GGUF tensor name>.lora_a`` / ``.lora_b`` (``blk.0.attn_q.weight.lora_a``) with the same numpy
shapes (GGUF lists them reversed: [n_in, r] and [r, n_out]). The Hugging Face -> GGUF names and the row transforms
(llama's Q/K RoPE permutation, applied to B's rows, since it permutes W = B·A's rows) are the base converter's
(models.py), planned for the base model's hyper-parameters, read from its GGUF file.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from . import constants as C
from .convert import check_output, encode_tensor, temporary_output
from .errors import ConvertError
from .gguf_tools import open_gguf
from .models import MODEL_CLASSES, ModelClass, Transform
from .source import CheckpointTensors, read_json

ADAPTER_CONFIG = "adapter_config.json"
LORA_OUTTYPES = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16}
_PEFT_PREFIX = "base_model.model."
# The GGUF matrices the engine adapts (per layer): attention Q/K/V/output, feed-forward gate/up/down.
_TARGETS = (C.BLK_ATTN_Q, C.BLK_ATTN_K, C.BLK_ATTN_V, C.BLK_ATTN_OUTPUT, C.BLK_FFN_GATE, C.BLK_FFN_UP, C.BLK_FFN_DOWN)


@dataclass
class LoraResult:
    """What convert_lora wrote: the file, the base architecture, alpha, ranks seen and the tensors (name, shape)."""

    output: Path
    architecture: str
    alpha: float
    ranks: list[int]
    tensors: list[tuple[str, tuple[int, ...]]]


def _base_config(meta: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    """A config.json-like dict of the base model's hyper-parameters, from its GGUF metadata."""
    a = arch + "."

    def key(suffix: str, default: Any = None) -> Any:
        value = meta.get(a + suffix, default)
        if value is None:
            raise ConvertError(f"{where}: the base model has no {a + suffix}")
        return value

    n_embd, n_head = int(key(C.ARCH_KEY_EMBEDDING_LENGTH)), int(key(C.ARCH_KEY_HEAD_COUNT))
    return {
        "hidden_size": n_embd,
        "num_hidden_layers": int(key(C.ARCH_KEY_BLOCK_COUNT)),
        "intermediate_size": int(key(C.ARCH_KEY_FEED_FORWARD_LENGTH)),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(key(C.ARCH_KEY_HEAD_COUNT_KV, n_head)),
        "head_dim": int(key(C.ARCH_KEY_KEY_LENGTH, n_embd // n_head)),
        "vocab_size": 1,  # not used by the layer plans
        "max_position_embeddings": int(key(C.ARCH_KEY_CONTEXT_LENGTH, 4096)),
    }


def _base_model(base: Path) -> tuple[ModelClass, dict[str, tuple[int, ...]]]:
    """The converter's model class for the base GGUF file's architecture, and the base's tensor shapes (numpy order)."""
    reader = open_gguf(base)
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    if meta.get(C.KEY_TYPE, "model") == C.TYPE_ADAPTER:
        raise ConvertError(f"{base}: is an adapter, not a base model")
    arch = meta.get(C.KEY_ARCHITECTURE)
    classes = [c for c in MODEL_CLASSES.values() if c.gguf_architecture == arch]
    if not classes:
        raise ConvertError(f"{base}: architecture {arch!r} has no converter (adapters convert for the same models)")
    try:
        model = classes[0](_base_config(meta, str(arch), str(base)), str(base))
    except ConvertError as e:
        raise ConvertError(f"{base}: cannot plan adapters for this {arch} model: {e}") from e
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    return model, shapes


def _target_plans(model: ModelClass) -> dict[str, tuple[str, tuple[int, ...], Transform | None]]:
    """HF module name (without .weight) -> (GGUF tensor name, [n_out, n_in], transform of W's rows), for
    every matrix of the base's layers that kvcmas adapts."""
    plans: dict[str, tuple[str, tuple[int, ...], Transform | None]] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], transform: Transform | None = None) -> None:
        if any(gguf_name.endswith("." + t) for t in _TARGETS) and hf_name.endswith(".weight"):
            plans[hf_name[: -len(".weight")]] = (gguf_name, shape, transform)

    for il in range(model.n_layer):
        model._plans_out = []  # where plan_attention / plan_ffn append computed tensors
        model.plan_attention(il, add)
        model.plan_ffn(il, add)
    return plans


def _layer_free(module: str) -> str:
    """A module name with its layer number taken out (model.layers.3.mlp.up_proj -> model.layers.*.mlp.up_proj)."""
    return re.sub(r"\.\d+\.", ".*.", module, count=1)


def _read_adapter_config(adapter_dir: Path) -> tuple[dict[str, Any], float]:
    """adapter_config.json, checked, and the alpha to write (alpha / rank is the update's scale)."""
    path = adapter_dir / ADAPTER_CONFIG
    if not path.is_file():
        raise ConvertError(f"{adapter_dir}: no {ADAPTER_CONFIG} (is it a PEFT adapter folder?)")
    cfg = read_json(path)
    if not isinstance(cfg, dict) or str(cfg.get("peft_type", "")).upper() != "LORA":
        raise ConvertError(f"{path}: peft_type {cfg.get('peft_type') if isinstance(cfg, dict) else None!r} is not LORA")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ConvertError(f"{path}: 'r' = {r!r} must be a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
        raise ConvertError(f"{path}: 'lora_alpha' = {alpha!r} must be a positive number")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ConvertError(f"{path}: '{key}' (per-module ranks or alphas) is not supported: one alpha per file")
    for key in ("use_dora", "lora_bias"):
        if cfg.get(key):
            raise ConvertError(f"{path}: '{key}' = true is not supported (plain LoRA only)")
    if cfg.get("use_rslora"):  # rank-stabilized: the scale is alpha / sqrt(r), written as alpha' / r
        alpha = float(alpha) * math.sqrt(r)
    return cfg, float(alpha)


def convert_lora(
    adapter_dir: str | Path,
    base: str | Path,
    output: str | Path,
    outtype: str = "f32",
    overwrite: bool = False,
) -> LoraResult:
    """Writes a PEFT LoRA adapter folder as a GGUF LoRA file for the base model GGUF file ``base``.

    Every lora_A / lora_B pair must adapt an attention (q, k, v, o) or feed-forward (gate, up, down) projection of
    the base with matching shapes; anything else is a ConvertError naming it, and nothing is written.
    """
    adapter_dir, base, out = Path(adapter_dir), Path(base), Path(output)
    if outtype not in LORA_OUTTYPES:
        raise ConvertError(f"outtype {outtype!r} is not one of {', '.join(LORA_OUTTYPES)}")
    _, alpha = _read_adapter_config(adapter_dir)
    model, base_shapes = _base_model(base)
    targets = _target_plans(model)
    tensors = CheckpointTensors(adapter_dir)
    pairs: dict[str, dict[str, str]] = {}  # HF module -> {"A": name, "B": name}
    for name in tensors:
        module, sep, rest = name.rpartition(".lora_")
        if not sep or rest not in ("A.weight", "B.weight"):
            raise ConvertError(f"{adapter_dir}: tensor {name!r} is not a LoRA factor (lora_A / lora_B weights only)")
        module = module.removeprefix(_PEFT_PREFIX)
        if module not in targets and _layer_free(module) in {_layer_free(t) for t in targets}:
            raise ConvertError(
                f"{adapter_dir}: tensor {name!r} adapts {module!r}, which the base model {base} does not have "
                f"({model.n_layer} layers): the adapter is for another model"
            )
        if module not in targets:
            raise ConvertError(
                f"{adapter_dir}: tensor {name!r} adapts {module!r}, which kvcmas does not adapt for "
                f"{model.gguf_architecture} (attention q/k/v/o and feed-forward gate/up/down projections)"
            )
        pairs.setdefault(module, {})[rest[0]] = name
    if not pairs:
        raise ConvertError(f"{adapter_dir}: the adapter holds no LoRA tensors")
    writes: list[tuple[str, str, Callable[[np.ndarray], np.ndarray] | None]] = []
    ranks: set[int] = set()
    for module in sorted(pairs, key=lambda m: targets[m][0]):
        names = pairs[module]
        gguf_name, (n_out, n_in), transform = targets[module]
        if set(names) != {"A", "B"}:
            raise ConvertError(f"{adapter_dir}: {module!r} has lora_{next(iter(names))} without its other factor")
        if base_shapes.get(gguf_name) != (n_out, n_in):
            raise ConvertError(
                f"{base}: tensor {gguf_name!r} is {base_shapes.get(gguf_name)}, "
                f"the adapter's {module!r} needs {(n_out, n_in)}"
            )
        a, b = tensors.shape(names["A"]), tensors.shape(names["B"])
        if len(a) != 2 or len(b) != 2 or a[1] != n_in or b[0] != n_out or a[0] != b[1]:
            raise ConvertError(
                f"{adapter_dir}: {module!r} has lora_A {list(a)} and lora_B {list(b)}; the base's matrix "
                f"[{n_out}, {n_in}] needs lora_A [r, {n_in}] and lora_B [{n_out}, r]"
            )
        ranks.add(a[0])
        writes.append((gguf_name + C.LORA_SUFFIX_A, names["A"], None))
        writes.append((gguf_name + C.LORA_SUFFIX_B, names["B"], transform))
    check_output(out, [adapter_dir / ADAPTER_CONFIG, *(r.path for r in tensors.refs.values()), base], overwrite)
    qtype = LORA_OUTTYPES[outtype]
    written: list[tuple[str, tuple[int, ...]]] = []
    try:
        with temporary_output(out) as tmp:
            writer = GGUFWriter(tmp, model.gguf_architecture)
            writer.add_string(C.KEY_TYPE, C.TYPE_ADAPTER)
            writer.add_string(C.KEY_ADAPTER_TYPE, C.ADAPTER_TYPE_LORA)
            writer.add_float32(C.KEY_ADAPTER_LORA_ALPHA, alpha)
            writer.add_string(C.KEY_NAME, adapter_dir.resolve().name)
            for gguf_name, source, transform in writes:
                data = tensors.load(source)
                if transform is not None:
                    data = transform(data)
                writer.add_tensor(gguf_name, encode_tensor(data, qtype), raw_dtype=qtype)
                written.append((gguf_name, tuple(data.shape)))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp.replace(out)
    except OSError as e:
        raise ConvertError(f"{out}: cannot write: {e}") from e
    finally:
        tensors.close()
    return LoraResult(out, model.gguf_architecture, alpha, sorted(ranks), written)


def add_lora_subcommand(subparsers: Any) -> None:
    """Registers ``convert-lora ADAPTER_DIR --base BASE.gguf -o OUT.gguf`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "convert-lora",
        help="convert a PEFT LoRA adapter folder to a GGUF LoRA file for a base model (docs/convert.md)",
        description="Write a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) as a GGUF LoRA "
        "file in llama.cpp's layout, for the base model GGUF file it adapts (docs/convert.md).",
    )
    p.add_argument("adapter_dir", metavar="ADAPTER_DIR", help="PEFT adapter folder")
    p.add_argument("--base", required=True, metavar="BASE.gguf", help="the base model's GGUF file")
    p.add_argument("-o", "--outfile", required=True, metavar="OUT.gguf", help="GGUF file to write")
    p.add_argument("--outtype", default="f32", choices=list(LORA_OUTTYPES), help="type of the factors (f32)")
    p.add_argument("--force", action="store_true", help="replace the output file if it exists")
    p.set_defaults(func=_run_convert_lora)


def _run_convert_lora(args: Any) -> int:
    r = convert_lora(args.adapter_dir, args.base, args.outfile, outtype=args.outtype, overwrite=args.force)
    ranks = "/".join(map(str, r.ranks))
    print(
        f"wrote {r.output} ({r.architecture} LoRA, rank {ranks}, alpha {r.alpha:g}, {len(r.tensors) // 2} matrices)",
        file=sys.stderr,
    )
    return 0
