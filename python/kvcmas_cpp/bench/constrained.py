"""`kvcmas bench constrained`: what grammar-constrained decoding costs at batch 1, and which library covers which
JSON Schema features.

Decode: the same greedy loop (one token per engine call) with and without a JSON-schema constraint; each token's
time is split into the engine step and the mask (llguidance's mask, its unpacking and the advance), so the overhead
is the mask time over the engine time. Coverage: a set of schemas using common JSON Schema features, compiled by
llguidance and (when installed) xgrammar, with compile time and the median per-token mask time over a short
random walk through the grammar.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

from ..model import Model, resolve_model_path
from ..sampling import Sampler, SamplingParams

SCHEMAS: dict[str, dict[str, Any]] = {
    "object": {"type": "object"},
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "enum+array+bounds": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["tags", "score"],
    },
    "$ref+anyOf null": {
        "$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
        "type": "object",
        "properties": {
            "pts": {"type": "array", "items": {"$ref": "#/$defs/p"}},
            "label": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
        "required": ["pts", "label"],
    },
    "pattern+format": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "when": {"type": "string", "format": "date"},
            "email": {"type": "string", "format": "email"},
        },
        "required": ["id", "when", "email"],
    },
    "oneOf+const": {
        "oneOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "a"}, "v": {"type": "integer"}},
                "required": ["kind", "v"],
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "b"}, "s": {"type": "string", "minLength": 2, "maxLength": 5}},
                "required": ["kind", "s"],
            },
        ]
    },
    "recursive": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                "required": ["v"],
            }
        },
        "$ref": "#/$defs/node",
    },
    "allOf": {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"type": "boolean"}}},
        ]
    },
    "if/then": {"type": "object", "if": {"properties": {"k": {"const": 1}}}, "then": {"required": ["x"]}},
}

DECODE_SCHEMA = {  # long-lived: a list of strings keeps the constraint active for the whole run
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}}},
    "required": ["items"],
}


def add_constrained_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded per run")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3, help="runs per mode; the fastest counts")
    p.add_argument("--json", action="store_true")


def _decode_run(model: Model, prompt: list[int], n_tokens: int, constrained: bool) -> tuple[float, float]:
    """(engine ms per token, mask ms per token) over n_tokens greedy steps."""
    from ..constrained import Constraint, json_schema_grammar

    tok = model.tokenizer
    grammar = json_schema_grammar(DECODE_SCHEMA)
    constraint = Constraint(tok, grammar, model.n_vocab) if constrained else None
    sampler = Sampler(SamplingParams(temperature=0))
    engine_s = mask_s = 0.0
    with model.new_sequence() as seq:
        logits = seq.append(prompt, logits="last")
        for _ in range(n_tokens):
            t0 = time.perf_counter()
            allowed = constraint.allowed() if constraint is not None else None
            assert logits is not None
            token = sampler.sample(logits, (), allowed)
            if token in tok.eog_ids or (constraint is not None and constraint.finished):
                token = tok.encode(" ", add_special=False)[0]  # keep the engine busy the same number of steps
                constraint = Constraint(tok, grammar, model.n_vocab) if constraint is not None else None
            elif constraint is not None:
                constraint.accept(token)
            t1 = time.perf_counter()
            logits = seq.append([token], logits="last")
            engine_s += time.perf_counter() - t1
            mask_s += t1 - t0
    return engine_s * 1000.0 / n_tokens, mask_s * 1000.0 / n_tokens


def _llguidance_coverage(model: Model, schema: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    from ..constrained import Constraint, GrammarError, json_schema_grammar

    t0 = time.perf_counter()
    try:
        c = Constraint(model.tokenizer, json_schema_grammar(schema), model.n_vocab)
    except GrammarError as e:
        return {"ok": False, "error": str(e)[:80]}
    compile_ms = (time.perf_counter() - t0) * 1000.0
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        allowed = c.allowed()
        times.append(time.perf_counter() - t0)
        ids = np.flatnonzero(allowed)
        token = int(rng.choice(ids))
        if token in model.tokenizer.eog_ids or c.finished:
            break
        c.accept(token)
    return {"ok": True, "compile_ms": compile_ms, "mask_us": statistics.median(times) * 1e6}


def _xgrammar_coverage(
    model: Model, schema: dict[str, Any], rng: np.random.Generator, state: dict[str, Any]
) -> dict[str, Any]:
    try:
        import xgrammar as xgr
    except ImportError:
        return {"ok": None, "error": "not installed"}
    tok = model.tokenizer
    if "compiler" not in state:
        pieces = [tok.token_to_piece(i) for i in range(tok.n_vocab)]
        info = xgr.TokenizerInfo(
            pieces, vocab_type=xgr.VocabType.RAW, vocab_size=model.n_vocab, stop_token_ids=sorted(tok.eog_ids)
        )
        state["compiler"] = xgr.GrammarCompiler(info, max_threads=1)
    t0 = time.perf_counter()
    try:
        compiled = state["compiler"].compile_json_schema(json.dumps(schema), any_whitespace=False)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses for unsupported schemas
        return {"ok": False, "error": str(e).splitlines()[0][:80]}
    compile_ms = (time.perf_counter() - t0) * 1000.0
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, model.n_vocab)
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[: model.n_vocab].astype(bool)
        times.append(time.perf_counter() - t0)
        token = int(rng.choice(np.flatnonzero(bits)))
        if token in tok.eog_ids or matcher.is_terminated():
            break
        matcher.accept_token(token)
    return {"ok": True, "compile_ms": compile_ms, "mask_us": statistics.median(times) * 1e6}


def run_constrained(args: argparse.Namespace) -> int:
    model = Model(resolve_model_path(args.model), n_threads=args.threads)
    tok = model.tokenizer
    text = model.apply_chat_template([{"role": "user", "content": "List some fruits as JSON."}])
    prompt = tok.encode(text, add_special=False, parse_special=True)
    _decode_run(model, prompt, 4, True)  # warm-up: llguidance's tokenizer tables are built once
    plain = min((_decode_run(model, prompt, args.tokens, False) for _ in range(args.rounds)), key=sum)
    masked = min((_decode_run(model, prompt, args.tokens, True) for _ in range(args.rounds)), key=sum)
    decode = {
        "tokens": args.tokens,
        "plain_ms_per_token": plain[0] + plain[1],
        "constrained_ms_per_token": masked[0] + masked[1],
        "engine_ms_per_token": masked[0],
        "mask_ms_per_token": masked[1],
        "mask_overhead": masked[1] / masked[0],
    }
    rng = np.random.default_rng(0)
    state: dict[str, Any] = {}
    coverage = {
        name: {"llguidance": _llguidance_coverage(model, s, rng), "xgrammar": _xgrammar_coverage(model, s, rng, state)}
        for name, s in SCHEMAS.items()
    }
    if args.json:
        print(json.dumps({"decode": decode, "coverage": coverage}, indent=2))
        return 0
    print(f"batch-1 greedy decode, {args.tokens} tokens, {model.n_threads} threads (best of {args.rounds}):")
    print("| mode | ms/token | engine ms | sample + mask ms | mask / engine |")
    print("|---|---|---|---|---|")
    print(f"| plain | {decode['plain_ms_per_token']:.2f} | {plain[0]:.2f} | {plain[1]:.3f} | - |")
    print(
        f"| json_schema | {decode['constrained_ms_per_token']:.2f} | {masked[0]:.2f} | {masked[1]:.3f} | "
        f"{100 * decode['mask_overhead']:.1f}% |"
    )
    print("\nschema coverage: compile ms / median mask us per token (random walk), or the error")
    print("| schema | llguidance | xgrammar |")
    print("|---|---|---|")

    def cell(r: dict[str, Any]) -> str:
        if r["ok"]:
            return f"{r['compile_ms']:.1f} ms / {r['mask_us']:.0f} us"
        return f"no: {r['error']}"

    for name, r in coverage.items():
        print(f"| {name} | {cell(r['llguidance'])} | {cell(r['xgrammar'])} |")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    add_constrained_arguments(p)
    return run_constrained(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
