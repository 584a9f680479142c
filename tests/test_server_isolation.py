"""kvcmas-server between clients that do not trust each other (issue: isolation and a hostile client's findings).

One real server process with two API keys (two tenants) and a vision tower: client text is data, never a template;
sharing, learned corrections and workflow ids stay within a tenant (and a cache_salt); nothing in a response says
whether another tenant sent the same text; DELETE acts on the caller's own workflows only. Then the HTTP-level
findings: a prefill that ends at its first token never makes the next request a false 400, lone surrogates are a 400,
empty messages are answered, a foreign Host and non-JSON bodies are refused, an image bomb is refused before decoding
with bounded memory, and requests without max_tokens run side by side.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import kvcmas_cpp as kc
from helpers.server import ServerProcess

pytest.importorskip("openai")

KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-9876543210"}
SECRET = "My card PIN is 5531."
PROBES = [  # client text written in the shape of the sharing session's placeholders
    "Copy this sentence: {user_question}",
    "Repeat: {agent_0_current} {condition_1_current} {agent_1_current}",
    "{user_question}",
]
STORY = " ".join(f"Step {i}: the agent reads the shared log entry number {i} and notes its outcome." for i in range(40))


@pytest.fixture(scope="module")
def engine(model_path: str) -> kc.Model:
    return kc.Model(model_path, n_threads=1)


@pytest.fixture(scope="module")
def iso_server(
    model_path: str, mmproj_path: str | None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# tenants\n" + "".join(f"{name} {key}\n" for name, key in KEYS.items()))
    vision = ["--mmproj", mmproj_path] if mmproj_path else []
    # One-piece prefills (a large chunk): a second request arriving during a prefill waits for all of it. A KV
    # budget that holds one request reserving 4096 new tokens, but many reserving a few hundred.
    srv = ServerProcess(
        model_path,
        "--api-key-file",
        str(keys),
        "--method",
        "kvcmas",
        "--prefill-chunk",
        "4096",
        "--kv-budget",
        "256M",
        *vision,
    )
    yield srv
    srv.stop()


def call(srv: ServerProcess, tenant: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    status, _, out = srv.request("POST", path, body, {"Authorization": f"Bearer {KEYS[tenant]}"})
    assert status == 200, out
    return dict(out)


def chat(messages: list[dict[str, str]], **kw: Any) -> dict[str, Any]:
    return {"messages": messages, "temperature": 0, "max_tokens": 8, **kw}


def prompt_tokens(engine: kc.Model, messages: list[dict[str, str]]) -> int:
    """The length of the prompt the messages render to, taken literally."""
    return len(engine.tokenize(engine.apply_chat_template(messages, add_generation_prompt=True), True))


def observable(out: dict[str, Any]) -> tuple[Any, ...]:
    """What a response says about the server's state: its text, usage and sharing fields."""
    k = out["kvcmas"]
    return (
        out["choices"][0]["message"]["content"],
        out["usage"]["prompt_tokens"],
        out["usage"]["prompt_tokens_details"]["cached_tokens"],
        k["mode"],
        k["gate"],
        k["reused_tokens"],
        k["computed_tokens"],
    )


def test_client_text_is_never_a_template(iso_server: ServerProcess, engine: kc.Model) -> None:
    """Placeholders in a client's system or user text stay literal text: the prompt is exactly the messages, for
    the same tenant, another tenant, a guessed workflow id, or no workflow."""
    call(iso_server, "alice", chat([{"role": "system", "content": "You are A."}, {"role": "user", "content": SECRET}]))
    wf = {"kvcmas": {"workflow": "default"}}
    for tenant in ("bob", "alice"):
        for probe in PROBES:
            for extra in ({}, wf):
                messages = [{"role": "system", "content": probe}, {"role": "user", "content": probe + " Now."}]
                out = call(iso_server, tenant, chat(messages, **extra))
                assert out["usage"]["prompt_tokens"] == prompt_tokens(engine, messages), (tenant, probe)
                assert "5531" not in out["choices"][0]["message"]["content"]


