"""The model store: models installed by name from data wheels, checked by size and sha256 before use."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from kvcmas_cpp import model_store
from kvcmas_cpp.model import default_model_path, resolve_model_path


def _fake_spec(parts: list[bytes], *, size: int | None = None, sha: str | None = None) -> model_store.StoredModel:
    whole = b"".join(parts)
    return model_store.StoredModel(
        "fake-model",
        "fake.gguf",
        len(whole) if size is None else size,
        hashlib.sha256(whole).hexdigest() if sha is None else sha,
        tuple(
            model_store.PartsPackage(f"kvcmas-fake-part{i}", "0.1.0", f"kvcmas_fake_part{i}", f"data/part{i:02d}.bin")
            for i in range(1, len(parts) + 1)
        ),
        "a test model",
    )


def _wheel(folder: Path, pkg: model_store.PartsPackage, data: bytes) -> None:
    """A minimal data wheel like the real ones: the import package with its data file, and the dist-info."""
    dist = pkg.dist.replace("-", "_")
    info = f"{dist}-{pkg.version}.dist-info"
    files = {
        f"{pkg.module}/__init__.py": b"",
        f"{pkg.module}/{pkg.member}": data,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {pkg.dist}\nVersion: {pkg.version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{dist}-{pkg.version}-py3-none-any.whl", "w") as z:
        for name, body in files.items():
            z.writestr(name, body)
        z.writestr(f"{info}/RECORD", record)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "store"
    monkeypatch.setenv("KVCMAS_MODELS_DIR", str(folder))
    return folder


def _part_files(tmp_path: Path, parts: list[bytes]) -> list[Path]:
    out = []
    for i, data in enumerate(parts):
        p = tmp_path / f"part{i}.bin"
        p.write_bytes(data)
        out.append(p)
    return out


PARTS = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3, b"tail"]


def test_assemble_concatenates_in_order_and_checks(tmp_path: Path, store: Path) -> None:
    spec = _fake_spec(PARTS)
    out = model_store.assemble(_part_files(tmp_path, PARTS), store / spec.file, spec.size, spec.sha256)
    assert out.read_bytes() == b"".join(PARTS)
    assert [p.name for p in store.iterdir()] == [spec.file]


@pytest.mark.parametrize(
    "size, sha, match",
    [
        (sum(map(len, PARTS)) + 1, None, "bytes, expected"),  # parts too short
        (sum(map(len, PARTS)) - 1, None, "more than the expected"),  # parts too long
        (None, "0" * 64, "sha256"),
    ],
)
def test_assemble_refuses_a_mismatch_and_leaves_nothing(
    tmp_path: Path, store: Path, size: int | None, sha: str | None, match: str
) -> None:
    spec = _fake_spec(PARTS, size=size, sha=sha)
    with pytest.raises(ValueError, match=match):
        model_store.assemble(_part_files(tmp_path, PARTS), store / spec.file, spec.size, spec.sha256)
    assert list(store.iterdir()) == []  # no partial file, no temporary file


def test_pull_installs_data_wheels_with_pip_and_verifies(
    tmp_path: Path, store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    spec = _fake_spec(PARTS)
    for pkg, data in zip(spec.parts, PARTS, strict=True):
        _wheel(wheels, pkg, data)
    monkeypatch.setitem(model_store.MODELS, spec.name, spec)
    with pytest.raises(FileNotFoundError, match="kvcmas models pull fake-model"):
        resolve_model_path("fake-model")
    path = model_store.pull(spec.name, pip_args=["--no-index", "--find-links", str(wheels)], log=lambda _s: None)
    assert path.read_bytes() == b"".join(PARTS)
    assert resolve_model_path("fake-model") == str(path)
    # only the model (and its verification stamp) stays: the wheels' temporary install is gone
    assert sorted(p.name for p in store.iterdir()) == [spec.file, spec.file + ".verified"]

    # the same wheels with a wrong pinned hash: refused, nothing left
    bad = _fake_spec(PARTS, sha="f" * 64)
    monkeypatch.setitem(model_store.MODELS, bad.name, bad)
    path.unlink()
    with pytest.raises(ValueError, match="sha256"):
        model_store.pull(bad.name, pip_args=["--no-index", "--find-links", str(wheels)], log=lambda _s: None)
    assert sorted(p.name for p in store.iterdir()) == [spec.file + ".verified"]


def test_an_installed_file_that_changed_is_refused(
    tmp_path: Path, store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _fake_spec(PARTS)
    monkeypatch.setitem(model_store.MODELS, spec.name, spec)
    path = model_store.assemble(_part_files(tmp_path, PARTS), store / spec.file, spec.size, spec.sha256)
    assert model_store.resolve(spec.name) == str(path)  # hashed once, stamped
    data = bytearray(path.read_bytes())
    data[7] ^= 1  # same size, other content (and a new mtime)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        model_store.resolve(spec.name)
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(ValueError, match="bytes, expected"):
        model_store.resolve(spec.name)


def test_resolver_names_paths_and_default(tmp_path: Path) -> None:
    assert resolve_model_path(None) == default_model_path()
    given = tmp_path / "file.gguf"
    given.write_bytes(b"GGUF")
    assert resolve_model_path(str(given)) == str(given)  # a path is passed on as given; the loader judges the file
    for missing in ("qwen2.5-coder", str(tmp_path / "gone.gguf")):  # a mistyped name, a missing file
        with pytest.raises(FileNotFoundError, match=r"no such model file, and not a model name .*qwen2\.5-coder-0\.5b"):
            resolve_model_path(missing)
    assert model_store.MODELS["qwen2.5-coder-0.5b"].size == 491_400_064
    assert model_store.MODELS["qwen2.5-coder-0.5b"].sha256.startswith("1d9614638d18")
    with pytest.raises(ValueError, match="unknown model"):
        model_store.get("no-such-model")


def test_model_takes_a_store_name(tmp_path: Path, store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Model("qwen2.5-coder-0.5b")` loads the installed file, as `--model` does; a name not installed says how to
    install it (it was the loader's "cannot open")."""
    from kvcmas_cpp.model import Model

    data = Path(default_model_path()).read_bytes()
    spec = _fake_spec([data])
    monkeypatch.setitem(model_store.MODELS, spec.name, spec)
    with pytest.raises(FileNotFoundError, match=r"model 'fake-model' is not installed .*kvcmas models pull fake-model"):
        Model(spec.name)
    installed = model_store.assemble(_part_files(tmp_path, [data]), store / spec.file, spec.size, spec.sha256)
    model = Model(spec.name, n_ctx=64)
    assert model.path == str(installed)
    assert model.tokenize("hello") == Model(default_model_path(), n_ctx=64).tokenize("hello")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    (elsewhere / spec.name).write_bytes(b"")  # a file of that name is the file, not the name
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ValueError, match="fake-model: file is empty"):
        Model(spec.name)
    assert Model(n_ctx=64).path == default_model_path()  # no path: the default model, as the CLI's default


def test_models_list_command(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvcmas_cpp.cli import main

    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "| qwen2.5-coder-0.5b | 469 MiB | no |" in out
    assert main(["models", "pull", "no-such-model"]) == 1  # a clear error, no traceback
