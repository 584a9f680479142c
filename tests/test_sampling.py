"""Sampler and StopMatcher tests.

The sampler's distribution is checked against a plain full-sort implementation of llama.cpp's default chain written
here (penalties -> top-k -> top-p -> min-p -> temperature), and its draws against that distribution with a
chi-square statistic over many seeded samples.
"""

from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest

from kvcmas_cpp.sampling import Sampler, SamplingParams, StopMatcher


def reference_distribution(logits: np.ndarray, prev: list[int], p: SamplingParams) -> dict[int, float]:
    """Token -> probability, by the book: full sort, no shortcuts."""
    x = logits.astype(np.float64).copy()
    window = prev if p.repeat_last_n == -1 else prev[-p.repeat_last_n :] if p.repeat_last_n > 0 else []
    for t in set(window):
        x[t] = x[t] * p.repeat_penalty if x[t] <= 0 else x[t] / p.repeat_penalty
    order = sorted(range(len(x)), key=lambda i: -x[i])
    if p.top_k > 0:
        order = order[: p.top_k]
    if p.top_p < 1.0:
        w = np.exp(x[order] - x[order[0]])
        probs = w / w.sum()
        mass, keep = 0.0, 0
        for q in probs:
            mass += q
            keep += 1
            if mass >= p.top_p:
                break
        order = order[:keep]
    if p.min_p > 0.0:
        w = np.exp(x[order] - x[order[0]])
        order = [t for t, q in zip(order, w, strict=True) if q >= p.min_p]
    z = x[order] / p.temperature
    w = np.exp(z - z.max())
    return {t: float(q) for t, q in zip(order, w / w.sum(), strict=True)}


def chi_square(counts: dict[int, int], expected: dict[int, float], n: int) -> float:
    assert set(counts) <= set(expected), f"drew tokens outside the allowed set: {set(counts) - set(expected)}"
    return sum((counts.get(t, 0) - n * q) ** 2 / (n * q) for t, q in expected.items())


def draw(sampler: Sampler, logits: np.ndarray, n: int, prev: list[int] | None = None) -> dict[int, int]:
    counts: dict[int, int] = {}
    for _ in range(n):
        t = sampler.sample(logits, prev or [])
        counts[t] = counts.get(t, 0) + 1
    return counts


# --- deterministic cases ----------------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    rng = np.random.default_rng(0)
    sampler = Sampler(SamplingParams(temperature=0.0, top_k=0, top_p=0.5, min_p=0.2, seed=1))
    for _ in range(50):
        logits = rng.normal(size=1000).astype(np.float32) * 3
        assert sampler.sample(logits, []) == int(np.argmax(logits))
    ids, probs = sampler.distribution(logits)
    assert ids.tolist() == [int(np.argmax(logits))] and probs.tolist() == [1.0]


def test_top_k_1_is_argmax() -> None:
    rng = np.random.default_rng(1)
    sampler = Sampler(SamplingParams(temperature=1.5, top_k=1, top_p=1.0, min_p=0.0, seed=2))
    for _ in range(50):
        logits = rng.normal(size=5000).astype(np.float32)
        assert sampler.sample(logits, []) == int(np.argmax(logits))


def test_logits_are_not_modified() -> None:
    logits = np.array([3.0, -1.0, 2.0, 0.5], dtype=np.float32)
    before = logits.copy()
    Sampler(SamplingParams(repeat_penalty=1.5, seed=0)).sample(logits, [0, 1, 2])
    np.testing.assert_array_equal(logits, before)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.49, {0}), (0.5001, {0, 1}), (0.79, {0, 1}), (0.81, {0, 1, 2}), (0.96, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p: float, kept: set[int]) -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.04, 0.01])
    logits = np.log(probs).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=top_p, min_p=0.0, seed=3))
    ids, q = sampler.distribution(logits)
    assert set(ids.tolist()) == kept
    expected = probs[sorted(kept)] / probs[sorted(kept)].sum()
    np.testing.assert_allclose(q[np.argsort(ids)], expected, rtol=1e-5)


@pytest.mark.parametrize(("min_p", "kept"), [(0.3, {0, 1, 2}), (0.45, {0, 1}), (0.55, {0}), (0.0, {0, 1, 2, 3})])
def test_min_p_is_relative_to_the_most_likely(min_p: float, kept: set[int]) -> None:
    logits = np.log(np.array([0.5, 0.25, 0.2, 0.05])).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=min_p, seed=4))
    assert set(sampler.distribution(logits)[0].tolist()) == kept


