"""Argument types the command lines share: a bad value is refused by argparse, naming the option, before any work."""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

_N = TypeVar("_N", int, float)


def _parsed(text: str, parse: Callable[[str], _N], noun: str) -> _N:
    try:
        return parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None


def positive_int(text: str) -> int:
    value = _parsed(text, int, "an integer")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _parsed(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _parsed(text, float, "a number")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def port(text: str) -> int:
    value = _parsed(text, int, "a port number")
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [1, 65535], got {value}")
    return value


def positive_int_list(text: str) -> list[int]:
    """'256,1024' -> [256, 1024]: one or more positive integers, comma-separated."""
    values = [positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"needs one or more positive integers, comma-separated, got {text!r}")
    return values


def output_file(text: str) -> str:
    """A file a command writes after its work: a folder, or a file in a folder that does not exist, is refused now
    rather than when the work is done."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory (give the output file name)")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{path.parent}: output folder does not exist")
    return text


def output_folder(text: str) -> str:
    """A folder a command writes files into after its work (made if missing): an existing file is refused now."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a file, not a directory")
    return text


class DocsFormatter(argparse.HelpFormatter):
    """argparse's help layout, but a line never breaks at a hyphen, so a page like docs/engine-speed.md stays whole
    in the terminal."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        wrap = textwrap.fill(" ".join(text.split()), width, break_on_hyphens=False)
        return textwrap.indent(wrap, indent)


def documented(summary: str, page: str) -> dict[str, Any]:
    """`add_parser` arguments of a subcommand: one line saying what it does and naming the docs page about it,
    shown in the parent's command list and atop the subcommand's own --help (tests/test_docs.py checks the pages)."""
    text = f"{summary} (docs/{page})"
    return {"help": text, "description": text, "formatter_class": DocsFormatter}


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """--kv-type, --device and --activations: how every command that loads a model loads it (engine_options)."""
    p.add_argument(
        "--kv-type", choices=("f32", "f16"), default="f32", help="KV row storage: f32 (exact) or f16 (half the memory)"
    )
    p.add_argument("--device", default="cpu", help="cpu (default), or cuda / cuda:N on a build with the CUDA backend")
    p.add_argument(
        "--activations",
        choices=("q8", "q8-fast", "f32"),
        default="q8",
        help="activations of matmuls over quantized weights: q8 (two 8-bit passes), q8-fast (K-quant matmuls in "
        "one 8-bit pass, llama.cpp's accuracy) or f32 (exact)",
    )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Model's keyword arguments from add_engine_arguments' options."""
    return {"kv_type": args.kv_type, "device": args.device, "activations": args.activations}