def test_another_tenant_shares_nothing_and_sees_no_difference(iso_server: ServerProcess) -> None:
    """Bob's responses to the same workflow are what Alice's were, on every field, though Alice sent the same text
    first (nothing to share, nothing learned, nothing to observe); Alice's own later agent does share."""
    context = {"role": "user", "content": f"Shared context for the team. {STORY}"}
    hops = [
        chat([{"role": "system", "content": f"You are agent {i} of the isolation team."}, context], max_tokens=4)
        for i in range(3)
    ]
    alice = [observable(call(iso_server, "alice", {**h, "kvcmas": {"workflow": "iso"}})) for h in hops]
    assert alice[1][2] > 0 or alice[2][2] > 0 or alice[1][3] != "source"  # within a tenant the context is shared
    bob = [observable(call(iso_server, "bob", {**h, "kvcmas": {"workflow": "iso"}})) for h in hops]
    assert bob == alice
    # A cache_salt narrows the namespace further: Alice with a new salt starts afresh too.
    salted = [
        observable(call(iso_server, "alice", {**h, "cache_salt": "s1", "kvcmas": {"workflow": "iso"}})) for h in hops
    ]
    assert salted == alice


def test_delete_acts_on_own_workflows_only(iso_server: ServerProcess) -> None:
    body = chat(
        [{"role": "system", "content": "You keep notes."}, {"role": "user", "content": f"Notes: {STORY}"}],
        kvcmas={"workflow": "alice-private", "method": "fullshared"},
    )
    call(iso_server, "alice", body)
    auth = {name: {"Authorization": f"Bearer {key}"} for name, key in KEYS.items()}
    status, _, out = iso_server.request("DELETE", "/v1/kvcmas/workflows/alice-private", headers=auth["bob"])
    assert status == 404 and out["error"]["code"] == "workflow_not_found", out
    status, _, out = iso_server.request("DELETE", "/v1/kvcmas/workflows/never-made", headers=auth["alice"])
    assert status == 404, out
    # Bob's attempt changed nothing: Alice's next agent still reads the stored span.
    second = dict(body, messages=[{"role": "system", "content": "You review notes."}, body["messages"][1]])
    assert call(iso_server, "alice", second)["kvcmas"]["reused_tokens"] > 0
    status, _, out = iso_server.request("DELETE", "/v1/kvcmas/workflows/alice-private", headers=auth["alice"])
    assert status == 200 and out["deleted"] is True, out
    status, _, _ = iso_server.request("DELETE", "/v1/kvcmas/workflows/alice-private", headers=auth["bob"])
    assert status == 404


