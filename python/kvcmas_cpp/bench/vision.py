"""`kvcmas bench vision`: images in the shared context of a 4-agent team.

By default the issue's benchmark: a random-weight LLaVA-OneVision of real size (SigLIP-so400m, 384 px tiles of 27 x 27
patches, OneVision's grid pinpoints, ``anyres_max_9``, ``image_newline``) projected to the width of the 0.5B text
model (``qwen2.5-coder-0.5b`` from ``kvcmas models pull``), one AnyRes photo (scikit-image's astronaut: 3,699 image
rows) and a question shared by the team; ``--images 3`` puts three photos in the message, each in OneVision's
single view of 730 rows. Per method: the first and later agents' TTFT, the team's KV, the encodes the encoder
counted, and the issue's goals as pass / fail lines. No vision-language weights exist offline; speed and memory do
not depend on the weights' values. ``--tower siglip`` is the earlier benchmark: one 729-row squashed SigLIP view.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..agents import AgentSession
from ..model import Model, resolve_model_path
from ..sharing.methods import REGISTRY, MethodConfig

ROLES = (
    ("Describer", "You describe images precisely."),
    ("Analyst", "You analyse what the other agents said about the image."),
    ("Critic", "You check the other agents' claims."),
    ("Decision Maker", "You give the final answer."),
)
QUESTION = "What is shown in {this}, and what is unusual about it?"
# The benchmark's photos (scikit-image's data), then the other photos kvcmas calibrates on first (never the same).
BENCH_PHOTOS = ("astronaut.png", "coffee.png", "chelsea.png")
CALIBRATION_PHOTOS = ("motorcycle_left.png", "rocket.jpg", "retina.jpg", "hubble_deep_field.jpg", "horse.png")
ONEVISION_TEXT_MODEL = "qwen2.5-coder-0.5b"  # the "0.5B text model" (Qwen2 architecture, as OneVision's)
# The goals for kvcmas against nonshared.
GOAL_TTFT_SPEEDUP, GOAL_KV_RATIO, GOAL_MIN_ROWS = 10.0, 0.35, 3000


def add_vision_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tower",
        choices=("onevision", "siglip"),
        default="onevision",
        help="random tower when no --mmproj: onevision (SigLIP-so400m AnyRes, the issue's benchmark) or siglip "
        "(one squashed 729-row view)",
    )
    p.add_argument(
        "-m",
        "--model",
        default=None,
        help=f"text model GGUF or store name (default: {ONEVISION_TEXT_MODEL} for --tower onevision, else "
        "SmolLM2-135M-Instruct)",
    )
    p.add_argument("--mmproj", default=None, help="mmproj GGUF (default: a random real-size tower, see --tower)")
    p.add_argument("--image", default=None, help="comma-separated image files (default: scikit-image's photos)")
    p.add_argument(
        "--images", type=int, default=1, help="images in the shared message (OneVision: single view when > 1)"
    )
    p.add_argument("--tile", type=int, default=384, help="the random tower's tile side in px (pinpoints scale)")
    p.add_argument("--layers", type=int, default=26, help="layers of the random tower (so400m: 26 used of 27)")
    p.add_argument("--method", default="nonshared,fullshared,kvcmas", help="comma-separated methods")
    p.add_argument("-n", "--max-tokens", type=int, default=8, help="tokens each agent generates")
    p.add_argument(
        "--calibrate",
        type=int,
        default=1,
        help=f"teams on other photos kvcmas calibrates on first (at most {len(CALIBRATION_PHOTOS)})",
    )
    p.add_argument("--recompute", type=float, default=None, help="kvcmas' recompute share (default: the method's)")
    p.add_argument(
        "--no-chain",
        action="store_true",
        help="kvcmas: each reader's own correction of the shared message instead of the chain's (MethodConfig.chain)",
    )
    p.add_argument("--threads", type=int, default=None)


def _photo(name: str) -> str:
    import skimage

    return str(Path(skimage.__file__).parent / "data" / name)


def _write_tower(args: argparse.Namespace, path: str, n_embd: int) -> None:
    from ..vision.random_mmproj import ONEVISION_PINPOINTS, SIGLIP_SO400M_ONEVISION, write_random_mmproj

    shape = {**SIGLIP_SO400M_ONEVISION, "n_layer": args.layers, "image_size": args.tile}
    if args.tower == "siglip":
        write_random_mmproj(path, **shape, n_embd_out=n_embd)
        return
    scale = args.tile / 384
    pinpoints = [(round(h * scale), round(w * scale)) for h, w in ONEVISION_PINPOINTS]
    write_random_mmproj(path, **shape, n_embd_out=n_embd, grid_pinpoints=pinpoints, vision_aspect_ratio="anyres_max_9")


@dataclass
class TeamRun:
    """One team's answer to the shared images and question under one method."""

    method: str
    first_ttft_ms: float
    later_ttft_ms: float
    computed: list[int]
    kv_bytes: int  # KV rows the four agents hold (the team KV of the goal)
    corr_bytes: int  # their low-rank corrections, held beside the rows
    encodes: int  # tower runs the encoder counted for this team (its feature cache cleared first)
    modes: list[str]

    @property
    def team_bytes(self) -> int:
        return self.kv_bytes + self.corr_bytes


