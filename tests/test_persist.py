"""Saved estimators: round trip, model fingerprint, damaged files, atomic writes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import kvcmas_cpp as kc
from kvcmas_cpp.sharing import estimators as est
from kvcmas_cpp.sharing import persist


@pytest.fixture(scope="module")
def model(default_model_path: str) -> kc.Model:
    return kc.Model(default_model_path, n_threads=2)


def _ctx(model: kc.Model, ph: str, reader: int, rng: np.random.Generator) -> est.EdgeContext:
    kd = model.n_head_kv * model._core.head_dim
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
    for a, b in zip(fitted.correct(ctx), loaded.correct(ctx), strict=True):  # type: ignore[arg-type]
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
