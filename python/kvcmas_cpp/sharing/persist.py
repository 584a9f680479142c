"""Saving and loading what kvcmas learns (the ridge maps), safely.

A file is a NumPy .npz archive (no pickled objects) holding a JSON header (format, the model's fingerprint, rank,
alpha, the edges, the span rows each edge's maps apply to) and the maps' arrays. It is written atomically: a
temporary file in the same directory, flushed and fsynced, then renamed over the target, so a crash or a full disk
never leaves a half-written file under the name. Loading checks the format, the fingerprint (maps are only valid
for the model they were fitted on), every array's shape, and that every value is finite; anything else is a
ValueError naming the file.

CalibrationStore keeps what agent sessions and the server learn across restarts: a directory with one such file per
fitted edge, keyed by the model's fingerprint, the method, the workflow and the edge's (content) key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import weakref
import zipfile
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..model import Model
from .estimator_base import Edge
from .ridge import RidgeEstimator, RidgeMap

log = logging.getLogger("kvcmas")

FORMAT = "kvcmas-ridge-v1"
_FIELDS = ("mu_x", "proj", "vt", "mu_y")
_HEAD_BYTES = 8 << 20  # the file's first bytes: header, metadata, tensor table and the first weights


_fingerprints: weakref.WeakKeyDictionary[Model, str] = weakref.WeakKeyDictionary()


def model_fingerprint(model: Model) -> str:
    """Identifies the weights: shape parameters, file size and a hash of the file's first 8 MiB (computed once per
    loaded model)."""
    known = _fingerprints.get(model)
    if known is not None:
        return known
    h = hashlib.sha256()
    shape = (model.arch, model.n_layer, model.n_embd, model.n_head, model.n_head_kv, model.n_vocab)
    h.update(json.dumps(shape).encode())
    with open(model.path, "rb") as f:
        h.update(str(os.fstat(f.fileno()).st_size).encode())
        h.update(f.read(_HEAD_BYTES))
    _fingerprints[model] = h.hexdigest()
    return _fingerprints[model]


def save_ridge(
    estimator: RidgeEstimator,
    path: str | os.PathLike[str],
    model: Model,
    edges: Iterable[Edge] | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Writes the fitted maps of `estimator` (fitted on `model`) to `path` atomically: those of `edges` (default:
    every fitted edge), with `extra` header fields."""
    target = Path(path)
    edges = sorted(estimator.maps if edges is None else edges, key=str)
    header: dict[str, Any] = {
        **(extra or {}),
        "format": FORMAT,
        "fingerprint": model_fingerprint(model),
        "rank": estimator.rank,
        "alpha": estimator.alpha,
        "edges": [[ph, reader] for ph, reader in edges],
        # per edge, the span rows its maps apply to (RidgeMap.rows, 0: every row); files without it: every row
        "rows": [_fitted_rows(estimator.maps[edge]) for edge in edges],
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
    return _load_ridge(path, model)[0]


def _load_ridge(path: str | os.PathLike[str], model: Model) -> tuple[RidgeEstimator, dict[str, Any]]:
    """load_ridge, and the file's header."""
    with _opened(path) as (_, z):
        header = _header(z, model)
        kd = model.kv_width
        rank, alpha = int(header["rank"]), float(header["alpha"])
        if not 1 <= rank <= kd:
            raise ValueError(f"rank {rank} out of range")
        est = RidgeEstimator(rank=rank, alpha=alpha)
        fitted_rows = header.get("rows", [0] * len(header["edges"]))
        if not (
            isinstance(fitted_rows, list)
            and len(fitted_rows) == len(header["edges"])
            and all(type(r) is int and r >= 0 for r in fitted_rows)
        ):
            raise ValueError("header field rows must hold one row count >= 0 per edge")
        for i, (ph, reader) in enumerate(header["edges"]):
            maps: list[tuple[RidgeMap, RidgeMap] | None] = [None]
            for il in range(1, model.n_layer):
                pair = []
                for kind in "kv":
                    a = {name: z[f"e{i}_l{il}_{kind}_{name}"] for name in _FIELDS}
                    r = a["vt"].shape[0]
                    want = {"mu_x": (kd,), "proj": (kd, r), "vt": (r, kd), "mu_y": (kd,)}
                    for name, arr in a.items():
                        if arr.shape != want[name] or arr.dtype != np.float32 or not np.isfinite(arr).all():
                            raise ValueError(f"array {name} of edge {ph!r}/{reader} layer {il} is malformed")
                    pair.append(RidgeMap(**a, rows=fitted_rows[i]))
                maps.append((pair[0], pair[1]))
            if not isinstance(reader, (int, str)):
                raise ValueError(f"edge {ph!r}: reader key {reader!r} is neither a number nor a string")
            est.maps[(str(ph), reader)] = maps
        return est, header


def _fitted_rows(maps: list[tuple[RidgeMap, RidgeMap] | None]) -> int:
    """The span rows an edge's maps apply to (one bound for all of its layers; 0: every row)."""
    return next((pair[0].rows for pair in maps if pair is not None), 0)


def _read_header(path: str | os.PathLike[str], model: Model) -> dict[str, Any]:
    """The checked header of a calibration file alone (its arrays are not read). Raises as load_ridge does."""
    with _opened(path) as (_, z):
        return _header(z, model)


def _header(z: Any, model: Model) -> dict[str, Any]:
    header = json.loads(bytes(z["header"]).decode())
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} file")
    if header.get("fingerprint") != model_fingerprint(model):
        raise ValueError(f"saved for another model than {os.path.basename(model.path)}")
    return header


