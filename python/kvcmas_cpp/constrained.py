"""Grammar-constrained decoding: structured output (JSON objects, JSON Schema) and forced tool calls.

The grammars come from llguidance (https://github.com/guidance-ai/llguidance), which compiles JSON Schema and Lark
grammars and computes, per generated token, the set of tokens that keep the output inside the grammar. Nothing here
writes a JSON grammar by hand: JSON Schema goes to llguidance's JSON compiler, and a tool call is a two-line Lark
grammar around llguidance's `%json` (the same JSON compiler). docs/openai-surface.md says why llguidance rather than
xgrammar (measured with `python -m kvcmas_cpp.bench.constrained`).

One Constraint follows one generation: `allowed()` is the mask for the next token, `accept(token)` advances it,
`finished` is true once the grammar admits nothing more (the generation ends there).
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._native import KvcmasError
from .tokenizer import Tokenizer
from .tools import HERMES, ToolFormat

__all__ = [
    "Constraint",
    "GrammarError",
    "json_object_grammar",
    "json_schema_grammar",
    "output_constraint",
    "tool_call_grammar",
]

# Compact JSON with the separators json.dumps writes by default: a call the model generates reads back as the same
# text when it is rendered again (a tool call in a later prompt is then a span the sharing session already holds),
# and a small model cannot wander off into unbounded whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"


class GrammarError(KvcmasError):
    """A schema or grammar llguidance cannot compile, or output settings that contradict each other (the message
    says why; param names the request field: "tools", "tool_choice" or "response_format")."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


_DEAD_END = "the grammar reached a dead end: no token can continue the output"
PROBE_STEPS = 8  # tokens a new constraint walks into its grammar to meet llguidance's size limits before generating
_LIMIT = re.compile(r"max is|limit|fuel|too many|too large", re.IGNORECASE)  # llguidance's size-limit errors


class ConstraintDeadEnd(KvcmasError):
    """The grammar reached a state that no token continues (a schema with no value, such as a required property that
    only refers to itself): the request's output settings are at fault, not the model."""


def _closed_objects(schema: Any, close: bool = True) -> Any:
    """The schema with `additionalProperties: false` on every object schema that lists properties and does not
    say: what is generated still validates against the original schema (a subset of what it allows), and a small
    model does not go on inventing keys. The parts of an allOf stay open (closing one would refuse the properties
    the others add)."""
    if isinstance(schema, list):
        return [_closed_objects(s, close) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("const", "enum", "default", "examples"):
            out[key] = value
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _closed_objects(sub) for name, sub in value.items()}
        else:
            out[key] = _closed_objects(value, close and key != "allOf")
    if close and isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _with_options(schema: Mapping[str, Any]) -> dict[str, Any]:
    out = _closed_objects(dict(schema))
    out["x-guidance"] = {**JSON_OPTIONS, **out.get("x-guidance", {})}
    return out


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    """The llguidance grammar of JSON documents valid under schema (a JSON Schema object)."""
    if not isinstance(schema, Mapping):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    import llguidance

    try:
        grammar: str = llguidance.LLMatcher.grammar_from_json_schema(_with_options(schema))
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}", "response_format") from None
    return grammar


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    return json_schema_grammar({"type": "object"})


def tool_call_grammar(
    tools: Sequence[Mapping[str, Any]],
    parallel: bool = True,
    fmt: ToolFormat = HERMES,
    prefix: str = "",
    tok: Tokenizer | None = None,
) -> str:
    """One or more (parallel) calls of the given functions (OpenAI tool objects {"type": "function", "function":
    {"name", "parameters"}}) in the model family's format fmt (kvcmas_cpp.tools.ToolFormat: hermes
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, llama3 `{"name": ..., "parameters": {...}}`,
    mistral `[TOOL_CALLS][...]`, phi4_mini `functools[...]`), the arguments valid under each function's parameters
    schema. prefix: text written first (`</think>` when the prompt left a reasoning block open). tok: the model's
    tokenizer, when known: a marker that is one special token of its vocabulary (Mistral's `[TOOL_CALLS]`) is
    written as that token, as the model writes it, not spelled out in text pieces."""
    calls = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, fmt.args_key: params},
                "required": ["name", fmt.args_key],
            }
        )
    if not calls:
        raise GrammarError("no function to call")
    schema = _with_options(calls[0] if len(calls) == 1 else {"anyOf": calls})
    call = f"{_lark_text(fmt.call_open, tok)} %json {json.dumps(schema)} {_lark_text(fmt.call_close, tok)}"
    more = f"({_lark_text(fmt.separator, tok)} call)*" if parallel else ""
    start = f"start: {_lark_text(prefix + fmt.prefix, tok)} call {more} {_lark_text(fmt.suffix, tok)}"
    import llguidance

    return str(llguidance.LLMatcher.grammar_from_lark(f"{start}\ncall: {call}\n"))