def test_repetition_penalty_semantics() -> None:
    logits = np.array([2.0, -2.0, 1.0, 0.0, 0.5], dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=2.0, repeat_last_n=64)
    ids, probs = Sampler(params).distribution(logits, [0, 1, 3, 0])
    # positive logits are divided, negative multiplied (both become less likely), zero stays, others untouched
    penalised = np.array([1.0, -4.0, 1.0, 0.0, 0.5])
    expected = np.exp(penalised - penalised.max())
    np.testing.assert_allclose(probs[np.argsort(ids)], expected / expected.sum(), rtol=1e-6)
    # with the penalty, greedy prefers token 2 over the repeated token 0
    greedy = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.5))
    assert greedy.sample(logits, []) == 0
    assert greedy.sample(logits, [0]) == 2


def test_repetition_window() -> None:
    logits = np.array([1.0, 0.9, 0.0], dtype=np.float32)
    history = [0] + [2] * 64  # token 0 is 65 tokens back
    last64 = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=64))
    assert last64.sample(logits, history) == 0
    everything = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=-1))
    assert everything.sample(logits, history) == 1
    off = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=0))
    assert off.sample(logits, [0]) == 0


@pytest.mark.parametrize("case", range(12))
def test_distribution_matches_reference_chain(case: int) -> None:
    rng = np.random.default_rng(100 + case)
    n_vocab = int(rng.choice([50, 1000, 49152]))
    logits = (rng.normal(size=n_vocab) * rng.uniform(0.5, 4)).astype(np.float32)
    params = SamplingParams(
        temperature=float(rng.choice([0.3, 0.8, 1.0, 1.7])),
        top_k=int(rng.choice([0, 1, 5, 40, 200])),
        top_p=float(rng.choice([0.3, 0.9, 0.95, 1.0])),
        min_p=float(rng.choice([0.0, 0.05, 0.2])),
        repeat_penalty=float(rng.choice([1.0, 1.3])),
        repeat_last_n=int(rng.choice([-1, 0, 8, 64])),
        seed=case,
    )
    prev = rng.integers(0, n_vocab, size=100).tolist()
    expected = reference_distribution(logits, prev, params)
    ids, probs = Sampler(params).distribution(logits, prev)
    assert sorted(ids.tolist()) == sorted(expected), params
    got = dict(zip(ids.tolist(), probs.tolist(), strict=True))
    for t, q in expected.items():
        assert got[t] == pytest.approx(q, rel=1e-4, abs=1e-9)


def test_top_p_over_a_large_vocabulary_without_top_k() -> None:
    """top_k = 0 takes the partial-sort path; it must still find the exact prefix (here thousands of tokens)."""
    rng = np.random.default_rng(7)
    logits = (rng.normal(size=151_936) * 1.5).astype(np.float32)
    for top_p in (0.1, 0.5, 0.9, 0.99):
        params = SamplingParams(temperature=1.0, top_k=0, top_p=top_p, min_p=0.0)
        ids, _ = Sampler(params).distribution(logits)
        order = np.argsort(-logits.astype(np.float64), kind="stable")
        w = np.exp(logits[order].astype(np.float64) - logits.max())
        cum = np.cumsum(w) / w.sum()
        n_keep = int(np.argmax(cum >= top_p)) + 1
        assert len(ids) == n_keep
        assert set(ids.tolist()) == set(order[:n_keep].tolist())
    assert n_keep > 16384  # the last case needed the full sort


# --- statistical ------------------------------------------------------------------------------------------------

# 99.9th percentile of chi-square for the degrees of freedom used below (df = allowed tokens - 1).
CHI2_999 = {
    1: 10.83,
    2: 13.82,
    3: 16.27,
    4: 18.47,
    5: 20.52,
    6: 22.46,
    7: 24.32,
    8: 26.12,
    9: 27.88,
    10: 29.59,
    11: 31.26,
}


def test_draws_follow_temperature_scaled_softmax() -> None:
    logits = np.array([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -2.0], dtype=np.float32)
    params = SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    expected = reference_distribution(logits, [], params)
    n = 20_000
    stat = chi_square(draw(Sampler(params), logits, n), expected, n)
    assert stat < CHI2_999[7]
    # The same draws are far from what temperature 1 would give: the statistic can tell them apart.
    wrong = reference_distribution(logits, [], SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0))
    assert chi_square(draw(Sampler(params), logits, n), wrong, n) > 10 * CHI2_999[7]


def test_draws_after_truncation_are_renormalised() -> None:
    rng = np.random.default_rng(5)
    logits = (rng.normal(size=1000) * 2).astype(np.float32)
    params = SamplingParams(temperature=1.3, top_k=12, top_p=0.9, min_p=0.05, seed=99)
    expected = reference_distribution(logits, [], params)
    assert 4 <= len(expected) <= 12
    n = 20_000
    counts = draw(Sampler(params), logits, n)
    assert set(counts) == set(expected)
    assert chi_square(counts, expected, n) < CHI2_999[len(expected) - 1]


