"""An agent of a session (a role that reads the shared context and replies), its template's checks and its identity
in the estimator."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypedDict, overload

from .agent_results import Prefilled, Response, ResponseChunk
from .constrained import output_constraint
from .model import CompletionChunk, Model
from .sampling import SamplingParams, TokenLogprob, chat_logprobs, max_tokens_count, stop_strings
from .sharing.workflow import PLACEHOLDER_RE
from .tools import parse_tool_calls, tool_format_of

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .sharing.adapter_views import AgentAdapter


class AgentOwner(Protocol):
    """The session an agent belongs to (agents.AgentSession), as its replies use it."""

    model: Model
    lock: threading.RLock

    def prefill_agent(self, agent: Agent) -> Prefilled: ...

    def finish(self, p: Prefilled, generated: Sequence[int], text: str | None = None) -> None: ...

    def stats_of(self, p: Prefilled, generation_ms: float = 0.0) -> Any: ...

    def release(self, p: Prefilled) -> None: ...


_WORD_IN_BRACES = re.compile(r"\{(\w+)\}")
CONTEXT_PLACEHOLDER = "{context}"  # in a template: every shared item


def check_declaration(name: object, system: object, template: object) -> str:
    """An agent's declaration checked (ValueError naming what is wrong); returns its role prompt ("" for None)."""
    if not isinstance(name, str) or not name:
        raise ValueError("agent: name must be a non-empty string")
    system = "" if system is None else system
    if not isinstance(system, str):
        raise ValueError(f"agent {name!r}: system must be a string, got {type(system).__name__}")
    if template is not None:
        check_template(name, template)
    return system


def check_template(name: str, template: object) -> None:
    """A session agent's template must read the shared context, and a {word} in it must be a placeholder: a typo
    ({contex}) or a template without any would otherwise leave the agent blind to what it is meant to read."""
    if not isinstance(template, str):
        raise ValueError(f"agent {name!r}: template must be a string, got {type(template).__name__}")
    words = _WORD_IN_BRACES.findall(template)
    unknown = [w for w in words if not (f"{{{w}}}" == CONTEXT_PLACEHOLDER or PLACEHOLDER_RE.fullmatch(f"{{{w}}}"))]
    if unknown:
        raise ValueError(
            f"agent {name!r}: the template's {{{unknown[0]}}} is not a placeholder ({{context}}, {{user_question}}, "
            "{agent_<i>_current}, {agent_<i>_history}, {condition_<k>_current}); a template has no escape for a "
            "literal {word}"
        )
    if not words:
        raise ValueError(
            f"agent {name!r}: the template reads nothing shared (no {{context}} or other placeholder), so the agent "
            "would never see the shared context"
        )


def agent_identity(system: str, template: str | None = None) -> str:
    """A reader's key in the estimator: a hash of its role prompt (and template), not its arrival order."""
    return "agent:" + hashlib.sha256(f"{system}\0{template or ''}".encode()).hexdigest()[:16]


