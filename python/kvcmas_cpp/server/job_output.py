"""A job's output on the server: its TokenStream's steps -> the client's events, and the end of the job.

The scheduler hands each generating job's next-token logits here (next_token): the job's TokenStream
(kvcmas_cpp.token_stream, the accept loop Model.generate runs too) samples and accepts the token, its new text goes
to the client as a Delta, and a finished job flushes its held-back text, registers its reply with its sharing
session (which may schedule training reads), reports its usage (jobs.job_stats, Metrics.count_done) in its Done and
frees what it holds. A job of a session whose prefill is in flight (another job's) ends only when that prefill
ends (`later`): ending registers a reply, which would touch the session in the middle of its prefill.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

import numpy as np

from ..constrained import ConstraintDeadEnd
from .admission import Admission
from .jobs import Delta, Done, Failed, Job, job_stats
from .metrics import Metrics
from .sessions import SessionStore
from .training_reads import TrainingReads

log = logging.getLogger("kvcmas.server")


class JobOutput:
    """Events and ends of the scheduler's jobs (scheduler thread only). `active`: the scheduler's admitted jobs
    (a job that ends leaves it)."""

    def __init__(
        self,
        active: list[Job],
        sessions: SessionStore,
        admission: Admission,
        reads: TrainingReads,
        metrics: Metrics,
    ) -> None:
        self.active = active
        self.sessions = sessions
        self.admission = admission
        self.reads = reads
        self.metrics = metrics
        self.service_s = 1.0  # moving average of a job's time in the engine, for Retry-After
        self.estimators_touched = False  # a reply was registered (it feeds the estimators): the scheduler resets it
        # completions postponed until their session's prefill plan ends: (id() of the session, the completion)
        self._deferred: list[tuple[int, Callable[[], None]]] = []

    def end_prefill(self, job: Job) -> None:
        job.prefilling = False
        if job.session is not None and self.sessions.busy.get(id(job.session)) is job:
            del self.sessions.busy[id(job.session)]

    def later(self, job: Job, action: Callable[[], None]) -> bool:
        """Postpones a job's completion while another job's prefill plan of its session is in flight (completing
        registers a reply, or fails, which would touch that session in the middle of its prefill) until that plan
        ends; returns True then. The job takes no more decode steps meanwhile."""
        owner = self.sessions.busy.get(id(job.session)) if job.session is not None else None
        if owner is None or owner is job:
            return False
        job.ending = True
        self._deferred.append((id(job.session), action))
        return True

    def run_deferred(self) -> None:
        """Runs the postponed completions whose session has no prefill in flight any more."""
        busy = self.sessions.busy
        while any(sid not in busy for sid, _ in self._deferred):
            ready = [a for sid, a in self._deferred if sid not in busy]
            self._deferred = [(sid, a) for sid, a in self._deferred if sid in busy]
            for action in ready:
                action()

    def next_token(self, job: Job, logits: np.ndarray) -> None:
        """The job's next token from its logits (its TokenStream): its text to the client, then end of generation,
        a stop string, max_tokens, the KV reservation, or keep going."""
        stream = job.stream
        assert stream is not None
        try:
            step = stream.step(logits)
        except ConstraintDeadEnd as e:  # the request's schema has no value: its fault, not the server's
            self.fail(job, 400, f"the output's grammar (response_format or forced tool call): {e}", "invalid_schema")
            return
        except ValueError as e:  # NaN logits and the like: this job cannot go on, the others can
            log.error("%s: sampling failed: %s", job.id, e)
            self.fail(job, 500, f"sampling failed: {e}", "internal_error")
            return
        if step.text:
            job.sink(Delta(step.text, step.token, job.index, stream.take_logprobs()))
        if step.finish is not None:
            self.finish(job, step.finish)
        elif len(stream.tokens) >= job.reserve and not self.admission.grow_reservation(job, self.active):
            log.info("%s: KV budget exhausted after %d tokens: ends with 'length'", job.id, len(stream.tokens))
            self.finish(job, "length")
        else:
            job.pending_token = step.token

    # ------------------------------------------------------------------------------------------- the end
    def finish(self, job: Job, reason: Literal["stop", "length"]) -> None:
        if self.later(job, lambda: self.finish(job, reason)):
            return
        stream = job.stream
        assert stream is not None and job.prefilled is not None
        t_end = time.perf_counter()
        if not stream.stopped:
            tail = stream.flush()
            if tail or stream.pending_logprobs:
                job.sink(Delta(tail, None, job.index, stream.take_logprobs()))
        self.estimators_touched = True
        try:
            if job.backend is not None:
                reads = job.backend.finish(job.prefilled, list(stream.tokens), stream.text)
                self.reads.add(reads, id(job.session))  # run after the Done below, between other work
        except Exception:
            log.exception("%s: registering the reply failed", job.id)
        stats = job_stats(job, t_end)
        self.release(job)
        self.service_s = 0.8 * self.service_s + 0.2 * (t_end - job.t_admit)
        self.metrics.count_done(stats, job.index, job.tenant, job.model)
        job.sink(Done(reason, stats, job.index))

    def release(self, job: Job) -> None:
        plan, job.plan, job.append = job.plan, None, None
        if plan is not None:  # its prefill in flight: closing the plan frees what it holds
            try:
                plan.close()
            except Exception:
                log.exception("%s: closing its prefill plan failed", job.id)
            self.end_prefill(job)
        if job in self.active:
            self.active.remove(job)
        if job.prefilled is not None:
            job.prefilled.close()
            job.prefilled = None
        self.sessions.release(job.session, job.space)
        job.session = None
        if plan is not None:
            self.run_deferred()  # its session's postponed completions

    def fail(self, job: Job, status: int, message: str, code: str = "server_error") -> None:
        if self.later(job, lambda: self.fail(job, status, message, code)):
            return
        self.release(job)
        job.sink(Failed(status, message, code))
