"""Saved estimators: round trip, model fingerprint, damaged files, atomic writes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import kvcmas_cpp as kc
from kvcmas_cpp.sharing import estimators as est
from kvcmas_cpp.sharing import persist


def _ctx(model: kc.Model, ph: str, reader: int, rng: np.random.Generator) -> est.EdgeContext:
    kd = model.n_head_kv * model.head_dim
    shape = (model.n_layer, 48, kd)
    base_k, base_v = rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)
    return est.EdgeContext(ph, reader, "m", base_k, base_v, base_k * 1.1 + 0.2, base_v - 0.1)


@pytest.fixture(scope="module")
def fitted(model: kc.Model) -> est.RidgeEstimator:
    rng = np.random.default_rng(0)
    r = est.RidgeEstimator(rank=4)
    for edge in (("user_question", 1), ("agent_0_current", 2)):
        for _ in range(2):
            r.add_example(_ctx(model, *edge, rng))
    r.fit()
    return r


def test_round_trip_gives_the_same_corrections(model: kc.Model, fitted: est.RidgeEstimator, tmp_path: Path) -> None:
    path = tmp_path / "ridge.npz"
    persist.save_ridge(fitted, path, model)
    loaded = persist.load_ridge(path, model)
    assert sorted(loaded.maps) == sorted(fitted.maps) and loaded.rank == fitted.rank
    ctx = _ctx(model, "agent_0_current", 2, np.random.default_rng(5))
    for a, b in zip(fitted.correction(ctx), loaded.correction(ctx), strict=True):  # type: ignore[arg-type]
        if a is None:
            assert b is None
            continue
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_another_model_is_refused(
    model: kc.Model, fitted: est.RidgeEstimator, tiny_models: dict, tmp_path: Path
) -> None:
    path = tmp_path / "ridge.npz"
    persist.save_ridge(fitted, path, model)
    other = kc.Model(tiny_models[("llama", "F32")], n_threads=1)
    with pytest.raises(ValueError, match="another model"):
        persist.load_ridge(path, other)


def test_damaged_files_are_clear_errors(model: kc.Model, fitted: est.RidgeEstimator, tmp_path: Path) -> None:
    good = tmp_path / "ridge.npz"
    persist.save_ridge(fitted, good, model)
    data = good.read_bytes()
    cases = {
        "truncated": data[: len(data) // 2],
        "garbage": os.urandom(4096),
        "empty": b"",
        "npy": b"\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }"
        + b" " * 54
        + b"\n"
        + b"\x00" * 4,
    }
    for name, blob in cases.items():
        bad = tmp_path / f"{name}.npz"
        bad.write_bytes(blob)
        with pytest.raises(ValueError, match=str(bad.name)):
            persist.load_ridge(bad, model)
    text = tmp_path / "passwd"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(ValueError, match=r"passwd: not a kvcmas-ridge-v1 file \(not an \.npz archive"):
        persist.load_ridge(text, model)
    other_format = tmp_path / "other.npz"
    np.savez(other_format, header=np.frombuffer(b'{"format": "something-else"}', np.uint8))
    with pytest.raises(ValueError, match="not a kvcmas-ridge-v1 file"):
        persist.load_ridge(other_format, model)
    with pytest.raises(FileNotFoundError):
        persist.load_ridge(tmp_path / "missing.npz", model)


def test_a_failed_write_leaves_the_old_file(
    model: kc.Model, fitted: est.RidgeEstimator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ridge.npz"
    persist.save_ridge(fitted, path, model)
    before = path.read_bytes()

    def broken_savez(f, allow_pickle=True, **arrays):  # type: ignore[no-untyped-def]
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(persist.np, "savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        persist.save_ridge(fitted, path, model)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ridge.npz"]


# ---------------------------------------------------------------------------------------------- calibration directory
def _team_run(m: kc.Model, question: str, **kw: object) -> kc.agents.Response:
    """Two agents over one question; returns the reader's response."""
    from kvcmas_cpp.agents import AgentSession

    cfg = kc.agents.MethodConfig("kvcmas", head=4, rank=8, calibrate=1)  # one read fits an edge
    with AgentSession(m, "kvcmas", workflow="persist", config=cfg, **kw) as team:  # type: ignore[arg-type]
        a = team.agent("Solver", system="You are a math expert. Solve the problem.")
        b = team.agent("Critic", system="You are a careful critic.")
        team.share(question, label="Question")
        a.respond(max_tokens=8)
        return b.respond(max_tokens=1)


