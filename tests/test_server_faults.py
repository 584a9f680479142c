"""kvcmas-server limits, security settings and faults, end to end: real server processes, real clients.

One server with small limits covers every per-request limit (body size, prompt tokens, max_tokens, images, requests
in flight, the request timeout). A second one runs on a copy of the model file that is deleted once loaded (the
weights are mmapped) with a tiny KV budget: client disconnects, KV exhaustion (429) and recovery. Each SIGTERM test
starts its own server. Route list, CORS and the API-key comparison are checked in-process on the FastAPI app.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import pytest

import kvcmas_cpp as kc
from helpers.server import BLOCK_BYTES, ServerProcess

openai = pytest.importorskip("openai")

COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # greedy continues counting: a long generation without an early stop
CTX = 512
KINDS: tuple[Literal["chat", "completion"], ...] = ("chat", "completion")
TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 1.5
HEADER_TIMEOUT_S = 1.5


def _wait_idle(srv: ServerProcess, baseline_kv: float, timeout: float = 15.0) -> dict[str, float]:
    """Metrics once no request runs and KV is back to baseline_kv (or the last metrics at the deadline)."""
    deadline = time.monotonic() + timeout
    m = srv.metrics()
    while time.monotonic() < deadline and (m["kvcmas_active_requests"] or m["kvcmas_kv_bytes"] != baseline_kv):
        time.sleep(0.1)
        m = srv.metrics()
    return m


def _open_stream(srv: ServerProcess, path: str, body: dict[str, Any]) -> tuple[http.client.HTTPConnection, Any]:
    """Starts a streaming request and reads until its first content chunk (the job is generating)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    seen = 0
    while seen < 2:
        line = resp.fp.readline()
        assert line, "the stream ended before any content"
        seen += line.startswith(b"data: ")
    return conn, resp


def _read_events(resp: Any) -> list[str]:
    """The remaining SSE data payloads of a stream (until the server closes it)."""
    events = []
    try:
        for line in resp.fp:
            if line.startswith(b"data: "):
                events.append(line[6:].strip().decode())
    except (OSError, http.client.HTTPException):
        pass
    return events


# ---------------------------------------------------------------------------------------------------- limits
@pytest.fixture(scope="module")
def limits_server(model_path: str) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        model_path,
        "--method",
        "nonshared",
        "-c",
        str(CTX),
        "--parallel",
        "2",
        "--max-body-bytes",
        "4096",
        "--max-tokens-limit",
        "500",
        "--max-images",
        "1",
        "--max-inflight",
        "2",
        "--request-timeout",
        str(TIMEOUT_S),
        "--body-timeout",
        str(BODY_TIMEOUT_S),
        "--header-timeout",
        str(HEADER_TIMEOUT_S),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def limits_client(limits_server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=f"{limits_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_body_size_limit_413(limits_server: ServerProcess) -> None:
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 1}).encode()
    status, _, out = limits_server.request("POST", "/v1/chat/completions", raw=big)
    assert status == 413 and out["error"]["code"] == "body_too_large", out
    # Without a Content-Length (chunked), the limit holds while the body is read.
    conn = http.client.HTTPConnection("127.0.0.1", limits_server.port, timeout=30)
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=iter([big[:3000], big[3000:]]),
        headers={"Content-Type": "application/json"},
        encode_chunked=True,
    )
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    assert resp.status == 413 and out["error"]["type"] == "invalid_request_error", out
    small = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    status, _, out = limits_server.request("POST", "/v1/chat/completions", small)
    assert status == 200, out
    assert limits_server.metrics()["kvcmas_rejected_body_too_large_total"] == 2


def test_prompt_longer_than_ctx_size_400(limits_client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        limits_client.completions.create(model=_model_id(limits_client), prompt="word " * (CTX + 20), max_tokens=1)
    assert err.value.status_code == 400 and err.value.body["code"] == "context_length_exceeded"


def test_max_tokens_limit_400(limits_client: Any, limits_server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        limits_client.chat.completions.create(
            model=_model_id(limits_client), messages=[{"role": "user", "content": "Hi"}], max_tokens=501
        )
    assert err.value.body["code"] == "max_tokens_exceeded" and err.value.body["param"] == "max_tokens"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 10_000}
    status, _, out = limits_server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "max_completion_tokens", out
    status, _, out = limits_server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 501})
    assert status == 400 and out["error"]["code"] == "max_tokens_exceeded", out


