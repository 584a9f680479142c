"""Message segmentation: a client message's content as literal text and the spans inside it (spans the session
holds, found by their text or by runs of their tokens, and new paragraphs that become spans of their own).

Inside a bigger message, a paragraph becomes its own span, and a span the session holds is found again, only from
MIN_PIECE_TOKENS tokens on (sharing.span_index).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import cast

import numpy as np

from ..model import Model
from .span_index import MIN_PIECE_TOKENS, Run, SpanIndex
from .state import RequestState

PARAGRAPH_RE = re.compile(r"\S(?:.*?\S)?(?=\s*\n\s*\n|\s*$)", re.DOTALL)  # text between blank lines, stripped


def _encode(model: Model, text: str) -> list[int]:
    return model.tokenizer.encode(text, add_special=False, parse_special=False)


def find_run(ids: list[int], piece: list[int], start: int = 0) -> int:
    """Where `piece` first occurs in `ids` as a contiguous run at or after `start`; -1 if nowhere."""
    if not piece:
        return -1
    hay, needle = np.asarray(ids, dtype=np.int64).tobytes(), np.asarray(piece, dtype=np.int64).tobytes()
    at = hay.find(needle, start * 8)
    while at >= 0 and at % 8:
        at = hay.find(needle, at + 1)
    return at // 8 if at >= 0 else -1


def segment(
    model: Model,
    index: SpanIndex,
    st: RequestState,
    observes_dense: bool,
    content: str,
    ids: list[int],
    new_ph: Callable[[int], str] | None,
) -> list[tuple[str, str | Run | None]] | None:
    """A message content as literal text and spans, when shared text sits inside it: each span the session holds
    whose text occurs in it (a reply, a paragraph of an earlier message), then each run of at least
    MIN_PIECE_TOKENS of the content's ids equal to ids of a span the session holds (a Run: part of an earlier
    reply, a reply edited at its start, wrapped in other text, or with its boundary tokens re-tokenized), then
    each other paragraph of at least MIN_PIECE_TOKENS tokens as a new span, and the rest of a paragraph that a
    run opens (a document that starts with text the session holds), after one literal token (placeholders the
    session has not registered yet, named by new_ph(k) for the k-th new one; with new_ph None, new paragraphs stay
    literal text). None when nothing would be split off. st: the session's spans; index: its SpanIndex;
    observes_dense: its estimator keeps state per placeholder (no runs, SpanIndex.stored_runs).

    Cuts are made only at token boundaries of the content's own ids (`ids`). A new paragraph's span may take
    the whitespace next to it, as the tokenizer groups it, and is cut only where the pieces tokenize to `ids`
    exactly, so a first reader's prompt is the one a whole-message span gives. Around a span the session holds,
    the literal text may tokenize its whitespace differently from `ids` (the same text; only later readers,
    which reuse, see it). Spans are never adjacent (the method computes text between them), and literal text
    holds no special-token text (the template parses its text for special tokens). A method that shares nothing
    does not call it: every message stays one piece, the exact reference prompt."""
    tok = model.tokenizer
    # Candidates (start, end, placeholder or run; None: a new paragraph), with a character between any two.
    found: list[tuple[int, int, str | Run | None]] = []

    def free(a: int, b: int) -> bool:
        return all(b < s or a > e for s, e, _ in found)

    spans = st.spans
    known = [t for t, ph in index.by_text.items() if ph in spans and len(spans[ph].ids) >= MIN_PIECE_TOKENS]
    for text in sorted(known, key=len, reverse=True):
        at = content.find(text) if text.strip() else -1
        while at >= 0:
            if free(at, at + len(text)):
                found.append((at, at + len(text), index.by_text[text]))
            at = content.find(text, at + len(text))
    # Runs may overlap the text matches (one whose cut is not at token boundaries gives way to a run in it) and
    # come with their first token left out too, for where one touches the span before it (a sentence cut out of
    # a reply): the walk below takes the first candidate that fits.
    bounds: dict[int, int | None] = {0: 0}
    for run in index.stored_runs(ids, st, observes_dense):
        for r in (run, Run(run.span, run.offset + 1, run.ids[1:], run.at + 1)):
            cut = run_chars(model, content, ids, r, bounds)
            if cut is not None:
                found.append(cut)
    runs_at = [(x, y) for x, y, ph in found if isinstance(ph, Run)]
    for m in PARAGRAPH_RE.finditer(content):
        a, b = m.start(), m.end()
        text_free = all(b < x or a > y for x, y, ph in found if not isinstance(ph, Run))
        # a paragraph a run opens stays a candidate (after the run, in the stable sort): its rest may be new text
        opened = any(x <= a <= y for x, y in runs_at)
        if text_free and (opened or all(b < x or a > y for x, y in runs_at)):
            found.append((a, b, None))
    found.sort(key=lambda f: f[0])
    pieces: list[tuple[str, str | Run | None]] = []
    pos, k, n_new = 0, 0, 0  # next character of the content, next id of `ids`, new spans so far
    for a, b, ph in found:
        rest_of_paragraph = False
        if a <= pos and pieces:  # touches the span before it
            if ph is not None or b <= pos or any(isinstance(r, Run) and pos < x < b for x, _, r in found):
                continue  # (a run further in the paragraph goes first: its rows exist)
            rest_of_paragraph = True  # a new paragraph a run took the start of: its rest may be a new span
        if isinstance(ph, Run):  # its ids are the content's own: cut where they sit
            if ph.at >= k and model.detokenize(ids[k : ph.at]) == content[pos:a]:
                pieces += [(content[pos:a], None), (content[a:b], ph)]
                pos, k = b, ph.at + len(ph.ids)
            continue
        if ph is not None:  # a span the session holds: its text must start and end at token boundaries
            text = content[a:b]
            start = a + len(text) - len(text.lstrip())
            inner = (start, start + len(text.strip()))  # a reply is known with and without its whitespace
            for x, y in [(a, b)] + ([inner] if index.by_text.get(text.strip()) == ph and inner != (a, b) else []):
                span = _encode(model, content[x:y])
                j = find_run(ids, span, k)
                if j >= 0 and model.detokenize(ids[k:j]) == content[pos:x]:
                    pieces += [(content[pos:x], None), (content[x:y], ph)]
                    pos, k = y, j + len(span)
                    break
            continue
        lead = a - 1 if a > 0 and content[a - 1].isspace() else a
        # the rest of a paragraph starts after one literal token: spans are never adjacent
        starts = [pos + len(model.detokenize(ids[k : k + 1]))] if rest_of_paragraph else [lead, a]
        trail = b + len(content[b:]) - len(content[b:].lstrip("\n"))
        for x, y in dict.fromkeys((x, y) for x in starts for y in (b, trail)):
            if x < pos or (x == pos and pieces):
                continue
            literal, span = _encode(model, content[pos:x]), _encode(model, content[x:y])
            n = len(literal) + len(span)
            if len(span) < MIN_PIECE_TOKENS or ids[k : k + n] != literal + span:
                continue
            ph = index.lookup(span, content[x:y])
            if ph is None and new_ph is not None:
                ph = new_ph(n_new)
                n_new += 1
            pieces += [(content[pos:x], None), (content[x:y], ph)]
            pos, k = y, k + n
            break
    tail = content[pos:]
    if not any(ph for _, ph in pieces) or model.detokenize(ids[k:]) != tail:
        return None
    for text, ph in [*pieces, (tail, None)]:
        if ph is None and tok.encode(text, add_special=False, parse_special=True) != _encode(model, text):
            return None  # client text would read as special tokens in the template
    new = pieces[1][1] if len(pieces) == 2 else None
    new_whole = isinstance(new, str) and new not in st.spans
    if new_whole and not pieces[0][0].strip() and not tail.strip():
        return None  # the whole message is one new paragraph: a whole-message span, as before
    return [(text, ph) for text, ph in [*pieces, (tail, None)] if text or ph is not None]


def run_chars(
    model: Model, content: str, ids: list[int], run: Run, bounds: dict[int, int | None]
) -> tuple[int, int, Run] | None:
    """The characters of `content` a run covers, its ends moved inwards (a token at a time) to token boundaries
    whose text before them is the content's own (not inside a character several tokens spell); None when the
    run is then shorter than MIN_PIECE_TOKENS. bounds: token boundary -> its character (None: not one), a
    cache for one content."""

    def chars(j: int) -> int | None:
        if j not in bounds:  # the text from the nearest boundary before j; from the start where that differs
            i = max(i for i, c in bounds.items() if c is not None and i <= j)
            c = cast(int, bounds[i])
            text = model.detokenize(ids[i:j])
            if not content.startswith(text, c):
                c, text = 0, model.detokenize(ids[:j])
            bounds[j] = c + len(text) if content.startswith(text, c) else None
        return bounds[j]

    a, e = run.at, run.at + len(run.ids)
    x = y = None
    while e - a >= MIN_PIECE_TOKENS and (x := chars(a)) is None:
        a += 1
    while e - a >= MIN_PIECE_TOKENS and (y := chars(e)) is None:
        e -= 1
    if x is None or y is None or e - a < MIN_PIECE_TOKENS or y <= x:
        return None
    if (a, e) != (run.at, run.at + len(run.ids)):
        run = Run(run.span, run.offset + a - run.at, tuple(ids[a:e]), a)
    return x, y, run
