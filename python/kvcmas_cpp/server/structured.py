"""What a chat request asks of its output beyond text: tool calls (parsed from the output; forced by constrained
decoding under tool_choice "required" or a named function) and structured output (response_format json_object /
json_schema, constrained decoding). The logic is kvcmas_cpp.constrained.output_constraint, shared with Model.chat;
this maps a request body onto it and its errors onto 400s."""

from __future__ import annotations

from dataclasses import dataclass

from ..constrained import Constraint, GrammarError, output_constraint
from ..model import Model
from .schemas import ChatCompletionRequest
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
    choice = body.tool_choice
    fmt = body.response_format
    try:
        constraint, names = output_constraint(
            model.tokenizer,
            model.n_vocab,
            body.tool_dicts(),
            choice.model_dump() if choice is not None and not isinstance(choice, str) else choice,
            fmt.model_dump(by_alias=True) if fmt is not None else None,
            body.parallel_tool_calls is not False,
        )
    except GrammarError as e:
        raise ApiError(400, f"{e.param or 'request'}: {e}", "invalid_schema", e.param) from None
    except ImportError:
        message = "structured output and forced tool calls need the llguidance package"
        raise ApiError(400, message, "unsupported", "response_format") from None
    return OutputPlan(constraint, names)
