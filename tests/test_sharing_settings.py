"""The method reads its settings from the model file's kvcmas.* keys (written by the converter or `kvcmas gguf
set`); API arguments override the file, and the file overrides the spec's defaults."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import kvcmas_cpp as kc
from kvcmas_convert import set_values
from kvcmas_cpp.sharing.methods import reference_estimator


def test_defaults_without_keys(tiny_models) -> None:
    model = kc.Model(tiny_models[("llama", "Q8_0")], n_threads=1)
    assert not any(k.startswith("kvcmas.") for k in model.metadata)
    e = reference_estimator(model, "gsm8k")
    assert (e.rank, e.base_rank, e.max_anchors, e.window, e.top_p) == (32, 32, 10, 5, pytest.approx(0.9))
    assert e.gamma == pytest.approx(0.32)  # the spec's GSM8K γ when the file says nothing
    assert reference_estimator(model, "mmlu").gamma == pytest.approx(0.29)


def test_file_values_then_api_overrides(tiny_models, tmp_path: Path) -> None:
    path = tmp_path / "tuned.gguf"
    shutil.copy(tiny_models[("llama", "Q8_0")], path)
    set_values(path, {"kvcmas.rank_k": 16, "kvcmas.anchor_pool_size": 4, "kvcmas.gate_threshold": 0.5})
    model = kc.Model(path, n_threads=1)
    e = reference_estimator(model, "gsm8k")
    assert (e.rank, e.max_anchors, e.gamma) == (16, 4, pytest.approx(0.5))
    o = reference_estimator(model, "gsm8k", rank_k=8, gate_threshold=0.7)
    assert (o.rank, o.max_anchors, o.gamma) == (8, 4, pytest.approx(0.7))
    with pytest.raises(ValueError, match="anchor_pool_size"):
        reference_estimator(model, "gsm8k", anchor_pool_size=0)
    with pytest.raises(ValueError, match="unknown kvcmas settings: ranks"):
        reference_estimator(model, "gsm8k", ranks=3)
