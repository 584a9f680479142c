"""`kvcmas bench vision`: images in the shared context of a 4-agent team.

By default the issue's benchmark: a random-weight LLaVA-OneVision of real size (SigLIP-so400m, 384 px tiles of 27 x 27
patches, OneVision's grid pinpoints, ``anyres_max_9``, ``image_newline``) projected to the width of the 0.5B text
model (``qwen2.5-coder-0.5b`` from ``kvcmas models pull``), one AnyRes photo (scikit-image's astronaut: 3,699 image
rows) and a question shared by the team; ``--images 3`` puts three photos in the message, each in OneVision's
single view of 730 rows. Per method: the first and later agents' TTFT, the team's KV, the encodes the encoder
counted, and the issue's goals as pass / fail lines. No vision-language weights exist offline; speed and memory do
not depend on the weights' values. ``--tower siglip`` is the earlier benchmark: one 729-row squashed SigLIP view.

``--family qwen2.5vl`` / ``--family gemma3`` run the same team on a random-weight checkpoint of that family
(bench.vision_families: made with transformers, converted by kvcmas' converters; ``--tower-layers N`` cuts the tower,
and the report says so), each image shared with ``share(image=...)`` as the family's prompts hold it. Every method's
first-token distributions are compared with nonshared's (KL(nonshared || method), per agent): the method
``kvcmas-nochain`` is kvcmas with each reader's own correction of the shared message (MethodConfig.chain off).
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
from .vision_families import FAMILIES, build_family

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
NO_CHAIN = "kvcmas-nochain"  # kvcmas with MethodConfig.chain off, beside the chained default
ONEVISION_LAYERS = 26  # SigLIP-so400m's blocks OneVision uses
# The goals for kvcmas against nonshared.
GOAL_TTFT_SPEEDUP, GOAL_KV_RATIO, GOAL_MIN_ROWS = 10.0, 0.35, 3000


def add_vision_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--family",
        choices=FAMILIES,
        default="onevision",
        help="onevision (the issue's benchmark, see --tower), or a random-weight qwen2.5vl / gemma3 checkpoint of real "
        "size built with transformers and converted (bench.vision_families)",
    )
    p.add_argument(
        "--tower-layers",
        type=int,
        default=None,
        help="cut the random tower to N blocks (the report says it is cut); default: the family's real depth",
    )
    p.add_argument("--family-size", choices=("real", "tiny"), default="real", help=argparse.SUPPRESS)  # tests
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
    p.add_argument("--layers", type=int, default=None, help="--tower-layers for --family onevision (so400m: 26 of 27)")
    p.add_argument(
        "--method",
        default=f"nonshared,fullshared,kvcmas,{NO_CHAIN}",
        help=f"comma-separated methods ({NO_CHAIN}: kvcmas without the chain's correction); the first is the "
        "reference of the ratios and of the KL",
    )
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


def _onevision_layers(args: argparse.Namespace) -> int:
    """The random OneVision tower's blocks: --tower-layers, or its alias --layers, or so400m's 26."""
    layers = args.tower_layers or args.layers or ONEVISION_LAYERS
    if not 1 <= layers <= ONEVISION_LAYERS:
        raise ValueError(f"--tower-layers must be in [1, {ONEVISION_LAYERS}], got {layers}")
    return int(layers)


def _write_tower(args: argparse.Namespace, path: str, n_embd: int) -> None:
    from ..vision.random_mmproj import ONEVISION_PINPOINTS, SIGLIP_SO400M_ONEVISION, write_random_mmproj

    shape = {**SIGLIP_SO400M_ONEVISION, "n_layer": _onevision_layers(args), "image_size": args.tile}
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
    first_logits: list[np.ndarray] = dataclasses.field(default_factory=list, repr=False)  # per agent
    replies: list[list[int]] = dataclasses.field(default_factory=list)  # per agent, the generated ids

    @property
    def team_bytes(self) -> int:
        return self.kv_bytes + self.corr_bytes


def _share(team: AgentSession, vision: Any, images: list[str], by_image: bool) -> None:
    """The images and the question as one message of the team. by_image: each image through share(image=...), as
    the model's prompts hold it (Qwen2.5-VL's grid positions, Gemma 3's markers and bidirectional rows); otherwise
    the rows of the view a message of len(images) images gives each (OneVision), as one span of vectors."""
    this = "this picture" if len(images) == 1 else "these pictures"
    question = QUESTION.format(this=this)
    if by_image:
        for i, image in enumerate(images):
            team.share(image=image, text=question if i == len(images) - 1 else None)
        return
    view = vision.view_for(len(images))
    features = [vision.encode(image, view=view) for image in images]
    team.share(embeddings=np.concatenate(features), text=question)


def run_team(
    model: Model,
    vision: Any,
    method: str,
    config: MethodConfig | None,
    images: list[str],
    max_tokens: int,
    fresh_cache: bool = True,
    by_image: bool = False,
) -> TeamRun:
    """A 4-agent team shares the images and the question (_share), then every agent answers. fresh_cache: the team
    starts from an empty feature cache, so `encodes` counts what this team encoded."""
    if fresh_cache:
        vision.clear_cache()
    encodes0 = vision.encode_count
    with AgentSession(
        model, method, vision=vision, workflow="bench-vision", config=config, calibration_dir=False
    ) as team:
        agents = [team.agent(n, system=r) for n, r in ROLES]
        _share(team, vision, images, by_image)
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
        first_logits=[np.asarray(r.first_logits, dtype=np.float64) for r in resp],
        replies=[list(r.ids) for r in resp],
    )


def first_token_kl(ref: TeamRun, run: TeamRun) -> list[float]:
    """KL(ref || run) of each agent's first-token distribution (nats). Agent k's prompt holds the replies of agents
    before it, so it is the same prompt as ref's only while those replies are (same_prompts)."""
    out = []
    for a, b in zip(ref.first_logits, run.first_logits, strict=True):
        la, lb = a - np.logaddexp.reduce(a), b - np.logaddexp.reduce(b)
        out.append(float(np.sum(np.exp(la) * (la - lb))))
    return out


