"""Fidelity of a method's run against the exact (nonshared) run of the same request, per hop: first-token KL and
top-1, teacher-forced top-1, per-layer K and V relative errors over the prompt after the template prefix."""

from __future__ import annotations

import numpy as np

from ..model import Model
from .state import RequestResult
from .workflow import Template


def evaluate_hops(
    m: Model, templates: list[Template], res: RequestResult, exact: RequestResult, teacher_forced: bool
) -> None:
    """Sets the fidelity fields of res's hop reports against exact's (the same prompts, agent by agent)."""
    for a, (hop, ehop) in enumerate(zip(res.hops, exact.hops, strict=True)):
        assert hop.first_logits is not None and ehop.first_logits is not None
        hop.kl = kl_divergence(ehop.first_logits, hop.first_logits)
        hop.top1 = bool(np.argmax(hop.first_logits) == np.argmax(ehop.first_logits))
        preds = [int(np.argmax(hop.first_logits))]
        if hop.tf_logits is not None:
            preds += [int(x) for x in np.argmax(hop.tf_logits, axis=1)]
        # the exact run decodes greedily: its argmax at each step is the token it generated
        ref = list(ehop.generated) if ehop.generated else [int(np.argmax(ehop.first_logits))]
        if ehop.tf_logits is not None:  # an exact run that was itself teacher-forced
            ref = [int(np.argmax(ehop.first_logits))] + [int(x) for x in np.argmax(ehop.tf_logits, axis=1)]
        k = min(len(preds), len(ref))
        hop.tf_top1 = float(np.mean([x == y for x, y in zip(preds[:k], ref[:k], strict=True)]))
        start = len(templates[a].texts[0])
        n = len(res.prompt_ids[a]) - start
        k1, v1 = res.seqs[a].kv(start, n)
        k0, v0 = exact.seqs[a].kv(start, n)
        hop.k_err = [
            float(np.linalg.norm(k1[il] - k0[il]) / max(np.linalg.norm(k0[il]), 1e-30)) for il in range(m.n_layer)
        ]
        hop.v_err = [
            float(np.linalg.norm(v1[il] - v0[il]) / max(np.linalg.norm(v0[il]), 1e-30)) for il in range(m.n_layer)
        ]
        hop.identical = None if teacher_forced else hop.generated == ehop.generated


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def kl_divergence(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    """KL(ref || got) of the next-token distributions two logit vectors give (float64): how far a shared method's
    first token is from the exact one's."""
    p, q = log_softmax(ref_logits), log_softmax(logits)
    return float(np.sum(np.exp(p) * (p - q)))