@contextlib.contextmanager
def _opened(path: str | os.PathLike[str]) -> Iterator[tuple[Path, Any]]:
    """A calibration file opened as an .npz archive; whatever is wrong with it (inside the block too) is a
    ValueError naming the file, and FileNotFoundError when there is none."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file")
    try:
        with p.open("rb") as f:
            magic = f.read(4)
        if magic[:2] != b"PK":  # np.load would blame "pickled data" for any other file
            raise ValueError(f"not a {FORMAT} file (not an .npz archive: it starts with {magic!r})")
        with np.load(p, allow_pickle=False) as z:
            yield p, z
    except (KeyError, TypeError, AttributeError, OSError, zipfile.BadZipFile, json.JSONDecodeError, EOFError) as e:
        raise ValueError(f"{p}: damaged kvcmas estimator file ({type(e).__name__}: {e})") from None
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None


def default_calibration_dir() -> Path:
    """Where learned corrections live by default: $XDG_CACHE_HOME/kvcmas (~/.cache/kvcmas)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcmas"


# A calibration file's name: a hash of its (method, workflow), then of its edge. A store lists only the files of its
# own (method, workflow), so a new namespace never opens another's; files written before this naming (one hash) are
# indexed by their headers once per process (_LegacyIndex).
_NAME = re.compile(r"[0-9a-f]{16}-[0-9a-f]{32}\.npz")


def _owner_key(method: str, workflow: str) -> str:
    return hashlib.sha256(json.dumps([method, workflow]).encode()).hexdigest()[:16]


class _LegacyIndex:
    """Files of the older one-hash naming, by directory: their (method, workflow) read from each header once (again
    only when the file changes), or why the file was refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[Path, tuple[int, int, tuple[str, str] | str]] = {}

    def files(self, directory: Path, model: Model, owner: tuple[str, str]) -> tuple[list[Path], list[str]]:
        """The legacy files of `owner` in directory, and the refusals of the directory's legacy files."""
        mine: list[Path] = []
        refused: list[str] = []
        with self._lock:
            for entry in sorted(os.scandir(directory), key=lambda e: e.name):
                if not entry.name.endswith(".npz") or _NAME.fullmatch(entry.name) or not entry.is_file():
                    continue
                path = Path(entry.path)
                st = entry.stat()
                known = self._seen.get(path)
                if known is None or known[:2] != (st.st_mtime_ns, st.st_size):
                    try:
                        header = _read_header(path, model)
                        found: tuple[str, str] | str = (str(header.get("method")), str(header.get("workflow")))
                    except (ValueError, OSError) as e:
                        found = str(e)
                        log.warning("kvcmas: calibration file refused (left in place): %s", found)
                    known = self._seen[path] = (st.st_mtime_ns, st.st_size, found)
                if isinstance(known[2], str):
                    refused.append(known[2])
                elif known[2] == owner:
                    mine.append(path)
        return mine, refused


_legacy = _LegacyIndex()


