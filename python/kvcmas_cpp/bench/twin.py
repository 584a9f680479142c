"""`kvcmas bench core --twin FILE=TWIN`: a file's speed per weight byte against its llama twin, measured in the same
run.

A twin is a plain llama file of the same size and type mix (models/make_bench_models.py `llama-twin-<shape>`): the
same widths, layers, heads and vocabulary without the architecture's extras. Decode reads every weight once per
token, so decode GB/s (weights read per token x tokens/s) divided by the twin's says what the extras cost per byte
read; prefill tokens/s x weight bytes a prefill pass reads divided by the twin's is the same measure for the
compute-bound phase (equal to the ratio of tokens/s when the two read equal bytes; a mixture of experts' pass reads
up to every expert where a decode token reads the chosen ones, so its pass bytes are counted apart). 1.00x: the
architecture costs nothing beyond its weights; below 0.90x it is more than 10 % behind.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class _Rates(Protocol):
    engine: str
    model: str
    prefill_tok_s: float
    decode_tok_s: float


def parse_twin(text: str) -> tuple[str, str]:
    """'FILE=TWIN' -> (FILE, TWIN) (argparse type)."""
    file, sep, twin = text.partition("=")
    if not sep or not file or not twin:
        raise argparse.ArgumentTypeError(f"--twin takes FILE=TWIN (a GGUF file and its llama twin), not {text!r}")
    return file, twin


def twin_ratios(
    results: Sequence[_Rates], twins: dict[str, str], per_token: dict[str, int], per_pass: dict[str, int] | None = None
) -> list[tuple[_Rates, _Rates, float, float]]:
    """(row, its twin's row of the same engine, prefill ratio, decode ratio) per row whose model has a twin; ratios are
    bytes x tokens/s of the row over the twin's (0 where either rate is missing): per_token bytes for decode,
    per_pass (the bytes a prefill pass reads; default per_token) for prefill."""
    per_pass = per_token if per_pass is None else per_pass
    by_key = {(r.model, r.engine): r for r in results}
    out = []
    for r in results:
        t = by_key.get((twins.get(r.model, ""), r.engine))
        if t is None:
            continue
        w, tw = per_token[r.model], per_token[t.model]
        pw, ptw = per_pass[r.model], per_pass[t.model]
        pre = r.prefill_tok_s * pw / (t.prefill_tok_s * ptw) if t.prefill_tok_s else 0.0
        dec = r.decode_tok_s * w / (t.decode_tok_s * tw) if t.decode_tok_s and r.decode_tok_s else 0.0
        out.append((r, t, pre, dec))
    return out


def format_twin_table(
    results: Sequence[_Rates], twins: dict[str, str], per_token: dict[str, int], per_pass: dict[str, int] | None = None
) -> str:
    """A markdown table of each file against its llama twin, per engine ('' when no file has a twin)."""
    rows = twin_ratios(results, twins, per_token, per_pass)
    if not rows:
        return ""
    lines = [
        "| file | llama twin | engine | decode GB/s | twin decode GB/s | decode per weight byte vs twin "
        "| prefill per weight byte vs twin |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, t, pre, dec in rows:
        gb, tgb = (f"{x.decode_tok_s * per_token[x.model] / 1e9:.1f}" if x.decode_tok_s else "-" for x in (r, t))
        lines.append(
            f"| {Path(r.model).name} | {Path(t.model).name} | {r.engine} | {gb} | {tgb} "
            f"| {f'{dec:.2f}x' if dec else '-'} | {f'{pre:.2f}x' if pre else '-'} |"
        )
    lines += [
        "",
        "vs twin = (weights read x tok/s) / the same of the llama twin, same engine, same run (1.00x: the "
        "architecture's extras cost nothing beyond their weights); weights read: per decode token for decode, per "
        "prefill pass (every expert of a mixture of experts, an upper bound) for prefill",
    ]
    return "\n".join(lines)
