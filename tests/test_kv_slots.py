"""KV slots: fork, truncate and remove must give exactly what recomputing from scratch gives, and batched decode of
several sequences must equal decoding them one by one."""

from __future__ import annotations

import os

import numpy as np
import pytest

import kvcmas_cpp as kc


@pytest.fixture(scope="module")
def model(default_model_path: str) -> kc.Model:
    return kc.Model(default_model_path, n_threads=2, n_ctx=512)


def _ids(model: kc.Model, seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(100, model.n_vocab, size=n)]


def _fresh(model: kc.Model, *chunks: list[int]) -> np.ndarray:
    """Logits of the last chunk, computed in a new sequence fed chunk by chunk."""
    with model.new_sequence() as seq:
        out = None
        for chunk in chunks:
            out = seq.append(chunk, logits="all")
    assert out is not None
    return out


def test_fork_shares_prefix_and_matches_recompute(model: kc.Model) -> None:
    prefix, x, y = _ids(model, 1, 45), _ids(model, 2, 7), _ids(model, 3, 9)
    with model.new_sequence() as a:
        a.append(prefix, logits="none")
        used_before_fork = model.kv_bytes_in_use
        b = a.fork()
        assert model.kv_bytes_in_use == used_before_fork  # a fork copies nothing
        out_a = a.append(x, logits="all")
        out_b = b.append(y, logits="all")
        assert len(a) == len(prefix) + len(x) and len(b) == len(prefix) + len(y)
        # The parent's later rows stay invisible to the fork and vice versa: exact equality with recomputation.
        np.testing.assert_array_equal(out_a, _fresh(model, prefix, x))
        np.testing.assert_array_equal(out_b, _fresh(model, prefix, y))
        b.close()


def test_fork_of_fork_and_parent_truncation(model: kc.Model) -> None:
    p, x, y, z = _ids(model, 4, 40), _ids(model, 5, 30), _ids(model, 6, 5), _ids(model, 7, 6)
    with model.new_sequence() as a:
        a.append(p + x, logits="none")
        b = a.fork()
        a.truncate(len(p))  # the parent drops rows the fork still reads
        a.append(z, logits="none")
        c = b.fork()
        out_c = c.append(y, logits="all")
        np.testing.assert_array_equal(out_c, _fresh(model, p + x, y))
        out_a = a.append(y, logits="all")
        np.testing.assert_array_equal(out_a, _fresh(model, p, z, y))
        b.close()
        c.close()


def test_truncate_then_continue_matches_recompute(model: kc.Model) -> None:
    p, x, y = _ids(model, 8, 70), _ids(model, 9, 20), _ids(model, 10, 11)
    with model.new_sequence() as a:
        a.append(p + x, logits="none")
        a.truncate(len(p))
        assert len(a) == len(p)
        out = a.append(y, logits="all")
    np.testing.assert_array_equal(out, _fresh(model, p, y)[-len(y) :])
    with pytest.raises(ValueError, match="truncate"), model.new_sequence() as s:
        s.append(p[:3], logits="none")
        s.truncate(4)


def test_remove_frees_memory(model: kc.Model) -> None:
    base = model.kv_bytes_in_use
    seq = model.new_sequence()
    seq.append(_ids(model, 11, 100), logits="none")
    assert model.kv_bytes_in_use > base
    fork = seq.fork()
    seq.close()
    assert model.kv_bytes_in_use > base  # the fork still reads the rows
    fork.close()
    assert model.kv_bytes_in_use == base
    with pytest.raises(kc.KvcmasError, match="no sequence"):
        model.sequence_rows(10**6)


def test_batched_decode_equals_one_by_one(model: kc.Model) -> None:
    prompts = [_ids(model, 20 + i, n) for i, n in enumerate((13, 29, 41))]
    steps = [_ids(model, 30 + i, 4) for i in range(3)]
    seqs = [model.new_sequence() for _ in prompts]
    for seq, p in zip(seqs, prompts, strict=True):
        seq.append(p, logits="none")
    batched = []
    for j in range(4):
        batched.append(model.decode_batch([(seq, [s[j]]) for seq, s in zip(seqs, steps, strict=True)]))
    for i, (p, s) in enumerate(zip(prompts, steps, strict=True)):
        with model.new_sequence() as alone:
            alone.append(p, logits="none")
            for j in range(4):
                single = alone.append([s[j]], logits="last")
                assert single is not None
                got = batched[j][i]
                scale = float(np.std(single))
                assert int(np.argmax(got)) == int(np.argmax(single))
                assert float(np.max(np.abs(got - single))) <= 1e-3 * scale
    for seq in seqs:
        seq.close()


