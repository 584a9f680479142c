"""`kvcmas bench core`'s bandwidth figures: the read-only probe beside the copy bandwidth, and the table's decode
column against both."""

from __future__ import annotations

import time

import numpy as np

from kvcmas_cpp.bench.core import (
    CoreResult,
    _read_bandwidth_gb_s,
    format_table,
    read_bandwidth_gb_s,
    weight_bytes_per_token,
)


def test_read_bandwidth_is_bytes_read_per_second() -> None:
    """The probe's figure is the buffer's bytes over the time of one read of it by the threads: timing the same read
    here gives a rate of the same order (a loaded machine moves it, not by 10x), and 1 or 2 threads both work."""
    gb_s = _read_bandwidth_gb_s(2, mib=64, repeats=3)
    buf = np.ones(64 << 18, dtype=np.float32)
    t0 = time.perf_counter()
    np.dot(buf, buf)
    own = buf.nbytes / (time.perf_counter() - t0) / 1e9
    assert 0.1 < gb_s < 1000 and gb_s > own / 10, (gb_s, own)
    assert _read_bandwidth_gb_s(1, mib=16, repeats=1) > 0.1
    assert read_bandwidth_gb_s(1) > 0.1  # the subprocess the command runs


def test_table_shows_decode_against_copy_and_read_bandwidth(default_model_path) -> None:
    r = CoreResult("kvcmas", str(default_model_path), 2, 16, 4, 100.0, 10.0, 300.0, "f16", "q8", "wall")
    table = format_table([r], bandwidth_gb_s=20.0, read_gb_s=10.0)
    assert "decode GB/s (of copy / of read)" in table
    assert "read bandwidth (2 threads reading a 1 GiB buffer) 10.0 GB/s" in table
    gb_s = 10.0 * weight_bytes_per_token(str(default_model_path)) / 1e9  # decode tok/s x bytes per token
    assert f"| {gb_s:.1f} ({gb_s / 20:.0%} / {gb_s / 10:.0%}) |" in table
    assert "of copy / of read" not in format_table([r], bandwidth_gb_s=20.0)