def same_prompts(ref: TeamRun, run: TeamRun) -> int:
    """How many agents of `run` read the same prompt as ref's: all earlier agents replied alike."""
    n = 1
    while n < len(ref.replies) and ref.replies[n - 1] == run.replies[n - 1]:
        n += 1
    return n


def _config_of(method: str, args: argparse.Namespace) -> MethodConfig | None:
    """kvcmas as sessions run it (online calibration, bounded training reads), with --recompute; chained unless
    --no-chain or the method is kvcmas-nochain. None (the method's default) for the others."""
    if method not in ("kvcmas", NO_CHAIN):
        return None
    config = REGISTRY["kvcmas"].session_config(recompute=args.recompute)
    chain = method == "kvcmas" and not args.no_chain
    return config if chain else dataclasses.replace(config, chain=False)


def _kvcmas_config(args: argparse.Namespace) -> MethodConfig:
    """The config of the method `kvcmas` under these arguments (--recompute, --no-chain)."""
    config = _config_of("kvcmas", args)
    assert config is not None
    return config


def _calibrate(
    model: Model, vision: Any, config: MethodConfig, args: argparse.Namespace, n_images: int, by_image: bool
) -> None:
    """Teams of the same shape on other photos, so kvcmas' edges have learned maps before the measured team."""
    photos = [_photo(f) for f in CALIBRATION_PHOTOS]
    for i in range(args.calibrate):
        images = [photos[(i * n_images + j) % len(photos)] for j in range(n_images)]
        run_team(model, vision, "kvcmas", config, images, args.max_tokens, by_image=by_image)
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
    """The per-method table; ratios and KL against the first method (nonshared by default)."""
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
    print(f"\nfirst-token KL({base.method} || method), nats, per agent (agents 2-4 read the agents before them):\n")
    print("| method | KL per agent | mean KL, later agents | top-1 as " + base.method + " | same prompts |")
    print("|---|---|---|---|---|")
    for r in runs[1:]:
        kl = first_token_kl(base, r)
        top1 = sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(base.first_logits, r.first_logits, strict=True))
        cells = ", ".join(f"{k:.2e}" for k in kl)
        same = same_prompts(base, r)
        print(f"| {r.method} | {cells} | {np.mean(kl[1:]):.2e} | {top1}/{len(kl)} | {same}/{len(kl)} |")


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


