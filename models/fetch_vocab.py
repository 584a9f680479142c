"""Fetch llama.cpp's vocabulary test files (ggml-vocab-*.gguf with .inp/.out test vectors) for the tokenizer tests.

They ship inside the llama-cpp-python source distribution (vendor/llama.cpp/models/). This script downloads that
sdist with pip (only the archive, ~77 MB; nothing is built or installed) and extracts the ggml-vocab-* files into
models/generated/vocab/. It does nothing when the files are already there.

    python models/fetch_vocab.py                  # download with pip, then extract
    python models/fetch_vocab.py --sdist FILE     # extract from an already downloaded llama_cpp_python-*.tar.gz
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
VOCAB_DIR = Path(__file__).resolve().parent / "generated" / "vocab"
MEMBER_MARKER = "/vendor/llama.cpp/models/ggml-vocab-"
# Written last: its presence means the extraction finished.
STAMP = ".complete"


def is_complete(target: Path = VOCAB_DIR) -> bool:
    """True when a previous run extracted the files into target."""
    stamp = target / STAMP
    return stamp.is_file() and stamp.read_text().strip() == LLAMA_CPP_PYTHON


def download_sdist(dest: Path) -> Path:
    """Downloads the llama-cpp-python sdist into dest with pip; returns the archive path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
        "--disable-pip-version-check", "-d", str(dest), LLAMA_CPP_PYTHON,
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    archives = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        raise SystemExit(f"pip download did not leave a llama_cpp_python-*.tar.gz in {dest}")
    return archives[0]


def extract_vocab(sdist: Path, target: Path = VOCAB_DIR) -> list[str]:
    """Copies every */vendor/llama.cpp/models/ggml-vocab-* regular file of the archive into target (flat)."""
    target.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            if MEMBER_MARKER not in member.name or not member.isfile():
                continue
            name = Path(member.name).name  # flat: never trust directory parts of archive names
            if not name.startswith("ggml-vocab-") or "/" in name or name in (".", ".."):
                continue
            source = tar.extractfile(member)
            if source is None:
                continue
            tmp = target / (name + ".part")
            with source, open(tmp, "wb") as out:
                shutil.copyfileobj(source, out)
            tmp.replace(target / name)
            names.append(name)
    if not names:
        raise SystemExit(f"{sdist} holds no {MEMBER_MARKER}* files")
    (target / STAMP).write_text(LLAMA_CPP_PYTHON + "\n")
    return sorted(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sdist", type=Path, help="use this llama_cpp_python-*.tar.gz instead of downloading")
    parser.add_argument("--target", type=Path, default=VOCAB_DIR, help=f"output folder (default {VOCAB_DIR})")
    parser.add_argument("--force", action="store_true", help="extract again even if the files are there")
    args = parser.parse_args(argv)

    if is_complete(args.target) and not args.force:
        print(f"vocab files already in {args.target}")
        return 0
    if args.sdist is not None:
        names = extract_vocab(args.sdist, args.target)
    else:
        with tempfile.TemporaryDirectory(prefix="kvcmas-vocab-") as tmp:
            names = extract_vocab(download_sdist(Path(tmp)), args.target)
    print(f"extracted {len(names)} files into {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
