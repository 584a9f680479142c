"""`kvcmas bench vision --family qwen2.5vl|gemma3` measures real team runs: random checkpoints of each family made
with transformers and converted (tiny widths, the real structure), the 4-agent team sharing one photo; the first
agent is nonshared's, the image is encoded once per team, later agents reuse the image's rows, and the KL against
nonshared is computed from the agents' own first-token logits."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("skimage")

from kvcmas_cpp.bench.vision import (  # noqa: E402
    NO_CHAIN,
    add_vision_arguments,
    first_token_kl,
    run_team,
    run_vision,
    same_prompts,
)
from kvcmas_cpp.bench.vision_families import build_family  # noqa: E402
from kvcmas_cpp.model import Model  # noqa: E402
from kvcmas_cpp.sharing.methods import REGISTRY  # noqa: E402
from kvcmas_cpp.vision import VisionEncoder  # noqa: E402

FAMILIES = ("qwen2.5vl", "gemma3")


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_vision_arguments(p)
    return p.parse_args(list(argv))


def _photo(name: str) -> str:
    import skimage

    return str(Path(skimage.__file__).parent / "data" / name)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    built = build_family(request.param, tmp_path_factory.mktemp(request.param), size="tiny", outtype="f32")
    return {"name": request.param, "model": Model(built.text, n_threads=2),
            "enc": VisionEncoder(built.mmproj, n_threads=2), "built": built}  # fmt: skip


def test_the_family_checkpoint_is_that_family(family: dict[str, Any]) -> None:
    enc, built = family["enc"], family["built"]
    assert enc.n_embd == family["model"].n_embd and not built.cut
    if family["name"] == "gemma3":
        assert enc.bidirectional and enc.n_tokens == 16 and enc.projector_type == "gemma3"
    else:
        assert enc.image_tokens == ("<|vision_start|>", "<|vision_end|>") and not enc.bidirectional


def test_team_rows_are_reused_and_the_first_agent_is_nonshareds(family: dict[str, Any]) -> None:
    model, enc = family["model"], family["enc"]
    photo = _photo("astronaut.png")
    ref = run_team(model, enc, "nonshared", None, [photo], 2, by_image=True)
    config = REGISTRY["kvcmas"].session_config()
    runs = [run_team(model, enc, m, config if m == "kvcmas" else None, [photo], 2, by_image=True)
            for m in ("fullshared", "kvcmas")]  # fmt: skip
    rows = enc.n_image_tokens(*enc.load(photo).size)
    assert ref.encodes == 1 and ref.modes == ["source", "dense", "dense", "dense"]
    assert first_token_kl(ref, ref) == [0.0] * 4 and same_prompts(ref, ref) == 4
    for run in runs:
        assert run.encodes == 1  # one tower pass for the team
        assert np.allclose(run.first_logits[0], ref.first_logits[0], atol=1e-4)  # the source agent computes all
        assert run.replies[0] == ref.replies[0] and run.computed[0] <= ref.computed[0]
        assert run.modes[1:] == ["reuse"] * 3
        for got, want in zip(run.computed[1:], ref.computed[1:], strict=True):
            assert got <= want - rows  # the image's rows were not computed again
        assert run.kv_bytes < ref.kv_bytes
        kl = first_token_kl(ref, run)
        assert kl[0] < 1e-6 and all(k >= -1e-12 for k in kl) and any(k > 0 for k in kl[1:])


def test_the_benchmark_reports_each_method_and_a_cut_tower(
    family: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    args = _args("--family", family["name"], "--family-size", "tiny", "--tower-layers", "1", "-n", "2",
                 "--calibrate", "0", "--method", f"nonshared,kvcmas,{NO_CHAIN}", "--threads", "2")  # fmt: skip
    assert run_vision(args) == 0
    out = capsys.readouterr().out
    assert "CUT to 1 of" in out
    for method in ("kvcmas", NO_CHAIN):
        assert f"| {method} | 0.00e+00, " in out  # the KL row; its first agent is nonshared's
        assert f"PASS: {method}: 1 encodes for 1 distinct images" in out
    assert "image rows 16 >=" not in out and "later-agent TTFT" in out


def test_bad_arguments_name_the_problem() -> None:
    with pytest.raises(ValueError, match="--tower-layers must be in"):
        build_family("gemma3", Path("/nonexistent"), size="tiny", tower_layers=9)
    with pytest.raises(ValueError, match="a random checkpoint is built for"):
        build_family("llava", Path("/nonexistent"))
    with pytest.raises(ValueError, match="no --mmproj"):
        run_vision(_args("--family", "gemma3", "--mmproj", "x.gguf"))
    with pytest.raises(ValueError, match="shape the OneVision tower"):
        run_vision(_args("--family", "qwen2.5vl", "--tile", "56"))
    with pytest.raises(ValueError, match="choose from"):
        run_vision(_args("--method", "nonshared,bogus"))