def test_images_per_request_limit_400(limits_server: ServerProcess) -> None:
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    status, _, out = limits_server.request(
        "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [part, part]}]}
    )
    assert status == 400 and out["error"]["code"] == "too_many_images", out
    status, _, out = limits_server.request(
        "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [part]}]}
    )
    assert status == 400 and out["error"]["code"] != "too_many_images" and "--mmproj" in out["error"]["message"]


def _recv_all(sock: socket.socket, timeout: float) -> bytes:
    """What the server sends on a socket until it closes it (or the timeout passes)."""
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(4096):
            data += chunk
    return data


def test_inflight_limit_counts_complete_requests_and_times_out_slow_clients(limits_server: ServerProcess) -> None:
    """Bodies that never complete hold a connection, not an in-flight slot, and get 408 after --body-timeout;
    a connection that never completes its headers is closed after --header-timeout; requests that run do fill
    --max-inflight (2): the third gets 503 with Retry-After, while /health still answers."""
    before = limits_server.metrics()
    half_sent = []
    for _ in range(4):  # more than --max-inflight
        sock = socket.create_connection(("127.0.0.1", limits_server.port), timeout=30)
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"messages"'
        )
        half_sent.append(sock)
    slow_headers = socket.create_connection(("127.0.0.1", limits_server.port), timeout=30)
    slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: local")
    t0 = time.monotonic()
    try:
        time.sleep(0.3)
        status, _, out = limits_server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        assert status == 200, out  # the half-sent bodies hold no slot
        long_body = {"prompt": COUNTING, "max_tokens": 480, "temperature": 0}
        streams = [_open_stream(limits_server, "/v1/completions", long_body) for _ in range(2)]
        try:
            status, headers, out = limits_server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
            assert status == 503 and int(headers["retry-after"]) >= 1, out
            assert out["error"]["code"] == "too_many_requests"
            assert limits_server.request("GET", "/health")[0] == 200  # probes are not limited
        finally:
            for conn, _ in streams:
                conn.close()
        for sock in half_sent:
            reply = _recv_all(sock, BODY_TIMEOUT_S + 10)
            assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
            assert b'"body_timeout"' in reply
        assert _recv_all(slow_headers, HEADER_TIMEOUT_S + 10) == b""  # closed without an answer
        assert time.monotonic() - t0 < max(BODY_TIMEOUT_S, HEADER_TIMEOUT_S) + 8
    finally:
        for sock in [*half_sent, slow_headers]:
            sock.close()
    deadline = time.monotonic() + 10
    status = 503
    while status == 503 and time.monotonic() < deadline:  # the streams are gone: requests run again
        status, _, out = limits_server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        time.sleep(0.05)
    assert status == 200, out
    after = limits_server.metrics()
    assert after["kvcmas_rejected_inflight_total"] >= before["kvcmas_rejected_inflight_total"] + 1
    assert after["kvcmas_rejected_body_timeout_total"] == before["kvcmas_rejected_body_timeout_total"] + 4


def test_request_timeout_ends_the_request_and_frees_its_kv(limits_server: ServerProcess) -> None:
    before = _wait_idle(limits_server, 0)
    t0 = time.monotonic()
    # greedy: the counting goes on for the whole budget (a sampled continuation could stop early at an EOS)
    long_body = {"prompt": COUNTING, "max_tokens": 480, "temperature": 0}
    status, _, out = limits_server.request("POST", "/v1/completions", long_body)
    elapsed = time.monotonic() - t0
    assert status == 408 and out["error"]["code"] == "request_timeout", out
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 5
    # Streaming: the stream carries the error event, then ends.
    conn, resp = _open_stream(limits_server, "/v1/completions", long_body)
    events = _read_events(resp)
    conn.close()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout", events[-3:]
    after = _wait_idle(limits_server, before["kvcmas_kv_bytes"])
    assert after["kvcmas_kv_bytes"] == before["kvcmas_kv_bytes"]
    assert after["kvcmas_engine_sequences"] == before["kvcmas_engine_sequences"]
    assert after["kvcmas_timed_out_total"] == before["kvcmas_timed_out_total"] + 2


def chat_body(srv: ServerProcess, messages: list[dict[str, str]], **kw: Any) -> dict[str, Any]:
    status, _, out = srv.request("POST", "/v1/chat/completions", {"messages": messages, "temperature": 0, **kw})
    assert status == 200, out
    return dict(out)