def _lark_text(text: str, tok: Tokenizer | None = None) -> str:
    """text in a Lark rule ("" for none): literals, and the special tokens of tok's vocabulary written in it as
    those tokens (llguidance's `<[id]>`)."""
    pieces = tok.split_special(text) if tok is not None else [text]
    return " ".join(f"<[{p}]>" if isinstance(p, int) else json.dumps(p) for p in pieces if p != "")


def _after(prefix: str, schema: Mapping[str, Any], tok: Tokenizer | None = None) -> str:
    """JSON under schema, written after prefix."""
    import llguidance

    try:
        lark = f"start: {_lark_text(prefix, tok)} %json {json.dumps(_with_options(schema))}\n"
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}", "response_format") from None


class _TokenizerAdapter:
    """What llguidance.TokenizerWrapper reads: the bytes of every token, the special ones, and an encoder."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tokenizer = tok
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else next(iter(tok.eog_ids), 0)
        self.bos_token_id = tok.bos_id
        self.tokens = [tok.token_to_piece(i) for i in range(tok.n_vocab)]
        self.special_token_ids = [i for i in range(tok.n_vocab) if tok.is_special(i)]

    def __call__(self, text: bytes | str) -> list[int]:
        s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self.tokenizer.encode(s, add_special=False, parse_special=False)


_LL_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, Any] = weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()


def _ll_tokenizer(tok: Tokenizer) -> Any:
    """llguidance's view of the vocabulary, built once per tokenizer (about a second for 49k tokens)."""
    import llguidance

    with _LL_LOCK:
        ll = _LL_TOKENIZERS.get(tok)
        if ll is None:
            wrapper = llguidance.TokenizerWrapper(_TokenizerAdapter(tok))
            ll = llguidance.LLTokenizer(wrapper, n_vocab=tok.n_vocab, eos_token=sorted(tok.eog_ids))
            _LL_TOKENIZERS[tok] = ll
        return ll


def _first_line(error: str) -> str:
    """llguidance's error without the parser-state dump it appends (grammar internals, many lines)."""
    return error.strip().splitlines()[0] if error.strip() else "unknown error"


