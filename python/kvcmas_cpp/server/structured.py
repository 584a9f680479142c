"""What a chat request asks of its output beyond text: tool calls (parsed from the output in the model family's
format; forced by constrained decoding under tool_choice "required" or a named function), structured output
(response_format json_object / json_schema, constrained decoding), and a thinking model's reasoning split off. The
logic is kvcmas_cpp.constrained.output_constraint, kvcmas_cpp.tools.tool_format_of and kvcmas_cpp.reasoning, shared
with Model.chat; this maps a request body onto them and their errors onto 400s."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..constrained import Constraint, GrammarError, output_constraint
from ..model import Model
from ..reasoning import THINK_CLOSE, opens_thinking, thinks
from ..tools import tool_format_of
from .choices import ReplyFormat
from .schemas import ChatCompletionRequest
from .validation import ApiError


@dataclass
class OutputPlan:
    """constraint: the grammar the output follows (None: free text). reply: how the reply is read (the tool names
    whose calls are parsed, in which format; reasoning)."""

    constraint: Constraint | None = None
    reply: ReplyFormat = field(default_factory=ReplyFormat)


def output_plan(body: ChatCompletionRequest, model: Model, prompt_ids: Sequence[int]) -> OutputPlan:
    """The request's tool and response_format settings, and the model's reasoning, as an OutputPlan. prompt_ids:
    the rendered prompt (its end says whether the reply starts inside a reasoning block). Raises ApiError 400 for a
    schema the grammar compiler refuses or settings that contradict each other."""
    template = model.tokenizer.chat_template
    tool_format = tool_format_of(template)
    reasoning = thinks(template)
    opened = reasoning and opens_thinking(model.detokenize(list(prompt_ids[-16:])))
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
            tool_format,
            THINK_CLOSE + "\n\n" if opened else "",
        )
    except GrammarError as e:
        raise ApiError(400, f"{e.param or 'request'}: {e}", "invalid_schema", e.param) from None
    except ImportError:
        message = "structured output and forced tool calls need the llguidance package"
        raise ApiError(400, message, "unsupported", "response_format") from None
    return OutputPlan(constraint, ReplyFormat(names, tool_format, reasoning, opened))