class ReplyOptions(TypedDict, total=False):
    """Agent.respond's keyword options besides max_tokens and stream (their defaults: REPLY_DEFAULTS): sampling as
    SamplingParams takes it, stop strings, and OpenAI's output options as Model.chat takes them."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    seed: int | None
    stop: str | Sequence[str] | None
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None
    parallel_tool_calls: bool
    response_format: Mapping[str, Any] | None
    logprobs: bool
    top_logprobs: int | None


REPLY_DEFAULTS: ReplyOptions = {  # greedy by default: an agent's reply is what the others read
    "temperature": 0.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0, "seed": None,
    "stop": None, "tools": None, "tool_choice": None, "parallel_tool_calls": True, "response_format": None,
    "logprobs": False, "top_logprobs": None,
}  # fmt: skip


class Agent:
    """A role in a session. Create with AgentSession.agent()."""

    def __init__(
        self,
        session: AgentOwner,
        index: int,
        name: str,
        system: str,
        template: str | None,
        adapter: AgentAdapter | None = None,
    ) -> None:
        """adapter: the sharing.adapter_views.AgentAdapter the agent runs with (None: the base model)."""
        self.session, self.index, self.name, self.system, self.template = session, index, name, system, template
        self.lora = adapter

    @property
    def adapter(self) -> str | None:
        """The name of the LoRA adapter the agent runs with (None: the base model)."""
        return None if self.lora is None else self.lora.name

    @property
    def adapter_scale(self) -> float:
        """The scale of its adapter (1.0 without one)."""
        return 1.0 if self.lora is None else self.lora.scale

    @overload
    def respond(
        self, max_tokens: int = ..., *, stream: Literal[False] = ..., **options: Unpack[ReplyOptions]
    ) -> Response: ...

    @overload
    def respond(
        self, max_tokens: int = ..., *, stream: Literal[True], **options: Unpack[ReplyOptions]
    ) -> Iterator[ResponseChunk]: ...

    def respond(
        self, max_tokens: int = 256, *, stream: bool = False, **options: Unpack[ReplyOptions]
    ) -> Response | Iterator[ResponseChunk]:
        """The agent's reply to the shared context so far (greedy by default). The reply joins the shared context
        as a span later agents read. stream=True returns an iterator of ResponseChunk.

        OpenAI's output options as Model.chat and the server take them (kvcmas_cpp.constrained.output_constraint):
        tools / tool_choice / parallel_tool_calls (calls in Response.tool_calls; "required" and a named function
        are enforced by constrained decoding; list the tools in the agent's system prompt, e.g. with
        kvcmas_cpp.tools.tools_system_text), response_format (json_object / json_schema), logprobs and top_logprobs
        (Response.logprobs). The reply's text, calls included, is what later agents read."""
        unknown = sorted(options.keys() - REPLY_DEFAULTS.keys())
        if unknown:
            raise TypeError(f"respond() got an unexpected keyword argument {unknown[0]!r}")
        o: dict[str, Any] = {**REPLY_DEFAULTS, **options}
        params = SamplingParams(**{f.name: o[f.name] for f in dataclasses.fields(SamplingParams) if f.name in o})
        params.validate()
        max_tokens_count(max_tokens, 1)
        stops = stop_strings(o["stop"])
        model = self.session.model
        fmt = tool_format_of(model.tokenizer.chat_template)
        constraint, names = (None, None)
        if o["tools"] or o["response_format"]:
            constraint, names = output_constraint(
                model.tokenizer, model.n_vocab, o["tools"], o["tool_choice"], o["response_format"],
                o["parallel_tool_calls"], fmt,
            )  # fmt: skip
        top = (o["top_logprobs"] or 0) if o["logprobs"] else None
        chunks = _reply(self.session, self, max_tokens, params, stops, constraint, top)
        if stream:
            return chunks
        last: Response | None = None
        for c in chunks:
            last = c.response or last
        assert last is not None
        if names is not None:
            _, calls = parse_tool_calls(last.text, names, fmt)
            if calls:
                last.tool_calls = calls
                last.finish_reason = "tool_calls" if last.finish_reason == "stop" else last.finish_reason
        return last

    async def arespond(self, max_tokens: int = 256, **options: Unpack[ReplyOptions]) -> Response:
        """respond() for asyncio: runs in a worker thread (compute releases the GIL), so other sessions' calls and
        the event loop go on meanwhile."""
        options.pop("stream", None)  # type: ignore[typeddict-item]  # a caller's stream=... is ignored here
        return await asyncio.to_thread(lambda: self.respond(max_tokens, **options))

    def __repr__(self) -> str:
        lora = "" if self.lora is None else f", adapter={self.lora.name!r}"
        return f"Agent({self.name!r}, index={self.index}{lora})"


def _reply(
    session: AgentOwner,
    ag: Agent,
    max_tokens: int,
    params: SamplingParams,
    stops: list[str],
    constraint: Any = None,
    logprobs: int | None = None,
) -> Iterator[ResponseChunk]:
    """The chunks of agent ag's reply: its prompt prefilled by the session, generated, then registered (finish)."""
    with session.lock:
        p = session.prefill_agent(ag)
        ids: list[int] = []
        pieces: list[str] = []
        finish: Literal["stop", "length"] = "length"
        gen_ms = 0.0
        try:
            chunks = session.model.continue_generation(p.seq, p.logits, max_tokens, params, stops, constraint, logprobs)
            lps: list[TokenLogprob] = []
            for c in chunks:
                c_: CompletionChunk = c
                if c_.logprob is not None:
                    lps.append(c_.logprob)
                if c_.token is not None:
                    ids.append(c_.token)
                if c_.finish_reason is not None:
                    finish = c_.finish_reason
                    gen_ms = c_.timings.generation_ms if c_.timings else 0.0
                    pieces.append(c_.text)
                    break
                pieces.append(c_.text)
                if c_.text:
                    yield ResponseChunk(c_.text, c_.token)
            text = "".join(pieces)
            session.finish(p, ids, text)
            stats = session.stats_of(p, gen_ms)
            chosen = chat_logprobs(session.model.tokenizer, lps) if logprobs is not None else None
            response = Response(ag.name, text, ids, finish, stats, p.logits, chosen)
            yield ResponseChunk(pieces[-1] if pieces else "", None, finish, response)
        finally:
            session.release(p)
