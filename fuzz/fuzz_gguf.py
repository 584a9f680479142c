"""Fuzz target: the C++ GGUF reader (``_core.GgufFile``) on arbitrary bytes.

Each input is written to a file on tmpfs and loaded; a file that loads is read back in full (metadata, value types,
tensor directory, every tensor's bytes, typed getters). Allowed outcomes: success, or ``KvcmasError`` whose message
starts with the file's path. Anything else (another exception, a broken invariant, a crash or sanitizer report) is
a finding.

    python fuzz/fuzz_gguf.py -max_total_time=45 fuzz/corpus/gguf
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

import _harness
import atheris
import numpy as np

_harness.use_source_tree_if_asked()
with atheris.instrument_imports(include=["kvcmas_cpp"]):
    from kvcmas_cpp._native import core

_PATH = str(_harness.scratch_dir() / "input.gguf")


def exercise(path: str) -> core.GgufFile:
    """Loads ``path`` and reads everything back; AssertionError when a loaded file breaks the reader's contract."""
    f = core.GgufFile(path)
    meta = f.metadata()
    types = f.value_types()
    assert set(meta) == set(types), "metadata() and value_types() disagree on the keys"
    for key, value in meta.items():
        if isinstance(value, str):
            assert f.get_string(key) == value
            f.string_bytes(key)
        elif isinstance(value, bool):
            pass
        elif isinstance(value, int):
            assert f.get_int(key) == value
            assert f.get_int(key, 0) == value
        elif isinstance(value, float):
            f.get_float(key)
    end = 0
    for t in f.tensors():
        data = f.tensor_bytes(t["name"])
        assert len(data) == t["n_bytes"], t
        assert f.data_offset + t["offset"] + t["n_bytes"] <= f.file_size, t
        assert t["offset"] % f.alignment == 0, t
        assert 1 <= len(t["shape"]) <= 4, t
        assert all(d >= 0 for d in t["shape"]), t
        end = max(end, t["offset"] + t["n_bytes"])
    assert f.alignment & (f.alignment - 1) == 0, f.alignment
    return f


# The core is not compiled with coverage instrumentation (gcc has no libFuzzer-compatible mode), so libFuzzer would
# see no new coverage beyond the first input. As a proxy, each distinct outcome (the reader's error message with its
# numbers and quoted names removed, or the shape of a file that loaded) gets its own freshly instrumented function:
# an input that reaches a check no earlier input reached is new coverage and joins the corpus.
_OUTCOME_PROBES: dict[str, Callable[[], None]] = {}


_MAX_PROBES = 4096  # beyond this, new outcomes share one probe (atheris' counters are not unlimited)


def _outcome(kind: str) -> None:
    probe = _OUTCOME_PROBES.get(kind)
    if probe is None and len(_OUTCOME_PROBES) >= _MAX_PROBES:
        probe = _OUTCOME_PROBES["(overflow)"]
    if probe is None:
        namespace: dict[str, object] = {}
        exec(f"def probe():\n    return {kind!r}\n", namespace)  # a new code object: new program counters
        probe = atheris.instrument_func(namespace["probe"])
        _OUTCOME_PROBES[kind] = probe
    probe()


def _message_shape(message: str) -> str:
    message = message[len(_PATH) + 2 :]
    message = re.sub(r"'.*'|\".*\"", "'_'", message, flags=re.DOTALL)  # names, possibly holding quotes
    message = re.sub(r"\([^)]*\)", "(_)", message)
    return re.sub(r"-?\b(0x)?[0-9a-fA-F]*\d[0-9a-fA-F]*\b", "N", message)[:200]


def exercise_model(path: str) -> str:
    """Loads ``path`` as a model and decodes two tokens when it loads; the outcome's shape, for coverage."""
    try:
        model = core.Model(path, 1, 32, 1 << 20)
    except core.KvcmasError as e:
        return "model error: " + _message_shape(str(e))
    n = 2
    tokens = np.array([0, model.n_vocab - 1], dtype=np.int32)
    seq = model.seq_new()
    logits = model.decode(np.full(n, seq, np.int32), tokens, np.ones(n, np.uint8))
    assert logits.shape == (n, model.n_vocab), logits.shape
    del model
    return "model decodes"


def test_one_input(data: bytes) -> None:
    with open(_PATH, "wb") as out:
        out.write(data)
    try:
        f = exercise(_PATH)
    except core.KvcmasError as e:
        if not str(e).startswith(f"{_PATH}: "):
            raise AssertionError(f"error message does not name the file first: {e}") from None
        _outcome("error: " + _message_shape(str(e)))
        return
    model_outcome = exercise_model(_PATH) if "general.architecture" in f.metadata() else "no model"
    value_types = sorted(set(f.value_types().values()))
    tensor_types = sorted({t["type_name"] for t in f.tensors()})
    f_version, f_alignment = f.version, f.alignment
    del f  # the next input rewrites the file: no mapping of it may outlive this call
    _outcome(f"ok: v{f_version} align={f_alignment} values={value_types} tensors={tensor_types} {model_outcome}")


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