class Constraint:
    """The tokens a grammar allows next, for one generation.

    tok: the model's tokenizer. grammar: from json_schema_grammar / json_object_grammar / tool_call_grammar.
    n_logits: the length of the logits rows (the model's n_vocab; ids past the tokenizer's are never allowed).
    Raises GrammarError when llguidance refuses the grammar (e.g. an unsupported schema keyword).
    """

    def __init__(self, tok: Tokenizer, grammar: str, n_logits: int | None = None, _matcher: Any = None) -> None:
        import llguidance

        self.tokenizer = tok
        self.grammar = grammar
        self.n_logits = n_logits or tok.n_vocab
        fresh = _matcher is None
        if _matcher is None:
            _matcher = llguidance.LLMatcher(_ll_tokenizer(tok), grammar, log_level=0)
            if _matcher.is_error():
                raise GrammarError(_first_line(_matcher.get_error()))
        self._matcher = _matcher
        self._bits = np.zeros((tok.n_vocab + 31) // 32, dtype=np.int32)
        if fresh:
            # A grammar with no output at all ({"$ref": "#"}) fails at the first mask: refuse it here, as the
            # caller's error, rather than in the middle of sampling.
            try:
                self.allowed()
            except ConstraintDeadEnd:
                raise GrammarError("it admits no output: no token can start one") from None
            self._probe()

    def _probe(self) -> None:
        """Walks PROBE_STEPS tokens into the grammar (each time the first token it allows) on a copy: a schema past
        llguidance's size limits (a parser row of more items than it takes: an anyOf of thousands of objects) is
        refused now, by GrammarError, not as a dead end once the request is generating."""
        walk = Constraint(self.tokenizer, self.grammar, self.n_logits, self._matcher.deep_copy())
        try:
            for _ in range(PROBE_STEPS):
                mask = walk.allowed()
                mask[sorted(self.tokenizer.eog_ids)] = False
                if walk.finished or not mask.any():
                    return
                walk.accept(int(np.argmax(mask)))
        except ConstraintDeadEnd as e:
            if _LIMIT.search(str(e)):
                cause = str(e).split("(llguidance: ", 1)[-1].rstrip(")")
                raise GrammarError(f"it is larger than llguidance's limits allow ({cause})") from None

    def fork(self) -> Constraint:
        """An independent copy in the same state (the n > 1 choices of one request)."""
        return Constraint(self.tokenizer, self.grammar, self.n_logits, self._matcher.deep_copy())

    def allowed(self) -> np.ndarray:
        """Bool mask (n_logits,) of the tokens that may come next (end-of-generation tokens once the output is
        complete). Raises ConstraintDeadEnd when no token can continue the output."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._matcher.is_error():
            raise ConstraintDeadEnd(f"{_DEAD_END} (llguidance: {_first_line(self._matcher.get_error())})")
        mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little").astype(bool)
        if mask.shape[0] >= self.n_logits:
            mask = mask[: self.n_logits]
        else:
            mask = np.concatenate([mask, np.zeros(self.n_logits - mask.shape[0], dtype=bool)])
        if not mask.any():
            raise ConstraintDeadEnd(_DEAD_END)
        return mask

    def accept(self, token: int) -> None:
        """Advances past a generated token (an end-of-generation token ends the output); raises ConstraintDeadEnd
        when the grammar refuses it."""
        if token in self.tokenizer.eog_ids or self._matcher.is_stopped():
            return
        if not self._matcher.consume_token(int(token)):
            raise ConstraintDeadEnd(f"{_DEAD_END} (llguidance: {_first_line(self._matcher.get_error())})")

    @property
    def finished(self) -> bool:
        """True once the grammar admits no further token: the output is complete."""
        return bool(self._matcher.is_stopped())


def output_constraint(
    tok: Tokenizer,
    n_logits: int,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    response_format: Mapping[str, Any] | None = None,
    parallel_tool_calls: bool = True,
    fmt: ToolFormat = HERMES,
    prefix: str = "",
) -> tuple[Constraint | None, frozenset[str] | None]:
    """OpenAI's output settings (tools, tool_choice, response_format, as their JSON objects) -> (the constraint the
    output follows or None, the names of the tools whose calls are read from the output or None).

    tool_choice "required" or a named function forces a call (constrained); "auto" (the default with tools) leaves
    the output free and reads calls from it; "none" reads none. response_format json_object / json_schema
    constrains the output to JSON. fmt: the model family's tool-call format (forced calls are written in it);
    prefix: what the output must start with (`</think>` when the prompt left a reasoning block open, so that the
    call or the JSON is the answer, not reasoning). Raises GrammarError (with .param) for schemas llguidance cannot
    compile and contradicting settings."""
    tools = list(tools or [])
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or tool.get("type") != "function" or not isinstance(fn.get("name"), str):
            raise GrammarError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
    names = [t["function"]["name"] for t in tools]
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise GrammarError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        forced = [t for t in tools if t["function"]["name"] == name]
    elif choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise GrammarError("tool_choice 'required' needs tools", "tool_choice")
        forced = tools if choice == "required" else []
    else:
        raise GrammarError(f"tool_choice must be 'auto', 'none', 'required' or a named function, got {choice!r}")
    fmt_type = (response_format or {}).get("type", "text")
    if fmt_type not in ("text", "json_object", "json_schema"):
        raise GrammarError(f"response_format type must be text, json_object or json_schema, got {fmt_type!r}")
    grammar: str | None = None
    param = "tools"
    if forced:
        if fmt_type != "text":
            raise GrammarError("response_format cannot be combined with a forced tool call", "response_format")
        grammar = tool_call_grammar(forced, parallel_tool_calls, fmt, prefix, tok)
    elif fmt_type == "json_object":
        param = "response_format"
        grammar = _after(prefix, {"type": "object"}, tok) if prefix else json_object_grammar()
    elif fmt_type == "json_schema":
        param = "response_format"
        spec = (response_format or {}).get("json_schema")
        if not isinstance(spec, Mapping):
            raise GrammarError("response_format json_schema needs a 'json_schema' object", param)
        schema = spec.get("schema") or {}
        grammar = _after(prefix, schema, tok) if prefix and isinstance(schema, Mapping) else json_schema_grammar(schema)
    try:
        constraint = Constraint(tok, grammar, n_logits) if grammar is not None else None
    except GrammarError as e:
        raise GrammarError(f"the schema cannot be compiled to a grammar: {e}", param) from None
    return constraint, (frozenset(names) if names and choice != "none" else None)
