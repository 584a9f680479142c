"""Fuzz worker for tests/test_gguf.py: loads many mutated copies of one GGUF file in a single process.

Usage: python gguf_fuzz_worker.py BASE_GGUF SCRATCH_DIR HEADER_END FIRST_SEED N_SEEDS

For each seed it derives a mutated file from BASE_GGUF (``mutate``), writes it into SCRATCH_DIR, prints
``seed <n>`` (flushed, so that a crash can be attributed to the seed that caused it) and loads it with
``_core.GgufFile``, then reads everything back (metadata, types, tensor directory, every tensor's bytes).
Accepted outcomes are success or ``KvcmasError``; anything else is collected. The last line printed is
``summary <json>`` with the counts and the unexpected outcomes. A segfault ends the process with a negative code.
"""

from __future__ import annotations

import json
import random
import struct
import sys
from pathlib import Path

from kvcmas_cpp._native import core

# Values that tend to sit on boundaries of counts, lengths, types and offsets.
_U32_SPECIAL = [0, 1, 2, 3, 4, 5, 8, 9, 12, 13, 30, 31, 255, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF]
_U64_SPECIAL = [0, 1, 2, 7, 32, 64, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 32, 2**64 - 1]


def mutate(base: bytes, seed: int, header_end: int) -> bytes:
    """Returns ``base`` with 1-4 random mutations; offsets fall mostly in the first ``header_end`` bytes."""
    rng = random.Random(seed)
    data = bytearray(base)
    for _ in range(rng.randint(1, 4)):
        if not data:
            break
        limit = min(header_end, len(data)) if rng.random() < 0.85 else len(data)
        at = rng.randrange(max(limit, 1))
        op = rng.randrange(7)
        if op == 0:  # flip one bit
            data[at] ^= 1 << rng.randrange(8)
        elif op == 1:
            data[at] = rng.choice([0x00, 0xFF])
        elif op == 2:
            data[at] = rng.randrange(256)
        elif op == 3 and at + 4 <= len(data):
            value = rng.choice(_U32_SPECIAL) if rng.random() < 0.7 else rng.getrandbits(32)
            data[at : at + 4] = struct.pack("<I", value)
        elif op == 4 and at + 8 <= len(data):
            specials = [*_U64_SPECIAL, len(data), len(data) - at]
            value = rng.choice(specials) if rng.random() < 0.7 else rng.getrandbits(64)
            data[at : at + 8] = struct.pack("<Q", value % 2**64)
        elif op == 5:  # truncate
            del data[rng.randrange(len(data)) :]
        elif op == 6:  # delete or duplicate a few bytes, shifting everything after them
            n = rng.randint(1, 8)
            if rng.random() < 0.5:
                del data[at : at + n]
            else:
                data[at:at] = data[at : at + n]
    return bytes(data)


def exercise(path: str) -> None:
    """Loads ``path`` and reads everything back; raises AssertionError when a loaded file breaks an invariant."""
    f = core.GgufFile(path)
    f.metadata()
    f.value_types()
    for t in f.tensors():
        data = f.tensor_bytes(t["name"])
        assert len(data) == t["n_bytes"], t
        assert f.data_offset + t["offset"] + t["n_bytes"] <= f.file_size, t
        assert t["offset"] % f.alignment == 0, t
        assert 1 <= len(t["shape"]) <= 4, t


def main(argv: list[str]) -> int:
    base_path, scratch, header_end, first, count = argv[1], Path(argv[2]), int(argv[3]), int(argv[4]), int(argv[5])
    base = Path(base_path).read_bytes()
    target = scratch / "mutated.gguf"
    counts = {"ok": 0, "error": 0}
    unexpected: list[dict[str, object]] = []
    for seed in range(first, first + count):
        target.write_bytes(mutate(base, seed, header_end))
        print(f"seed {seed}", flush=True)
        try:
            exercise(str(target))
            counts["ok"] += 1
        except core.KvcmasError as e:
            if not str(e).startswith(f"{target}: "):
                unexpected.append({"seed": seed, "error": f"message does not start with the path: {e}"})
            counts["error"] += 1
        except BaseException as e:  # noqa: BLE001 - any other outcome is what this worker reports
            unexpected.append({"seed": seed, "error": f"{type(e).__name__}: {e}"})
    print("summary " + json.dumps({**counts, "unexpected": unexpected}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
