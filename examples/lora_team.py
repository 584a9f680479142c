"""A team whose agents run with their own LoRA adapters over one shared task, in process (no server), offline.

Three agents (planner, critic, writer: the roles of examples/shared.py) each run with a different adapter of one base
model. The task is computed once, by the first agent with its adapter; the later agents read it, and the replies
before them, by reference, and kvcmas corrects what another adapter's rows would get wrong for them (its maps are
learned per pair of adapters, online). The team runs `--rounds` times (fresh sessions of one workflow): the first
round calibrates the edges (its readers share without correction and learn from exact rows computed after their
reply), the later ones reuse with the learned corrections. Each agent's line says what its call computed and read.

Without --adapter, the adapters are RANDOM (rank 8 on every linear layer, written to a temporary folder and
deleted at the end): they change the model's output as a fine-tune would, but were trained on nothing, so expect the
replies of a small base model with a random twist. Bring real ones with `--adapter NAME=FILE.gguf` (three times;
`kvcmas convert-lora PEFT_DIR --base MODEL -o FILE.gguf` makes one from a PEFT folder).

    python examples/lora_team.py                      # the default model (SmolLM2-135M), random adapters
    python examples/lora_team.py --model base.gguf --adapter planner=p.gguf --adapter critic=c.gguf \\
        --adapter writer=w.gguf --method fullshared
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import kvcmas_cpp as kc
from kvcmas_cpp.agents import AgentSession
from kvcmas_cpp.bench.lora import write_random_adapter
from kvcmas_cpp.model import resolve_model_path
from shared import ROLES, TASK


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF base model (default: the default model)")
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="a GGUF LoRA adapter of the model, one per role in order (default: three random ones)",
    )
    p.add_argument("--method", default="kvcmas", choices=("nonshared", "fullshared", "kvcmas", "kvcomm"))
    p.add_argument("--rounds", type=int, default=2, help="runs of the team (the first one calibrates kvcmas)")
    p.add_argument("--max-tokens", type=int, default=48, help="most tokens per reply")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print each call's figures as one JSON line as well")
    args = p.parse_args()
    if args.adapter and len(args.adapter) != len(ROLES):
        p.error(f"--adapter: give one per role ({len(ROLES)}), or none for random ones")
    if args.rounds < 1 or args.max_tokens < 1:
        p.error("--rounds and --max-tokens must be at least 1")
    return args


def load_adapters(model: kc.Model, model_path: str, given: list[str], folder: Path) -> list[str]:
    """The adapters' names, one per role: the files given (NAME=FILE), or random ones written to `folder`."""
    names = []
    if given:
        for item in given:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise SystemExit(f"--adapter {item!r}: expected NAME=FILE")
            model.load_adapter(path, name=name)
            names.append(name)
        return names
    print("using RANDOM LoRA adapters (rank 8, all linear layers; trained on nothing) - see --adapter")
    for seed, (role, _) in enumerate(ROLES):
        path = folder / f"{role}-random.gguf"
        write_random_adapter(model_path, 8, path, seed=seed)
        model.load_adapter(path, name=f"{role}-random")
        names.append(f"{role}-random")
    return names


def main() -> None:
    args = arguments()
    model_path = resolve_model_path(args.model)
    model = kc.Model(model_path, n_threads=args.threads, n_ctx=4096)
    with tempfile.TemporaryDirectory(prefix="kvcmas-lora-team-") as tmp:  # kept while agents run: maps key on files
        adapters = load_adapters(model, model_path, args.adapter, Path(tmp))
        for round_ in range(1, args.rounds + 1):
            print(f"\n== round {round_} ({args.method}) ==")
            with AgentSession(model, args.method, workflow="lora-team-example", calibration_dir=False) as team:
                agents = [
                    team.agent(role, system=prompt, adapter=adapter)
                    for (role, prompt), adapter in zip(ROLES, adapters, strict=True)
                ]
                team.share(TASK, label="Task")
                for agent in agents:
                    r = agent.respond(max_tokens=args.max_tokens)
                    s = r.stats
                    print(f"-- {agent.name} (adapter {agent.adapter}): {r.text.strip()!r}")
                    print(
                        f"   prompt {s.prompt_tokens} tokens: computed {s.computed_tokens}, read from other agents' "
                        f"spans {s.span_tokens}, prefix cache {s.prefix_cached_tokens}; {s.mode} ({s.gate}), "
                        f"correction rank {s.corr_rank}, TTFT {s.ttft_ms:.0f} ms"
                    )
                    if args.json:
                        print(json.dumps({"round": round_, "adapter": agent.adapter, **s.as_dict()}))


if __name__ == "__main__":
    main()
