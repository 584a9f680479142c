"""Chat on a Model: rendering messages with the model's chat template, and Model.chat (the OpenAI chat options:
tools, response_format, logprobs, reasoning) on top of Model.generate."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..chat import RESERVED_TEMPLATE_VARIABLES, TEMPLATE_KWARGS_KEY, ChatTemplateError, normalize_messages, render_chat
from ..token_stream import Completion, CompletionChunk
from ..tokenizer import Tokenizer

if TYPE_CHECKING:
    from .model import Model


def chat_prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat prompt: special tokens parsed, BOS first when the model wants it and the template
    did not write it."""
    ids = tokenizer.encode(text, add_special=False, parse_special=True)
    bos = tokenizer.bos_id
    if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids = [bos, *ids]
    return ids


def render_chat_prompt(
    model: Model,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Model.apply_chat_template (see there)."""
    from ..tools import model_messages

    normalize_messages(messages)  # the messages' faults first, without the file's name: what follows is the file's
    tok = model.tokenizer
    carried = next((m.get(TEMPLATE_KWARGS_KEY) for m in messages if isinstance(m, dict)), None)
    extra: dict[str, Any] = {**(carried or {}), **(template_kwargs or {})}
    if carried is not None:
        messages = [{k: v for k, v in m.items() if k != TEMPLATE_KWARGS_KEY} for m in messages]
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(extra))
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them")
    messages, tools = model_messages(messages, tok.chat_template)
    if tools is not None:
        extra["tools"] = tools
    try:
        return render_chat(
            tok.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
            eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
            **extra,
        )
    except ChatTemplateError as e:  # the file's template failed (or refused the messages): say which file
        raise ChatTemplateError(f"{os.path.basename(model.path)}: {e}") from None  # by name: servers show it


def chat_completion(
    model: Model,
    messages: list[dict[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool,
    response_format: Mapping[str, Any] | None,
    top_logprobs: int | None,
    **kwargs: Any,
) -> Completion | Iterator[CompletionChunk]:
    """Model.chat (see there)."""
    from ..constrained import output_constraint
    from ..reasoning import THINK_CLOSE, opens_thinking, split_reasoning, thinks
    from ..tools import parse_tool_calls, render_tool_messages, tool_format_of

    if isinstance(kwargs.get("logprobs"), bool):
        kwargs["logprobs"] = (top_logprobs or 0) if kwargs["logprobs"] else None
    template_kwargs = kwargs.pop("chat_template_kwargs", None)
    text = model.apply_chat_template(render_tool_messages(messages, tools), True, template_kwargs)
    reasoning = thinks(model.tokenizer.chat_template)
    opened = reasoning and opens_thinking(text)
    fmt = tool_format_of(model.tokenizer.chat_template)
    constraint, names = (None, None)
    if tools or response_format:
        constraint, names = output_constraint(
            model.tokenizer,
            model.n_vocab,
            tools,
            tool_choice,
            response_format,
            parallel_tool_calls,
            fmt,
            THINK_CLOSE + "\n\n" if opened else "",
        )
    ids = chat_prompt_ids(model.tokenizer, text)
    out = model.generate(ids, constraint=constraint, **kwargs)
    if isinstance(out, Completion) and reasoning:
        out.reasoning_content, out.text = split_reasoning(out.text, opened)
    if isinstance(out, Completion) and names is not None:
        content, calls = parse_tool_calls(out.text, names, fmt)
        if calls:
            out.text, out.tool_calls = content or "", calls
            out.finish_reason = "tool_calls" if out.finish_reason == "stop" else out.finish_reason
    return out
