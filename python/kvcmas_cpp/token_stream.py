"""The output processor: one generation's logits -> its tokens, text, stops, logprobs and timings.

`TokenStream` is the one accept loop of kvcmas: `Model.generate` (and the agents on it) and the server's scheduler
both feed it each step's next-token logits and act on what it says (go on, or finish with a reason). It samples
(kvcmas_cpp.sampling: the chain, logit bias, penalties over the prompt and what it generated), keeps a constraint
(kvcmas_cpp.constrained) in step, ends at an end-of-generation token, a stop string (never part of the text),
a finished constraint or max_tokens, decodes tokens to text as whole characters, and keeps the first token's time.
What to do with the text (yield a chunk, send a server event) and with the KV rows is the caller's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .sampling import Sampler, SamplingParams, StopMatcher, TokenLogprob, token_logprobs
from .tokenizer import StreamDecoder, Tokenizer

FinishReason = Literal["stop", "length"]


@dataclass
class Timings:
    """What one generation cost. Times are wall-clock milliseconds."""

    prompt_tokens: int = 0  # tokens of the prompt, reused ones included
    reused_tokens: int = 0  # prompt tokens whose KV was reused instead of computed
    prompt_ms: float = 0.0  # computing the prompt's KV and the first logits
    generated_tokens: int = 0
    generation_ms: float = 0.0  # after the first token, until the last one
    ttft_ms: float = 0.0  # time to first token

    @property
    def prompt_tokens_per_s(self) -> float:
        computed = self.prompt_tokens - self.reused_tokens
        return computed / (self.prompt_ms / 1000.0) if self.prompt_ms > 0 else 0.0

    @property
    def generation_tokens_per_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / (self.generation_ms / 1000.0) if self.generation_ms > 0 and steps > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "prompt_ms": round(self.prompt_ms, 3),
            "prompt_tokens_per_s": round(self.prompt_tokens_per_s, 2),
            "generated_tokens": self.generated_tokens,
            "generation_ms": round(self.generation_ms, 3),
            "generation_tokens_per_s": round(self.generation_tokens_per_s, 2),
            "ttft_ms": round(self.ttft_ms, 3),
        }

    def __str__(self) -> str:
        return (
            f"prompt: {self.prompt_tokens} tokens ({self.reused_tokens} reused) in {self.prompt_ms:.1f} ms "
            f"({self.prompt_tokens_per_s:.1f} tok/s) | generation: {self.generated_tokens} tokens in "
            f"{self.generation_ms:.1f} ms ({self.generation_tokens_per_s:.1f} tok/s) | ttft {self.ttft_ms:.1f} ms"
        )


@dataclass
class Completion:
    """A finished generation: the new text and tokens (prompt excluded)."""

    text: str  # with tool calls: the text around them (the calls are in tool_calls)
    tokens: list[int]
    finish_reason: Literal["stop", "length", "tool_calls"]
    timings: Timings = field(default_factory=Timings)
    logprobs: list[dict[str, Any]] | None = None  # logprobs=: OpenAI's chat logprobs "content" entries, per token
    tool_calls: list[dict[str, Any]] | None = None  # chat(tools=...): OpenAI tool_call objects the model made
    reasoning_content: str | None = None  # chat() of a thinking model: its `<think>` text (text is the answer)


@dataclass
class CompletionChunk:
    """One piece of a streamed generation. The last chunk has finish_reason and timings set."""

    text: str
    token: int | None
    finish_reason: Literal["stop", "length"] | None = None
    timings: Timings | None = None
    logprob: TokenLogprob | None = None  # logprobs=: this token's (None on the final chunk)


@dataclass(frozen=True)
class Accepted:
    """What one sampled token did to the stream."""

    token: int
    text: str  # new text for the client: whole characters, never part of a stop string ('' at the end of generation)
    logprob: TokenLogprob | None  # the token's (logprobs asked, and not an end-of-generation token)
    finish: FinishReason | None  # the generation ends here, for this reason (None: it goes on)
    end_of_generation: bool  # an end-of-generation token: not part of the output, not appended to the sequence


class TokenStream:
    """The per-token state of one generation (see the module's docstring). Not thread-safe: one caller steps it.

    history: the prompt's token ids (the repetition penalty reads them); the stream appends what it generates.
    max_tokens: the most tokens it generates (an end-of-generation token is not one of them).
    constraint: a kvcmas_cpp.constrained.Constraint the output follows (it ends when the grammar is complete).
    logprobs: None, or each token's logprob with this many alternatives.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        stops: list[str],
        max_tokens: int,
        history: list[int],
        constraint: Any = None,
        logprobs: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.stops = stops
        self.max_tokens = max_tokens
        self.history = history
        self.constraint = constraint
        self.logprobs = logprobs
        self.sampler = Sampler(params)
        self._decoder = StreamDecoder(tokenizer)
        self._matcher = StopMatcher(stops)
        self._eog = tokenizer.eog_ids
        self.tokens: list[int] = []  # the generated tokens (an end-of-generation token excluded)
        self.sampled = 0  # tokens sampled, an end-of-generation token included
        self.text = ""  # the text given out so far (stop strings cut)
        self.t_first = 0.0  # time.perf_counter() when the first token was sampled (0: none yet)
        self.pending_logprobs: list[TokenLogprob] = []  # logprobs of tokens whose text was not taken yet

    def fork(self, params: SamplingParams) -> TokenStream:
        """A stream that continues from the same prompt with its own sampler (and a fork of the constraint): another
        choice of an n > 1 request, made before either has sampled."""
        constraint = self.constraint.fork() if self.constraint is not None else None
        return TokenStream(
            self.tokenizer, params, self.stops, self.max_tokens, list(self.history), constraint, self.logprobs
        )

    def step(self, logits: np.ndarray) -> Accepted:
        """Samples the next token from its logits and accepts it. Raises ValueError when it cannot sample (NaN
        logits, kvcmas_cpp.constrained.ConstraintDeadEnd: the grammar allows no token); the stream is unchanged then."""
        allowed = self.constraint.allowed() if self.constraint is not None else None
        token = self.sampler.sample(logits, self.history, allowed)
        eog = token in self._eog
        lp = token_logprobs(logits, token, self.logprobs) if self.logprobs is not None and not eog else None
        if self.constraint is not None:
            self.constraint.accept(token)
        self.sampled += 1
        if self.sampled == 1:
            self.t_first = time.perf_counter()  # the first token exists from here
        if lp is not None:
            self.pending_logprobs.append(lp)
        if eog:
            return Accepted(token, "", None, "stop", True)
        self.tokens.append(token)
        self.history.append(token)
        text, hit = self._matcher.feed(self._decoder.feed(token))
        self.text += text
        finish: FinishReason | None = None
        if hit or (self.constraint is not None and self.constraint.finished):
            finish = "stop"
        elif len(self.tokens) >= self.max_tokens:
            finish = "length"
        return Accepted(token, text, lp, finish, False)

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended it."""
        return self._matcher.stopped

    def flush(self) -> str:
        """The end of the generation: the text held back (a partial character, a partial stop string), '' after a
        stop string."""
        if self._matcher.stopped:
            return ""
        tail = self._matcher.flush(self._decoder.flush())
        self.text += tail
        return tail

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """The logprobs of the tokens since the last take (None when not asked for)."""
        if self.logprobs is None:
            return None
        taken, self.pending_logprobs = self.pending_logprobs, []
        return taken

    def timings(self, t_start: float, prompt_tokens: int, reused_tokens: int) -> Timings:
        """The generation's Timings, its prompt computed from t_start (time.perf_counter()) on; call it at the end."""
        now = time.perf_counter()
        first = self.t_first if self.sampled else now
        return Timings(
            prompt_tokens=prompt_tokens,
            reused_tokens=reused_tokens,
            prompt_ms=(first - t_start) * 1000.0,
            generated_tokens=self.sampled,
            generation_ms=(now - self.t_first) * 1000.0 if self.sampled > 1 else 0.0,
            ttft_ms=(first - t_start) * 1000.0,
        )
