"""Concurrent sessions on one Model: several Python threads create, fork, append to, share, truncate and remove
sequences at the same time (decode releases the GIL, so the C++ side really runs from several threads). Every
thread's results must equal what the same work gives when run alone, and the KV pool must be empty afterwards.

scripts/ci-tsan.sh runs this file against a ThreadSanitizer build of the core; scripts/ci-sanitize.sh under ASan.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import kvcmas_cpp as kc

N_WORKERS = 4
ROUNDS = 3


@pytest.fixture(scope="module")
def model_path(tiny_models: dict[tuple[str, str], Path]) -> Path:
    return tiny_models[("llama", "Q8_0")]


def _ids(n_vocab: int, seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, n_vocab, size=n)]


def session(model: kc.Model, worker: int, round_: int) -> list[np.ndarray]:
    """One agent's work: a prompt, a fork that diverges, a shared span appended elsewhere, truncation, removal.

    Returns the logits it saw, in order; they depend only on (worker, round_), not on other sessions.
    """
    seed = 1000 * worker + round_
    v = model.n_vocab
    out: list[np.ndarray] = []
    with model.new_sequence() as a:
        out.append(a.append(_ids(v, seed, 24 + worker), logits="last"))
        b = a.fork()
        out.append(a.append(_ids(v, seed + 1, 5), logits="all"))
        out.append(b.append(_ids(v, seed + 2, 3 + worker), logits="all"))
        span = a.share(4, 8)
        with model.new_sequence() as c:
            c.append(_ids(v, seed + 3, 6), logits="none")
            c.append_shared(span)
            out.append(c.append(_ids(v, seed + 4, 2), logits="all"))
        a.truncate(10)
        out.append(a.append(_ids(v, seed + 5, 4), logits="all"))
        [last_a, last_b] = model.decode_batch([(a, _ids(v, seed + 6, 2)), (b, _ids(v, seed + 7, 1))])
        out += [last_a, last_b]
        b.close()
        out.append(np.stack([np.asarray(x) for x in a.kv(0, 4)]))
    return out


def _run_threads(model: kc.Model, rounds: int) -> dict[tuple[int, int], list[np.ndarray]]:
    results: dict[tuple[int, int], list[np.ndarray]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(N_WORKERS)

    def worker(w: int) -> None:
        try:
            start.wait()
            for r in range(rounds):
                results[(w, r)] = session(model, w, r)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(N_WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a worker thread did not finish"
    if errors:
        raise errors[0]
    return results


def test_concurrent_sessions_equal_serial_ones(model_path: Path) -> None:
    model = kc.Model(model_path, n_threads=2, n_ctx=256)
    baseline = model.kv_bytes_in_use
    serial = {(w, r): session(model, w, r) for w in range(N_WORKERS) for r in range(ROUNDS)}
    assert model.kv_bytes_in_use == baseline
    concurrent = _run_threads(model, ROUNDS)
    assert set(concurrent) == set(serial)
    for key, expected in serial.items():
        got = concurrent[key]
        assert len(got) == len(expected)
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g.shape == e.shape, (key, i)
            assert np.array_equal(g, e), f"session {key}, result {i}: concurrent run differs from the serial one"
    assert model.kv_bytes_in_use == baseline, "sequences were closed but KV memory is still in use"
    assert model.n_sequences == 0


def test_concurrent_errors_leave_other_sessions_intact(model_path: Path) -> None:
    """Threads that make invalid calls (bad ids, removed sequences) get errors; the valid sessions are unaffected."""
    model = kc.Model(model_path, n_threads=2, n_ctx=256)
    expected = session(model, 7, 0)
    failures: list[str] = []
    bad_errors: list[BaseException] = []
    stop = threading.Event()

    def vandal() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            seq = model.new_sequence()
            try:
                seq.append([model.n_vocab + i], logits="none")  # out of range: refused before any state changes
                failures.append("an out-of-range token was accepted")
            except kc.KvcmasError:
                pass
            except BaseException as e:  # noqa: BLE001
                bad_errors.append(e)
            seq_id = seq.id
            seq.close()
            try:
                model.sequence_rows(seq_id)  # removed: must raise, never read freed state
                failures.append("a removed sequence still answered")
            except Exception:  # noqa: BLE001 - any Python exception is the expected refusal
                pass

    vandals = [threading.Thread(target=vandal) for _ in range(2)]
    for t in vandals:
        t.start()
    try:
        for _ in range(3):
            got = session(model, 7, 0)
            for g, e in zip(got, expected, strict=True):
                assert np.array_equal(g, e)
    finally:
        stop.set()
        for t in vandals:
            t.join(timeout=60)
    assert not failures, failures[:3]
    assert not bad_errors, bad_errors[:3]
    assert model.n_sequences == 0