def _model_id(client: Any) -> str:
    return str(client.models.list().data[0].id)


# ------------------------------------------------------------------------------- request parsing, no model
def test_request_parsing_gives_a_request_or_a_4xx(default_model_path: Path) -> None:
    """The model-free path every body takes (the fuzz target's contract): hostile bodies give ApiError 4xx."""
    from kvcmas_cpp.server.validation import ApiError, Limits, parse_request

    limits = Limits(max_body_bytes=16384, max_tokens=64, max_images=2)
    hostile = [
        b"[" * 4000 + b"]" * 4000,  # nesting past Python's recursion limit: a 400, not a RecursionError (500)
        b'{"messages": ' + b"[" * 2000 + b"]" * 2000 + b"}",
        b"\xff\xfe\x00{",
        b'{"prompt": "x", "temperature": NaN}',
        b'{"prompt": "x", "top_p": Infinity}',
        b'{"messages": [{"role": "user", "content": "\\ud800"}], "stop": ["a", "b", "c", "d", "e"]}',
        b"x" * 20000,  # 413
        b"",
        b"null",
    ]
    for raw in hostile:
        for kind in KINDS:
            with pytest.raises(ApiError) as err:
                parse_request(kind, raw, limits)
            assert 400 <= err.value.status < 500 and err.value.message, raw[:40]
    ok = parse_request("chat", b'{"messages": [{"role": "user", "content": "hi"}], "stop": "."}', limits)
    assert ok.stops == ["."] and ok.max_tokens is None and ok.sampling.temperature == 1.0
    # The seed corpus of fuzz/fuzz_server.py: every input is a request or a 4xx.
    corpus = Path(__file__).resolve().parent.parent / "fuzz" / "corpus" / "server"
    outcomes = set()
    for path in sorted(corpus.iterdir()):
        data = path.read_bytes()
        try:
            parse_request("chat" if data[0] % 2 == 0 else "completion", data[1:], limits)
            outcomes.add("ok")
        except ApiError as e:
            assert 400 <= e.status < 500
            outcomes.add("4xx")
    assert outcomes == {"ok", "4xx"}


# ------------------------------------------------------------------------------- routes, CORS, key, binding
EXPECTED_ROUTES = {
    ("POST", "/v1/chat/completions"),
    ("POST", "/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/completions"),
    ("GET", "/v1/models"),
    ("GET", "/models"),
    ("GET", "/v1/models/{model_name:path}"),
    ("GET", "/models/{model_name:path}"),
    ("DELETE", "/v1/kvcmas/workflows/{workflow:path}"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/v1/responses"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/apply-template"),
    ("GET", "/props"),
    ("GET", "/lora-adapters"),  # llama.cpp's list of the loaded LoRA adapters (server/lora.py)
    # the live page (its files are a fixed set read from the package at start-up) and the JSON it draws from
    ("GET", "/ui"),
    ("GET", "/ui/"),
    ("GET", "/ui/{name}"),
    ("GET", "/v1/kvcmas/workflows"),
    ("GET", "/v1/kvcmas/workflows/{workflow:path}"),
    ("GET", "/v1/kvcmas/summary"),
}