Q1 = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?"
Q2 = "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?"


def test_a_restart_keeps_the_learned_corrections(default_model_path: str, tiny_models: dict, tmp_path: Path) -> None:
    root = tmp_path / "calibration"
    first = kc.Model(default_model_path, n_threads=2)
    assert _team_run(first, Q1, calibration_dir=root).stats.gate == "calibrating -> reuse"
    files = sorted(root.rglob("*.npz"))
    assert len(files) == 2  # the question's edge and the reply's edge of the critic, one file each
    assert all(f.parent.name == persist.model_fingerprint(first)[:16] for f in files)
    assert not list(root.rglob("*.tmp"))
    warm = _team_run(first, Q2, calibration_dir=root)  # the same process: maps in memory
    assert warm.stats.gate == "reuse" and warm.stats.corr_rank > 0

    # a damaged file and another model's file in the directory: refused by name, left as they are
    damaged = files[0].parent / "0000damaged.npz"
    damaged.write_bytes(b"not a zip at all")
    tiny = kc.Model(tiny_models[("llama", "F32")], n_threads=1)
    r = est.RidgeEstimator(rank=8)
    kd = tiny.n_head_kv * tiny.head_dim
    rng = np.random.default_rng(0)
    base = rng.standard_normal((tiny.n_layer, 8, kd), np.float32)
    r.add_example(est.EdgeContext("context:", "agent:x", "", base, base, base + 1, base - 1))
    r.fit()
    foreign = files[0].parent / "0001foreign.npz"
    persist.save_ridge(r, foreign, tiny, extra={"method": "kvcmas", "workflow": "persist"})
    foreign_bytes = foreign.read_bytes()

    restarted = kc.Model(default_model_path, n_threads=2)  # a new process: fresh estimators, loaded from disk
    again = _team_run(restarted, Q2, calibration_dir=root)
    assert again.stats.gate == "reuse" and again.stats.corr_rank > 0  # the first workflow reuses, calibrated
    np.testing.assert_array_equal(again.first_logits, warm.first_logits)  # with the very same maps
    from kvcmas_cpp.agents import shared_estimator

    store = persist.CalibrationStore(root, restarted, "kvcmas", "persist")
    store.load_into(est.RidgeEstimator(rank=8))
    assert any("0000damaged.npz" in m and "damaged" in m for m in store.refused)
    assert any("0001foreign.npz" in m and "another model" in m for m in store.refused)
    assert damaged.read_bytes() == b"not a zip at all" and foreign.read_bytes() == foreign_bytes  # nothing lost
    assert len(shared_estimator(restarted, "kvcmas", "persist")[0].maps) == 2  # type: ignore[attr-defined]


def test_no_calibration_dir_writes_nothing_and_the_default_is_the_cache_home(
    default_model_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert persist.default_calibration_dir() == tmp_path / "xdg" / "kvcmas"
    m = kc.Model(default_model_path, n_threads=2)
    _team_run(m, Q1, calibration_dir=False)
    assert not (tmp_path / "xdg").exists()
    m2 = kc.Model(default_model_path, n_threads=2)
    _team_run(m2, Q1)  # default: on, under the cache home
    assert len(list((tmp_path / "xdg" / "kvcmas").rglob("*.npz"))) == 2
