"""Saving and loading what kvcmas learns (the ridge maps), safely.

A file is a NumPy .npz archive (no pickled objects) holding a JSON header (format, the model's fingerprint, rank,
alpha, the edges) and the maps' arrays. It is written atomically: a temporary file in the same directory, flushed
and fsynced, then renamed over the target, so a crash or a full disk never leaves a half-written file under the
name. Loading checks the format, the fingerprint (maps are only valid for the model they were fitted on), every
array's shape, and that every value is finite; anything else is a ValueError naming the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..model import Model
from .estimators import RidgeEstimator, _RidgeMap

FORMAT = "kvcmas-ridge-v1"
_FIELDS = ("mu_x", "proj", "vt", "mu_y")
_HEAD_BYTES = 8 << 20  # the file's first bytes: header, metadata, tensor table and the first weights


def model_fingerprint(model: Model) -> str:
    """Identifies the weights: shape parameters, file size and a hash of the file's first 8 MiB."""
    h = hashlib.sha256()
    shape = (model.arch, model.n_layer, model.n_embd, model.n_head, model.n_head_kv, model.n_vocab)
    h.update(json.dumps(shape).encode())
    with open(model.path, "rb") as f:
        h.update(str(os.fstat(f.fileno()).st_size).encode())
        h.update(f.read(_HEAD_BYTES))
    return h.hexdigest()


def save_ridge(estimator: RidgeEstimator, path: str | os.PathLike[str], model: Model) -> None:
    """Writes the fitted maps of `estimator` (fitted on `model`) to `path` atomically."""
    target = Path(path)
    edges = sorted(estimator.maps)
    header: dict[str, Any] = {
        "format": FORMAT,
        "fingerprint": model_fingerprint(model),
        "rank": estimator.rank,
        "alpha": estimator.alpha,
        "edges": [[ph, reader] for ph, reader in edges],
        "n_layer": model.n_layer,
    }
    arrays: dict[str, np.ndarray] = {"header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)}
    for i, edge in enumerate(edges):
        for il, pair in enumerate(estimator.maps[edge]):
            if pair is None:
                continue
            for kind, m in zip("kv", pair, strict=True):
                for name in _FIELDS:
                    arrays[f"e{i}_l{il}_{kind}_{name}"] = getattr(m, name)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, allow_pickle=False, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable where the platform allows it
        dfd = os.open(target.parent or ".", os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def load_ridge(path: str | os.PathLike[str], model: Model) -> RidgeEstimator:
    """The RidgeEstimator saved at `path`; raises ValueError when the file is not one, is damaged, or was saved for
    another model, and FileNotFoundError when it does not exist."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file")
    try:
        with np.load(p, allow_pickle=False) as z:
            header = json.loads(bytes(z["header"]).decode())
            if not isinstance(header, dict) or header.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} file")
            if header.get("fingerprint") != model_fingerprint(model):
                raise ValueError(f"saved for another model than {model.path}")
            kd = model.n_head_kv * model._core.head_dim
            rank, alpha = int(header["rank"]), float(header["alpha"])
            if not 1 <= rank <= kd:
                raise ValueError(f"rank {rank} out of range")
            est = RidgeEstimator(rank=rank, alpha=alpha)
            for i, (ph, reader) in enumerate(header["edges"]):
                maps: list[tuple[_RidgeMap, _RidgeMap] | None] = [None]
                for il in range(1, model.n_layer):
                    pair = []
                    for kind in "kv":
                        a = {name: z[f"e{i}_l{il}_{kind}_{name}"] for name in _FIELDS}
                        r = a["vt"].shape[0]
                        want = {"mu_x": (kd,), "proj": (kd, r), "vt": (r, kd), "mu_y": (kd,)}
                        for name, arr in a.items():
                            if arr.shape != want[name] or arr.dtype != np.float32 or not np.isfinite(arr).all():
                                raise ValueError(f"array {name} of edge {ph!r}/{reader} layer {il} is malformed")
                        pair.append(_RidgeMap(**a))
                    maps.append((pair[0], pair[1]))
                est.maps[(str(ph), int(reader))] = maps
            return est
    except (KeyError, TypeError, AttributeError, OSError, zipfile.BadZipFile, json.JSONDecodeError, EOFError) as e:
        raise ValueError(f"{p}: damaged kvcmas estimator file ({type(e).__name__}: {e})") from None
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None
