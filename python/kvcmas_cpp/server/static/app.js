// kvcmas-server's page (docs/ui.md). It draws only what GET /v1/kvcmas/workflows, /v1/kvcmas/workflows/{id} and
// /v1/kvcmas/summary return, and sends chat requests as the API's clients do. Text from the server or a client is
// only ever set as textContent (never parsed as HTML). The API key, when the server wants one, is kept in this tab's
// sessionStorage and sent as a Bearer header.
"use strict";

const KEY_STORE = "kvcmas-api-key";
const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const CONTEXT = "\u0000context"; // the graph's node for spans no agent wrote

const state = {
  selected: null, // the workflow shown
  shownVersion: null, // "<id>:<hops>" last drawn
  transcripts: new Map(), // workflow -> [texts this tab sent or received], read by later agents
  needKey: false,
  timer: null,
};

// ------------------------------------------------------------------------------------------------ helpers
function $(id) { return document.getElementById(id); }

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

function fmtInt(n) { return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"); }

function fmtMs(ms) {
  if (ms === null || ms === undefined) return "–";
  return ms >= 1000 ? (ms / 1000).toFixed(2) + " s" : Math.round(ms) + " ms";
}

function fmtBytes(b) {
  if (b === null || b === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Number(b);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return (i === 0 ? v.toFixed(0) : v.toFixed(v >= 100 ? 0 : 1)) + " " + units[i];
}

function fmtPct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"; }

function nodeName(name) { return name === null ? CONTEXT : name; }

// ------------------------------------------------------------------------------------------------ the API
class NeedKey extends Error {}

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { Authorization: "Bearer " + key } : {};
}

async function api(path, init) {
  const opts = Object.assign({ cache: "no-store" }, init || {});
  opts.headers = Object.assign({}, authHeaders(), (init && init.headers) || {});
  const resp = await fetch(path, opts);
  if (resp.status === 401) { askForKey(sessionStorage.getItem(KEY_STORE) ? "That key was refused." : ""); throw new NeedKey(); }
  let body = null;
  try { body = await resp.json(); } catch (e) { body = null; }
  if (!resp.ok) {
    const msg = body && body.error && body.error.message ? body.error.message : "HTTP " + resp.status;
    const err = new Error(msg);
    err.status = resp.status;
    throw err;
  }
  return body;
}

function askForKey(message) {
  state.needKey = true;
  $("key-panel").hidden = false;
  $("key-error").textContent = message || "";
  $("key-input").focus();
}

function setLive(ok, text) {
  const dot = $("live-dot");
  dot.className = "dot " + (ok ? "on" : "err");
  $("live-text").textContent = text;
}

// ------------------------------------------------------------------------------------------------ polling
async function refresh() {
  if (state.needKey || document.hidden) return;
  try {
    const [summary, list] = await Promise.all([api("/v1/kvcmas/summary"), api("/v1/kvcmas/workflows")]);
    drawSummary(summary);
    drawList(list.data);
    if (state.selected === null && list.data.length) state.selected = list.data[0].id;
    const current = list.data.find((w) => w.id === state.selected);
    if (current) {
      const version = current.id + ":" + current.hops;
      if (version !== state.shownVersion) {
        const wf = await api("/v1/kvcmas/workflows/" + encodeURIComponent(current.id));
        drawWorkflow(wf);
        state.shownVersion = version;
      }
    }
    $("forget-key").hidden = !sessionStorage.getItem(KEY_STORE);
    setLive(true, "live · " + new Date().toLocaleTimeString());
  } catch (e) {
    if (!(e instanceof NeedKey)) setLive(false, "error: " + e.message);
  }
}

function schedule() {
  clearTimeout(state.timer);
  state.timer = setTimeout(async () => { await refresh(); schedule(); }, POLL_MS);
}

// ------------------------------------------------------------------------------------------------ drawing
function drawList(workflows) {
  const ul = $("workflow-list");
  clear(ul);
  $("workflow-empty").hidden = workflows.length > 0;
  for (const w of workflows) {
    const li = el("li");
    li.setAttribute("data-workflow", w.id);
    if (w.id === state.selected) li.classList.add("selected");
    li.appendChild(el("div", "wf-name", w.id));
    const share = w.prompt_tokens ? w.reused_tokens / w.prompt_tokens : 0;
    const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
    li.appendChild(el("div", "wf-line", `${plural(w.hops, "hop")} · ${plural(w.agents.length, "agent")} · ${fmtPct(share)} reused`));
    const mini = el("div", "mini");
    const fill = el("div");
    fill.style.width = (100 * share).toFixed(1) + "%";
    mini.appendChild(fill);
    li.appendChild(mini);
    li.addEventListener("click", () => {
      state.selected = w.id;
      state.shownVersion = null;
      $("chat-workflow").value = w.id;
      refresh();
    });
    ul.appendChild(li);
  }
}

function drawWorkflow(wf) {
  $("wf-none").hidden = true;
  $("wf-title").textContent = wf.id;
  const stats = $("wf-stats");
  clear(stats);
  const share = wf.prompt_tokens ? wf.reused_tokens / wf.prompt_tokens : 0;
  for (const [label, value] of [
    ["hops", fmtInt(wf.hops_total)],
    ["prompt tokens", fmtInt(wf.prompt_tokens)],
    ["reused", fmtInt(wf.reused_tokens) + " (" + fmtPct(share) + ")"],
    ["computed", fmtInt(wf.computed_tokens)],
    ["method", wf.methods.join(", ")],
  ]) {
    const s = el("span");
    s.appendChild(document.createTextNode(label + " "));
    s.appendChild(el("b", null, value));
    stats.appendChild(s);
  }
  if (wf.hops_kept < wf.hops_total) {
    stats.appendChild(el("span", null, `(the last ${wf.hops_kept} hops are kept)`));
  }
  drawGraph(wf.hops);
  drawHops(wf.hops);
}

function graphModel(hops) {
  const names = [];
  const nodes = new Map();
  const addNode = (key) => {
    if (!nodes.has(key)) {
      nodes.set(key, { key, hops: 0, reused: 0, computed: 0, gate: null, mode: null });
      names.push(key);
    }
    return nodes.get(key);
  };
  const edges = new Map(); // "from\u0001to" -> {from, to, tokens, mode}: the reader's latest hop
  const hasContext = hops.some((h) => h.reads.some((r) => r.from === null));
  if (hasContext) addNode(CONTEXT);
  for (const h of hops) {
    const reader = addNode(h.node);
    reader.hops += 1;
    reader.reused += h.reused_tokens;
    reader.computed += h.computed_tokens;
    reader.gate = h.gate;
    reader.mode = h.mode;
    for (const r of h.reads) {
      const from = nodeName(r.from);
      if (from === h.node) continue; // an agent reading its own earlier reply
      addNode(from);
      edges.set(from + "\u0001" + h.node, { from, to: h.node, tokens: r.tokens, mode: h.mode === "reuse" ? "reuse" : "dense" });
    }
  }
  return { names, nodes, edges: [...edges.values()] };
}

function spread(center, width, i, n) {
  // the i-th of n attachment points along a node's top edge
  if (n <= 1) return center;
  const span = width - 36;
  return center - span / 2 + (span * i) / (n - 1);
}

function drawGraph(hops) {
  const g = $("graph");
  clear(g);
  const { names, nodes, edges } = graphModel(hops);
  const W = Math.max(560, g.clientWidth || 800);
  const H = 300;
  const nodeW = Math.min(170, Math.max(112, (W - 40) / Math.max(1, names.length) - 24));
  const nodeH = 84;
  const gap = names.length > 1 ? Math.min(150, (W - 40 - nodeW * names.length) / (names.length - 1)) : 0;
  const left = (W - nodeW * names.length - gap * Math.max(0, names.length - 1)) / 2; // the group centred
  const baseY = H - nodeH - 12;
  const index = new Map(names.map((n, i) => [n, i]));
  const x = new Map(names.map((n, i) => [n, left + i * (nodeW + gap) + nodeW / 2]));
  const maxTokens = Math.max(1, ...edges.map((e) => e.tokens));
  g.setAttribute("viewBox", `0 0 ${W} ${H}`);
  // attachment points: a source's edges leave in the order of their targets, a target's arrive in the order of
  // their sources, so arcs fan out instead of meeting in one point
  const outs = new Map(), ins = new Map();
  for (const e of edges) {
    if (!outs.has(e.from)) outs.set(e.from, []);
    if (!ins.has(e.to)) ins.set(e.to, []);
    outs.get(e.from).push(e);
    ins.get(e.to).push(e);
  }
  for (const list of outs.values()) list.sort((a, b) => index.get(a.to) - index.get(b.to));
  for (const list of ins.values()) list.sort((a, b) => index.get(a.from) - index.get(b.from));
  const labels = [];
  for (const e of edges) {
    const o = outs.get(e.from), n = ins.get(e.to);
    const x1 = spread(x.get(e.from), nodeW, o.indexOf(e), o.length);
    const x2 = spread(x.get(e.to), nodeW, n.indexOf(e), n.length);
    const dist = Math.abs(index.get(e.to) - index.get(e.from));
    const top = Math.max(18, baseY - 34 - 44 * dist);
    const d = `M ${x1} ${baseY} C ${x1} ${top}, ${x2} ${top}, ${x2} ${baseY - 7}`;
    const path = svg("path", { d, class: "edge " + e.mode, "stroke-width": (1.5 + 5 * e.tokens / maxTokens).toFixed(2) });
    path.setAttribute("data-from", e.from === CONTEXT ? "" : e.from);
    path.setAttribute("data-to", e.to);
    path.appendChild(svg("title", {}, `${e.from === CONTEXT ? "shared context" : e.from} → ${e.to}: ${e.tokens} tokens ${e.mode === "reuse" ? "read (reused)" : "computed again"}`));
    g.appendChild(path);
    g.appendChild(svg("polygon", { points: `${x2 - 5},${baseY - 9} ${x2 + 5},${baseY - 9} ${x2},${baseY - 1}`, class: "edge-head " + e.mode }));
    // the label at the arc's highest point (a cubic's midpoint: 3/4 of the way to the control points' height)
    const label = svg("text", { x: (x1 + x2) / 2, y: baseY - 0.75 * (baseY - top) + 4, "text-anchor": "middle", class: "edge-label" }, fmtInt(e.tokens));
    label.setAttribute("data-from", e.from === CONTEXT ? "" : e.from);
    label.setAttribute("data-to", e.to);
    labels.push(label);
  }
  for (const l of labels) g.appendChild(l); // above every arc
  for (const name of names) {
    const n = nodes.get(name);
    const cx = x.get(name);
    const grp = svg("g", { class: "node" + (name === CONTEXT ? " ctx" : ""), transform: `translate(${cx - nodeW / 2},${baseY})` });
    grp.setAttribute("data-agent", name === CONTEXT ? "" : name);
    grp.appendChild(svg("rect", { width: nodeW, height: nodeH, rx: 10, class: "box" }));
    grp.appendChild(svg("text", { x: 10, y: 20, class: "node-name" }, name === CONTEXT ? "shared context" : clip(name, nodeW)));
    grp.appendChild(svg("title", {}, name === CONTEXT ? "messages no agent of this workflow wrote" : name));
    if (name === CONTEXT) {
      grp.appendChild(svg("text", { x: 10, y: 38, class: "node-sub" }, "task and user"));
      grp.appendChild(svg("text", { x: 10, y: 52, class: "node-sub" }, "messages"));
    } else {
      const sub = svg("text", { x: 10, y: 38, class: "node-sub node-figures" });
      sub.setAttribute("data-reused", String(n.reused));
      sub.setAttribute("data-computed", String(n.computed));
      sub.appendChild(svg("tspan", { class: "fig-reuse" }, `reused ${fmtInt(n.reused)}`));
      sub.appendChild(svg("tspan", { x: 10, dy: 14, class: "fig-dense" }, `computed ${fmtInt(n.computed)}`));
      grp.appendChild(sub);
      grp.appendChild(svg("text", { x: 10, y: 66, class: "node-sub" }, clip(`${n.hops} hop${n.hops === 1 ? "" : "s"} · ${n.gate && n.gate !== "n/a" ? n.gate : n.mode || ""}`, nodeW + 10)));
      const total = Math.max(1, n.reused + n.computed);
      const bw = nodeW - 20;
      grp.appendChild(svg("rect", { x: 10, y: 73, width: bw, height: 5, rx: 2.5, class: "bar-bg" }));
      grp.appendChild(svg("rect", { x: 10, y: 73, width: (bw * n.reused / total).toFixed(1), height: 5, rx: 2.5, class: "bar-reuse" }));
      grp.appendChild(svg("rect", { x: 10 + bw * n.reused / total, y: 73, width: (bw * n.computed / total).toFixed(1), height: 5, rx: 2.5, class: "bar-dense" }));
    }
    g.appendChild(grp);
  }
}

function clip(text, width) {
  const max = Math.max(6, Math.floor((width - 20) / 7.5));
  return text.length <= max ? text : text.slice(0, max - 1) + "\u2026";
}

function decision(h) {
  const td = el("td");
  const kind = h.mode === "reuse" ? "reuse" : (h.index === 0 || h.mode === "source") ? "first" : "dense";
  td.appendChild(el("span", "tag " + kind, h.gate && h.gate !== "n/a" ? h.gate : h.mode || "–"));
  if (h.dense_reason) td.appendChild(el("span", "reason", "dense: " + h.dense_reason));
  return td;
}

function drawHops(hops) {
  const body = $("hops").querySelector("tbody");
  clear(body);
  const scale = Math.max(1, ...hops.map((h) => Math.max(h.timings.ttft_ms, h.nonshared_estimate.ttft_ms || 0)));
  for (const h of hops) {
    const tr = el("tr");
    tr.setAttribute("data-hop", String(h.index));
    const num = (v, cls) => el("td", "num" + (cls ? " " + cls : ""), v);
    tr.appendChild(num(h.index + 1));
    const agent = el("td", "agent", h.node);
    agent.title = h.node;
    tr.appendChild(agent);
    tr.appendChild(decision(h));
    tr.appendChild(num(fmtInt(h.prompt_tokens)));
    const reused = num(fmtInt(h.reused_tokens), "reused");
    reused.title = `prefix cache ${h.prefix_cached_tokens}, other agents' spans ${h.span_tokens}`;
    tr.appendChild(reused);
    tr.appendChild(num(fmtInt(h.computed_tokens), "computed"));
    const t = h.timings;
    const split = el("td");
    const bar = el("div", "tbar");
    bar.title = `queue ${fmtMs(t.queue_ms)} · wait ${fmtMs(t.wait_ms)} · engine ${fmtMs(t.engine_ms)} · sharing ${fmtMs(t.session_ms)} · others' work ${fmtMs(t.interleaved_ms)}`;
    for (const [cls, ms] of [["t-queue", t.queue_ms], ["t-wait", t.wait_ms], ["t-engine", t.engine_ms], ["t-session", t.session_ms], ["t-inter", t.interleaved_ms]]) {
      const part = el("div", cls);
      part.style.width = (100 * ms / scale).toFixed(2) + "%";
      bar.appendChild(part);
    }
    split.appendChild(bar);
    tr.appendChild(split);
    tr.appendChild(num(fmtMs(t.ttft_ms), "ttft"));
    const est = h.nonshared_estimate;
    const estTd = num(fmtMs(est.ttft_ms), "est");
    estTd.title = est.prefill_rate_tokens_per_s === null ? "no prefill rate measured yet" : `${fmtInt(est.computed_tokens)} tokens at ${est.prefill_rate_tokens_per_s} tok/s (measured on ${est.rate_from}), plus this hop's waits`;
    if (est.ttft_ms !== null && est.ttft_ms > t.ttft_ms) estTd.appendChild(el("span", "saving", "saves ~" + fmtMs(est.ttft_ms - t.ttft_ms)));
    tr.appendChild(estTd);
    const kv = num(fmtBytes(h.kv_bytes), "kv");
    kv.appendChild(el("span", "sub", "corrections " + fmtBytes(h.corr_bytes)));
    kv.appendChild(el("span", "sub est-kv", "nonshared " + fmtBytes(est.kv_bytes) + " est."));
    tr.appendChild(kv);
    body.appendChild(tr);
  }
}

function drawSummary(s) {
  $("server-meta").textContent = `${s.model} · method ${s.method} · ${s.server.active_requests} running, ${s.server.queued_requests} queued`;
  const t = s.tenant;
  const kpis = $("kpis");
  clear(kpis);
  const add = (value, label, id) => {
    const k = el("div", "kpi");
    if (id) k.id = id;
    k.appendChild(el("div", "v", value));
    k.appendChild(el("div", "l", label));
    kpis.appendChild(k);
  };
  add(fmtInt(t.requests), "requests", "kpi-requests");
  add(fmtPct(t.prompt_tokens ? t.reused_tokens / t.prompt_tokens : null), "prompt tokens reused", "kpi-reused");
  add(fmtPct(t.prefix_cache_hit_rate), "from the prefix cache");
  add(fmtPct(t.span_hit_rate), "from other agents' spans");
  add(fmtMs(t.ttft_ms.p50), "TTFT p50 (10 min)");
  add(fmtMs(t.ttft_ms.p90), "TTFT p90 (10 min)");
  const dense = Object.entries(t.dense_hops).map(([r, n]) => `${r} ${n}`).join(", ");
  add(fmtInt(Object.values(t.dense_hops).reduce((a, b) => a + b, 0)), "dense hops" + (dense ? " (" + dense + ")" : ""));
  add(s.prefill_rate_tokens_per_s === null ? "–" : fmtInt(Math.round(s.prefill_rate_tokens_per_s)), "prefill tok/s (measured)");
  drawTtft(t);
  const sv = s.server;
  const budget = Math.max(1, sv.kv_budget_bytes);
  $("kv-used").style.width = (100 * Math.min(1, sv.kv_bytes / budget)).toFixed(2) + "%";
  $("kv-stored").style.width = (100 * Math.min(1, sv.kv_stored_bytes / budget)).toFixed(2) + "%";
  $("kv-note").textContent = `${fmtBytes(sv.kv_bytes)} in use of ${fmtBytes(sv.kv_budget_bytes)} (peak ${fmtBytes(sv.kv_peak_bytes)}); `
    + `stored spans ${fmtBytes(sv.kv_stored_bytes)}; estimators ${fmtBytes(sv.estimator_bytes)}; `
    + `${sv.training_reads_pending} training reads pending`;
  const box = $("estimators");
  clear(box);
  if (!s.estimators.length) box.appendChild(el("p", "empty", "No estimator yet (kvcmas learns one per namespace)."));
  for (const e of s.estimators) {
    const row = el("div", "est-row");
    row.appendChild(el("span", null, e.method + (e.cache_salt ? " · salt " + e.cache_salt : "")));
    row.appendChild(el("span", null, `${e.fitted} fitted · ${e.calibrating} calibrating (${e.reads} reads) · ${fmtBytes(e.bytes)}`));
    box.appendChild(row);
  }
}

function drawTtft(t) {
  const g = $("ttft-chart");
  clear(g);
  const W = g.clientWidth || 260, H = 140, pad = 26;
  g.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const series = t.ttft_series.filter((w) => w.p50 !== null);
  $("ttft-note").textContent = series.length
    ? `p50 (solid) and p90 (dashed) per ${t.ttft_window_s} s window; ${fmtInt(t.ttft_ms.n)} requests`
    : "No request in the last 10 minutes.";
  g.appendChild(svg("line", { x1: pad, y1: H - 16, x2: W - 4, y2: H - 16, class: "axis" }));
  if (!series.length) return;
  const now = Date.now() / 1000;
  const span = Math.min(600, Math.max(60, now - series[0].t));
  const t0 = now - span;
  const maxV = Math.max(...series.map((w) => w.p90));
  const px = (ts) => pad + (W - pad - 6) * Math.min(1, Math.max(0, (ts + t.ttft_window_s / 2 - t0) / span));
  const py = (v) => H - 16 - (H - 30) * v / maxV;
  for (const [key, cls] of [["p90", "p90"], ["p50", "p50"]]) {
    const pts = series.map((w) => `${px(w.t).toFixed(1)},${py(w[key]).toFixed(1)}`).join(" ");
    g.appendChild(svg("polyline", { points: series.length === 1 ? pts + " " + pts : pts, class: cls }));
    for (const w of series) g.appendChild(svg("circle", { cx: px(w.t), cy: py(w[key]), r: 2.2, class: cls }));
  }
  g.appendChild(svg("text", { x: 2, y: 12 }, fmtMs(maxV)));
  g.appendChild(svg("text", { x: pad, y: H - 3 }, span >= 120 ? `-${Math.round(span / 60)} min` : `-${Math.round(span)} s`));
  g.appendChild(svg("text", { x: W - 30, y: H - 3 }, "now"));
}

// ------------------------------------------------------------------------------------------------ chat
async function sendChat(ev) {
  ev.preventDefault();
  const workflow = $("chat-workflow").value.trim();
  const agent = $("chat-agent").value.trim();
  const system = $("chat-system").value;
  const message = $("chat-message").value;
  const withHistory = $("chat-history").checked;
  const history = withHistory ? (state.transcripts.get(workflow) || []) : [];
  const messages = [];
  if (system.trim()) messages.push({ role: "system", content: system });
  for (const text of history) messages.push({ role: "user", content: text });
  if (message.trim()) messages.push({ role: "user", content: message });
  if (!messages.some((m) => m.role === "user")) { addLog("failed", "", "Write a message (there is nothing earlier to read)."); return; }
  const maxTokens = Math.max(1, parseInt($("chat-max").value, 10) || 48);
  addLog("sent", `${agent} → ${workflow}`, message.trim() ? message : "(reads the workflow's earlier messages)");
  $("chat-send").disabled = true;
  try {
    const body = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ messages, max_tokens: maxTokens, temperature: 0, kvcmas: { workflow, agent } }),
    });
    const reply = body.choices[0].message.content || "";
    const k = body.kvcmas;
    addLog("reply", `${agent}: reused ${k.reused_tokens} of ${body.usage.prompt_tokens} prompt tokens · ${k.gate && k.gate !== "n/a" ? k.gate : k.mode} · TTFT ${fmtMs(body.timings.ttft_ms)}`, reply);
    const list = state.transcripts.get(workflow) || [];
    if (withHistory) {
      if (message.trim()) list.push(message);
      if (reply) list.push(reply);
    }
    state.transcripts.set(workflow, list);
    $("chat-message").value = "";
    state.selected = workflow;
    state.shownVersion = null;
    await refresh();
  } catch (e) {
    if (!(e instanceof NeedKey)) addLog("failed", "error", e.message);
  } finally {
    $("chat-send").disabled = false;
  }
}

function addLog(kind, who, text) {
  const li = el("li", kind);
  li.appendChild(el("div", "chat-who", who));
  li.appendChild(el("div", "chat-text", text));
  $("chat-log").appendChild(li);
}

// ------------------------------------------------------------------------------------------------ start
function start() {
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_STORE, key);
    $("key-input").value = "";
    $("key-panel").hidden = true;
    state.needKey = false;
    refresh();
  });
  $("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORE);
    askForKey("");
  });
  $("chat-form").addEventListener("submit", sendChat);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
  refresh();
  schedule();
}

document.addEventListener("DOMContentLoaded", start);
