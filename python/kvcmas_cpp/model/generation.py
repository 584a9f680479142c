"""Text generation on a sequence: the prompt appended, then one TokenStream step per token (the accept loop the
server runs too), and a generation's chunks collected into its Completion."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..sampling import SamplingParams, TokenLogprob, chat_logprobs
from ..token_stream import Completion, CompletionChunk, TokenStream
from ..tokenizer import Tokenizer
from .sequence import KVSequence

if TYPE_CHECKING:
    from .model import Model


def generate_chunks(
    model: Model,
    ids: list[int],
    max_tokens: int,
    params: SamplingParams,
    stops: list[str],
    sequence: KVSequence | None,
    first_logits: np.ndarray | None = None,
    constraint: Any = None,
    logprobs: int | None = None,
) -> Iterator[CompletionChunk]:
    """The generation loop of Model.generate and Model.continue_generation. first_logits: the prompt is already in
    `sequence` (ids are its tokens, for the repetition penalty only) and these are its next-token logits. constraint:
    the tokens allowed next (kvcmas_cpp.constrained.Constraint); logprobs: None, or each chunk's logprob with this
    many alternatives."""
    if not ids:
        raise ValueError("generate: the prompt is empty")
    held = len(sequence) if sequence is not None else 0
    if first_logits is None and held + len(ids) >= model.n_ctx:  # the prompt and one generated token must fit
        before = f" after the sequence's {held}" if held else ""
        raise ValueError(
            f"generate: the prompt is {len(ids)} tokens{before}, and the context (n_ctx) is {model.n_ctx} tokens, "
            "the reply included: shorten the prompt or raise n_ctx (Model(n_ctx=...), -c/--ctx-size)"
        )
    stream = TokenStream(model.tokenizer, params, stops, max_tokens, [], constraint, logprobs)  # params checked
    seq = sequence if sequence is not None else model.new_sequence()
    prior = len(seq) if first_logits is None else len(seq) - len(ids)
    stream.history.extend([*seq.tokens, *ids] if first_logits is None else seq.tokens)  # the penalty reads them
    finish: Literal["stop", "length"] = "length"
    try:
        t0 = time.perf_counter()
        logits = seq.append(ids, logits="last") if first_logits is None else first_logits
        stream.max_tokens = min(max_tokens, model.n_ctx - len(seq))  # every token it yields fits in the sequence
        while stream.sampled < stream.max_tokens:
            assert logits is not None
            step = stream.step(logits)
            if step.end_of_generation:
                finish = "stop"
                break
            yield CompletionChunk(step.text, step.token, logprob=step.logprob)
            if step.finish is not None:
                finish = step.finish
                break
            logits = seq.append([step.token], logits="last")
        timings = stream.timings(t0, prior + len(ids), prior)
        yield CompletionChunk(stream.flush(), None, finish, timings)
    finally:
        if sequence is None:
            seq.close()


def collect_completion(chunks: Iterator[CompletionChunk], tokenizer: Tokenizer, with_logprobs: bool) -> Completion:
    """A generation's chunks -> its Completion (logprobs in OpenAI's chat shape when asked)."""
    pieces: list[str] = []
    tokens: list[int] = []
    lps: list[TokenLogprob] = []
    for chunk in chunks:
        pieces.append(chunk.text)
        if chunk.token is not None:
            tokens.append(chunk.token)
        if chunk.logprob is not None:
            lps.append(chunk.logprob)
        if chunk.finish_reason is not None:
            assert chunk.timings is not None
            logprobs = chat_logprobs(tokenizer, lps) if with_logprobs else None
            return Completion("".join(pieces), tokens, chunk.finish_reason, chunk.timings, logprobs)
    raise AssertionError("generation ended without a final chunk")
