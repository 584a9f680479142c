"""Units of the OpenAI surface: sampler parity (presence / frequency penalties, logit_bias, allowed masks, logprobs),
the tool-call parsers on well-formed and malformed output, and grammar-constrained decoding (llguidance)."""

from __future__ import annotations

import numpy as np
import pytest

from kvcmas_cpp.sampling import Sampler, SamplingParams, token_logprobs


# ------------------------------------------------------------------------------------------------ sampling
def test_presence_and_frequency_penalties_count_drawn_tokens() -> None:
    logits = np.array([3.0, 2.9, 0.0, -1.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0, presence_penalty=0.05, frequency_penalty=0.1))
    drawn = [s.sample(logits) for _ in range(4)]
    # 0 (3.0) -> 0 lowered to 2.85 < 2.9 -> 1 -> both lowered once: 0 at 2.85 > 1 at 2.75 -> 0 -> 0 at 2.75 vs 2.75
    assert drawn[:3] == [0, 1, 0]
    assert Sampler(SamplingParams(temperature=0)).sample(logits) == 0
    ids, probs = Sampler(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0, presence_penalty=2)).distribution(
        logits
    )
    ref = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    np.testing.assert_allclose(probs, ref, rtol=1e-6)  # nothing drawn yet: no penalty


def test_logit_bias_and_allowed_mask() -> None:
    logits = np.array([1.0, 0.5, 0.2, 0.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0, logit_bias={0: -100})).sample(logits) == 1
    assert Sampler(SamplingParams(temperature=0, logit_bias={3: 5})).sample(logits) == 3
    allowed = np.array([False, False, True, True])
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    assert {s.sample(logits, allowed=allowed) for _ in range(50)} <= {2, 3}
    ids, probs = s.distribution(logits, allowed=allowed)
    assert probs[ids == 0].sum() == 0 and probs[ids == 2].sum() == pytest.approx(np.exp(0.2) / (np.exp(0.2) + 1))
    with pytest.raises(ValueError, match="allows no token"):
        s.sample(logits, allowed=np.zeros(4, dtype=bool))
    with pytest.raises(ValueError, match="outside"):
        Sampler(SamplingParams(logit_bias={9: 1.0})).sample(logits)
    for bad in ({"presence_penalty": 3.0}, {"frequency_penalty": -2.5}, {"logit_bias": {0: 101}}):
        with pytest.raises(ValueError):
            SamplingParams(**bad).validate()  # type: ignore[arg-type]


def test_token_logprobs_is_log_softmax() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=1000).astype(np.float32) * 4
    lp = token_logprobs(x, 7, top_n=5)
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum())
    assert lp.logprob == pytest.approx(ref[7], abs=1e-9)
    assert [t for t, _ in lp.top] == list(np.argsort(-ref)[:5])
    assert [v for _, v in lp.top] == pytest.approx(list(np.sort(ref)[::-1][:5]))
