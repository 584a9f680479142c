"""`kvcmas bench vision`: an image in the shared context of a 4-agent team.

Encode time per image (cold, then from the feature cache), and per method the later agents' TTFT, prompt tokens
computed and KV bytes when every agent reads the image and a question. Without --mmproj it writes a random-weight
SigLIP tower of real size (384 px, patch 14, so400m-shaped by default) projected to the text model's width: no
vision-language weights exist offline, and speed and memory do not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..agents import AgentSession
from ..model import Model, resolve_model_path
from ..sharing.methods import MethodConfig

ROLES = (
    ("Describer", "You describe images precisely."),
    ("Analyst", "You analyse what the other agents said about the image."),
    ("Critic", "You check the other agents' claims."),
    ("Decision Maker", "You give the final answer."),
)


def add_vision_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="text model GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--mmproj", default=None, help="mmproj GGUF (default: a random real-size SigLIP tower)")
    p.add_argument("--image", default=None, help="image file (default: scikit-image's astronaut.png)")
    p.add_argument("--layers", type=int, default=26, help="layers of the random tower (so400m: 26 used of 27)")
    p.add_argument("--method", default="nonshared,fullshared,kvcmas", help="comma-separated methods")
    p.add_argument("-n", "--max-tokens", type=int, default=8, help="tokens each agent generates")
    p.add_argument(
        "--calibrate", type=int, default=4, help="other photos kvcmas learns its corrections on first (at most 4)"
    )
    p.add_argument("--threads", type=int, default=None)


def run_vision(args: argparse.Namespace) -> int:
    from ..vision import VisionEncoder
    from ..vision.random_mmproj import write_random_mmproj

    model = Model(resolve_model_path(args.model), n_threads=args.threads)
    image = args.image
    if image is None:
        import skimage

        image = str(Path(skimage.__file__).parent / "data" / "astronaut.png")
    with tempfile.TemporaryDirectory() as tmp:
        mmproj = args.mmproj
        if mmproj is None:
            mmproj = str(Path(tmp) / "siglip-random.gguf")
            print("writing a random SigLIP tower (384 px, patch 14) ...", file=sys.stderr)
            write_random_mmproj(mmproj, n_layer=args.layers, n_embd_out=model.n_embd)
        vision = VisionEncoder(mmproj, n_threads=args.threads)
        t0 = time.perf_counter()
        n_rows = len(vision.encode(image))
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        vision.encode(image)
        cached = time.perf_counter() - t0
        print(f"## image: {Path(image).name}, {vision.model_type} {vision.image_size} px -> {n_rows} tokens")
        print(f"encode: {cold * 1000:.0f} ms cold, {cached * 1000:.2f} ms from the feature cache\n")
        methods = [m.strip() for m in args.method.split(",") if m.strip()]
        cfg = MethodConfig("kvcmas", head=4, rank=8, calibrate=args.calibrate)
        if "kvcmas" in methods and args.calibrate:
            import skimage

            data = Path(skimage.__file__).parent / "data"
            others = [data / f for f in ("chelsea.png", "coffee.png", "motorcycle_left.png", "rocket.jpg")]
            for photo in others[: args.calibrate]:
                with AgentSession(
                    model, "kvcmas", vision=vision, workflow="bench-vision", config=cfg, calibration_dir=False
                ) as team:
                    agents = [team.agent(n, system=r) for n, r in ROLES]
                    team.share(image=photo, text="What is shown in this picture, and what is unusual about it?")
                    for a in agents:
                        a.respond(max_tokens=args.max_tokens)
                print(f"kvcmas calibrated on {photo.name}", file=sys.stderr)
        rows: list[dict[str, Any]] = []
        for method in methods:
            config = cfg if method == "kvcmas" else None
            with AgentSession(
                model, method, vision=vision, workflow="bench-vision", config=config, calibration_dir=False
            ) as team:
                agents = [team.agent(n, system=r) for n, r in ROLES]
                team.share(image=image, text="What is shown in this picture, and what is unusual about it?")
                resp = [a.respond(max_tokens=args.max_tokens) for a in agents]
            later = [r.stats for r in resp[1:]]
            rows.append(
                {
                    "method": method,
                    "first_ttft_ms": resp[0].stats.ttft_ms,
                    "later_ttft_ms": float(np.mean([s.ttft_ms for s in later])),
                    "computed": [r.stats.computed_tokens for r in resp],
                    "kv_bytes": sum(r.stats.kv_bytes for r in resp),
                    "corr_bytes": sum(r.stats.corr_bytes for r in resp),
                    "modes": [r.stats.mode for r in resp],
                }
            )
    base = rows[0]
    print(
        "| method | first-agent TTFT ms | later-agent TTFT ms | vs first method | computed tokens per agent | "
        "KV MiB (4 agents) | vs first method | correction MiB | modes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['first_ttft_ms']:.0f} | {r['later_ttft_ms']:.0f} | "
            f"{base['later_ttft_ms'] / r['later_ttft_ms']:.2f}x | {r['computed']} | {r['kv_bytes'] / 2**20:.1f} | "
            f"{r['kv_bytes'] / base['kv_bytes']:.2f} | {r['corr_bytes'] / 2**20:.2f} | {','.join(r['modes'])} |"
        )
    return 0
