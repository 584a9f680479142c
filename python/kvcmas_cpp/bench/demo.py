"""`kvcmas run`, the main job: the spec's GSM8K team (Math Solver, Mathematical Analyst, Programming Expert and a
decision agent, fully connected) answers a few GSM8K questions on the default model, once with `nonshared` (every
agent computes the question and earlier replies; its system prompt's rows come from the model's exact prefix cache)
and once with `kvcmas` (later agents read the question and earlier replies from the first reader's KV with learned
low-rank corrections). Prints each agent's answer, a per-hop table and the
later-agent TTFT and KV memory of both methods side by side."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..agents import AgentSession, Response
from ..arguments import output_file, positive_int
from ..model import Model, resolve_model_path
from ..sharing import methods as registry
from ..sharing.estimators import RidgeEstimator
from ..sharing.persist import load_ridge, save_ridge
from .accuracy import compare
from .tasks import Example, get_task
from .tasks.base import Task

METHODS = ("nonshared", "kvcmas")
CALIBRATION_OFFSET = 1000  # training questions come from a different slice of the test split than the demo's

# questions the main job's kvcmas team learns its corrections from before it answers (each edge fitted on them)
CALIBRATION_QUESTIONS = 4


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="GGUF file or model name (default: SmolLM2-135M)")
    p.add_argument("-t", "--threads", type=positive_int, default=None, help="compute threads (default: all cores)")
    p.add_argument("--kv-type", choices=("f32", "f16"), default="f32", help="KV cache rows (f16: half the memory)")
    p.add_argument("--questions", type=int, default=3, help="GSM8K questions to answer")
    p.add_argument("--start", type=int, default=0, help="first GSM8K test question")
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens each agent may generate")
    p.add_argument(
        "--calibrate",
        type=int,
        default=CALIBRATION_QUESTIONS,
        help="GSM8K questions (from line 1000 on) that kvcmas learns its corrections from before the demo",
    )
    p.add_argument(
        "--calibration",
        type=output_file,
        default=None,
        help="file of kvcmas' learned corrections: loaded when it exists (no calibration run), else written after it",
    )
    p.add_argument(
        "--recompute",
        type=float,
        default=0.0,
        help="kvcmas' recompute budget: share of the shared rows later agents recompute (0..1, docs/recompute.md)",
    )
    p.add_argument("--image", default=None, help="an image every agent reads with the question (needs --mmproj)")
    p.add_argument("--mmproj", default=None, help="the vision tower + projector GGUF for --image")
    p.add_argument("--json", action="store_true", help="print the per-hop rows as JSON at the end")


@dataclass
class Hop:
    question: int
    method: str
    response: Response


def _progress(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)


def run_team(
    model: Model,
    task: Task,
    method: str,
    example: Example,
    max_tokens: int,
    calibrate: int = CALIBRATION_QUESTIONS,
    estimator: RidgeEstimator | None = None,
    image: tuple[Any, str] | None = None,
    recompute: float = 0.0,
) -> list[Response]:
    """One request: every agent of the task's workflow answers in order over the shared question. kvcmas learns
    each edge's correction from its first `calibrate` dense reads (shared across calls on this model)."""
    workflow = task.workflow()
    entry = registry.method(method)  # a method that learns online calibrates here, or starts from `estimator`
    config = entry.config(for_session=True, calibrate=calibrate, recompute=recompute) if entry.learns_online else None
    learned = estimator if entry.learns_online else None
    vision = image[0] if image else None
    with AgentSession(
        model, method, workflow=f"{task.name}-demo", config=config, estimator=learned, vision=vision
    ) as team:
        agents = [team.agent(a.name, system=a.role, template=a.user_template) for a in workflow.agents]
        team.share(example.question, image=image[1] if image else None)
        return [a.respond(max_tokens=max_tokens) for a in agents]


