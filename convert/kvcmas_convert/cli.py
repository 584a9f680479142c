"""Command line: ``convert`` and ``gguf show`` / ``gguf set``, registered on any argparse subparsers object.

``kvcmas_cpp.cli`` calls ``add_subcommands``; ``python -m kvcmas_convert`` uses ``main`` (where ``convert`` is the
default subcommand, so ``python -m kvcmas_convert HF_DIR -o OUT.gguf`` works).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from .constants import KVCMAS_SETTINGS
from .convert import EXPERT_TYPES, OUTTYPES, convert
from .errors import ConvertError
from .gguf_tools import parse_assignments, set_values, show
from .lora import add_lora_subcommand
from .settings import parse_setting
from .vision import add_mmproj_subcommand


def _flag(key: str) -> str:
    return "--" + key.replace(".", "-").replace("_", "-")  # kvcmas.rank_k -> --kvcmas-rank-k


def _add_convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", metavar="HF_DIR", help="Hugging Face checkpoint folder")
    p.add_argument("-o", "--outfile", required=True, metavar="OUT.gguf", help="GGUF file to write")
    p.add_argument("--outtype", default="f16", choices=list(OUTTYPES), help="weight type of the matrices (f16)")
    p.add_argument(
        "--expert-type", choices=list(EXPERT_TYPES), help="store the routed experts' matrices as this (gpt-oss: mxfp4)"
    )
    p.add_argument("--name", help="general.name (default: the folder name)")
    p.add_argument("--vocab-pre", help="override the detected tokenizer.ggml.pre (a llama.cpp pre-tokenizer name)")
    p.add_argument("--no-vocab", action="store_true", help="write no tokenizer")
    p.add_argument("--dry-run", action="store_true", help="validate and list what would be written; write nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--force", action="store_true", help="replace the output file if it exists")
    g = p.add_argument_group("KVCMAS correction settings (written as kvcmas.* keys; defaults from the method)")
    g.add_argument("--kvcmas-rank", metavar="R", help="rank of both the K and V corrections (sets rank_k and rank_v)")
    for s in KVCMAS_SETTINGS:
        if s.key == "kvcmas.version":
            continue
        g.add_argument(_flag(s.key), dest=s.key, metavar="V", help=f"{s.help} (default {s.default})")


def _kvcmas_overrides(args: argparse.Namespace) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if args.kvcmas_rank is not None:
        for key in ("kvcmas.rank_k", "kvcmas.rank_v"):
            values[key] = parse_setting(key, args.kvcmas_rank, "--kvcmas-rank")[1]
    for s in KVCMAS_SETTINGS:
        text = getattr(args, s.key, None)
        if text is not None:
            values[s.key] = parse_setting(s.key, text, _flag(s.key))[1]
    return values


def run_convert(args: argparse.Namespace) -> int:
    """Handler of ``convert``."""
    result = convert(
        args.model_dir, args.outfile, outtype=args.outtype, kvcmas=_kvcmas_overrides(args),
        vocab=not args.no_vocab, vocab_pre=args.vocab_pre, name=args.name, dry_run=args.dry_run,
        progress=not args.no_progress, overwrite=args.force, expert_type=args.expert_type,
    )  # fmt: skip
    if result.dry_run:
        print(f"dry run: would write {result.output} ({result.architecture}, {len(result.tensors)} tensors)")
        for key, value in result.metadata.items():
            shown = f"[{len(value)} items]" if isinstance(value, list) else repr(value)
            print(f"  {key} = {shown[:120]}")
        for name, type_name, shape in result.tensors:
            print(f"  {name:<40} {type_name:<6} {list(shape)}")
    else:
        print(f"wrote {result.output} ({result.architecture}, {len(result.tensors)} tensors)", file=sys.stderr)
    return 0


def run_gguf_show(args: argparse.Namespace) -> int:
    """Handler of ``gguf show``."""
    show(args.file, sys.stdout, tensors=not args.no_tensors)
    return 0


def run_gguf_set(args: argparse.Namespace) -> int:
    """Handler of ``gguf set``."""
    values = parse_assignments(args.assignments)
    set_values(args.file, values)
    for key, value in values.items():
        print(f"{args.file}: {key} = {value!r}", file=sys.stderr)
    return 0


def add_subcommands(subparsers: Any) -> None:
    """Registers ``convert`` and ``gguf`` (``show``, ``set``) on an argparse subparsers object.

    Each parser sets ``func`` (taking the parsed namespace, returning an exit status); callers catch ConvertError
    (a ValueError) to print it as an error message.
    """
    p = subparsers.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint to GGUF (docs/convert.md)",
        description="Convert a Hugging Face checkpoint folder to a GGUF file (docs/convert.md).",
    )
    _add_convert_arguments(p)
    p.set_defaults(func=run_convert)
    add_mmproj_subcommand(subparsers)
    add_lora_subcommand(subparsers)
    g = subparsers.add_parser(
        "gguf",
        help="inspect or update a GGUF file (docs/convert.md)",
        description="Inspect or update a GGUF file (docs/convert.md).",
    )
    gsub = g.add_subparsers(dest="gguf_command", required=True)
    s = gsub.add_parser(
        "show",
        help="print metadata and tensors (docs/convert.md)",
        description="Print metadata and tensors (docs/convert.md).",
    )
    s.add_argument("file")
    s.add_argument("--no-tensors", action="store_true", help="metadata only")
    s.set_defaults(func=run_gguf_show)
    u = gsub.add_parser(
        "set",
        help="update kvcmas.* keys in place (no reconversion; docs/convert.md)",
        description="Update kvcmas.* keys of a GGUF file, e.g. kvcmas.rank_k=16 gate_threshold=0.5 (docs/convert.md).",
    )
    u.add_argument("file")
    u.add_argument("assignments", nargs="+", metavar="KEY=VALUE")
    u.set_defaults(func=run_gguf_set)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcmas_convert [convert] HF_DIR -o OUT.gguf ...`` or ``python -m kvcmas_convert gguf ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("convert", "convert-lora", "gguf", "mmproj", "-h", "--help"):
        argv.insert(0, "convert")
    parser = argparse.ArgumentParser(
        prog="python -m kvcmas_convert", description="Hugging Face checkpoints to GGUF, and GGUF metadata tools."
    )
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