def test_prefill_in_one_batch_mixing_sequences(model: kc.Model) -> None:
    """Prompts of two sequences in one forward pass give their own logits."""
    p1, p2 = _ids(model, 40, 17), _ids(model, 41, 23)
    a, b = model.new_sequence(), model.new_sequence()
    last = model.decode_batch([(a, p1), (b, p2)])
    for got, p in zip(last, (p1, p2), strict=True):
        # Logits of one row each side, so the output matmul takes the same (few-rows) kernel path on both.
        with model.new_sequence() as alone:
            ref = alone.append(p, logits="last")
        assert int(np.argmax(got)) == int(np.argmax(ref))
        assert float(np.max(np.abs(got - ref))) <= 1e-3 * float(np.std(ref))
    a.close()
    b.close()


def test_context_overflow_and_bad_ids_leave_state_unchanged(model: kc.Model) -> None:
    with model.new_sequence() as seq:
        seq.append(_ids(model, 50, 500), logits="none")
        used = model.kv_bytes_in_use
        with pytest.raises(kc.KvcmasError, match="context overflow"):
            seq.append(_ids(model, 51, 13))
        with pytest.raises(kc.KvcmasError, match="token id .* out of range"):
            seq.append([1, 2, model.n_vocab])
        with pytest.raises(kc.KvcmasError, match="out of range"):
            seq.append([-5])
        assert model.sequence_rows(seq.id) == 500
        assert model.kv_bytes_in_use == used
        # still usable, and exact
        out = seq.append([5, 6], logits="last")
        assert out is not None and np.all(np.isfinite(out))


def test_kv_budget_exhaustion_is_an_error(default_model_path: str) -> None:
    small = kc.Model(default_model_path, n_threads=1, n_ctx=512, kv_budget=3 * 1024 * 1024)
    with small.new_sequence() as seq:
        with pytest.raises(kc.KvcmasError, match="KV cache budget exhausted"):
            seq.append(_ids(small, 60, 200), logits="none")
        assert len(seq) == 0 and small.sequence_rows(seq.id) == 0
        assert small.kv_bytes_in_use == 0
        seq.append(_ids(small, 61, 20), logits="none")  # fits


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc to read the resident set size")
def test_trim_returns_freed_blocks_to_the_system(default_model_path: str) -> None:
    m = kc.Model(default_model_path, n_threads=2, n_ctx=2048, kv_budget=1 << 30)
    ids = _ids(m, 70, 24)
    with m.new_sequence() as probe:
        want = probe.append(ids, logits="all")
    block = m.kv_bytes_allocated  # one block (24 rows), freed again
    assert block > 0 and m.kv_bytes_in_use == 0

    # ~50 MiB of KV in two sequences, every row written, then freed: the pool keeps the blocks for reuse
    seqs = [m.new_sequence() for _ in range(2)]
    for i, s in enumerate(seqs):
        s.append(_ids(m, 80 + i, 1100), logits="none")
    held = m.kv_bytes_in_use
    assert held >= 40 << 20 and m.kv_bytes_allocated == held
    for s in seqs:
        s.close()
    assert m.kv_bytes_in_use == 0 and m.kv_bytes_allocated == held
    rss_freed = _rss_bytes()

    released = m.kv_trim()
    assert released == held and m.kv_bytes_allocated == 0
    # the pages really go back to the system (blocks are their own mappings, not heap chunks kept by malloc)
    assert rss_freed - _rss_bytes() > 0.8 * held
    assert m.kv_trim() == 0

    # trimmed blocks are mapped again on demand and compute the same thing
    with m.new_sequence() as again:
        np.testing.assert_array_equal(again.append(ids, logits="all"), want)
        assert m.kv_bytes_allocated == block
