"""Driving a grammar constraint with random logits: what the mask alone guarantees."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcmas_cpp.sampling import Sampler, SamplingParams


def drive_randomly(constraint: Any, tok: Any, rng: np.random.Generator, max_steps: int = 400) -> str:
    """Random logits under the mask until the grammar ends: the mask alone must keep the output valid."""
    out: list[int] = []
    for _ in range(max_steps):
        allowed = constraint.allowed()
        logits = rng.normal(size=allowed.shape[0]).astype(np.float32)
        token = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=int(rng.integers(1 << 30))))
        t = token.sample(logits, allowed=allowed)
        if t in tok.eog_ids:
            break
        constraint.accept(t)
        out.append(t)
        if constraint.finished:
            break
    return str(tok.decode(out))
