"""Records what the core computes for fixed inputs, to prove a refactor of the core changed nothing.

    python3 tests/backend_reference.py record DIR     # one .npz per (model file, KV type) under DIR
    python3 tests/backend_reference.py compare DIR    # recomputes and compares bit for bit; exit 1 on any difference

Every weight type the test models cover (the tiny random llama / llama_untied / llama_rope3 / qwen2 files in all
their types, the SmolLM2 re-exports F32 / F16 / BF16 / Q8_0 and the default Q4_1 file), f32 and f16 KV. Per file:
prefill logits, batched decode of a sequence and its fork, embedding-row input, a span shared at its own position,
shifted, with a random low-rank correction, a ridge correction built in the core (its factors and the logits read
through it), a materialized copy of a corrected span, and the KV read back through all of these. Uses the raw
`_core` module only, so the Python layer above it cannot change what is recorded.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "models"))
sys.path.insert(0, str(REPO / "python"))

N_THREADS = 2  # fixed: the recording must not depend on the machine's core count


def model_files() -> Iterator[tuple[str, Path]]:
    """(name, path) of every file recorded: tiny models first, then the SmolLM2 files when installed."""
    import make_test_models as mtm

    for (variant, type_name), path in sorted(mtm.ensure_tiny_models().items()):
        yield f"tiny-{variant}-{type_name}", path
    src = mtm.default_model_path()
    if src is not None:
        yield "smollm2-Q4_1", src
        for type_name, path in sorted(mtm.ensure_reference_models(src=src).items()):
            yield f"smollm2-{type_name}", path


def _ids(rng: np.random.Generator, n_vocab: int, n: int) -> np.ndarray:
    return rng.integers(0, n_vocab, size=n).astype(np.int32)


def record_one(core, path: Path, kv_type: str, device: str | None = None) -> dict[str, np.ndarray]:
    """Everything recorded for one model file and KV type, by name."""
    kwargs = {} if device is None else {"device": device}
    m = core.Model(str(path), n_threads=N_THREADS, n_ctx=256, kv_type=kv_type, **kwargs)
    rng = np.random.default_rng(12345)
    out: dict[str, np.ndarray] = {}
    nv, kd, nl = m.n_vocab, m.n_head_kv * m.head_dim, m.n_layer

    def run(seq: int, toks: np.ndarray, want: str = "all") -> np.ndarray:
        flags = np.ones(len(toks), np.uint8) if want == "all" else np.zeros(len(toks), np.uint8)
        if want == "last":
            flags[-1] = 1
        return m.decode(np.full(len(toks), seq, np.int32), toks.astype(np.int32), flags)

    # Prefill across a block boundary (blocks hold 32 rows), then decode a sequence and its fork in one batch.
    prompt = _ids(rng, nv, 45)
    a = m.seq_new()
    out["prefill"] = run(a, prompt)
    b = m.seq_fork(a)
    steps = []
    for _ in range(3):
        t = _ids(rng, nv, 2)
        steps.append(m.decode(np.array([a, b], np.int32), t, np.ones(2, np.uint8)))
    out["decode_batched"] = np.stack(steps)
    out["kv_a_k"], out["kv_a_v"] = m.seq_kv(a, 0, m.seq_length(a))

    # Embedding-row input (how images enter), mixed with tokens in one batch.
    e = m.seq_new()
    embd = rng.standard_normal((3, m.n_embd)).astype(np.float32) * 0.05
    out["embd_rows"] = m.decode(
        np.full(5, e, np.int32),
        np.array([int(prompt[0]), -1, -1, int(prompt[1]), -1], np.int32),
        np.ones(5, np.uint8),
        embd,
        np.array([-1, 0, 2, -1, 1], np.int32),
    )

    span_pos, span_n = 10, 30
    tail = _ids(rng, nv, 5)
    shared = m.seq_share(a, span_pos, span_n)

    # The span read at its own position (no shift) and shifted by -3.
    for name, prefix_n in (("shared_same", span_pos), ("shared_shifted", span_pos - 3)):
        s = m.seq_new()
        run(s, prompt[:prefix_n], "none")
        m.seq_append_shared(s, shared)
        out[name] = run(s, tail)
        out[name + "_kv_k"], out[name + "_kv_v"] = m.seq_kv(s, prefix_n, span_n)
        m.seq_remove(s)

    # A random low-rank correction (layer 0 uncorrected), read fused by attention.
    rank = 4
    corr = core.KvCorrection(span_n, rank, kd, nl)
    for il in range(1, nl):
        f = [rng.standard_normal(shape).astype(np.float32) * 0.1 for shape in ((span_n, rank), (rank, kd)) * 2]
        corr.set_layer(il, *f)
    c = m.seq_new()
    run(c, prompt[:7], "none")
    m.seq_append_shared(c, shared, corr)
    out["corrected_kv_k"], out["corrected_kv_v"] = m.seq_kv(c, 7, span_n)
    out["corrected"] = run(c, tail)

    # A ridge correction built in the core from the corrected view (prev = corr), then read through.
    r = 3
    maps = core.RidgeMaps(nl, kd, r)
    for il in range(1, nl):
        parts = []
        for _ in range(2):
            parts += [
                rng.standard_normal(kd).astype(np.float32) * 0.1,
                rng.standard_normal((kd, r)).astype(np.float32) * 0.1,
                rng.standard_normal((r, kd)).astype(np.float32) * 0.1,
                rng.standard_normal(kd).astype(np.float32) * 0.1,
            ]
        maps.set_layer(il, *parts)
    ridge = core.ridge_correction(m, maps, c, 7, span_n, shared.frame0, corr)
    for il in range(nl):
        layer = core.correction_layer(ridge, il)
        if layer is not None:
            for name, arr in zip(("a_k", "b_k", "a_v", "b_v"), layer, strict=True):
                out[f"ridge_L{il}_{name}"] = arr
    d = m.seq_new()
    run(d, prompt[:12], "none")
    m.seq_append_shared(d, shared, ridge)
    out["ridge"] = run(d, tail)

    # A materialized (copied) corrected span reads like the fused one up to storage rounding; record both.
    f_seq = m.seq_new()
    run(f_seq, prompt[:5], "none")
    m.seq_append_shared(f_seq, shared, corr)
    out["materialized_rows"] = np.array([core.seq_materialize_last(m, f_seq)], np.int32)
    out["materialized_kv_k"], out["materialized_kv_v"] = m.seq_kv(f_seq, 5, span_n)
    out["materialized"] = run(f_seq, tail)
    for s in (a, b, c, d, e, f_seq):
        m.seq_remove(s)
    return out


def _cases() -> Iterator[tuple[str, Path, str]]:
    for name, path in model_files():
        for kv_type in ("f32", "f16"):
            yield f"{name}-{kv_type}", path, kv_type


def _for_each(fn: Callable[[str, dict[str, np.ndarray]], None]) -> None:
    from kvcmas_cpp._native import core

    for case, path, kv_type in _cases():
        t0 = time.perf_counter()
        fn(case, record_one(core, path, kv_type))
        print(f"{case}: {time.perf_counter() - t0:.2f} s", flush=True)


def record(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    _for_each(lambda case, arrays: np.savez(out_dir / f"{case}.npz", **arrays))


def compare(ref_dir: Path) -> int:
    bad: list[str] = []
    n_arrays = 0

    def check(case: str, arrays: dict[str, np.ndarray]) -> None:
        nonlocal n_arrays
        ref_path = ref_dir / f"{case}.npz"
        if not ref_path.exists():
            bad.append(f"{case}: no recording")
            return
        ref = np.load(ref_path)
        if set(ref.files) != set(arrays):
            bad.append(f"{case}: arrays {sorted(set(ref.files) ^ set(arrays))} differ in presence")
        for key in sorted(set(ref.files) & set(arrays)):
            n_arrays += 1
            want, got = ref[key], arrays[key]
            if want.shape != got.shape or want.dtype != got.dtype or want.tobytes() != got.tobytes():
                diff = np.abs(want.astype(np.float64) - got.astype(np.float64)).max() if want.shape == got.shape else -1
                bad.append(f"{case}/{key}: not bit-identical (max |diff| {diff:.3g})")

    _for_each(check)
    print(f"compared {n_arrays} arrays: {len(bad)} differ")
    for line in bad:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("record", "compare"):
        sys.exit(__doc__)
    directory = Path(sys.argv[2])
    if sys.argv[1] == "record":
        record(directory)
    else:
        sys.exit(compare(directory))