def _methods(args: argparse.Namespace) -> list[str]:
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    unknown = [m for m in methods if m not in REGISTRY and m != NO_CHAIN]
    if unknown or not methods:
        raise ValueError(f"--method {args.method!r}: choose from {', '.join([*REGISTRY, NO_CHAIN])}")
    return methods


def _load(args: argparse.Namespace, tmp: Path) -> tuple[Model, Any, str]:
    """The text model, the vision encoder and a line saying what the tower is (cut or not)."""
    from ..vision import VisionEncoder

    if args.family != "onevision":
        if args.mmproj or args.model:
            raise ValueError(f"--family {args.family} builds its own checkpoint: no --mmproj / --model")
        if args.tile != 384 or args.tower != "onevision" or args.layers is not None:
            raise ValueError(f"--tile, --tower and --layers shape the OneVision tower, not --family {args.family}'s")
        built = build_family(args.family, tmp, args.family_size, args.tower_layers)
        cut = f"CUT to {built.tower_layers} of {built.real_tower_layers} blocks" if built.cut else "full depth"
        model = Model(built.text, n_threads=args.threads)
        return model, VisionEncoder(built.mmproj, n_threads=args.threads), f"tower: {built.label}; {cut}"
    default_model = ONEVISION_TEXT_MODEL if args.tower == "onevision" and args.mmproj is None else None
    model = Model(resolve_model_path(args.model or default_model), n_threads=args.threads)
    if args.mmproj is not None:
        return model, VisionEncoder(args.mmproj, n_threads=args.threads), f"tower: {args.mmproj}"
    mmproj = str(tmp / f"{args.tower}-random.gguf")
    layers = _onevision_layers(args)
    print(f"writing a random {args.tower} tower ({args.tile} px tiles, {layers} layers) ...", file=sys.stderr)
    _write_tower(args, mmproj, model.n_embd)
    cut = f"CUT to {layers} of {ONEVISION_LAYERS} blocks" if layers < ONEVISION_LAYERS else "full depth"
    return model, VisionEncoder(mmproj, n_threads=args.threads), f"tower: random {args.tower}, {cut}"


def run_vision(args: argparse.Namespace) -> int:
    if not 0 <= args.calibrate <= len(CALIBRATION_PHOTOS):
        raise ValueError(f"--calibrate must be in [0, {len(CALIBRATION_PHOTOS)}], got {args.calibrate}")
    images = _image_files(args)
    methods = _methods(args)
    by_image = args.family != "onevision"
    with tempfile.TemporaryDirectory() as tmp:
        model, vision, tower_line = _load(args, Path(tmp))
        vision.check_text_model(model.n_embd)
        view = None if by_image else vision.view_for(len(images))
        sizes = [vision.load(i).size for i in images]
        n_rows = [vision.n_image_tokens(w, h, view) for w, h in sizes]
        t0 = time.perf_counter()
        for image in images:
            vision.encode(image, view=view)
        cold = time.perf_counter() - t0
        n_inputs = sum(len(vision.preprocess(i, view)) if view is not None else 1 for i in images)
        side = f" {vision.image_size} px" if vision.image_size else " (dynamic resolution)"
        print(f"## {model.path}: {len(images)} image(s), {vision.model_type}{side}, view {view}")
        print(tower_line)
        for image, (w, h), n in zip(images, sizes, n_rows, strict=True):
            print(f"- {Path(image).name} {w}x{h}: {n} image rows")
        print(f"image rows in the message: {sum(n_rows)}")
        print(f"encode: {cold * 1000:.0f} ms cold ({n_inputs} tower inputs, batched per image)\n")
        runs = []
        for m in methods:
            config = _config_of(m, args)
            if config is not None and args.calibrate:
                _calibrate(model, vision, config, args, len(images), by_image)
            method = "kvcmas" if m == NO_CHAIN else m
            print(f"team: {m} ...", file=sys.stderr)
            run = run_team(model, vision, method, config, images, args.max_tokens, by_image=by_image)
            runs.append(dataclasses.replace(run, method=m))
    print_report(runs)
    print()
    for line in goal_lines(runs, len(images), n_rows, view == "single" or by_image):  # the rows goal: OneVision's
        print(line)
    return 0
