"""The numpy reference of the attention kernel (materialized, float64) and random KV runs for it."""

from __future__ import annotations

import numpy as np


def rotate(x: np.ndarray, pos: float, head_dim: int, n_rot: int, neox: bool, base: float) -> np.ndarray:
    """RoPE of every head of rows x [n, n_heads * head_dim] by position pos, in float64."""
    n, width = x.shape
    h = x.astype(np.float64).reshape(n, width // head_dim, head_dim).copy()
    half = n_rot // 2
    inv = base ** (-2.0 * np.arange(half) / n_rot)
    c, s = np.cos(pos * inv), np.sin(pos * inv)
    i0 = np.arange(half) if neox else 2 * np.arange(half)
    i1 = i0 + half if neox else i0 + 1
    a, b = h[..., i0].copy(), h[..., i1].copy()
    h[..., i0] = a * c - b * s
    h[..., i1] = a * s + b * c
    return h.reshape(n, width)


def reference(q, runs, n_head_kv, n_rot, neox, base, n_visible, window=0):
    """Materializes every run's keys at their sequence positions (rotated by +shift, corrected) and attends to the
    first n_visible rows (only the last `window` of them when window > 0)."""
    n_head, hd = q.shape
    keys, values = [], []
    for r in runs:
        k = r["k"].astype(np.float64)
        v = r["v"].astype(np.float64)
        if "a_k" in r:
            k = k + r["a_k"].astype(np.float64) @ r["b_k"].astype(np.float64)
            v = v + r["a_v"].astype(np.float64) @ r["b_v"].astype(np.float64)
        keys.append(rotate(k, r.get("shift", 0), hd, n_rot, neox, base))
        values.append(v)
    first = max(0, n_visible - window) if window > 0 else 0
    K = np.concatenate(keys)[first:n_visible]
    V = np.concatenate(values)[first:n_visible]
    group = n_head // n_head_kv
    out = np.zeros((n_head, hd))
    for h in range(n_head):
        g = h // group
        s = K[:, g * hd : (g + 1) * hd] @ q[h].astype(np.float64) / np.sqrt(hd)
        p = np.exp(s - s.max())
        p /= p.sum()
        out[h] = p @ V[:, g * hd : (g + 1) * hd]
    return out


def make_runs(rng, lengths, shifts, ranks, n_head_kv, hd, shared_factors=False):
    kd = n_head_kv * hd
    runs = []
    shared = {}
    for n, shift, rank in zip(lengths, shifts, ranks, strict=True):
        r = {
            "k": rng.standard_normal((n, kd)).astype(np.float32),
            "v": rng.standard_normal((n, kd)).astype(np.float32),
            "shift": int(shift),
        }
        if rank > 0:
            if not (shared_factors and rank in shared):
                shared[rank] = (
                    (rng.standard_normal((rank, kd)) * 0.3).astype(np.float32),
                    (rng.standard_normal((rank, kd)) * 0.3).astype(np.float32),
                )
            r["a_k"] = rng.standard_normal((n, rank)).astype(np.float32)
            r["a_v"] = rng.standard_normal((n, rank)).astype(np.float32)
            r["b_k"], r["b_v"] = shared[rank]
        runs.append(r)
    return runs


CASES = [
    # (n_head, n_head_kv, head_dim, n_rot, neox, lengths, shifts, ranks)
    (4, 4, 64, 64, False, [32, 17], [0, 0], [0, 0]),  # MHA, no correction
    (9, 3, 64, 64, False, [32, 32, 5], [0, 40, 40], [0, 8, 8]),  # SmolLM2 GQA, a corrected shifted segment
    (8, 2, 64, 64, True, [7, 30, 3], [0, -12, 100], [0, 32, 1]),  # neox, negative shift, ranks 32 and 1
    (8, 1, 128, 128, False, [40, 9], [3, 0], [16, 0]),  # MQA, head 128
    (6, 2, 32, 16, True, [13, 13, 13], [5, 6, 7], [2, 2, 2]),  # partial rotary, three segments
    (4, 2, 24, 24, False, [10, 11], [0, 9], [0, 3]),  # head size not a multiple of 8: portable path
]