def test_seeds_are_reproducible() -> None:
    rng = np.random.default_rng(6)
    logits = rng.normal(size=2000).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=100, top_p=0.95, min_p=0.0, seed=42)
    s1, s2 = Sampler(params), Sampler(params)
    a = [s1.sample(logits, []) for _ in range(200)]
    b = [s2.sample(logits, []) for _ in range(200)]
    assert a == b
    params.seed = 43
    s3 = Sampler(params)
    c = [s3.sample(logits, []) for _ in range(200)]
    assert c != a
    params.seed = None
    assert 0 <= Sampler(params).sample(logits, []) < 2000


def test_sampling_a_large_vocabulary_is_fast() -> None:
    rng = np.random.default_rng(8)
    logits = rng.normal(size=256_000).astype(np.float32)
    history = rng.integers(0, 256_000, size=512).tolist()
    sampler = Sampler(SamplingParams(repeat_penalty=1.1, seed=0))  # defaults: top_k 40, top_p 0.95, min_p 0.05
    t0 = time.perf_counter()
    for _ in range(50):
        sampler.sample(logits, history)
    per_token = (time.perf_counter() - t0) / 50
    assert per_token < 0.05, f"{per_token * 1000:.1f} ms per token"


# --- validation -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", -1.0),
        ("repeat_last_n", -2),
        ("seed", -1),
        ("seed", "abc"),
    ],
)
def test_invalid_params_are_rejected(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        Sampler(params)


def test_invalid_logits_are_rejected() -> None:
    sampler = Sampler(SamplingParams(seed=0))
    with pytest.raises(ValueError, match="1-D"):
        sampler.sample(np.zeros((2, 3), dtype=np.float32), [])
    with pytest.raises(ValueError, match="1-D"):
        sampler.sample(np.zeros(0, dtype=np.float32), [])
    with pytest.raises(ValueError, match="NaN"):
        sampler.sample(np.array([0.0, np.nan], dtype=np.float32), [])
    with pytest.raises(ValueError, match="-inf"):
        sampler.sample(np.full(4, -np.inf, dtype=np.float32), [])
    with pytest.raises(ValueError, match="prev_tokens"):
        Sampler(SamplingParams(repeat_penalty=1.2)).sample(np.zeros(4, dtype=np.float32), [7])
    masked = np.array([-np.inf, 0.0, -np.inf, 0.0], dtype=np.float32)  # masked tokens are never drawn
    assert set(draw(Sampler(SamplingParams(top_k=0, top_p=1.0, min_p=0.0, seed=1)), masked, 200)) == {1, 3}


# --- StopMatcher ------------------------------------------------------------------------------------------------


def stream(matcher: StopMatcher, chunks: list[str]) -> tuple[list[str], bool]:
    out: list[str] = []
    for chunk in chunks:
        text, hit = matcher.feed(chunk)
        out.append(text)
        if hit:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_stop_across_chunk_boundaries() -> None:
    matcher = StopMatcher(["###"])
    out, hit = stream(matcher, list("Hello ### world"))
    assert hit and matcher.stopped and matcher.matched == "###"
    assert "".join(out) == "Hello "
    assert all("#" not in piece for piece in out)
    assert matcher.feed("more") == ("", True)


def test_partial_match_is_released() -> None:
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("a </e") == ("a ", False)
    assert matcher.feed("x") == ("</ex", False)
    assert matcher.feed("</en") == ("", False)
    assert matcher.flush() == "</en"  # the stream ended: a partial stop string is just text


def test_earliest_stop_wins() -> None:
    matcher = StopMatcher(["world", "lo w", "xyz"])
    out, hit = stream(matcher, ["Hel", "lo wor", "ld"])
    assert hit and "".join(out) == "Hel" and matcher.matched == "lo w"


def test_no_stops_passes_everything_through() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.flush("d") == "d"
    with pytest.raises(ValueError, match=r"stop\[1\]"):
        StopMatcher(["ok", ""])


@pytest.mark.parametrize("seed", range(20))
def test_stop_matcher_random_streams(seed: int) -> None:
    rnd = random.Random(seed)
    alphabet = "ab<>/ \n"
    stops = ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 4))) for _ in range(rnd.randint(1, 3))]
    text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 60)))
    cuts = sorted(rnd.sample(range(len(text) + 1), k=min(len(text) + 1, rnd.randint(0, 10))))
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    positions = [p for p in (text.find(s) for s in stops) if p >= 0]
    expected = text[: min(positions)] if positions else text

    matcher = StopMatcher(stops)
    emitted = ""
    fed = ""
    for chunk in chunks:
        fed += chunk
        piece, hit = matcher.feed(chunk)
        emitted += piece
        assert expected.startswith(emitted)
        if hit:
            break
        # Exactly the longest tail that could still grow into a stop string is held back.
        assert fed.startswith(emitted)
        held = fed[len(emitted) :]
        longest_partial = max(
            (n for st in stops for n in range(1, len(st)) if fed.endswith(st[:n])),
            default=0,
        )
        assert len(held) == longest_partial
    else:
        emitted += matcher.flush()
    assert emitted == expected
    assert matcher.stopped == bool(positions)