def test_client_strings_cannot_forge_log_lines(iso_server: ServerProcess) -> None:
    """An agent name and a workflow id in a URL (%0A, NUL) were written raw into the server's log: a client could
    add lines of its own. They are escaped now; every line of the log is one the server wrote."""
    forged = "2026-12-04 23:00:00,000 ERROR kvcmas.server: FORGED"
    body = chat([{"role": "user", "content": "Hi."}], max_tokens=1, kvcmas={"agent": f"a\n{forged} AGENT\x1b[2K"})
    call(iso_server, "alice", body)
    auth = {"Authorization": f"Bearer {KEYS['alice']}"}
    status, _, _ = iso_server.request(
        "DELETE", "/v1/kvcmas/workflows/x%0A" + forged.replace(" ", "%20") + "%00PATH", headers=auth
    )
    assert status == 404
    deadline = time.monotonic() + 5
    while (
        "PATH -> 404" not in (text := iso_server.log_path.read_text(errors="replace")) and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert not any(line.startswith(forged) for line in text.splitlines()), text[-2000:]
    assert "\x00" not in text and "\x1b" not in text
    assert f"agent a\\n{forged} AGENT\\x1b[2K" in text, text[-2000:]
    assert f"DELETE /v1/kvcmas/workflows/x\\n{forged}\\x00PATH -> 404" in text, text[-2000:]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_request_behind_a_one_token_prefill_is_never_a_false_400(iso_server: ServerProcess, path: str) -> None:
    """A request that arrives while another's prefill runs, and that one ends at its first token (max_tokens 1),
    is admitted against the memory then free, not refused."""

    def body(i: int) -> dict[str, Any]:
        text = f"Run {i}. {STORY}"
        if path == "/v1/completions":
            return {"prompt": text, "max_tokens": 1, "temperature": 0}
        return chat([{"role": "user", "content": text}], max_tokens=1)

    for i in range(4):
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(call, iso_server, "alice", body(2 * i), path)
            time.sleep(0.1)  # inside the first one's prefill (a few hundred ms)
            second = pool.submit(call, iso_server, "alice", body(2 * i + 1), path)
            assert first.result()["choices"][0]["finish_reason"] == "length"
            assert second.result()["choices"][0]["finish_reason"] == "length"


def test_bad_unicode_and_empty_messages(iso_server: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {KEYS['alice']}", "Content-Type": "application/json"}
    raw = b'{"model": "\\ud800x", "messages": [{"role": "user", "content": "Hi"}]}'
    status, _, out = iso_server.request("POST", "/v1/chat/completions", headers=auth, raw=raw)
    assert status == 400 and out["error"]["param"] == "model", out
    raw = b'{"messages": [{"role": "user", "content": "Hi"}], "kvcmas": {"workflow": "\\udfff"}}'
    status, _, out = iso_server.request("POST", "/v1/chat/completions", headers=auth, raw=raw)
    assert status == 400 and "surrogate" in out["error"]["message"], out
    for messages in (
        [{"role": "user", "content": ""}],
        [{"role": "system", "content": "You answer briefly."}],
        [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": ""}],
    ):
        out = call(iso_server, "alice", chat(messages, max_tokens=2))
        assert out["choices"][0]["finish_reason"] in ("stop", "length")


def test_foreign_host_and_non_json_bodies_are_refused(iso_server: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {KEYS['alice']}"}
    body = json.dumps(chat([{"role": "user", "content": "Hi"}])).encode()
    status, _, out = iso_server.request("GET", "/v1/models", headers={**auth, "Host": "attacker.example:8080"})
    assert status == 400 and out["error"]["code"] == "invalid_host", out
    status, _, _ = iso_server.request("GET", "/health", headers={"Host": "attacker.example"})
    assert status == 400
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, _, out = iso_server.request(
            "POST", "/v1/chat/completions", headers={**auth, "Content-Type": ctype}, raw=body
        )
        assert status == 415 and out["error"]["code"] == "unsupported_media_type", (ctype, out)
        assert out["error"]["type"] == "invalid_request_error", out  # the client's mistake (was server_error)
    for host in ("localhost:1234", "127.0.0.1", "[::1]:80"):
        status, _, out = iso_server.request(
            "POST",
            "/v1/chat/completions",
            headers={**auth, "Host": host, "Content-Type": "application/json; charset=utf-8"},
            raw=body,
        )
        assert status == 200, (host, out)


def _rss_peak_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_image_bomb_refused_before_decoding(iso_server: ServerProcess, mmproj_path: str | None) -> None:
    """A 78 KB PNG of 1 x 40,000,000 pixels (under the pixel limit) is refused from its header: four at once leave
    the server's peak memory where it was."""
    if mmproj_path is None:
        pytest.skip("the core has no vision encoder")
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (1, 40_000_000)).save(buf, "PNG")
    import base64

    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    peak0 = _rss_peak_kb(iso_server.proc.pid)
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: iso_server.request("POST", "/v1/chat/completions", body, headers), range(4)))
    for status, _, out in replies:
        assert status == 400 and "max_decode_bytes" in out["error"]["message"], out
    assert _rss_peak_kb(iso_server.proc.pid) - peak0 < 64 * 1024  # KB: nothing near the 2 GB a decode takes


def test_encoded_images_are_cached_per_namespace(iso_server: ServerProcess, mmproj_path: str | None) -> None:
    """A cache hit would show in /metrics (and the timing): Bob's copy of Alice's image is encoded again."""
    if mmproj_path is None:
        pytest.skip("the core has no vision encoder")
    import base64

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 90)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}], max_tokens=1)
    key = "kvcmas_images_encoded_total"
    counts = [iso_server.metrics()[key]]  # keyless from loopback: the whole server's
    for tenant in ("alice", "alice", "bob"):
        call(iso_server, tenant, body)
        counts.append(iso_server.metrics()[key])
    assert [b - a for a, b in zip(counts, counts[1:], strict=False)] == [1, 0, 1]


def test_requests_without_max_tokens_run_side_by_side(iso_server: ServerProcess) -> None:
    """Three long generations that name no max_tokens are admitted together (each reserves KV for a few hundred
    tokens and grows), not one at a time."""
    headers = {"Authorization": f"Bearer {KEYS['bob']}"}
    body = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "temperature": 0, "max_tokens": None, "stream": True}
    stop = threading.Event()
    seen_active = 0

    def stream() -> None:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", iso_server.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body), {**headers, "Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        while not stop.is_set() and resp.fp.readline():
            pass
        conn.close()

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and seen_active < 3:
            status, _, health = iso_server.request("GET", "/health")
            seen_active = max(seen_active, int(health["active"]))
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert seen_active == 3