def check_calibration_dir(root: str | os.PathLike[str], model: Model) -> Path:
    """The directory where `model`'s calibration files go under root, made if missing, once it is proven writable
    (a file written and removed); its files of the older naming are indexed now, not by a tenant's first request.
    Raises ValueError naming the problem (root is a file, cannot be made, is not writable)."""
    directory = Path(root) / model_fingerprint(model)[:16]
    if Path(root).exists() and not Path(root).is_dir():
        raise ValueError(f"--calibration-dir {root}: not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe.", suffix=".tmp", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"--calibration-dir {root}: cannot write calibration files there: {e.strerror or e}") from None
    _legacy.files(directory, model, ("", ""))
    return directory


class CalibrationStore:
    """Fitted ridge maps of one (model, method, workflow) kept in a directory:
    <root>/<fingerprint[:16]>/<owner>-<edge>.npz, one file per edge (save_ridge's format; owner hashes method and
    workflow, edge the edge), so a store opens only its own files. Writes are atomic; a file that is damaged, of
    another format or saved for another model is refused with a warning naming it and left as it is (`refused`
    lists the messages); the other files still load."""

    def __init__(self, root: str | os.PathLike[str], model: Model, method: str, workflow: str) -> None:
        self.model, self.method, self.workflow = model, method, workflow
        self.fingerprint = model_fingerprint(model)
        self.dir = Path(root) / self.fingerprint[:16]
        self.owner = _owner_key(method, workflow)
        self.refused: list[str] = []
        self.failed_saves = 0  # edges whose file could not be written (the maps stay in memory)

    def path(self, edge: Edge) -> Path:
        key = json.dumps([self.method, self.workflow, list(edge)])
        return self.dir / f"{self.owner}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.npz"

    def save(self, estimator: RidgeEstimator, edges: Iterable[Edge]) -> None:
        """Writes the given fitted edges, one file each; a failed write is logged and counted (the maps stay in
        memory)."""
        global _save_failure_count
        extra = {"method": self.method, "workflow": self.workflow}
        for edge in edges:
            if edge not in estimator.maps:
                continue
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                save_ridge(estimator, self.path(edge), self.model, [edge], extra)
            except OSError as e:
                self.failed_saves += 1
                _save_failure_count += 1
                _save_failures.append(f"{self.dir}: {e.strerror or e}")
                log.warning("kvcmas: could not save the calibration of edge %s to %s: %s", edge, self.dir, e)

    def load_into(self, estimator: RidgeEstimator) -> int:
        """Installs every stored edge of this method and workflow into `estimator` (fitted at its rank and alpha).
        Returns how many edges were loaded. Opens only this store's files (and, once per process, the headers of
        files of the older naming)."""
        if not self.dir.is_dir():
            return 0
        legacy, refused = _legacy.files(self.dir, self.model, (self.method, self.workflow))
        self.refused += refused
        loaded = 0
        for path in sorted(self.dir.glob(f"{self.owner}-*.npz")) + legacy:
            try:
                got, header = _load_ridge(path, self.model)
            except (ValueError, OSError) as e:
                self._refuse(f"{e}")
                continue
            if header.get("method") != self.method or header.get("workflow") != self.workflow:
                continue  # another workflow's or method's edge
            if (got.rank, got.alpha) != (estimator.rank, estimator.alpha):
                self._refuse(
                    f"{path}: fitted at rank {got.rank}, alpha {got.alpha}; "
                    f"this estimator uses rank {estimator.rank}, alpha {estimator.alpha}"
                )
                continue
            for edge, maps in got.maps.items():
                if estimator.calibrating(edge):  # what this process learned already stays
                    estimator.set_maps(edge, maps)
                    loaded += 1
        return loaded

    def _refuse(self, message: str) -> None:
        self.refused.append(message)
        log.warning("kvcmas: calibration file refused (left in place): %s", message)


# Saves that failed in this process, latest last (bounded): the server reports them in /health and /metrics.
_save_failures: deque[str] = deque(maxlen=16)


_save_failure_count = 0


def save_failures() -> list[str]:
    """The latest failed calibration saves of this process (directory: reason), oldest first."""
    return list(_save_failures)


def save_failure_count() -> int:
    """Calibration saves that failed in this process."""
    return _save_failure_count