def run_team(
    model: Model,
    vision: Any,
    method: str,
    config: MethodConfig | None,
    images: list[str],
    max_tokens: int,
    fresh_cache: bool = True,
) -> TeamRun:
    """A 4-agent team shares the images (each in the view a message of len(images) images gives it) and the
    question, then every agent answers. fresh_cache: the team starts from an empty feature cache, so `encodes`
    counts what this team encoded."""
    if fresh_cache:
        vision.clear_cache()
    encodes0 = vision.encode_count
    with AgentSession(
        model, method, vision=vision, workflow="bench-vision", config=config, calibration_dir=False
    ) as team:
        agents = [team.agent(n, system=r) for n, r in ROLES]
        view = vision.view_for(len(images))
        features = [vision.encode(image, view=view) for image in images]
        this = "this picture" if len(images) == 1 else "these pictures"
        team.share(embeddings=np.concatenate(features), text=QUESTION.format(this=this))
        resp = [a.respond(max_tokens=max_tokens) for a in agents]
    later = [r.stats for r in resp[1:]]
    return TeamRun(
        method=method,
        first_ttft_ms=resp[0].stats.ttft_ms,
        later_ttft_ms=float(np.mean([s.ttft_ms for s in later])),
        computed=[r.stats.computed_tokens for r in resp],
        kv_bytes=sum(r.stats.kv_bytes for r in resp),
        corr_bytes=sum(r.stats.corr_bytes for r in resp),
        encodes=vision.encode_count - encodes0,
        modes=[r.stats.mode for r in resp],
    )


def _kvcmas_config(args: argparse.Namespace) -> MethodConfig:
    """kvcmas as sessions run it (online calibration, bounded training reads), with --recompute and --no-chain."""
    config = REGISTRY["kvcmas"].session_config(recompute=args.recompute)
    return dataclasses.replace(config, chain=False) if args.no_chain else config


def _calibrate(model: Model, vision: Any, config: MethodConfig, args: argparse.Namespace, n_images: int) -> None:
    """Teams of the same shape on other photos, so kvcmas' edges have learned maps before the measured team."""
    photos = [_photo(f) for f in CALIBRATION_PHOTOS]
    for i in range(args.calibrate):
        images = [photos[(i * n_images + j) % len(photos)] for j in range(n_images)]
        run_team(model, vision, "kvcmas", config, images, args.max_tokens)
        print(f"kvcmas calibrated on {', '.join(Path(p).name for p in images)}", file=sys.stderr)


def goal_lines(runs: list[TeamRun], n_images: int, n_rows: list[int], single_view: bool) -> list[str]:
    """The issue's goals as PASS / FAIL lines (kvcmas against nonshared; encodes for every method)."""
    by = {r.method: r for r in runs}
    lines = []
    total = sum(n_rows)

    def line(ok: bool, text: str) -> None:
        lines.append(f"{'PASS' if ok else 'FAIL'}: {text}")

    if not single_view:
        line(total >= GOAL_MIN_ROWS, f"image rows {total} >= {GOAL_MIN_ROWS}")
    if "nonshared" in by and "kvcmas" in by:
        speedup = by["nonshared"].later_ttft_ms / by["kvcmas"].later_ttft_ms
        line(speedup >= GOAL_TTFT_SPEEDUP, f"kvcmas later-agent TTFT {speedup:.2f}x nonshared (goal >= 10x)")
        kv = by["kvcmas"].kv_bytes / by["nonshared"].kv_bytes
        held = by["kvcmas"].team_bytes / by["nonshared"].team_bytes
        line(kv <= GOAL_KV_RATIO, f"kvcmas team KV {kv:.3f}x nonshared (goal <= 0.35x; {held:.3f}x with corrections)")
    for r in runs:
        line(r.encodes == n_images, f"{r.method}: {r.encodes} encodes for {n_images} distinct images (goal: one each)")
    return lines