def _short(text: str, width: int = 160) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def run_demo(args: argparse.Namespace) -> int:
    if args.questions < 1 or args.max_tokens < 1 or args.calibrate < 0 or not 0.0 <= args.recompute <= 1.0:
        raise ValueError("--questions and --max-tokens must be >= 1, --calibrate >= 0, --recompute in [0, 1]")
    if (args.image is None) != (args.mmproj is None):
        raise ValueError(
            "--image and --mmproj go together (no vision-language weights ship with kvcmas: see docs/vision.md)"
        )
    model = Model(resolve_model_path(args.model), n_threads=args.threads, kv_type=args.kv_type)
    image = None
    if args.image is not None:
        from ..vision import VisionEncoder

        encoder = VisionEncoder(args.mmproj, n_threads=args.threads)
        width, height = encoder.load(args.image).size  # a bad image fails here, before any work
        image = (encoder, args.image)
        n_rows = encoder.n_image_tokens(width, height)
        print(f"image: {args.image} ({n_rows} image tokens per agent prompt)", file=sys.stderr)
    task = get_task("gsm8k")
    examples = task.load(args.start, args.questions)
    print(f"model: {model.path} ({model.arch}, {model.n_layer} layers, {model.n_threads} threads)", file=sys.stderr)
    names = [a.name for a in task.workflow().agents]
    print(f"team: {' -> '.join(names)} (fully connected; the decision agent reads everyone)", file=sys.stderr)

    estimator = RidgeEstimator(rank=8)
    if args.calibration and Path(args.calibration).is_file():
        estimator = load_ridge(args.calibration, model)
        print(f"kvcmas corrections loaded from {args.calibration}", file=sys.stderr)
    elif args.calibrate:
        bar = _progress(args.calibrate, "kvcmas learns its corrections")
        for ex in task.load(CALIBRATION_OFFSET, args.calibrate):
            # replies as long as the demo's: the maps of the reply spans' edges are fitted on the replies they correct
            run_team(model, task, "kvcmas", ex, args.max_tokens, args.calibrate, estimator, image)
            bar.update()
        bar.close()
        if args.calibration:
            save_ridge(estimator, args.calibration, model)
            print(f"kvcmas corrections saved to {args.calibration}", file=sys.stderr)

    hops: list[Hop] = []
    bar = _progress(len(examples) * len(METHODS), "questions x methods")
    for qi, ex in enumerate(examples):
        for method in METHODS:
            team = run_team(model, task, method, ex, args.max_tokens, args.calibrate, estimator, image, args.recompute)
            for r in team:
                hops.append(Hop(qi, method, r))
            bar.update()
    bar.close()

    correct = {m: 0 for m in METHODS}
    base = {(h.question, h.response.agent): h.response for h in hops if h.method == "nonshared"}
    fidelity: dict[tuple[int, str], dict[str, Any]] = {}  # (question, agent) -> kvcmas' reply vs nonshared's
    for qi in range(len(examples)):
        mine = [h.response for h in hops if h.question == qi and h.method == "kvcmas"]
        for f, r in zip(compare([base[(qi, r.agent)] for r in mine], mine), mine, strict=True):
            fidelity[(qi, r.agent)] = f

    def same_answer(h: Hop) -> bool:
        return task.extract(h.response.text) == task.extract(base[(h.question, h.response.agent)].text)

    for qi, ex in enumerate(examples):
        print(f"\nQuestion {args.start + qi}: {_short(ex.question, 300)}")
        print(f"reference answer: {ex.reference}")
        for name in names:
            row = {h.method: h for h in hops if h.question == qi and h.response.agent == name}
            answers = ", ".join(f"{m}: {task.extract(row[m].response.text) or '-'}" for m in METHODS)
            same = "same answer" if same_answer(row["kvcmas"]) else "DIFFERENT answer"
            reply = "identical reply" if fidelity[(qi, name)]["identical"] else "reply differs"
            print(f"  {name} [{answers}] kvcmas: {same} as nonshared, {reply}")
            print(f"    {_short(row['kvcmas'].response.text)}")
        for m in METHODS:
            final = next(
                h.response for h in hops if h.question == qi and h.method == m and h.response.agent == names[-1]
            )
            correct[m] += task.score(ex, final.text)

    print("\nper hop (fidelity: kvcmas against nonshared's hop; KL and top-1 of the first token while the prompt is")
    print("still identical, i.e. every upstream reply was identical):")
    print(
        "| question | agent | method | mode | TTFT ms | computed (recomputed) | reused | KV MiB | correction KiB "
        "| answer = nonshared | reply = nonshared | first-token KL | top-1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for h in hops:
        s = h.response.stats
        fid = fidelity.get((h.question, s.agent), {}) if h.method == "kvcmas" else {"identical": True}
        kl = f"{fid['kl']:.1e}" if "kl" in fid else "-"
        top1 = ("yes" if fid["top1"] else "no") if "top1" in fid else "-"
        print(
            f"| {args.start + h.question} | {s.agent} | {s.method} | {s.mode} | {s.ttft_ms:.0f} | {s.computed_tokens} "
            f"({s.recomputed_tokens}) | {s.reused_tokens} | {s.kv_bytes / 2**20:.2f} | {s.corr_bytes / 2**10:.0f} "
            f"| {'yes' if same_answer(h) else 'NO'} | {'yes' if fid['identical'] else 'no'} | {kl} | {top1} |"
        )

    print("\nsummary (later agents = every agent after the first):")
    print(
        "| method | later-agent TTFT ms | vs nonshared | prompt tokens computed | KV MiB per request | accuracy "
        "| later answers = nonshared | later replies identical | first-token KL (aligned hops) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    base_ttft = 0.0
    for m in METHODS:
        later_hops = [h for h in hops if h.method == m and h.response.agent != names[0]]
        later = [h.response.stats for h in later_hops]
        every = [h.response.stats for h in hops if h.method == m]
        ttft = sum(s.ttft_ms for s in later) / len(later)
        base_ttft = base_ttft or ttft
        kv = sum(s.kv_bytes for s in every) / len(examples)
        computed = sum(s.computed_tokens for s in every)
        fid_cols = "- | - | -"
        if m != "nonshared":
            later_f = [fidelity[(h.question, h.response.agent)] for h in later_hops]
            kls = [f["kl"] for f in later_f if "kl" in f]
            kl = f"{sum(kls) / len(kls):.1e} ({len(kls)})" if kls else "-"
            n_same = sum(same_answer(h) for h in later_hops)
            fid_cols = f"{n_same}/{len(later_hops)} | {sum(f['identical'] for f in later_f)}/{len(later_f)} | {kl}"
        print(
            f"| {m} | {ttft:.0f} | {base_ttft / ttft:.2f}x | {computed} | {kv / 2**20:.1f} "
            f"| {correct[m]}/{len(examples)} | {fid_cols} |"
        )
    if args.json:
        rows = [{"question": args.start + h.question, **h.response.stats.as_dict()} for h in hops]
        print(json.dumps(rows, indent=1))
    return 0
