"""What a chat request asks of its output beyond text: tool calls (parsed from the output; forced by constrained
decoding under tool_choice "required" or a named function) and structured output (response_format json_object /
json_schema, constrained decoding). The grammars are llguidance's (kvcmas_cpp.constrained)."""

from __future__ import annotations

from dataclasses import dataclass

from ..constrained import Constraint, GrammarError, json_object_grammar, json_schema_grammar, tool_call_grammar
from ..model import Model
from .schemas import ChatCompletionRequest, NamedToolChoice
from .validation import ApiError


@dataclass
class OutputPlan:
    """constraint: the grammar the output follows (None: free text). parse_tools: the tool names whose calls are
    read from the output (None: no tool-call parsing)."""

    constraint: Constraint | None = None
    parse_tools: frozenset[str] | None = None


def output_plan(body: ChatCompletionRequest, model: Model) -> OutputPlan:
    """The request's tool and response_format settings as an OutputPlan. Raises ApiError 400 for a schema the
    grammar compiler refuses or settings that contradict each other."""
    tools = body.tool_dicts() or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    fmt = body.response_format
    grammar: str | None = None
    param = "tools"
    try:
        if tools and choice != "none":
            if isinstance(choice, NamedToolChoice):
                forced = [t for t in tools if t["function"]["name"] == choice.function.name]
            else:
                forced = tools if choice == "required" else []
            if forced:
                if fmt is not None and fmt.type != "text":
                    raise ApiError(
                        400,
                        "response_format cannot be combined with a forced tool call (tool_choice)",
                        "invalid_request",
                        "response_format",
                    )
                grammar = tool_call_grammar(forced, body.parallel_tool_calls is not False)
        if grammar is None and fmt is not None and fmt.type != "text":
            param = "response_format"
            if fmt.type == "json_object":
                grammar = json_object_grammar()
            else:
                assert fmt.json_schema is not None
                grammar = json_schema_grammar(fmt.json_schema.schema_ or {})
        constraint = Constraint(model.tokenizer, grammar, model.n_vocab) if grammar is not None else None
    except GrammarError as e:
        message = f"{param}: the schema cannot be compiled to a grammar: {e}"
        raise ApiError(400, message, "invalid_schema", param) from None
    except ImportError:
        raise ApiError(
            400, "structured output and forced tool calls need the llguidance package", "unsupported", param
        ) from None
    names = frozenset(t["function"]["name"] for t in tools) if tools and choice != "none" else None
    return OutputPlan(constraint, names)