def test_routes_cors_api_key_and_loopback(model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The route list is exactly the API (no file upload or download, no docs); CORS headers only when asked; the
    API key goes through hmac.compare_digest; the default bind address is loopback."""
    from fastapi.testclient import TestClient

    from kvcmas_cpp.server import add_serve_arguments
    from kvcmas_cpp.server import http_guard as app_module
    from kvcmas_cpp.server.app import Server, ServerConfig

    parser = __import__("argparse").ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([])
    assert args.host == "127.0.0.1" and args.cors_origin == [] and ServerConfig("m").host == "127.0.0.1"

    model = kc.Model(model_path, n_threads=1)
    plain = Server(ServerConfig(model_path, api_key="k3y"), model)
    cors = Server(ServerConfig(model_path, cors_origins=("http://ok.example",)), model)
    try:
        routes = {
            (m, getattr(r, "path", "")) for r in plain.app.routes for m in getattr(r, "methods", ()) if m != "HEAD"
        }
        assert routes == EXPECTED_ROUTES
        calls: list[tuple[bytes, bytes]] = []
        real = app_module.hmac.compare_digest

        def spy(a: bytes, b: bytes) -> bool:
            calls.append((a, b))
            return real(a, b)

        monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
        origin = {"Origin": "http://ok.example"}
        with TestClient(plain.app, base_url="http://127.0.0.1") as c:
            assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
            r = c.get("/v1/models", headers={"Authorization": "Bearer k3y", **origin})
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
            pre = c.options("/v1/models", headers={**origin, "Access-Control-Request-Method": "GET"})
            assert "access-control-allow-origin" not in pre.headers
            for path in ("/docs", "/openapi.json", "/redoc", "/static/../etc/passwd", "/v1/files", "/ui/..%2Fapp.py"):
                assert c.get(path, headers={"Authorization": "Bearer k3y"}).status_code == 404
            r = c.get("/v1/models/..%2F..%2Fetc%2Fpasswd", headers={"Authorization": "Bearer k3y"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert (b"nope", b"k3y") in calls and (b"k3y", b"k3y") in calls
        with TestClient(cors.app, base_url="http://localhost") as c:
            pre = c.options("/v1/models", headers={**origin, "Access-Control-Request-Method": "GET"})
            assert pre.headers["access-control-allow-origin"] == "http://ok.example"
            other = c.get("/v1/models", headers={"Origin": "http://evil.example"})
            assert "access-control-allow-origin" not in other.headers
    finally:
        plain.scheduler.stop()
        cors.scheduler.stop()


def test_an_unhandled_error_is_a_counted_and_logged_500(model_path: str, caplog: pytest.LogCaptureFixture) -> None:
    """An exception out of a handler used to escape the accounting middleware: the client got its JSON 500 from
    Starlette's outer handler, but /metrics never counted it, no access line was written, and the exception went on
    to uvicorn (a second traceback). Now it is answered, counted and logged like any status, the traceback once. The
    fault is put in by hand: no request is known to cause one."""
    from fastapi.testclient import TestClient

    from kvcmas_cpp.server.app import Server, ServerConfig

    server = Server(ServerConfig(model_path), kc.Model(model_path, n_threads=1))

    def broken_card() -> dict[str, Any]:
        raise ZeroDivisionError

    server._model_card = broken_card  # type: ignore[method-assign]
    try:
        # raise_server_exceptions (the default): an exception that leaves the app fails the request here
        with TestClient(server.app, base_url="http://127.0.0.1") as c, caplog.at_level("INFO", "kvcmas.server"):
            r = c.get("/v1/models")
            metrics = c.get("/metrics").text
    finally:
        server.scheduler.stop()
    assert r.status_code == 500 and r.json()["error"] == {
        "message": "internal error: ZeroDivisionError",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
    assert 'kvcmas_requests_total{endpoint="/v1/models",status="500"} 1' in metrics
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kvcmas.server"]
    assert "GET /v1/models -> 500" in lines, lines
    assert len([rec for rec in caplog.records if rec.exc_info]) == 1


def test_a_stopped_server_and_its_model_are_freed(model_path: str) -> None:
    """FastAPI caches what it learns of each endpoint in module-level caches; an endpoint that held its server (a bound
    method, a closure) kept every server ever built, and its model, alive until exit (nanobind then reported the
    model leaked). The endpoints reach the server weakly now: once the caller drops a served, stopped server, the
    server and its model are collected."""
    import gc
    import weakref

    from fastapi.testclient import TestClient

    from kvcmas_cpp.server.app import Server, ServerConfig

    model = kc.Model(model_path, n_threads=1)
    server = Server(ServerConfig(model_path), model)
    with TestClient(server.app, base_url="http://127.0.0.1") as c:
        assert c.get("/v1/models").status_code == 200
        assert c.post("/tokenize", json={"content": "hi"}).json()["tokens"]  # a utility route (a closure)
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    server.scheduler.stop()
    orphan = Server(ServerConfig(model_path), model)  # what an endpoint whose handler is gone answers
    with TestClient(orphan.app, base_url="http://127.0.0.1") as c:
        orphan._handlers.clear()
        gc.collect()
        r = c.get("/health")
        assert r.status_code == 503 and "shut down" in r.json()["error"]["message"]
    orphan.scheduler.stop()
    refs = [weakref.ref(server), weakref.ref(orphan), weakref.ref(model)]
    del server, orphan, model, c, r
    # The test client's portal thread may still be finishing the lifespan (whose frame holds the server) on a
    # loaded machine: give it a few seconds, then the server must be gone.
    deadline = time.monotonic() + 10.0
    while True:
        gc.collect()
        if all(ref() is None for ref in refs) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert [ref() is None for ref in refs] == [True] * 3, [gc.get_referrers(ref()) for ref in refs if ref()]


def _server_exit(model_path: str, port: int, patch_precheck: bool = False) -> subprocess.CompletedProcess[str]:
    """kvcmas-server run to its exit on `port` (1 thread); patch_precheck disables its bind check beforehand."""
    args = ["--model", model_path, "--port", str(port), "-t", "1"]
    code = "import sys, kvcmas_cpp.server.cli as s\n"
    if patch_precheck:
        code += "s._cannot_listen = lambda host, port: None\n"
    code += f"sys.exit(s.main({args!r}))\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_an_address_that_cannot_be_served_is_a_plain_error(model_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A port out of range is refused by the parser; a port already taken is refused before the model loads (exit 1,
    one line); if it is taken between that check and uvicorn's bind (forced here by disabling the check), the
    server still exits non-zero with uvicorn's reason, and lets go of the engine: no nanobind leak report."""
    from kvcmas_cpp.server import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    for bad in ("99999", "0", "http"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--port", bad])
        assert "--port" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        early = _server_exit(model_path, port)
        assert early.returncode == 1, early.stderr
        assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in early.stderr, early.stderr
        assert "listening on" not in early.stderr  # refused before the model was loaded
        late = _server_exit(model_path, port, patch_precheck=True)
    assert late.returncode not in (0, None), late.stderr
    assert "address already in use" in late.stderr.lower(), late.stderr
    assert "nanobind: leaked" not in late.stderr and "Traceback" not in late.stderr, late.stderr


# ------------------------------------------------------------------ faults: deleted model file, disconnects, KV
@pytest.fixture(scope="module")
def fault_server(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    copy = tmp_path_factory.mktemp("model") / Path(model_path).name
    shutil.copyfile(model_path, copy)
    srv = ServerProcess(
        str(copy),
        "--method",
        "nonshared",
        "--kv-budget",
        str(7 * BLOCK_BYTES),
        "--parallel",
        "4",
        "--max-queue",
        "1",
    )
    copy.unlink()  # the weights are mapped: the server keeps working without the file
    yield srv
    srv.stop()


def test_model_file_removed_after_load(fault_server: ServerProcess, model_path: str) -> None:
    client = openai.OpenAI(base_url=f"{fault_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    engine = kc.Model(model_path, n_threads=1)
    messages = [{"role": "user", "content": "Name three colors."}]
    reference = engine.chat(messages, max_tokens=10, temperature=0)
    assert isinstance(reference, kc.Completion)
    want = reference.text
    got = client.chat.completions.create(model=_model_id(client), messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == want
    chunks = client.chat.completions.create(
        model=_model_id(client), messages=messages, max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    # The sharing path (kvcmas method, agent sessions) needs nothing from the file either.
    hop = [{"role": "system", "content": "You are a planner."}, {"role": "user", "content": "Plan a picnic."}]
    options = {"workflow": "wf-removed", "agent": "planner", "method": "kvcmas"}
    out = chat_body(fault_server, hop, max_tokens=4, kvcmas=options)
    assert out["usage"]["completion_tokens"] >= 1
    assert fault_server.request("DELETE", "/v1/kvcmas/workflows/wf-removed")[0] == 200


def _prefix_cache_holding_only(srv: ServerProcess, model_path: str, prompt: str) -> dict[str, float]:
    """Leaves the server's prefix cache holding the prompt's entry alone: a completion whose reservation needs the
    whole KV budget evicts every entry before it runs, stores its prompt's rows, and stops at its first token.
    Returns the metrics once idle (the KV in use is then that entry's)."""
    n_prompt = len(kc.Model(model_path, n_threads=1, n_ctx=64).tokenize(prompt))
    body = {"prompt": prompt, "max_tokens": 6 * 32 - n_prompt, "stop": [","], "temperature": 0}  # 7 blocks: all
    status, _, out = srv.request("POST", "/v1/completions", body)
    assert status == 200, out
    m = _wait_idle(srv, srv.metrics()["kvcmas_kv_bytes"])
    assert m["kvcmas_prefix_cache_entries"] == 1 and m["kvcmas_kv_bytes"] == BLOCK_BYTES
    return m


def test_client_vanishing_frees_its_sequence(fault_server: ServerProcess, model_path: str) -> None:
    """Non-streaming and streaming clients that disconnect mid-generation: their jobs are cancelled, KV freed (all
    but the prompt's rows, which the prefix cache keeps)."""
    fault_server.request("DELETE", "/v1/kvcmas/workflows/default")
    before = _prefix_cache_holding_only(fault_server, model_path, COUNTING)
    for stream in (False, True):
        _wait_idle(fault_server, before["kvcmas_kv_bytes"])
        conn = http.client.HTTPConnection("127.0.0.1", fault_server.port, timeout=60)
        body = {"prompt": COUNTING, "max_tokens": 150, "stream": stream, "temperature": 0}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        if stream:
            resp = conn.getresponse()
            resp.fp.readline()
        deadline = time.monotonic() + 10
        # running and holding rows of its own (the fork of the cached prompt takes a block at its first new rows)
        while fault_server.metrics()["kvcmas_kv_bytes"] <= before["kvcmas_kv_bytes"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fault_server.metrics()["kvcmas_kv_bytes"] > before["kvcmas_kv_bytes"]
        assert conn.sock is not None
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    after = _wait_idle(fault_server, before["kvcmas_kv_bytes"])
    assert after["kvcmas_active_requests"] == 0 and after["kvcmas_kv_bytes"] == before["kvcmas_kv_bytes"]
    assert after["kvcmas_cancelled_total"] == before["kvcmas_cancelled_total"] + 2


def test_kv_budget_exhausted_429_then_recovers(fault_server: ServerProcess, model_path: str) -> None:
    before = _prefix_cache_holding_only(fault_server, model_path, COUNTING)
    body = {"prompt": COUNTING, "max_tokens": 120, "temperature": 0}
    n = 5
    start = threading.Barrier(n)

    def send(_: int) -> tuple[int, dict[str, str], Any]:
        start.wait()
        return fault_server.request("POST", "/v1/completions", body)

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(send, range(n)))
    statuses = sorted(r[0] for r in results)
    assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses, statuses
    for status, headers, out in results:
        if status == 429:
            assert int(headers["retry-after"]) >= 1 and out["error"]["type"] == "rate_limit_error"
    texts = {r[2]["choices"][0]["text"] for r in results if r[0] == 200}
    assert len(texts) == 1  # the ones that waited for memory got the same greedy answer
    after = _wait_idle(fault_server, before["kvcmas_kv_bytes"])  # the prompt's entry, stored again by each prefill
    assert after["kvcmas_kv_bytes"] == before["kvcmas_kv_bytes"] and after["kvcmas_queued_requests"] == 0
    status, _, out = fault_server.request("POST", "/v1/completions", body)  # recovered: memory is free again
    assert status == 200 and out["choices"][0]["text"] in texts


# ---------------------------------------------------------------------------------------------------- SIGTERM
def test_sigterm_drains_running_requests_and_exits_0(model_path: str) -> None:
    srv = ServerProcess(model_path, "--method", "nonshared", "--parallel", "4", "--shutdown-timeout", "5")
    streams: list[tuple[http.client.HTTPConnection, Any]] = []
    try:
        greedy = {"prompt": COUNTING, "temperature": 0}  # greedy: no early EOS (sampled, one may stop short)
        for max_tokens in (8, 8, 2000):  # two finish within the drain deadline, the last one is ended by it
            streams.append(_open_stream(srv, "/v1/completions", {**greedy, "max_tokens": max_tokens}))
        pool = ThreadPoolExecutor(4)
        plain = pool.submit(srv.request, "POST", "/v1/completions", {**greedy, "max_tokens": 8})
        time.sleep(0.2)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        readers = [pool.submit(_read_events, resp) for _, resp in streams]
        time.sleep(0.3)
        with pytest.raises(OSError):  # no new connections once draining
            socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()
        code = srv.proc.wait(timeout=15)
        elapsed = time.monotonic() - t0
        assert code == 0, srv.log()
        assert elapsed < 10
        for reader in readers[:2]:  # short ones finish normally within the deadline
            events = reader.result(timeout=5)
            assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        cut = readers[2].result(timeout=5)  # the long one is ended at the deadline with an error event
        assert cut[-1] == "[DONE]" and json.loads(cut[-2])["error"]["code"] == "server_shutting_down", cut[-2:]
        status, _, out = plain.result(timeout=5)
        assert status == 200 and out["usage"]["completion_tokens"] == 8, out
        pool.shutdown()
        assert "Traceback" not in srv.log()
    finally:
        for conn, _ in streams:
            conn.close()
        srv.stop()
