"""How an agent session reads OpenAI-style messages: each content keyed by its token ids (input vectors by their
rows), split into literal text and spans where shared text sits inside it (sharing.segments), sub-runs of stored
spans read from their rows, new content registered as spans, and the agent's template rendered with span markers.
AgentSession's part that deals with messages (a mixin: the session's state is its own)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .agent import CONTEXT_PLACEHOLDER, Agent
from .agent_results import Prefilled
from .model import BidirectionalRows, Model, is_bidirectional, token_ids
from .plan import ChunkExecutor, Plan, run_plan
from .sharing.methods import Method
from .sharing.runner import WorkflowRunner
from .sharing.segments import segment
from .sharing.span import Span
from .sharing.span_index import Run, SpanIndex
from .sharing.state import RequestState
from .sharing.workflow import QUESTION, Template, template_from_messages
from .tools import TOOLS_KEY, attached_tools


class SessionMessages:
    """The message half of AgentSession (see the module docstring)."""

    model: Model
    agents: list[Agent]
    _lock: threading.RLock
    _entry: Method
    _runner: WorkflowRunner
    _state: RequestState
    _index: SpanIndex
    _vector_ids: dict[tuple[str, str], list[int]]
    _n_runs: int
    vision: Any
    agent: Callable[..., Agent]  # AgentSession.agent
    prefill_plan: Callable[..., Plan[Prefilled]]  # AgentSession.prefill_plan

    def prefill(
        self,
        messages: list[dict[str, Any]],
        agent: str | None = None,
        *,
        chunks: ChunkExecutor | None = None,
        chunk_tokens: int = 256,
        recompute: float | None = None,
        adapter: tuple[str, float] | None = None,
    ) -> Prefilled:
        """Puts a chat (OpenAI-style messages) in the engine under the method. A content is a string, or a list of
        strings and input vectors [n, n_embd] (e.g. an image's embeddings from the session's vision encoder). The
        agent is `agent` or the system prompt's text; each other message's content is a span keyed by its token ids
        (vectors by their rows), reused if the session computed it before. chunks: appends of the prompt run in
        chunks of about chunk_tokens rows (chunk_bounds) through this executor (the same rows and logits as in one
        piece). recompute: this call's recompute budget instead of the session's. adapter: (name, scale) of the
        LoRA adapter the agent runs with. Call finish() after generating, then close(). It runs prefill_plan to its
        end."""
        if chunk_tokens < 1:
            raise ValueError(f"prefill: chunk_tokens must be >= 1, got {chunk_tokens}")
        return run_plan(self.prefill_plan(messages, agent, recompute=recompute, adapter=adapter), chunks, chunk_tokens)

    def _prefill_template(self, ag: Agent, t: Template) -> Plan[Prefilled]:
        raise NotImplementedError

    def _embedding_ids(self, embeddings: np.ndarray, where: str, register: bool = True) -> list[int] | None:
        """The prompt ids standing for input vectors [n, n_embd]; the same rows (by content) get the same ids. Rows
        the session has not seen are registered, or give None when not `register`."""
        rows = np.asarray(embeddings, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[0] == 0 or rows.shape[1] != self.model.n_embd:
            raise ValueError(f"{where}: embeddings must have shape [n, {self.model.n_embd}], got {rows.shape}")
        if not np.isfinite(rows).all():
            raise ValueError(f"{where}: embeddings hold NaN or infinite values")
        kind = "image rows" if is_bidirectional(embeddings) else "vectors"  # Gemma 3's images attend within
        grid = getattr(embeddings, "grid", None)  # an image's rows for an M-RoPE model (ImageFeatures)
        if grid is not None:
            kind = f"image{grid}"
        key = (kind, hashlib.sha256(rows.tobytes()).hexdigest())
        if key not in self._vector_ids:
            if not register:
                return None
            registered = rows.view(BidirectionalRows) if is_bidirectional(embeddings) else rows
            self._vector_ids[key] = self._state.add_vectors(registered, grid)
        return self._vector_ids[key]

    def _parts_ids(
        self, parts: Sequence[str | Sequence[int] | np.ndarray], where: str, register: bool = True
    ) -> list[int] | None:
        """Prompt ids of content parts (text, token ids, input vectors [n, n_embd]; None: vectors the session has not
        seen, when not `register`). Gemma 3's image rows (BidirectionalRows) stand as its processor writes them:
        the newlines around an image tokenized with the text beside it, the rows between the begin / end tokens
        (vision.gemma3), so a content's ids are those of the processor's text."""
        if any(is_bidirectional(p) for p in parts):
            from .vision import gemma3

            parts = gemma3.with_image_text(parts)
            boi, eoi = gemma3.marker_ids(self.model.tokenizer)
        ids: list[int] = []
        for part in parts:
            if isinstance(part, np.ndarray):
                vector_ids = self._embedding_ids(part, where, register)
                if vector_ids is None:
                    return None
                if is_bidirectional(part):
                    ids += [boi, *vector_ids, eoi]
                else:
                    before, after = self._image_token_ids(part)
                    ids += [*before, *vector_ids, *after]
            else:
                ids += self._ids(part)
        return ids

    def _image_token_ids(self, part: np.ndarray) -> tuple[list[int], list[int]]:
        """The ids the model's template writes around an image's rows (Qwen2.5-VL: <|vision_start|> and
        <|vision_end|>, as special tokens) for rows that know their grid; none for other vectors, or when the
        vocabulary lacks the tokens."""
        tokens = getattr(self.vision, "image_tokens", ("", ""))
        if getattr(part, "grid", None) is None or not any(tokens):
            return [], []
        ids = [self.model.tokenizer.encode(t, False, True) if t else [] for t in tokens]
        return (ids[0], ids[1]) if all(len(i) <= 1 for i in ids) else ([], [])

    def _prefill_messages(
        self,
        messages: list[dict[str, Any]],
        agent: str | None,
        runs: list[str],
        adapter: tuple[str, float] | None = None,
    ) -> Plan[Prefilled]:
        # Spans are marked with a marker no client can write (a fresh nonce per call): the messages' own text,
        # braces and all, is data and never expanded as a placeholder.
        nonce = secrets.token_hex(8)
        marker_re = re.compile(rf"<kvcmas-span-{nonce}:(\w+)>")
        system = ""
        rendered: list[dict[str, Any]] = []
        tools = attached_tools(messages)
        for i, msg in enumerate(messages):
            role, content = msg.get("role"), msg.get("content")
            if not isinstance(role, str):
                raise ValueError(f"prefill: message {i} needs string 'role' and 'content'")
            # what the template reads beside the content (tool_calls, tool_call_id, name, ...) is rendered with it
            keys = {k: v for k, v in msg.items() if k not in ("role", "content", TOOLS_KEY)}
            if role == "system" and i == 0:
                if not isinstance(content, str):
                    raise ValueError("prefill: the system prompt (message 0) must be a string")
                system = content
                rendered.append({**keys, "role": role, "content": content})
                continue
            ids = self._content_ids(i, role, content) or []
            if not ids:
                rendered.append({**keys, "role": role, "content": content if isinstance(content, str) else ""})
                continue
            ph = self._index.lookup(ids, content)
            pieces = self._pieces(content, ids) if ph is None and isinstance(content, str) else None
            if pieces is not None:  # shared text inside a bigger message: its spans between literal text
                marked = []
                for text, piece in pieces:
                    if isinstance(piece, Run):
                        piece = self._add_run(piece, runs)
                    elif piece is not None and piece not in self._state.spans:
                        self._add_message_item(self._ids(text), text, role, piece)
                    marked.append(text if piece is None else f"<kvcmas-span-{nonce}:{piece}>")
                rendered.append({**keys, "role": role, "content": "".join(marked)})
                continue
            if ph is None:
                ph = self._add_message_item(ids, content if isinstance(content, str) else None, role)
            rendered.append({**keys, "role": role, "content": f"<kvcmas-span-{nonce}:{ph}>"})
        key = agent if agent is not None else (system or "assistant")
        if tools is not None:  # the tools are part of the agent's prompt prefix, and so of who it is
            rendered[0][TOOLS_KEY] = tools
            if agent is None:
                digest = hashlib.sha256(json.dumps(tools, sort_keys=True).encode()).hexdigest()[:12]
                key = f"{key} [tools {digest}]"
        if adapter is not None:  # the same role with another adapter computes other rows: another agent
            key = f"{key} [adapter {adapter[0]}*{adapter[1]:g}]"
        ag = next((a for a in self.agents if a.name == key), None)
        if ag is None:
            name, scale = adapter if adapter is not None else (None, 1.0)
            ag = self.agent(key, system, adapter=name, adapter_scale=scale)
        template = template_from_messages(self.model, rendered, ag.name, marker_re)
        return (yield from self._prefill_template(ag, template))

    def reusable_tokens(self, messages: list[dict[str, Any]]) -> int:
        """Tokens of these messages' contents the session holds stored spans for: what prefill() would not compute
        (an estimate: an edge kvcmas is still calibrating reads densely). 0 under nonshared."""
        with self._lock:
            total = 0
            for i, msg in enumerate(messages):
                content = msg.get("content")
                if i == 0 and msg.get("role") == "system" and isinstance(content, str):
                    continue
                try:
                    ids = self._content_ids(i, msg.get("role"), content, register=False)
                except ValueError:
                    continue
                ph = self._index.lookup(ids, content) if ids else None
                if ph is None and ids and isinstance(content, str):
                    for _, piece in self._pieces(content, ids, False) or []:
                        if isinstance(piece, Run):
                            total += len(piece.ids)
                        elif piece is not None and (span := self._state.stored(piece)) is not None:
                            total += len(span.ids)
                elif ph is not None and (span := self._state.stored(ph)) is not None:
                    total += len(span.ids)
            return total

    def _add_message_item(self, ids: list[int], text: str | None, role: str, ph: str | None = None) -> str:
        """Registers (part of) a client message as a new context span; returns its placeholder."""
        if ph is None:
            ph = self._next_context_ph()
        self._add_span(Span(ph, ids, f"message:{role}"))
        if text is not None:
            self._index.name_text(text, ph)
        return ph

    def _next_context_ph(self, reserved: int = 0) -> str:
        n_ctx = sum(1 for span in self._items if span.author is None) + reserved
        return QUESTION if n_ctx == 0 else f"condition_{n_ctx}_current"

    def _pieces(self, content: str, ids: list[int], register: bool = True) -> list[tuple[str, str | Run | None]] | None:
        """A message content as literal text and spans (sharing.segments.segment), or None when nothing would be
        split off; new paragraphs get placeholders only when `register`. Under a method that shares nothing, None:
        every message stays one piece, the exact reference prompt."""
        if not self._entry.shares:
            return None
        new_ph = self._next_context_ph if register else None
        observes_dense = self._runner.estimator.observes_dense
        return segment(self.model, self._index, self._state, observes_dense, content, ids, new_ph)

    def _add_run(self, run: Run, runs: list[str]) -> str:
        """A placeholder for a run of a stored span: the span's own when the run is all of it, else a new one whose
        stored state is the span's rows under the run (WorkflowRunner.sub_span; its first `head` ids are
        forwarded, as any span's) and whose estimator edges (key) are the span's. Appended to `runs` (dropped by
        _drop_runs)."""
        st = self._state
        whole = st.spans[run.span]
        if run.offset == 0 and len(run.ids) == len(whole.ids):
            return run.span
        self._n_runs += 1
        ph = f"run_{self._n_runs}_current"
        h = min(self._runner.config.head, len(run.ids))
        rows = self._runner.sub_span(whole, run.offset, len(run.ids) - h)
        st.spans[ph] = dataclasses.replace(rows, ph=ph, ids=list(run.ids), key=whole.key or whole.ph)
        self._index.runs.add(ph)
        runs.append(ph)
        self._index.touch(run.span)
        return ph

    def _drop_runs(self, runs: list[str]) -> None:
        """Forgets the placeholders of sub-runs a prompt read (their spans hold no rows of their own)."""
        for ph in runs:
            self._state.spans.pop(ph, None)
            self._index.runs.discard(ph)
        runs.clear()

    def _content_ids(self, i: int, role: Any, content: Any, register: bool = True) -> list[int] | None:
        """Prompt ids of a message content: text tokens and input-vector ids (None: vectors the session has not
        seen, when not `register`)."""
        if not isinstance(role, str) or not isinstance(content, (str, list)):
            raise ValueError(
                f"prefill: message {i} needs string 'role' and 'content' (or a list of strings and arrays [n, n_embd])"
            )
        if isinstance(content, str):
            return self._ids(content)
        if not all(isinstance(part, (str, np.ndarray)) for part in content):
            raise ValueError(f"prefill: message {i}: content parts are strings or arrays [n, n_embd]")
        return self._parts_ids(content, f"prefill: message {i}", register)

    def _ids(self, content: str | Sequence[int]) -> list[int]:
        if isinstance(content, str):
            return self.model.tokenizer.encode(content, add_special=False, parse_special=False)
        ids = token_ids(content, "content")
        n_vocab = self.model.n_vocab
        bad = [t for t in ids if not 0 <= t < n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {n_vocab})")
        return ids

    def _add_span(self, span: Span) -> None:
        self._state.spans[span.ph] = span
        self._index.add(span)

    @property
    def _items(self) -> list[Span]:
        """The shared items (context and replies) in the order they joined: every span but the sub-runs live
        prompts read."""
        return [span for ph, span in self._state.spans.items() if ph not in self._index.runs]

    def share(
        self,
        content: str | Sequence[int] | None = None,
        *,
        text: str | None = None,
        image: Any = None,
        embeddings: np.ndarray | None = None,
        label: str | None = None,
    ) -> None:
        """Adds shared context every agent that responds later reads: text (or token ids), an image (a path, bytes
        or a PIL image; encoded once by the session's vision encoder, cached by content) and/or input vectors
        [n, n_embd] in place of token embeddings. Given together they form one span: image, vectors, then text."""
        if content is not None and text is not None:
            raise ValueError("share: give the text as `content` or as `text`, not both")
        body = content if content is not None else text
        with self._lock:
            parts: list[str | Sequence[int] | np.ndarray] = []
            if image is not None:
                if self.vision is None:
                    raise ValueError("share(image=...): this session has no vision encoder (AgentSession(vision=...))")
                if self.vision.bidirectional:  # Gemma 3: the base image then its pan-and-scan crops, if any
                    from .vision import gemma3

                    parts += gemma3.image_parts(gemma3.encode_views(self.vision, image))
                else:
                    parts.append(self.vision.encode(image))  # the encoder's cache: one encode per picture
            if embeddings is not None:
                parts.append(embeddings)
            if body is not None:
                parts.append(body)
            ids = self._parts_ids(parts, "share") or []
            if not ids:
                raise ValueError("share: the content is empty")
            self._add_span(Span(self._next_context_ph(), ids, f"context:{label or ''}", label))

    @property
    def context(self) -> list[tuple[str | None, str]]:
        """The shared items so far as (label, text)."""
        return [(it.label, self._describe(it.ids)) for it in self._items]

    def _describe(self, ids: list[int]) -> str:
        n_vec = sum(1 for t in ids if t < 0)
        text = self.model.detokenize([t for t in ids if t >= 0])
        return f"[{n_vec} input vectors]{text}" if n_vec else text

    def _user_template(self, ag: Agent) -> str:
        if ag.template is not None and CONTEXT_PLACEHOLDER not in ag.template:
            return ag.template
        parts = []
        for span in self._items:
            label = span.label
            if label is None and span.author is not None:
                label = f"{self.agents[span.author].name}'s output"
            parts.append((f"{label}:\n" if label else "") + "{" + span.ph + "}")
        ctx = "\n\n".join(parts)
        return ag.template.replace(CONTEXT_PLACEHOLDER, ctx) if ag.template is not None else ctx
