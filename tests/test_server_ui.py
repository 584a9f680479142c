"""kvcmas-server's page and the JSON it draws from (docs/ui.md).

One real server with two API keys (two tenants). The JSON endpoints hold what the responses and /metrics reported
for a scripted 4-agent workflow, field for field; a tenant never sees another's workflows; the page loads in a real
browser (Debian's headless Chromium, driven by Selenium), asks for the key, runs the same workflow from its chat box
and draws the four agents with their reuse figures; client text shows as text, never as HTML. A screenshot of the
page is kept under build/ui-test/.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.server import ROLES, TASK, ServerProcess, chat, run_workflow

KEYS = {"alice": "alice-ui-key-0123456789", "bob": "bob-ui-key-9876543210"}
ARTIFACTS = Path(__file__).resolve().parent.parent / "build" / "ui-test"  # gitignored
HOSTILE_AGENT = "<script>window.__kvcmas_pwned = 1</script>"
HOSTILE_TEXT = '<img src=x onerror="window.__kvcmas_pwned = 2"><b>bold?</b>'


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def ui_server(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("".join(f"{name} {key}\n" for name, key in KEYS.items()))
    srv = ServerProcess(model_path, "--api-key-file", str(keys), "--method", "kvcmas", "--no-calibration-dir")
    yield srv
    srv.stop()


def get(srv: ServerProcess, path: str, tenant: str | None) -> tuple[int, Any]:
    status, _, body = srv.request("GET", path, headers=auth(tenant) if tenant else None)
    return status, body


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = 0
    while (k + 1) / len(ordered) < q / 100.0:  # the smallest value with at least q% at or below it
        k += 1
    return ordered[k]


def authors_read(replies: list[str], k: int) -> set[str | None]:
    """Whose spans agent k's prompt holds: the task's (no author), and for each earlier reply its author; a reply
    equal to an earlier one is that one's span (the session keys spans by their text)."""
    first = {}
    for j, text in enumerate(replies[:k]):
        if text:
            first.setdefault(text, f"agent{j}")
    return {None, *first.values()}


