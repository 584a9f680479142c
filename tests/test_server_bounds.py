"""kvcmas-server's memory bounds hold across namespaces, which clients create at will (a cache_salt per request):
what the estimators of all namespaces hold stays within --calibration-memory, and one tenant's prompts and images
never evict another tenant's prefix-cache entries or encoded images (its counters and timing would tell it about
the other's traffic)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.server import ServerProcess

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-9876543210"}


def post(srv: ServerProcess, tenant: str | None, body: dict[str, Any], path: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
    status, _, out = srv.request("POST", path, body, headers)
    assert status == 200, out
    return dict(out)


def image_chat(colour: tuple[int, int, int]) -> dict[str, Any]:
    """A one-token chat whose message is a 32x32 image of one colour."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    part = {"type": "image_url", "image_url": {"url": url}}
    return {"messages": [{"role": "user", "content": [part]}], "max_tokens": 1}


@pytest.fixture(scope="module")
def bounded_server(default_model_path: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        str(default_model_path), "--method", "kvcmas", "--calibration-memory", "24M", "--no-calibration-dir"
    )
    yield srv
    srv.stop()


def test_estimators_of_every_namespace_stay_within_calibration_memory(bounded_server: ServerProcess) -> None:
    """A client that sends each workflow under a new cache_salt makes a new estimator each time, each calibrating
    its edges (~17 MB of statistics an edge on this model while its read runs) and keeping their fitted maps. Their
    sum was unbounded (a tester took a server from 416 to 900 MB this way); now --calibration-memory bounds all of
    them together, dropping old namespaces' maps before the statistics of a read in progress, and the server keeps
    serving (its latest namespaces still calibrate)."""
    bound = 24 << 20  # one calibrating edge (~17 MB) and a few namespaces' maps (~0.8 MB each)

    def workflow(salt: str, question: str, hops: int) -> dict[str, Any]:
        """One workflow of `hops` agents reading the question (and, in this namespace, each other's replies)."""
        for hop in range(hops):
            messages = [
                {"role": "system", "content": f"You are agent {hop}. Answer briefly."},
                {"role": "user", "content": question},
            ]
            for h in range(hop):
                messages += [{"role": "assistant", "content": f"Answer {h}."}, {"role": "user", "content": "Go on."}]
            body = {"messages": messages, "max_tokens": 3, "cache_salt": salt, "kvcmas": {"workflow": "w"}}
            out = post(bounded_server, None, body, "/v1/chat/completions")
            seen.append(bounded_server.metrics()["kvcmas_estimator_bytes"])
        return out

    def reads_done() -> None:
        deadline = time.monotonic() + 120  # the last reads run once the requests are done
        while bounded_server.metrics()["kvcmas_training_reads_pending"] and time.monotonic() < deadline:
            time.sleep(0.1)

    seen: list[float] = []
    for _ in range(20):
        workflow(uuid.uuid4().hex, "The shared question: how should a server bound its memory? " * 3, 3)
    reads_done()
    seen.append(bounded_server.metrics()["kvcmas_estimator_bytes"])
    assert max(seen) <= bound, seen  # unbounded, 20 namespaces reached 38 MB (maps growing by 0.8 MB each)
    assert max(seen) > 17 << 20  # the namespaces did calibrate edges (each holds ~17 MB while it does)
    assert "dropped (--calibration-memory)" in bounded_server.log_path.read_text()
    salt = uuid.uuid4().hex  # a namespace after the bound bit still learns: its second workflow reuses with a map
    for _ in range(2):
        out = workflow(salt, f"Question {uuid.uuid4().hex}: how does a bound work? " * 3, 2)
        reads_done()
    assert out["kvcmas"]["gate"] == "reuse" and out["kvcmas"]["corr_bytes"] > 0, out["kvcmas"]


