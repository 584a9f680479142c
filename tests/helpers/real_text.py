"""Real text for whole-model accuracy checks (GSM8K questions shipped with the package) and the logits of a model
read in chunks (the decode path for chunks of up to 16 tokens)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import kvcmas_cpp as kc

# The capable model's file (`kvcmas models pull qwen2.5-coder-0.5b`): real weights with Q4_K / Q6_K tensors.
REAL_K_QUANT_MODEL = Path(os.path.expanduser("~/.cache/kvcmas/models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"))


def real_text_ids(model: kc.Model, n: int) -> list[int]:
    """n tokens of real text: GSM8K questions (shipped with the package), one after another."""
    ids: list[int] = []
    with open(kc.sharing.gsm8k_path(), encoding="utf-8") as f:
        for line in f:
            ids += model.tokenize(json.loads(line)["question"] + "\n")
            if len(ids) >= n:
                return ids[:n]
    raise AssertionError("GSM8K ran out of text")


def chunked_logits(model: kc.Model, ids: Sequence[int], chunk: int) -> np.ndarray:
    """Logits at every position, appending `chunk` tokens per call (the decode path for chunk <= 16)."""
    rows = []
    with model.new_sequence() as seq:
        for i in range(0, len(ids), chunk):
            out = seq.append(ids[i : i + chunk], logits="all")
            assert out is not None
            rows.append(out)
    return np.concatenate(rows)


def agreement(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement, rms difference / std of b)."""
    top1 = float(np.mean(a.argmax(-1) == b.argmax(-1)))
    return top1, float(np.sqrt(np.mean((a - b) ** 2)) / b.std())
