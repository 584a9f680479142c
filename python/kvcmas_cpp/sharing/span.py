"""A shared span in the method layer: what it is (placeholder, ids, role) and what a later reader starts from.

A span is a run of prompt ids several agents read: the shared context (the question, conditions, a client's
message or a paragraph of it), an agent's reply passed on to later agents, or a sub-run of a stored span that a
prompt reads (a reply quoted in part). The first reader computes its rows exactly; they are stored once (`shared`, a
handle on the engine's rows, `model.SharedKV`) and later readers append them by reference with the method's
correction. The engine's own handles (SharedKV / the core's SharedSpan and KvSpan) stay one per layer of the chain;
this class is the method layer's single record of a span.

A Span is a value: a reader that moves the span (a new stored view, a longer chain) puts a new Span in
RequestState.spans (Span.with_rows), so whoever kept the old one (a training read waiting to continue a chain) can
tell by identity whether the span moved since.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..model import KVSequence, SharedKV
from . import estimators as est
from .workflow import QUESTION


@dataclass(frozen=True, eq=False)
class Span:
    """One shared span. Identity: `ph`, `ids`, `key`, `label`, `author`. Stored state (set once a reader has computed
    the span; `stored` says so): `shared`, `corr`, `frame0`, `view_seq`, `view_pos`.

    ph: the placeholder naming the span in templates ({user_question}, {condition_<k>_current},
        {agent_<i>_current}, run_<k>_current for a sub-run).
    ids: its prompt ids (token ids; -(1 + r) for row r of RequestState.vectors). The first `head` of them are
        forwarded exactly by each reader; the stored rows are those of the rest.
    key: the span's role in the estimator's edges ("context:<label>", "message:<role>", "reply:<reader identity>");
        empty where edges are named by placeholder (a fixed workflow's runner).
    label: the label line shown before it in an agent's default prompt (AgentSession.share), or None.
    author: the index of the agent whose reply it is; None for shared context.
    shared: the stored rows (after the head), None when there are none (a reply no longer than the head).
    corr: the correction accumulated so far along the chain, in the stored frame (None: none yet).
    frame0: the position the stored rows were computed at (the frame corrections are expressed in).
    view_seq, view_pos: where the last reader's view of the span lives (the base the next reader's estimate starts
        from): a sequence and the position of the span's first stored row in it.
    view_agent: the index of the agent whose view that is (None: unknown), part of the estimator's edge in agent
        sessions: a map learned for one base (agent A's view, read by B) must not correct another's (B's own view).
    """

    ph: str
    ids: list[int]
    key: str = ""
    label: str | None = None
    author: int | None = None
    shared: SharedKV | None = None
    corr: est.Correction | None = None
    frame0: int = 0
    view_seq: KVSequence | None = None
    view_pos: int = 0
    view_agent: int | None = None

    @property
    def stored(self) -> bool:
        """A reader has computed the span: the stored state is set (its rows may still be None, see `shared`)."""
        return self.view_seq is not None

    @property
    def view(self) -> KVSequence:
        """view_seq of a stored span."""
        if self.view_seq is None:
            raise ValueError(f"span {self.ph!r} has no stored rows")
        return self.view_seq

    def with_rows(
        self,
        shared: SharedKV | None = None,
        corr: est.Correction | None = None,
        frame0: int = 0,
        view_seq: KVSequence | None = None,
        view_pos: int = 0,
        view_agent: int | None = None,
    ) -> Span:
        """The same span with this stored state; with no arguments, without any (evicted, or copied to a session
        that computes it again)."""
        return dataclasses.replace(
            self, shared=shared, corr=corr, frame0=frame0, view_seq=view_seq, view_pos=view_pos, view_agent=view_agent
        )


def chains(ph: str) -> bool:
    """Shared context (the question, conditions) is chained hop to hop; agents' replies are not."""
    return ph == QUESTION or ph.startswith("condition_")