def test_workflow_endpoints_hold_what_the_responses_and_metrics_reported(ui_server: ServerProcess) -> None:
    # the first traffic on this server: alice's totals are the server's
    answers = run_workflow(ui_server, "team", None, headers=auth("alice"))  # it ends with DELETE: the history stays
    status, listed = get(ui_server, "/v1/kvcmas/workflows", "alice")
    assert status == 200
    (entry,) = listed["data"]
    assert entry["id"] == "team" and entry["hops"] == 4
    assert entry["agents"] == [f"agent{k}" for k in range(4)]
    assert entry["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert entry["reused_tokens"] == sum(a["kvcmas"]["reused_tokens"] for a in answers)
    status, wf = get(ui_server, "/v1/kvcmas/workflows/team", "alice")
    assert status == 200 and wf["id"] == "team"
    hops = wf["hops"]
    assert len(hops) == 4
    for k, (hop, answer) in enumerate(zip(hops, answers, strict=True)):
        for field, value in answer["kvcmas"].items():  # the response's kvcmas object, field for field
            assert hop[field] == value, (k, field)
        assert hop["timings"] == answer["timings"]
        assert hop["id"] == answer["id"] and hop["index"] == k and hop["node"] == f"agent{k}"
        assert hop["prompt_tokens"] == answer["usage"]["prompt_tokens"]
        assert hop["completion_tokens"] == answer["usage"]["completion_tokens"]
        # the spans of its prompt by author: the task (no author) and every earlier agent's reply
        replies = [a["choices"][0]["message"]["content"] for a in answers]
        assert {r["from"] for r in hop["reads"]} == authors_read(replies, k), (k, hop["reads"])
        assert 0 < sum(r["tokens"] for r in hop["reads"]) < hop["prompt_tokens"]
        assert all(r["spans"] >= 1 for r in hop["reads"])
        est = hop["nonshared_estimate"]
        assert est["estimate"] is True and est["computed_tokens"] == hop["prompt_tokens"]
        row_bytes = hop["kv_bytes"] // (hop["computed_tokens"] + hop["completion_tokens"])
        assert est["kv_bytes"] == (hop["prompt_tokens"] + hop["completion_tokens"]) * row_bytes
        t = hop["timings"]
        if hop["mode"] != "reuse" and (hop["computed_tokens"] >= 64 or hop["reused_tokens"] == 0):
            assert est["rate_from"] == "this hop"  # it measured its own prefill rate
            assert est["prefill_rate_tokens_per_s"] == round(t["prompt_per_second"], 2)
        if hop["reused_tokens"] == 0:  # it is its own nonshared hop
            assert est["ttft_ms"] == pytest.approx(t["ttft_ms"], rel=1e-3)
        if est["ttft_ms"] is not None:  # its waits, then the whole prompt at that rate
            prefill = hop["prompt_tokens"] / est["prefill_rate_tokens_per_s"] * 1000.0
            assert est["ttft_ms"] == pytest.approx(t["queue_ms"] + t["wait_ms"] + t["interleaved_ms"] + prefill, 1e-3)
    assert any(h["span_tokens"] > 0 for h in hops[1:])  # later agents read spans the earlier ones computed
    assert hops[0]["reused_tokens"] == 0  # a fresh server: the first hop is its own nonshared hop (checked above)
    metrics = ui_server.metrics(auth("alice"))
    status, summary = get(ui_server, "/v1/kvcmas/summary", "alice")
    assert status == 200
    mine = summary["tenant"]
    assert mine["requests"] == 4 == metrics['kvcmas_requests_total{endpoint="/v1/chat/completions",status="200"}']
    for field, metric in (
        ("prompt_tokens", "kvcmas_prompt_tokens_total"),
        ("computed_tokens", "kvcmas_prompt_tokens_computed_total"),
        ("reused_tokens", "kvcmas_reused_tokens_total"),
        ("prefix_cached_tokens", "kvcmas_prefix_cached_tokens_total"),
        ("span_tokens", "kvcmas_span_tokens_total"),
        ("completion_tokens", "kvcmas_generated_tokens_total"),
    ):
        assert mine[field] == metrics[metric], field
    dense = {k.split('"')[1]: v for k, v in metrics.items() if k.startswith("kvcmas_dense_hops_total{")}
    assert mine["dense_hops"] == dense
    assert mine["prefix_cache_hit_rate"] == mine["prefix_cached_tokens"] / mine["prompt_tokens"]
    assert mine["span_hit_rate"] == mine["span_tokens"] / mine["prompt_tokens"]
    ttfts = [a["timings"]["ttft_ms"] for a in answers]
    assert mine["ttft_ms"]["n"] == 4 == metrics["kvcmas_ttft_seconds_count"]
    for q in (50, 90, 99):
        assert mine["ttft_ms"][f"p{q}"] == nearest_rank(ttfts, q)
    assert sum(w["n"] for w in mine["ttft_series"]) == 4
    server = summary["server"]
    whole = ui_server.metrics()  # the server-wide gauges: a keyless scrape from loopback (a tenant key sees its own)
    assert server["kv_budget_bytes"] == whole["kvcmas_kv_budget_bytes"]
    assert 0 <= server["kv_bytes"] <= server["kv_budget_bytes"]
    if answers[0]["kvcmas"]["method"] == "kvcmas":  # the namespace's estimator: edges by calibration state
        (est,) = summary["estimators"]
        assert est["method"] == "kvcmas" and est["cache_salt"] == ""
        assert est["fitted"] + est["calibrating"] >= 1 and est["bytes"] > 0


def one_hop(srv: ServerProcess, tenant: str, workflow: str) -> dict[str, Any]:
    """One short request of `tenant` in its own workflow."""
    messages = [{"role": "user", "content": f"Only {tenant} runs this."}]
    return chat(srv, messages, auth(tenant), max_tokens=4, kvcmas={"workflow": workflow, "agent": tenant})


def test_a_tenant_sees_only_its_own_workflows(ui_server: ServerProcess) -> None:
    one_hop(ui_server, "alice", "alice-only")
    bob = run_workflow(ui_server, "team", None, max_tokens=4, headers=auth("bob"))  # the same id as alice's
    one_hop(ui_server, "bob", "bob-only")
    _, alice_list = get(ui_server, "/v1/kvcmas/workflows", "alice")
    _, bob_list = get(ui_server, "/v1/kvcmas/workflows", "bob")
    assert {w["id"] for w in alice_list["data"]} == {"team", "alice-only"}
    assert [w["id"] for w in bob_list["data"]] == ["bob-only", "team"]  # the most recently active first
    _, alice_team = get(ui_server, "/v1/kvcmas/workflows/team", "alice")
    _, bob_team = get(ui_server, "/v1/kvcmas/workflows/team", "bob")
    assert [h["id"] for h in bob_team["hops"]] == [b["id"] for b in bob]
    assert not {h["id"] for h in alice_team["hops"]} & {h["id"] for h in bob_team["hops"]}
    other_status, other = get(ui_server, "/v1/kvcmas/workflows/alice-only", "bob")
    unknown_status, unknown = get(ui_server, "/v1/kvcmas/workflows/nobody-has-this", "bob")
    assert other_status == unknown_status == 404  # the same answer for another's and for none
    assert other["error"]["code"] == unknown["error"]["code"] == "workflow_not_found"
    _, bob_summary = get(ui_server, "/v1/kvcmas/summary", "bob")
    assert bob_summary["tenant"]["requests"] == 5
    assert bob_summary["tenant"]["prompt_tokens"] == sum(h["prompt_tokens"] for h in bob_team["hops"]) + sum(
        h["prompt_tokens"] for h in get(ui_server, "/v1/kvcmas/workflows/bob-only", "bob")[1]["hops"]
    )
    for path in ("/v1/kvcmas/workflows", "/v1/kvcmas/workflows/team", "/v1/kvcmas/summary"):
        assert get(ui_server, path, None)[0] == 401
        assert ui_server.request("GET", path, headers={"Authorization": "Bearer wrong"})[0] == 401


def test_client_text_comes_back_as_data(ui_server: ServerProcess) -> None:
    out = chat(
        ui_server,
        [{"role": "user", "content": HOSTILE_TEXT}],
        auth("alice"),
        max_tokens=4,
        kvcmas={"workflow": "hostile </script>", "agent": HOSTILE_AGENT},
    )
    status, headers, wf = ui_server.request(
        "GET", "/v1/kvcmas/workflows/hostile%20%3C%2Fscript%3E", headers=auth("alice")
    )
    assert status == 200 and headers["content-type"].startswith("application/json")
    assert wf["id"] == "hostile </script>" and wf["hops"][0]["agent"] == HOSTILE_AGENT == out["kvcmas"]["agent"]


def test_a_streamed_response_is_recorded_as_sent(ui_server: ServerProcess) -> None:
    body = {
        "messages": [{"role": "system", "content": "You stream."}, {"role": "user", "content": "Count to three."}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "kvcmas": {"workflow": "streamed", "agent": "streamer"},
    }
    status, _, text = ui_server.request("POST", "/v1/chat/completions", body, auth("alice"))
    assert status == 200
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    last = next(c for c in reversed(chunks) if "kvcmas" in c)
    _, wf = get(ui_server, "/v1/kvcmas/workflows/streamed", "alice")
    (hop,) = wf["hops"]
    assert {k: hop[k] for k in last["kvcmas"]} == last["kvcmas"] and hop["timings"] == last["timings"]
    assert hop["id"] == last["id"] and hop["node"] == "streamer"


def test_the_page_is_static_package_data(ui_server: ServerProcess, model_path: str) -> None:
    status, headers, html = ui_server.request("GET", "/ui")  # no key: the page holds no data
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert (
        "default-src 'none'" in headers["content-security-policy"]
        and "script-src 'self'" in headers["content-security-policy"]
    )
    assert '<script src="/ui/app.js"' in html and "http://" not in html and "https://" not in html  # no CDN
    for name, kind in (("app.js", "text/javascript"), ("app.css", "text/css")):
        status, headers, text = ui_server.request("GET", f"/ui/{name}")
        assert status == 200 and headers["content-type"].startswith(kind) and len(text) > 1000
        assert "innerHTML" not in text and "insertAdjacentHTML" not in text and "document.write" not in text
    assert ui_server.request("GET", "/ui/nothing.js", headers=auth("alice"))[0] == 404  # only the three files
    assert ui_server.request("GET", "/ui/../app.py", headers=auth("alice"))[0] == 404
    off = ServerProcess(model_path, "--no-ui")
    try:
        assert off.request("GET", "/ui")[0] == 404
        assert off.request("GET", "/v1/kvcmas/workflows")[0] == 200  # the JSON stays
    finally:
        off.stop()


# ------------------------------------------------------------------------------------------------ the browser
def _browser() -> Any:
    """A headless Chromium driven by Selenium, or a skip that says what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (scripts/setup.sh --test)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("Chromium is not installed: `apt-get install chromium chromium-driver` (scripts/setup.sh --test)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1500,1250",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver_path), options=options)


def _wait(condition: Any, timeout: float = 120.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _send(drv: Any, workflow: str, agent: str, system: str, message: str) -> None:
    from selenium.webdriver.common.by import By

    replies = len(drv.find_elements(By.CSS_SELECTOR, "#chat-log li.reply"))
    for field, value in (
        ("chat-workflow", workflow),
        ("chat-agent", agent),
        ("chat-system", system),
        ("chat-message", message),
    ):
        box = drv.find_element(By.ID, field)
        box.clear()
        if value:
            box.send_keys(value)
    drv.find_element(By.ID, "chat-max").clear()
    drv.find_element(By.ID, "chat-max").send_keys("12")
    drv.find_element(By.ID, "chat-send").click()
    _wait(
        lambda: (
            len(drv.find_elements(By.CSS_SELECTOR, "#chat-log li.reply")) > replies
            or drv.find_elements(By.CSS_SELECTOR, "#chat-log li.failed")
        ),
        what=f"{agent}'s reply",
    )
    assert not drv.find_elements(By.CSS_SELECTOR, "#chat-log li.failed"), drv.find_element(By.ID, "chat-log").text


def test_the_page_in_a_browser_draws_the_team(ui_server: ServerProcess) -> None:
    from selenium.webdriver.common.by import By

    drv = _browser()
    try:
        drv.get(f"{ui_server.url}/ui")
        _wait(lambda: drv.find_element(By.ID, "key-panel").is_displayed(), 30, "the key prompt")
        drv.find_element(By.ID, "key-input").send_keys(KEYS["alice"])
        drv.find_element(By.ID, "key-submit").click()
        _wait(lambda: not drv.find_element(By.ID, "key-panel").is_displayed(), 30, "the key prompt to close")
        assert drv.execute_script("return sessionStorage.getItem('kvcmas-api-key')") == KEYS["alice"]
        assert KEYS["alice"] not in drv.current_url
        # the scripted workflow from the chat box: the first agent sends the task, each later one reads the task
        # and every earlier reply (the tab's transcript), as _workflow does over HTTP
        for k, role in enumerate(ROLES):
            _send(drv, "browser-team", f"agent{k}", role, TASK if k == 0 else "")
        _, wf = get(ui_server, "/v1/kvcmas/workflows/browser-team", "alice")
        assert [h["agent"] for h in wf["hops"]] == [f"agent{k}" for k in range(4)]

        def drawn() -> dict[str, Any]:
            nodes = drv.find_elements(By.CSS_SELECTOR, "#graph g.node")
            return {n.get_attribute("data-agent"): n for n in nodes if n.get_attribute("data-agent")}

        _wait(lambda: set(drawn()) == {f"agent{k}" for k in range(4)}, 30, "the four agents in the graph")
        nodes = drawn()
        for hop in wf["hops"]:  # each agent ran once: its node shows its hop's figures
            figures = nodes[hop["agent"]].find_element(By.CSS_SELECTOR, ".node-figures")
            assert figures.get_attribute("data-reused") == str(hop["reused_tokens"])
            assert figures.get_attribute("data-computed") == str(hop["computed_tokens"])
            assert f"reused {hop['reused_tokens']:,}" in figures.text
        edges = {
            (e.get_attribute("data-from"), e.get_attribute("data-to"))
            for e in drv.find_elements(By.CSS_SELECTOR, "#graph path.edge")
        }
        replies = [
            t.get_attribute("textContent") for t in drv.find_elements(By.CSS_SELECTOR, "#chat-log li.reply .chat-text")
        ]
        expected = {(author, f"agent{k}") for k in range(4) for author in authors_read(replies, k) if author}
        assert len(expected) >= 3 and expected <= edges  # at least agent0's reply, read by each later agent
        assert {(author, to) for author, to in edges if author} <= expected
        rows = drv.find_elements(By.CSS_SELECTOR, "#hops tbody tr")
        assert [r.find_element(By.CSS_SELECTOR, "td.reused").text for r in rows] == [
            f"{h['reused_tokens']:,}" for h in wf["hops"]
        ]
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        drv.execute_script("window.scrollTo(0, 0)")
        drv.save_screenshot(str(ARTIFACTS / "ui.png"))
        # client text is shown as text: a hostile agent name and message
        _send(drv, "browser-hostile", HOSTILE_AGENT, "", HOSTILE_TEXT)
        _wait(
            lambda: any(
                n.get_attribute("textContent") == HOSTILE_AGENT
                for n in drv.find_elements(By.CSS_SELECTOR, "#hops td.agent")
            ),
            30,
            "the hostile agent's row",
        )
        assert drv.execute_script("return window.__kvcmas_pwned") is None
        assert not drv.find_elements(By.CSS_SELECTOR, "#hops b, #chat-log img, #chat-log b, #hops script")
        assert any(HOSTILE_TEXT in li.text for li in drv.find_elements(By.CSS_SELECTOR, "#chat-log li"))
        drv.save_screenshot(str(ARTIFACTS / "ui-hostile.png"))
    finally:
        drv.quit()


def test_the_history_is_bounded_per_tenant() -> None:
    from kvcmas_cpp.server import history as hist

    h = hist.History(rows_bytes=lambda rows: 100 * rows)
    kvcmas = {
        "method": "kvcmas",
        "reused_tokens": 3,
        "computed_tokens": 7,
        "prefix_cached_tokens": 1,
        "span_tokens": 2,
        "mode": "reuse",
        "gate": "reuse",
        "dense_reason": None,
        "kv_bytes": 0,
        "corr_bytes": 0,
    }
    timings = {"ttft_ms": 5.0, "prompt_per_second": 100.0, "queue_ms": 0.0, "wait_ms": 0.0, "interleaved_ms": 0.0}
    usage = {"prompt_tokens": 10, "completion_tokens": 2}
    reads = [{"from": f"author{i}", "tokens": 1, "spans": 1} for i in range(hist.MAX_READ_AUTHORS + 5)]
    for i in range(hist.MAX_WORKFLOWS + 10):
        h.record("t", "", f"wf{i}", f"id{i}", kvcmas, timings, usage, [], "x" * 1000)
    for i in range(hist.MAX_HOPS + 10):
        h.record("t", "", "long", f"hop{i}", kvcmas, timings, usage, reads, f"agent{i}")
    listed = h.workflows("t")
    assert len(listed) == hist.MAX_WORKFLOWS and listed[0]["id"] == "long"
    assert h.workflow("t", "wf0") is None  # the least recently active went first
    assert len(listed[-1]["agents"][0]) == hist.NAME_CHARS
    long = h.workflow("t", "long")
    assert long is not None and long["hops_total"] == hist.MAX_HOPS + 10 and len(long["hops"]) == hist.MAX_HOPS
    assert long["hops"][0]["index"] == 10 and long["hops"][-1]["id"] == f"hop{hist.MAX_HOPS + 9}"
    assert len(long["hops"][0]["reads"]) == hist.MAX_READ_AUTHORS + 1
    assert long["hops"][0]["reads"][-1] == {"from": "(others)", "tokens": 5, "spans": 5}
    assert h.workflows("other") == [] and h.workflow("other", "long") is None
    summary = h.tenant_summary("t")
    n = hist.MAX_WORKFLOWS + hist.MAX_HOPS + 20
    assert summary["requests"] == n and summary["ttft_ms"]["n"] == n and summary["prompt_tokens"] == 10 * n
    assert sum(len(samples) for _, _, samples in h._tenants["t"].ttft) <= hist.TTFT_WINDOWS * hist.TTFT_SAMPLES