@pytest.fixture(scope="module")
def tenants_server(
    default_model_path: Path, mmproj_path: str | None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("".join(f"{name} {key}\n" for name, key in KEYS.items()))
    vision = ["--mmproj", mmproj_path] if mmproj_path else []
    # a 64 MiB KV budget: the prefix cache may hold a quarter of it, 8 MiB (~180 rows of this model) per tenant
    srv = ServerProcess(str(default_model_path), "--api-key-file", str(keys), "--kv-budget", "64M", *vision)
    yield srv
    srv.stop()


def test_one_tenants_prompts_never_evict_anothers_prefix_cache_entries(tenants_server: ServerProcess) -> None:
    """Bob's prompt is cached; Alice then sends many prompts of her own, far more than the cache holds. Bob's next
    identical prompt is served from the cache exactly as before (it used to report 0 cached tokens and take ten
    times as long: the cache's LRU was shared, so Bob could measure Alice's traffic)."""
    srv = tenants_server
    bobs = {"prompt": " ".join(f"Bob's record {i} is filed." for i in range(16)), "max_tokens": 1}

    def cached(tenant: str, body: dict[str, Any]) -> int:
        return int(post(srv, tenant, body, "/v1/completions")["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("bob", bobs) == 0
    before = cached("bob", bobs)
    assert before > 64
    operator: dict[str, str] = {}  # keyless from loopback: the whole server's /metrics, the operator's view
    entries_before = srv.metrics(operator)["kvcmas_prefix_cache_entries"]
    for k in range(10):
        alices = {"prompt": f"Alice's ledger {k}: " + " ".join(f"entry {k}.{i} is paid." for i in range(24))}
        assert cached("alice", {**alices, "max_tokens": 1}) == 0
    assert srv.metrics(operator)["kvcmas_prefix_cache_entries"] <= entries_before + 2  # Alice's share holds few of hers
    assert cached("bob", bobs) == before


def test_one_tenants_images_never_evict_anothers_encoded_images(
    tenants_server: ServerProcess, mmproj_path: str | None
) -> None:
    """Bob's image stays encoded while Alice sends more images than the whole cache holds (IMAGE_CACHE): his next
    request with it is not encoded again (it was: the cache's LRU was shared, and a re-encode shows in the timing)."""
    if mmproj_path is None:
        pytest.skip("the core has no vision encoder")
    from kvcmas_cpp.server.config import IMAGE_CACHE

    operator: dict[str, str] = {}  # keyless from loopback: the whole server's /metrics

    def encoded() -> float:
        return tenants_server.metrics(operator)["kvcmas_images_encoded_total"]

    bobs = image_chat((10, 200, 30))
    post(tenants_server, "bob", bobs, "/v1/chat/completions")
    before = encoded()
    for k in range(IMAGE_CACHE + 4):
        post(tenants_server, "alice", image_chat((k, 0, 255 - k)), "/v1/chat/completions")
    assert encoded() == before + IMAGE_CACHE + 4
    post(tenants_server, "bob", bobs, "/v1/chat/completions")
    assert encoded() == before + IMAGE_CACHE + 4  # Bob's was still cached


def test_encoded_images_are_bounded_by_bytes_too(default_model_path: Path, mmproj_path: str | None) -> None:
    """An AnyRes photo's rows take tens of MB, so 32 kept images could hold most of a GB: the cache is bounded by
    --image-cache-memory as well as by count. With room for one tiny image's rows (16 x 576 f32 = 36 KiB), a
    second image evicts the first, which is then encoded again; an image asked twice in a row is not."""
    if mmproj_path is None:
        pytest.skip("the core has no vision encoder")
    srv = ServerProcess(str(default_model_path), "--mmproj", mmproj_path, "--image-cache-memory", "40K")
    try:

        def encoded() -> float:
            return srv.metrics()["kvcmas_images_encoded_total"]

        a, b = image_chat((200, 10, 10)), image_chat((10, 10, 200))
        post(srv, None, a, "/v1/chat/completions")
        post(srv, None, a, "/v1/chat/completions")
        assert encoded() == 1  # kept: it fits
        post(srv, None, b, "/v1/chat/completions")
        post(srv, None, a, "/v1/chat/completions")
        assert encoded() == 3  # b took a's room (by count, 32 would have fit)
    finally:
        srv.stop()
