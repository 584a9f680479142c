"""Answers: a job's events (Delta, Done, Failed from the scheduler thread) -> an OpenAI response body, or its
server-sent-event stream, with usage, timings and the kvcmas fields; each finished response is recorded in the
caller's history (dashboard.py). A client that goes away (or a stream that breaks) cancels its job."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..model import Model
from .choices import Choice, ReplyFormat
from .dashboard import record_response
from .history import History
from .jobs import Done, Event, Failed, Job
from .scheduler import Scheduler
from .validation import ApiError, error_body, loggable

log = logging.getLogger("kvcmas.server")

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming handler checks that its client is still there


def sse_event(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: ` and the payload (JSON unless a string), then a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class Replies:
    """Answers the jobs of one server (see the module's docstring)."""

    def __init__(
        self, scheduler: Scheduler, model: Model, model_id: str, history: History, replica: str | None
    ) -> None:
        self.scheduler = scheduler
        self.model = model
        self.model_id = model_id
        self.history = history
        self.replica = replica  # a cluster replica's name: answered in each response's kvcmas.replica

    @staticmethod
    def event_queue() -> tuple[asyncio.Queue[Event], Callable[[Event], None]]:
        """A queue the scheduler thread can feed (events are posted to the running event loop)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens any more
                loop.call_soon_threadsafe(queue.put_nowait, event)

        return queue, sink

    async def _next_event(self, queue: asyncio.Queue[Event], request: Request) -> Event | None:
        """The job's next event, or None when the client went away first. The client is checked every
        DISCONNECT_POLL_S seconds even while events keep coming (a long answer to a client that left)."""
        while True:
            now = time.monotonic()
            if now - getattr(request.state, "disconnect_checked", 0.0) >= DISCONNECT_POLL_S:
                request.state.disconnect_checked = now
                if await request.is_disconnected():
                    return None
            try:
                return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue

    async def respond(
        self,
        job: Job,
        queue: asyncio.Queue[Event],
        request: Request,
        kind: str,
        stream: bool,
        include_usage: bool,
        extra: dict[str, Any],
        echo: str,
        reply: ReplyFormat | None = None,
    ) -> Response:
        """Waits for the first event (so early failures keep their status code), then answers or streams. reply:
        how a chat reply is read (reasoning, tool calls; None: plain text)."""
        first = await self._next_event(queue, request)
        if first is None:
            self.scheduler.cancel(job)
            return Response(status_code=499)
        if isinstance(first, Failed):
            self.scheduler.cancel(job)  # the other choices (n > 1)
            raise ApiError(first.status, first.message, first.code)
        choices = self._new_choices(job, kind, echo, reply)
        if not stream:
            dones: list[Done] = []
            event: Event | None = first
            while True:
                if event is None or isinstance(event, Failed):
                    self.scheduler.cancel(job)
                    if event is None:
                        return Response(status_code=499)
                    raise ApiError(event.status, event.message, event.code)
                if isinstance(event, Done):
                    choices[event.index].on_done(event)
                    dones.append(event)
                    if len(dones) == len(choices):
                        break
                else:
                    choices[event.index].on_delta(event)
                event = await self._next_event(queue, request)
            dones.sort(key=lambda d: d.index)
            self._log_done(job, kind, dones[0])
            return JSONResponse(self._final_body(job, kind, choices, dones, extra))
        return StreamingResponse(
            self._stream(job, queue, kind, first, include_usage, extra, choices),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def _new_choices(self, job: Job, kind: str, echo: str, reply: ReplyFormat | None) -> list[Choice]:
        tok = self.model.tokenizer
        return [Choice(i, kind, tok, reply, echo) for i in range(job.n)]

    async def _stream(
        self,
        job: Job,
        queue: asyncio.Queue[Event],
        kind: str,
        first: Event,
        include_usage: bool,
        extra: dict[str, Any],
        choices: list[Choice],
    ) -> AsyncIterator[bytes]:
        finished = False
        created = int(time.time())
        dones: list[Done] = []
        try:
            for c in choices:
                if kind == "chat":
                    opening: dict[str, Any] = {"role": "assistant", "content": ""}
                    yield sse_event(self._chunk(job, kind, created, [c._stream_choice(opening, None, None)]))
                if c.echo_len:
                    yield sse_event(self._chunk(job, kind, created, [c._stream_choice(c.text[0], None, None)]))
            event = first
            while True:
                if isinstance(event, Failed):
                    finished = True
                    self.scheduler.cancel(job)  # the other choices (n > 1)
                    yield sse_event(error_body(event.status, event.message, event.code))
                    break
                if isinstance(event, Done):
                    dones.append(event)
                    last = choices[event.index].on_done(event)
                    for part in last[:-1]:
                        yield sse_event(self._chunk(job, kind, created, [part]))
                    chunk = self._chunk(job, kind, created, last[-1:])
                    if len(dones) == len(choices):
                        finished = True
                        dones.sort(key=lambda d: d.index)
                        self._log_done(job, kind, dones[0])
                        extras = self._extras(job, dones, extra)
                        # include_usage: OpenAI's shape, usage in the last chunk only (clients add usages up)
                        usage = extras.pop("usage") if include_usage else None
                        yield sse_event({**chunk, **extras})
                        if usage is not None:
                            yield sse_event({**self._chunk(job, kind, created, []), "usage": usage})
                        break
                    yield sse_event(chunk)
                else:
                    for part in choices[event.index].on_delta(event):
                        yield sse_event(self._chunk(job, kind, created, [part]))
                event = await queue.get()
            yield sse_event("[DONE]")
        finally:
            if not finished:  # the client went away (the task was cancelled) or the stream broke
                self.scheduler.cancel(job)

    # ------------------------------------------------------------------------------------------- bodies
    def _chunk(self, job: Job, kind: str, created: int, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        return {
            "id": job.id,
            "object": obj,
            "created": created,
            "model": job.model or self.model_id,
            "choices": choices,
        }

    @staticmethod
    def _usage(dones: list[Done]) -> dict[str, Any]:
        """The prompt once (n > 1 choices are forks of one prefill), the completions of every choice."""
        s = dones[0].stats
        completion = sum(d.stats["completion_tokens"] for d in dones)
        return {
            "prompt_tokens": s["prompt_tokens"],
            "completion_tokens": completion,
            "total_tokens": s["prompt_tokens"] + completion,
            "prompt_tokens_details": {"cached_tokens": s["reused_tokens"]},
        }

    def _extras(self, job: Job, dones: list[Done], extra: dict[str, Any]) -> dict[str, Any]:
        """usage, timings and kvcmas of a finished response; recorded in the caller's history (dashboard.py)."""
        s = dones[0].stats
        timings = {
            "prompt_n": s["prompt_tokens"] - s["reused_tokens"],
            "cache_n": s["reused_tokens"],
            "prompt_ms": round(s["prompt_ms"], 3),
            "prompt_per_second": round(s["prompt_per_second"], 2),
            "predicted_n": s["completion_tokens"],
            "predicted_ms": round(s["predicted_ms"], 3),
            "predicted_per_second": round(s["predicted_per_second"], 2),
            "queue_ms": round(s["queue_ms"], 3),
            "wait_ms": round(s["wait_ms"], 3),
            "engine_ms": round(s["engine_ms"], 3),
            "session_ms": round(s["session_ms"], 3),
            "interleaved_ms": round(s["interleaved_ms"], 3),
            "ttft_ms": round(s["ttft_ms"], 3),
        }
        kvcmas = {
            "method": s["method"],
            "reused_tokens": s["reused_tokens"],
            "computed_tokens": s["computed_tokens"],
            "recomputed_tokens": s["recomputed_tokens"],
            "mode": s["mode"],
            "gate": s["gate"],
            "kv_bytes": s["kv_bytes"],
            "corr_bytes": s["corr_bytes"],
            "prefix_cached_tokens": s["prefix_cached_tokens"],
            "span_tokens": s["span_tokens"],
            "calibration_tokens_scheduled": s["calibration_tokens_scheduled"],
            "dense_reason": s["dense_reason"],
            **extra,
        }
        if self.replica is not None:
            kvcmas["replica"] = self.replica
        extras = {"usage": self._usage(dones), "timings": timings, "kvcmas": kvcmas}
        record_response(self.history, job, extras, s)
        return extras

    def _final_body(
        self, job: Job, kind: str, choices: list[Choice], dones: list[Done], extra: dict[str, Any]
    ) -> dict[str, Any]:
        obj = "chat.completion" if kind == "chat" else "text_completion"
        body = {
            "id": job.id,
            "object": obj,
            "created": int(time.time()),
            "model": job.model or self.model_id,
            "choices": [c.final() for c in choices],
        }
        body.update(self._extras(job, dones, extra))
        return body

    def _log_done(self, job: Job, kind: str, done: Done) -> None:
        s = done.stats
        log.info(
            "%s %s: prompt %d (reused %d) + %d tokens, %s, ttft %.0f ms = queue %.0f + wait %.0f + prefill %.0f "
            "(engine %.0f, session %.0f, others' work %.0f), %.1f tok/s, method %s (%s), agent %s",
            kind,
            job.id,
            s["prompt_tokens"],
            s["reused_tokens"],
            s["completion_tokens"],
            done.finish_reason,
            s["ttft_ms"],
            s["queue_ms"],
            s["wait_ms"],
            s["prompt_ms"],
            s["engine_ms"],
            s["session_ms"],
            s["interleaved_ms"],
            s["predicted_per_second"],
            s["method"],
            s["gate"] or s["mode"],
            loggable(str(job.agent)),
        )
