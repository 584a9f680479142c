"""The CPU backend's weights on anonymous (huge-page) memory: same logits as reading the file in place, and the
file's pages dropped after the copy (issue 45, docs/prefill-kernels.md Round 6)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

_CHILD = r"""
import json, sys
import numpy as np
import kvcmas_cpp as kc

path, out = sys.argv[1], sys.argv[2]
m = kc.Model(path, n_threads=2, n_ctx=64)
ids = [(i * 7919) % 3000 + 50 for i in range(6)]
with m.new_sequence() as seq:  # a prefill, then the decode path one token at a time
    rows = [seq.append(ids[:3], logits="all")] + [seq.append([t], logits="all") for t in ids[3:]]
np.save(out, np.concatenate(rows))
rss = {"file": 0, "anon": 0}
with open("/proc/self/smaps") as f:
    name = ""
    for line in f:
        head = line.split()
        if "-" in head[0] and len(head) >= 5:
            name = head[5] if len(head) > 5 else ""
        elif head[0] == "Rss:":
            key = "file" if name == path else ("anon" if name == "" else "")
            if key:
                rss[key] += int(head[1]) * 1024
print(json.dumps(rss))
"""


def _run(model: Path, out: Path, in_place: bool) -> dict[str, int]:
    env = dict(os.environ)
    env.pop("KVCMAS_WEIGHTS_IN_PLACE", None)
    if in_place:
        env["KVCMAS_WEIGHTS_IN_PLACE"] = "1"
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model), str(out)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_copied_weights_give_the_in_place_logits_and_release_the_file(default_model_path: Path, tmp_path: Path) -> None:
    model = default_model_path.resolve()
    size = model.stat().st_size
    copied = _run(model, tmp_path / "copy.npy", in_place=False)
    in_place = _run(model, tmp_path / "in-place.npy", in_place=True)
    np.testing.assert_array_equal(np.load(tmp_path / "copy.npy"), np.load(tmp_path / "in-place.npy"))
    # In place the decode keeps the file's pages mapped; copied, they were dropped after the load (only what was
    # read since, such as the token embedding's rows, comes back) and the weights live in anonymous memory.
    assert in_place["file"] > size // 2
    assert copied["file"] < size // 10
    assert copied["anon"] > in_place["anon"] + size // 2
