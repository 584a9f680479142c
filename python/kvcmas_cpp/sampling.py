"""Token sampling (llama.cpp's default chain) and stop-string matching for streamed text.

The chain, in llama.cpp's default order: logit bias -> penalties (repetition; OpenAI's presence and frequency) ->
allowed-token mask (constrained decoding) -> top-k -> top-p -> min-p -> temperature -> draw.
As in llama.cpp, top-k / top-p / min-p look at the (penalised) logits at temperature 1; temperature only reshapes the
distribution over the tokens that survive. Temperature 0 is greedy decoding (argmax after the penalty).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Sampler", "SamplingParams", "StopMatcher", "TokenLogprob", "chat_logprobs", "token_logprobs"]


@dataclass
class SamplingParams:
    """Sampling settings.

    temperature: >= 0; 0 = greedy. top_k: keep the k most likely tokens (0 = all). top_p: keep the smallest set of
    most likely tokens whose probability mass is >= top_p (1 = all). min_p: drop tokens with probability below
    min_p * p(most likely) (0 = off). repeat_penalty: divide positive / multiply negative logits of tokens seen in the
    last repeat_last_n tokens (1 = off; repeat_last_n 0 = off, -1 = all previous tokens). seed: None = random.
    presence_penalty / frequency_penalty: OpenAI's, in [-2, 2]: a token this sampler already drew c > 0 times has
    its logit lowered by presence_penalty + c * frequency_penalty (0 = off). logit_bias: token id -> value in
    [-100, 100] added to its logit (OpenAI's logit_bias).
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None

    def validate(self) -> None:
        """Raises ValueError naming the first invalid field."""
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        if not _is_real(self.repeat_penalty) or not math.isfinite(self.repeat_penalty) or self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be a finite number > 0 (1 disables it), got {self.repeat_penalty!r}")
        if not _is_int(self.repeat_last_n) or self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be an integer >= -1 (-1 = all, 0 = off), got {self.repeat_last_n!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be None or an integer >= 0, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 disables it), got {value!r}")
        for token, bias in (self.logit_bias or {}).items():
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias: token ids are integers >= 0, got {token!r}")
            if not _is_real(bias) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{token}] must be a number in [-100, 100], got {bias!r}")


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


