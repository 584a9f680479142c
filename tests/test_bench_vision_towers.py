"""`kvcmas bench vision-towers` reports true numbers: the towers it times give transformers' features, at real
width (two blocks, to stay short)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from kvcmas_cpp.bench.vision_towers import add_tower_arguments, run_vision_towers  # noqa: E402


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_tower_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.slow
def test_towers_timed_are_transformers_towers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.json"
    args = _args("--layers", "2", "--runs", "1", "--outtype", "f32", "--no-llama-cpp", "--json", str(out))
    assert run_vision_towers(args) == 0
    rows = {r["family"]: r for r in json.loads(out.read_text())}
    assert rows["qwen2.5vl"]["tokens"] == 37 * 27  # 1024 x 768 -> 1036 x 756 pixels, 74 x 54 patches, merged 2 x 2
    assert rows["gemma3"]["tokens"] == 256
    for r in rows.values():
        assert r["kvcmas_s"] > 0 and r["torch_s"] > 0 and r["ref_max"] > 0.1
        assert r["delta_torch"] <= 1e-4 * r["ref_max"], r
    table = capsys.readouterr().out
    assert "| qwen2.5vl | 2 | 999 | f32 |" in table and "| gemma3 | 2 | 256 | f32 |" in table


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_vision_towers(_args("--family", "llava")) == 2
    assert "known families are qwen2.5vl, gemma3" in capsys.readouterr().err
    assert run_vision_towers(_args("--runs", "0")) == 2