def print_report(runs: list[TeamRun]) -> None:
    """The per-method table; ratios against the first method (nonshared by default)."""
    base = runs[0]
    print(
        f"| method | first-agent TTFT ms | later-agent TTFT ms | later vs {base.method} | computed tokens per agent | "
        f"team KV MiB | vs {base.method} | correction MiB | KV + corrections vs {base.method} | encodes | modes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r.method} | {r.first_ttft_ms:.0f} | {r.later_ttft_ms:.0f} | "
            f"{base.later_ttft_ms / r.later_ttft_ms:.2f}x | {r.computed} | {r.kv_bytes / 2**20:.1f} | "
            f"{r.kv_bytes / base.kv_bytes:.3f} | {r.corr_bytes / 2**20:.2f} | {r.team_bytes / base.team_bytes:.3f} | "
            f"{r.encodes} | {','.join(r.modes)} |"
        )


def _image_files(args: argparse.Namespace) -> list[str]:
    if args.images < 1:
        raise ValueError(f"--images must be >= 1, got {args.images}")
    if args.image:
        files = [f.strip() for f in args.image.split(",") if f.strip()]
        if len(files) != args.images:
            raise ValueError(f"--image names {len(files)} files, --images asks for {args.images}")
        return files
    if args.images > len(BENCH_PHOTOS):
        raise ValueError(f"--images {args.images}: name them with --image (the defaults hold {len(BENCH_PHOTOS)})")
    return [_photo(f) for f in BENCH_PHOTOS[: args.images]]


def run_vision(args: argparse.Namespace) -> int:
    from ..vision import VisionEncoder

    if not 0 <= args.calibrate <= len(CALIBRATION_PHOTOS):
        raise ValueError(f"--calibrate must be in [0, {len(CALIBRATION_PHOTOS)}], got {args.calibrate}")
    images = _image_files(args)
    default_model = ONEVISION_TEXT_MODEL if args.tower == "onevision" and args.mmproj is None else None
    model = Model(resolve_model_path(args.model or default_model), n_threads=args.threads)
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        mmproj = args.mmproj
        if mmproj is None:
            mmproj = str(Path(tmp) / f"{args.tower}-random.gguf")
            print(
                f"writing a random {args.tower} tower ({args.tile} px tiles, {args.layers} layers) ...", file=sys.stderr
            )
            _write_tower(args, mmproj, model.n_embd)
        vision = VisionEncoder(mmproj, n_threads=args.threads)
        vision.check_text_model(model.n_embd)
        view = vision.view_for(len(images))
        sizes = [vision.load(i).size for i in images]
        n_rows = [vision.n_image_tokens(w, h, view) for w, h in sizes]
        t0 = time.perf_counter()
        for image in images:
            vision.encode(image, view=view)
        cold = time.perf_counter() - t0
        n_inputs = sum(len(vision.preprocess(i, view)) if view is not None else 1 for i in images)
        print(f"## {model.path}: {len(images)} image(s), {vision.model_type} {vision.image_size} px, view {view}")
        for image, (w, h), n in zip(images, sizes, n_rows, strict=True):
            print(f"- {Path(image).name} {w}x{h}: {n} image rows")
        print(f"image rows in the message: {sum(n_rows)}")
        print(f"encode: {cold * 1000:.0f} ms cold ({n_inputs} tower inputs, batched per image)\n")
        config = _kvcmas_config(args)
        if "kvcmas" in methods and args.calibrate:
            _calibrate(model, vision, config, args, len(images))
        runs = [run_team(model, vision, m, config if m == "kvcmas" else None, images, args.max_tokens) for m in methods]
    print_report(runs)
    print()
    for line in goal_lines(runs, len(images), n_rows, view == "single"):
        print(line)
    return 0
