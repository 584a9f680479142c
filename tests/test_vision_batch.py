"""The vision tower's batched pass (AnyRes's crops in one call) and `kvcmas bench vision`'s OneVision benchmark.

The batched pass must give bit for bit the rows one pass per crop gives (the contract in vision-encoder.h), for
SigLIP (no class token) and CLIP (class token dropped by the select strategy), across the per-pass batch limit; the
benchmark's small configuration (scaled-down tiles, one layer, SmolLM2) runs end to end and counts one encode per
image and exactly the rows `n_image_tokens` predicts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("skimage")

from kvcmas_cpp.agents import AgentSession  # noqa: E402
from kvcmas_cpp.bench import vision as bench_vision  # noqa: E402
from kvcmas_cpp.model import Model  # noqa: E402
from kvcmas_cpp.vision import VisionEncoder  # noqa: E402
from kvcmas_cpp.vision.anyres import ANYRES, SINGLE  # noqa: E402
from kvcmas_cpp.vision.random_mmproj import ONEVISION_PINPOINTS, write_random_mmproj  # noqa: E402

TILE = 56
TOWER = dict(image_size=TILE, patch_size=14, n_embd=64, n_ff=128, n_layer=2, n_head=4)


@pytest.fixture(scope="module", params=["siglip", "clip"])
def tower(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("batch") / f"{request.param}.gguf"
    write_random_mmproj(path, model_type=request.param, n_embd_out=96, outtype="f32", **TOWER)
    return path


@pytest.mark.parametrize("n", [1, 3, 11])
def test_batched_pass_equals_one_pass_per_image(tower: Path, n: int) -> None:
    enc = VisionEncoder(tower, n_threads=2)
    assert enc.max_batch < 11  # the largest case spans two passes
    pixels = np.random.default_rng(n).standard_normal((n, 3, TILE, TILE)).astype(np.float32)
    looped = np.stack([enc.encode_pixels(p) for p in pixels])  # [3, S, S]: one tower pass each
    batched = enc.encode_pixels(pixels)  # [n, 3, S, S]: one batched pass
    assert batched.shape == (n, enc.n_tokens, enc.n_embd)
    assert np.array_equal(batched, looped)  # bit for bit, not merely close
    # each image's rows depend on that image only: a batch of one image repeated gives its rows each time
    same = enc.encode_pixels(np.repeat(pixels[:1], 2, axis=0))
    assert np.array_equal(same[0], same[1])


def test_batched_pass_refuses_bad_input(tower: Path) -> None:
    enc = VisionEncoder(tower, n_threads=1)
    pixels = np.zeros((3, 3, TILE, TILE), dtype=np.float32)
    pixels[2, 1, 5, 7] = np.nan
    with pytest.raises(ValueError, match="of image 2 is not finite"):
        enc.encode_pixels(pixels)
    with pytest.raises(ValueError, match=r"shape \[n >= 1, 3, 56, 56\]"):
        enc.encode_pixels(np.zeros((2, 3, TILE, TILE + 14), dtype=np.float32))
    with pytest.raises(ValueError, match=r"got \[0, 3"):
        enc.encode_pixels(np.zeros((0, 3, TILE, TILE), dtype=np.float32))


def test_anyres_encode_uses_the_batched_pass(tmp_path: Path) -> None:
    """VisionEncoder.encode_pixels on AnyRes's crops equals the tower run crop by crop."""
    path = tmp_path / "onevision.gguf"
    pinpoints = [(h * TILE // 384, w * TILE // 384) for h, w in ONEVISION_PINPOINTS]
    write_random_mmproj(path, n_embd_out=96, grid_pinpoints=pinpoints, vision_aspect_ratio="anyres_max_9", **TOWER)
    enc = VisionEncoder(path, n_threads=2)
    pixels = enc.preprocess(bench_vision._photo("astronaut.png"), ANYRES)
    assert len(pixels) > enc.max_batch  # crosses a pass boundary
    batched = enc.encode_pixels(pixels)
    assert np.array_equal(batched, np.stack([enc.encode_pixels(p) for p in pixels]))


def _args(**over: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_vision.add_vision_arguments(p)
    args = p.parse_args([])
    for k, v in over.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("n_images", [1, 3])
def test_bench_vision_small_configuration(
    default_model_path: Path, n_images: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The OneVision benchmark scaled down (56 px tiles, one layer, SmolLM2): every method's team encodes each image
    once (the encoder's own counter), and the rows the team shares are the rows n_image_tokens predicts."""
    args = _args(model=str(default_model_path), tile=TILE, layers=1, max_tokens=2, calibrate=1, threads=2,
                 images=n_images)  # fmt: skip
    assert bench_vision.run_vision(args) == 0
    out = capsys.readouterr().out
    for method in ("nonshared", "fullshared", "kvcmas"):
        assert f"PASS: {method}: {n_images} encodes for {n_images} distinct images" in out
    assert "later-agent TTFT" in out and "team KV" in out

    model = Model(str(default_model_path), n_threads=2)
    mmproj = tmp_path / "onevision.gguf"
    bench_vision._write_tower(args, str(mmproj), model.n_embd)
    enc = VisionEncoder(mmproj, n_threads=2)
    images = bench_vision._image_files(args)
    view = enc.view_for(n_images)
    assert view == (ANYRES if n_images == 1 else SINGLE)  # OneVision's multi-image rule
    predicted = [enc.n_image_tokens(*enc.load(i).size, view) for i in images]
    assert f"image rows in the message: {sum(predicted)}" in out
    run = bench_vision.run_team(model, enc, "fullshared", None, images, 1)
    assert run.encodes == n_images == enc.encode_count
    assert run.computed[0] > sum(predicted) > run.computed[1]  # the first agent computes the rows, later ones read
    with AgentSession(model, "fullshared", vision=enc, calibration_dir=False) as team:
        team.share(embeddings=np.concatenate([enc.encode(i, view=view) for i in images]), text="?")
        assert team.context[0][1].startswith(f"[{sum(predicted)} input vectors]")
    assert enc.encode_count == n_images  # the second session's encodes came from the feature cache


def test_bench_vision_no_chain_keeps_one_correction_per_reader(default_model_path: Path, tmp_path: Path) -> None:
    """--no-chain: each later agent holds its own rank-9 correction of the shared image (with the chain, the ranks
    grow 9, 18, 27 hop by hop), so the team's correction bytes fall by half."""
    model = Model(str(default_model_path), n_threads=2)
    mmproj = tmp_path / "onevision.gguf"
    bench_vision._write_tower(_args(tile=TILE, layers=1), str(mmproj), model.n_embd)
    enc = VisionEncoder(mmproj, n_threads=2)
    corr = {}
    for no_chain in (False, True):
        config = bench_vision._kvcmas_config(_args(no_chain=no_chain))
        assert config.chain is not no_chain
        runs = [
            bench_vision.run_team(model, enc, "kvcmas", config, [bench_vision._photo(p)], 2, fresh_cache=False)
            for p in ("motorcycle_left.png", "astronaut.png")  # the first team calibrates the edges (if not yet)
        ]
        assert runs[1].corr_bytes > 0
        corr[no_chain] = runs[1].corr_bytes
    assert corr[False] == 2 * corr[True]  # ranks 9 + 18 + 27 against 3 x 9, on the same rows