class Sampler:
    """Draws token ids from logits with one seeded numpy Generator per sampler (same seed -> same tokens)."""

    # Partial-sort sizes tried in turn when top-p runs over the whole vocabulary (top_k = 0).
    _TOP_P_STEPS = (64, 1024, 16384)

    def __init__(self, params: SamplingParams | None = None) -> None:
        """params: validated here (ValueError on bad values); the sampler keeps its own copy."""
        p = SamplingParams() if params is None else SamplingParams(**vars(params))
        if p.logit_bias is not None:
            p.logit_bias = dict(p.logit_bias)
        p.validate()
        self.params = p
        self._rng = np.random.default_rng(p.seed)
        self._counts: dict[int, int] = {}  # tokens drawn so far (presence / frequency penalties)
        bias = p.logit_bias or {}
        self._bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self._bias_values = np.fromiter(bias.values(), dtype=np.float64, count=len(bias))

    def sample(self, logits: np.ndarray, prev_tokens: Sequence[int] = (), allowed: np.ndarray | None = None) -> int:
        """Picks the next token.

        logits: float array of shape (n_vocab,) (not modified). prev_tokens: the tokens so far (prompt and generated),
        used by the repetition penalty. allowed: a bool mask (n_vocab,) of the tokens that may be drawn (constrained
        decoding), or None. Raises ValueError for a wrongly shaped array, NaN / +inf logits, or when every logit is
        -inf (or masked). The drawn token counts for the presence / frequency penalties of later draws.
        """
        if self.params.temperature == 0.0:
            x = self._processed(self._checked_logits(logits), prev_tokens, allowed)
            token = int(np.argmax(x))
        else:
            ids, probs = self.distribution(logits, prev_tokens, allowed)
            cdf = np.cumsum(probs)
            pick = int(np.searchsorted(cdf, self._rng.random() * cdf[-1], side="right"))
            token = int(ids[min(pick, len(ids) - 1)])
        self._counts[token] = self._counts.get(token, 0) + 1
        return token

    def distribution(
        self, logits: np.ndarray, prev_tokens: Sequence[int] = (), allowed: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The distribution :meth:`sample` draws from: (token ids int64, probabilities float64 summing to 1).

        With temperature 0 it is the single most likely token. Ids are sorted by decreasing probability when top-k or
        top-p is active, in vocabulary order otherwise.
        """
        x = self._processed(self._checked_logits(logits), prev_tokens, allowed)
        p = self.params
        if p.temperature == 0.0:
            return np.array([int(np.argmax(x))], dtype=np.int64), np.ones(1)

        ids = self._top_k(x)
        if p.top_p < 1.0:
            ids = self._top_p(x, ids)
        if p.min_p > 0.0:
            ids = self._min_p(x, ids)
        if ids is None:
            ids = np.arange(x.shape[0], dtype=np.int64)

        z = x[ids].astype(np.float64) / p.temperature
        z -= z.max()
        w = np.exp(z)
        return ids.astype(np.int64, copy=False), w / w.sum()

    # --- chain steps ----------------------------------------------------------------------------------------------

    @staticmethod
    def _checked_logits(logits: np.ndarray) -> np.ndarray:
        x = np.asarray(logits)
        if x.ndim != 1 or x.shape[0] == 0:
            raise ValueError(f"logits must be a non-empty 1-D array (n_vocab,), got shape {x.shape}")
        if not np.issubdtype(x.dtype, np.floating):
            raise ValueError(f"logits must be floating point, got dtype {x.dtype}")
        if np.isnan(x).any() or np.isposinf(x).any():
            raise ValueError("logits contain NaN or +inf")
        if not np.isfinite(x).any():
            raise ValueError("every logit is -inf: no token can be sampled")
        return x

    def _processed(self, x: np.ndarray, prev_tokens: Sequence[int], allowed: np.ndarray | None) -> np.ndarray:
        """Bias, penalties and the allowed-token mask applied to (a copy of) the checked logits."""
        p = self.params
        if self._bias_ids.size:
            if self._bias_ids.max() >= x.shape[0]:
                raise ValueError(f"logit_bias names token ids outside [0, {x.shape[0]})")
            x = x.astype(np.float64)
            x[self._bias_ids] += self._bias_values
        x = self._apply_penalty(x, prev_tokens)
        if self._counts and (p.presence_penalty or p.frequency_penalty):
            ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
            counts = np.fromiter(self._counts.values(), dtype=np.float64, count=len(self._counts))
            x = x.astype(np.float64)  # a copy: the caller's logits stay untouched
            x[ids] -= p.presence_penalty + counts * p.frequency_penalty
        if allowed is not None:
            if allowed.shape != x.shape:
                raise ValueError(f"allowed must be a bool mask of shape {x.shape}, got {allowed.shape}")
            if not allowed.any():
                raise ValueError("the allowed-token mask allows no token")
            x = np.where(allowed, x, -np.inf)
            if not np.isfinite(x).any():
                raise ValueError("every allowed token has a -inf logit: no token can be sampled")
        return x

    def _apply_penalty(self, x: np.ndarray, prev_tokens: Sequence[int]) -> np.ndarray:
        p = self.params
        if p.repeat_penalty == 1.0 or p.repeat_last_n == 0 or len(prev_tokens) == 0:
            return x
        window = prev_tokens if p.repeat_last_n == -1 else prev_tokens[-p.repeat_last_n :]
        seen = np.unique(np.asarray(window, dtype=np.int64))
        if seen.size and (seen[0] < 0 or seen[-1] >= x.shape[0]):
            raise ValueError(f"prev_tokens holds ids outside [0, {x.shape[0]})")
        x = x.copy()
        vals = x[seen]
        # llama.cpp: penalise towards "less likely" whatever the sign of the logit.
        x[seen] = np.where(vals <= 0, vals * p.repeat_penalty, vals / p.repeat_penalty)
        return x

    def _top_k(self, x: np.ndarray) -> np.ndarray | None:
        """Indices of the k largest logits, sorted by decreasing logit; None = all tokens (unsorted)."""
        k = self.params.top_k
        n = x.shape[0]
        if k == 0 or k >= n:
            return None
        part = np.argpartition(-x, k - 1)[:k]
        return part[np.argsort(-x[part], kind="stable")]

    def _top_p(self, x: np.ndarray, ids: np.ndarray | None) -> np.ndarray:
        """Smallest prefix of the tokens sorted by probability whose mass reaches top_p (probabilities over ids)."""
        top_p = self.params.top_p
        m = float(x.max())
        if ids is not None:
            w = np.exp((x[ids] - m).astype(np.float64))
            return ids[self._prefix_len(np.cumsum(w) / w.sum(), top_p)]
        w_all = np.exp((x - m).astype(np.float64))
        total = w_all.sum()
        n = x.shape[0]
        for size in (*self._TOP_P_STEPS, n):
            if size >= n:
                order = np.argsort(-x, kind="stable")
            else:
                part = np.argpartition(-x, size - 1)[:size]
                order = part[np.argsort(-x[part], kind="stable")]
            cum = np.cumsum(w_all[order]) / total
            if cum[-1] >= top_p or size >= n:
                return order[self._prefix_len(cum, top_p)]
        raise AssertionError("unreachable")

    @staticmethod
    def _prefix_len(cum: np.ndarray, top_p: float) -> slice:
        # First index whose cumulative mass is >= top_p, inclusive; all tokens when rounding leaves it short.
        last = int(np.searchsorted(cum, top_p, side="left"))
        return slice(0, min(last + 1, cum.shape[0]))

    def _min_p(self, x: np.ndarray, ids: np.ndarray | None) -> np.ndarray:
        """Tokens with p >= min_p * p_max, i.e. logit >= max_logit + log(min_p); the most likely always stays."""
        cand = np.arange(x.shape[0]) if ids is None else ids
        vals = x[cand]
        threshold = float(vals.max()) + math.log(self.params.min_p)
        return cand[vals >= threshold]


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the model (log-softmax of the raw logits, before sampling
    settings, penalties and masks), and the top alternatives at its position as (token id, logprob), most likely
    first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: np.ndarray, token: int, top_n: int = 0) -> TokenLogprob:
    """The log-softmax of logits (n_vocab,) at token, and the top_n most likely tokens (top_n >= 0)."""
    x = np.asarray(logits, dtype=np.float64)
    m = float(x.max())
    log_z = m + math.log(float(np.exp(x - m).sum()))
    top: list[tuple[int, float]] = []
    if top_n > 0:
        k = min(top_n, x.shape[0])
        part = np.argpartition(-x, k - 1)[:k]
        order = part[np.argsort(-x[part], kind="stable")]
        top = [(int(i), float(x[i] - log_z)) for i in order]
    return TokenLogprob(int(token), float(x[token] - log_z), top)


def chat_logprobs(tokenizer: Any, lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs "content" entries ({"token", "logprob", "bytes", "top_logprobs"}) of these tokens;
    tokenizer: anything with token_to_piece(id) -> bytes."""

    def entry(token: int, value: float) -> dict[str, Any]:
        raw = tokenizer.token_to_piece(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": value, "bytes": list(raw)}

    return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


def max_tokens_count(value: Any, minimum: int) -> int:
    """A generate / respond `max_tokens` argument: an integer >= minimum, or a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"max_tokens must be an integer >= {minimum}, got {value!r}")
    return value


def stop_strings(stop: Any) -> list[str]:
    """A generate / respond `stop` argument as a list: None -> [], a string -> [it], strings -> them; anything else is
    a ValueError naming it (StopMatcher checks the strings)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, bytes | bytearray) or not isinstance(stop, Iterable):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    return list(stop)


class StopMatcher:
    """Finds stop strings in streamed text without ever emitting part of one.

    ``feed(text)`` returns ``(text_to_emit, stopped)``: text is held back while it could be the start of a stop
    string; when a stop string completes, everything before it is emitted, the stop string and anything after it are
    dropped, and ``stopped`` becomes true (later feeds emit nothing). ``flush()`` releases held-back text at the end.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        """stop: the stop strings (non-empty strings; duplicates allowed), as stop_strings takes them."""
        stops = stop_strings(stop)
        for i, s in enumerate(stops):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r}")
        self._stops = stops
        self._held = ""
        self._stopped = False
        self._matched: str | None = None

    @property
    def stopped(self) -> bool:
        """True once a stop string was seen."""
        return self._stopped

    @property
    def matched(self) -> str | None:
        """The stop string that ended the stream, or None."""
        return self._matched

    def feed(self, text: str) -> tuple[str, bool]:
        """Adds streamed text; returns the text that is safe to emit and whether a stop string was found."""
        if self._stopped:
            return "", True
        buf = self._held + text
        if not self._stops:
            self._held = ""
            return buf, False
        best = -1
        for s in self._stops:
            pos = buf.find(s)
            if pos >= 0 and (best < 0 or pos < best):
                best, self._matched = pos, s
        if best >= 0:
            self._stopped = True
            self._held = ""
            return buf[:best], True
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self, text: str = "") -> str:
        """Ends the stream: feeds ``text`` and returns it with any held-back text (a partial stop string is not a
        stop)."""
        out, stopped = self.feed(text)
        if stopped:
            return out
        out += self._held
        self._held = ""
        return out

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
