// mlx-troupe dashboard: reads GET /actors/events (Server-Sent Events) and draws each snapshot.
// Plain JavaScript, no framework and no build step. The stream is read with fetch() rather
// than EventSource because EventSource cannot send the API key as a header.
"use strict";

const KEY_STORE = "troupe-api-key";
const RETRY_MS = 1000;
// No event for this long (the server sends one every 500 ms): the connection is dead.
const STALL_MS = 5000;
const SVG_NS = "http://www.w3.org/2000/svg";

const state = {
  key: sessionStorage.getItem(KEY_STORE),
  retryMs: RETRY_MS,
  snapshot: null,
  cards: new Map(),      // actor name -> its card's elements, updated in place
  treeShape: "",         // which actors on which threads: the tree is rebuilt when it changes
  seenFinished: new Set(),
};

const $ = (id) => document.getElementById(id);

// -- small helpers ---------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child !== null && child !== undefined) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
  }
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
  return node;
}

function fmtInt(n) {
  return n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US");
}

function fmtNum(n, digits = 1) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  return Number(n).toFixed(digits);
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Number(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return `${v >= 100 || i === 0 ? v.toFixed(0) : v.toFixed(1)} ${units[i]}`;
}

function fmtMs(ms) {
  if (ms === null || ms === undefined) return "–";
  return ms >= 10000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms)} ms`;
}

function fmtAgo(seconds) {
  if (seconds < 60) return `${Math.max(0, Math.round(seconds))} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  return `${Math.round(seconds / 3600)} h ago`;
}

function shortId(id) {
  // "chatcmpl-4f6a…": the prefix says which API, 6 hex digits tell requests apart.
  const dash = id.lastIndexOf("-");
  return dash > 0 && id.length - dash > 8 ? `${id.slice(0, dash + 7)}…` : id;
}

function pill(text, cls) {
  return el("span", { class: `pill ${cls || String(text).replace(/\s+/g, "-")}`, text });
}

function bar(fraction, level) {
  const f = Math.max(0, Math.min(1, fraction || 0));
  const node = el("div", { class: `bar ${level || ""}` }, el("span"));
  node.firstChild.style.width = `${(f * 100).toFixed(1)}%`;
  return node;
}

function authHeaders() {
  return state.key ? { Authorization: `Bearer ${state.key}` } : {};
}

// -- the stream ------------------------------------------------------------------------

function setConn(what, text) {
  const node = $("conn");
  node.dataset.state = what;
  node.textContent = text || what;
}

async function connect() {
  const ctrl = new AbortController();
  let watchdog = 0;
  const arm = () => {
    clearTimeout(watchdog);
    watchdog = setTimeout(() => ctrl.abort(), STALL_MS);
  };
  try {
    arm();
    const resp = await fetch("/actors/events", {
      headers: { Accept: "text/event-stream", ...authHeaders() },
      cache: "no-store",
      signal: ctrl.signal,
    });
    if (resp.status === 401) {
      clearTimeout(watchdog);
      askKey(state.key ? "That key was refused. Try another." : null);
      return; // connect() again once a key is given
    }
    if (!resp.ok || !resp.body) throw new Error(`HTTP ${resp.status}`);
    setConn("live");
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      arm();
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        onEvent(block);
      }
    }
  } catch (err) {
    // The server went away, restarted, or stalled: try again below.
  } finally {
    clearTimeout(watchdog);
  }
  setConn("reconnecting", "reconnecting…");
  setTimeout(connect, state.retryMs);
}

function onEvent(block) {
  let name = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") name = value;
    else if (field === "data") data.push(value);
    else if (field === "retry" && /^\d+$/.test(value)) state.retryMs = Number(value);
  }
  if (name === "snapshot" && data.length) {
    try {
      render(JSON.parse(data.join("\n")));
    } catch (err) {
      console.error("dashboard: bad snapshot", err);
    }
  }
}

// -- the API key -----------------------------------------------------------------------

function askKey(why) {
  setConn("unauthorized", "API key needed");
  if (why) $("key-why").textContent = why;
  const dialog = $("key-dialog");
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
}

function setupKey() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    state.key = key;
    sessionStorage.setItem(KEY_STORE, key);
    $("key-input").value = "";
    $("key-dialog").close();
    $("forget-key").hidden = false;
    setConn("connecting", "connecting…");
    connect();
  });
  $("forget-key").hidden = !state.key;
  $("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORE);
    location.reload();
  });
}

// -- drawing ---------------------------------------------------------------------------

function render(snap) {
  state.snapshot = snap;
  renderKpis(snap);
  renderTree(snap.actors || []);
  renderInflight(snap.requests.in_flight || []);
  renderFinished(snap.requests.finished || [], snap.time);
  renderCache(snap.cache || []);
  renderMemory(snap.memory, snap.history, snap.time);
  renderModels(snap.models || { models: [] });
  renderCharts(snap.history, snap.time);
  document.body.dataset.snapshots = String(Number(document.body.dataset.snapshots || 0) + 1);
}

function setKpi(id, text, value) {
  const node = $(id);
  node.textContent = text;
  if (value !== undefined) node.dataset.value = String(value);
}

function renderKpis(snap) {
  const t = snap.totals;
  setKpi("kpi-tps", fmtNum(t.tokens_per_s), t.tokens_per_s);
  setKpi("kpi-tokens", fmtInt(t.generated_tokens), t.generated_tokens);
  setKpi("kpi-inflight", fmtInt(t.in_flight), t.in_flight);
  setKpi("kpi-finished", fmtInt(t.finished), t.finished);
  const caches = snap.cache || [];
  const hit = caches.reduce((s, c) => s + c.hit_tokens, 0);
  const looked = hit + caches.reduce((s, c) => s + c.miss_tokens, 0);
  setKpi("kpi-hit", looked ? `${(100 * hit / looked).toFixed(0)} %` : "–", looked ? hit / looked : 0);
  const m = snap.memory;
  setKpi("kpi-mem", m ? `${fmtBytes(m.usage_bytes)}` : "–", m ? m.usage_bytes : 0);
}

// The tree: the actor system at the root, its threads (the event loop for actors that are
// not pinned), each thread's actors under it.
function renderTree(actors) {
  const shape = actors.map((a) => `${a.thread || ""}/${a.name}`).join("|");
  if (shape !== state.treeShape) buildTree(actors, shape);
  for (const actor of actors) updateCard(actor);
}

function buildTree(actors, shape) {
  state.treeShape = shape;
  state.cards.clear();
  const threads = new Map();
  for (const actor of actors) {
    const thread = actor.thread || "event loop";
    if (!threads.has(thread)) threads.set(thread, []);
    threads.get(thread).push(actor);
  }
  const row = el("div", { class: "threads" });
  for (const [thread, members] of threads) {
    const list = el("div", { class: "actors" });
    for (const actor of members) list.append(makeCard(actor));
    row.append(el("div", { class: "thread", "data-thread": thread },
      el("div", { class: "label", text: threadLabel(thread) }), list));
  }
  const tree = $("tree");
  tree.replaceChildren(el("div", { class: "root", text: "ActorSystem" }), row);
}

function threadLabel(thread) {
  return thread === "event loop" ? "event loop" : `thread ${thread}`;
}

function makeCard(actor) {
  const parts = {
    name: el("span", { class: "name", text: actor.name, title: actor.name }),
    state: el("span", { class: "pill" }),
    cls: el("div", { class: "cls" }),
    bar: el("div", { class: "bar" }, el("span")),
    depth: el("span"),
    handled: el("b"),
    restarts: el("b"),
    error: el("div", { class: "error" }),
  };
  const card = el("a", {
    class: "actor",
    href: `/actors/${encodeURIComponent(actor.name)}`,
    "data-actor": actor.name,
  },
  el("div", { class: "head" }, parts.name, parts.state),
  parts.cls,
  el("div", { class: "mailbox" }, el("span", { text: "mailbox" }), parts.bar, parts.depth),
  el("div", { class: "stats" },
    el("span", {}, "handled ", parts.handled),
    el("span", {}, "restarts ", parts.restarts)),
  parts.error);
  card.addEventListener("click", (event) => {
    event.preventDefault();
    openActor(actor.name);
  });
  state.cards.set(actor.name, { card, ...parts });
  return card;
}

function updateCard(actor) {
  const c = state.cards.get(actor.name);
  if (!c) return;
  const full = actor.mailbox_capacity ? actor.mailbox_depth / actor.mailbox_capacity : 0;
  const backed = actor.waiting_senders > 0 || full >= 0.5;
  c.card.classList.toggle("backed-up", backed);
  c.card.dataset.state = actor.state;
  c.card.dataset.depth = String(actor.mailbox_depth);
  c.card.dataset.restarts = String(actor.restarts);
  c.state.className = `pill ${actor.state}`;
  c.state.textContent = actor.state;
  const cls = actor.actor_class.split(".").pop();
  c.cls.textContent = actor.group ? `${cls} · group ${actor.group}` : cls;
  c.cls.title = actor.actor_class;
  c.bar.className = `bar ${backed ? "bad" : full > 0.25 ? "warn" : ""}`;
  // A sliver stays visible for one message in a large mailbox.
  c.bar.firstChild.style.width = `${actor.mailbox_depth ? Math.max(3, 100 * full) : 0}%`;
  const waiting = actor.waiting_senders ? ` +${actor.waiting_senders} waiting` : "";
  c.depth.textContent = `${actor.mailbox_depth}/${actor.mailbox_capacity}${waiting}`;
  c.handled.textContent = fmtInt(actor.messages_handled);
  c.restarts.textContent = String(actor.restarts);
  const err = actor.last_error;
  c.error.textContent = err ? `${err.type}: ${err.message}` : "";
  c.error.title = c.error.textContent;
  c.error.hidden = !err;
}

function renderTable(tableId, emptyId, rows, makeRow) {
  const table = $(tableId);
  const body = table.tBodies[0];
  body.replaceChildren(...rows.map(makeRow));
  table.dataset.empty = String(rows.length === 0);
  $(emptyId).hidden = rows.length > 0;
}

function renderInflight(rows) {
  renderTable("inflight", "inflight-empty", rows, (r) => el("tr", { "data-id": r.id, "data-stage": r.stage },
    el("td", { class: "id", text: shortId(r.id), title: r.id }),
    el("td", { text: r.model || "–" }),
    el("td", {}, pill(r.stage), r.detail ? el("span", { class: "detail", text: r.detail }) : null),
    el("td", { class: "num tokens", text: fmtInt(r.tokens), "data-value": r.tokens }),
    el("td", { class: "num", text: fmtNum(r.tokens_per_s) }),
    el("td", { class: "num", text: `${fmtNum(r.age_s)} s` })));
}

function renderFinished(rows, now) {
  const seen = new Set();
  renderTable("finished", "finished-empty", rows, (r) => {
    seen.add(r.id);
    const fresh = state.seenFinished.size > 0 && !state.seenFinished.has(r.id);
    const outcomeClass = r.status >= 400 ? "error" : r.outcome.replace(/\s+/g, "-");
    return el("tr", { "data-id": r.id, "data-outcome": r.outcome, class: fresh ? "fresh" : null },
      el("td", { class: "id", text: shortId(r.id), title: r.id }),
      el("td", { text: r.model || "–" }),
      el("td", {}, pill(r.outcome, outcomeClass)),
      el("td", { class: "num", text: fmtMs(r.ttft_ms) }),
      el("td", { class: "num", text: fmtMs(r.total_ms) }),
      el("td", { class: "num", text: fmtInt(r.prompt_tokens) }),
      el("td", { class: "num cached", text: fmtInt(r.cached_tokens), "data-value": r.cached_tokens || 0 }),
      el("td", { class: "num", text: fmtInt(r.completion_tokens) }),
      el("td", { class: "num", text: fmtNum(r.tokens_per_s) }),
      el("td", { class: "num", text: fmtAgo(now - r.ended) }));
  });
  state.seenFinished = seen.size ? seen : new Set([""]);
}

function meter(what, used, max, text) {
  const f = max ? used / max : 0;
  return el("div", { class: "meter" },
    el("span", { class: "what", text: what }),
    bar(f, f > 0.9 ? "bad" : f > 0.75 ? "warn" : ""),
    el("span", { text }));
}

function figure(value, label, cls, dataValue) {
  return el("div", { class: `figure ${cls || ""}` },
    el("span", { class: "v", text: value, "data-value": dataValue }),
    el("span", { class: "l", text: label }));
}

function renderCache(engines) {
  const node = $("cache");
  if (!engines.length) {
    node.replaceChildren(el("p", { class: "empty", text: "no prefix cache" }));
    return;
  }
  node.replaceChildren(...engines.map((e) => el("div", { class: "engine", "data-engine": e.name },
    engines.length > 1 ? el("div", { class: "cls", text: e.model || e.name }) : null,
    meter("RAM", e.ram_bytes, e.ram_max_bytes,
      `${fmtInt(e.ram_blocks)} blocks · ${fmtBytes(e.ram_bytes)} / ${fmtBytes(e.ram_max_bytes)}`),
    meter("disk", e.disk_bytes, e.disk_max_bytes,
      `${fmtInt(e.disk_blocks)} blocks · ${fmtBytes(e.disk_bytes)} / ${fmtBytes(e.disk_max_bytes)}`),
    el("div", { class: "figures" },
      figure(`${(100 * (e.hit_rate || 0)).toFixed(0)} %`, "hit rate", "hit-rate", e.hit_rate),
      figure(fmtInt(e.hit_tokens), "tokens hit", "hit-tokens", e.hit_tokens),
      figure(fmtInt(e.writes_queued), "writes queued"),
      figure(fmtInt(e.writes_dropped), "writes dropped", e.writes_dropped ? "bad" : ""),
      figure(fmtInt(e.persisted), "written")))));
}

function renderMemory(m, history, now) {
  const node = $("memory");
  if (!m) {
    node.replaceChildren(el("p", { class: "empty", text: "no memory monitor" }));
  } else {
    node.replaceChildren(
      meter("used", m.usage_bytes, m.limit_bytes,
        `${fmtBytes(m.usage_bytes)} / ${fmtBytes(m.limit_bytes)}`),
      el("div", { class: "figures" },
        el("div", { class: "figure" }, pill(m.pressure), el("span", { class: "l", text: "pressure" })),
        figure(fmtBytes(m.high_water_bytes), "high water (3 s)"),
        figure(m.rss_bytes ? fmtBytes(m.rss_bytes) : "–", "process RSS"),
        figure(m.limit_source || "–", "limit from")));
  }
  $("memory-chart").hidden = !m;
  if (m) drawMemoryChart($("chart-mem"), history, now, m.limit_bytes);
}

function renderModels(view) {
  const rows = view.models || [];
  renderTable("models", "models-empty", rows, (r) => el("tr", { "data-model": r.id },
    el("td", { class: "id", text: r.id, title: r.id }),
    el("td", {}, pill(r.state), r.pinned ? " " : null, r.pinned ? pill("pinned", "pinned") : null),
    el("td", { class: "num", text: r.weights_bytes === null || r.weights_bytes === undefined ? "–" : fmtBytes(r.weights_bytes) }),
    el("td", { class: "num", text: r.loaded ? fmtNum(r.tokens_per_s) : "–" })));
  const parts = [];
  if (view.loaded_weights_bytes !== null && view.loaded_weights_bytes !== undefined) {
    parts.push(`weights loaded: ${fmtBytes(view.loaded_weights_bytes)}`);
  }
  if (view.budget_bytes) parts.push(`budget: ${fmtBytes(view.budget_bytes)}`);
  $("models-foot").textContent = parts.join(" · ");
}

// -- charts (plain SVG) ----------------------------------------------------------------

function chartFrame(node) {
  const width = Math.max(120, Math.round(node.getBoundingClientRect().width || 300));
  const height = 96;
  node.setAttribute("viewBox", `0 0 ${width} ${height}`);
  node.replaceChildren();
  // Plot area: room on the left for the axis labels, at the bottom for the time labels.
  return { width, height, left: 54, right: width - 6, top: 6, bottom: height - 16 };
}

function fmtSpan(seconds) {
  return seconds < 120 ? `−${Math.round(seconds)} s` : `−${Math.round(seconds / 60)} min`;
}

function timeAxis(node, f, window) {
  for (const [frac, label] of [[0, fmtSpan(window)], [0.5, fmtSpan(window / 2)], [1, "now"]]) {
    const x = f.left + frac * (f.right - f.left);
    const text = svg("text", { x, y: f.height - 3, class: "axis", "text-anchor": frac === 0 ? "start" : frac === 1 ? "end" : "middle" });
    text.textContent = label;
    node.append(text);
  }
}

function valueAxis(node, f, max, fmt) {
  for (const frac of [0, 0.5, 1]) {
    const y = f.bottom - frac * (f.bottom - f.top);
    node.append(svg("line", { x1: f.left, x2: f.right, y1: y, y2: y, class: "grid-line" }));
    const text = svg("text", { x: f.left - 4, y: y + 3, class: "axis", "text-anchor": "end" });
    text.textContent = fmt(frac * max);
    node.append(text);
  }
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// The time axis spans the history the server has, at least a minute, at most its window
// (ten minutes): a server started a minute ago fills its charts.
function span(history, now) {
  if (!history || !history.t.length) return 60;
  return Math.min(history.window_s, Math.max(60, now - history.t[0] + history.bucket_s));
}

function series(history, now, key) {
  const window = span(history, now);
  const points = [];
  if (!history) return { points, window };
  for (let i = 0; i < history.t.length; i++) {
    const v = history[key][i];
    if (v !== null && v !== undefined && now - history.t[i] <= window) points.push([history.t[i], v]);
  }
  return { points, window };
}

function noData(node, f, text) {
  const t = svg("text", { x: (f.left + f.right) / 2, y: (f.top + f.bottom) / 2 + 4, class: "none", "text-anchor": "middle" });
  t.textContent = text;
  node.append(t);
}

function drawLine(node, history, now, key, fmt, opts = {}) {
  const f = chartFrame(node);
  const { points, window } = series(history, now, key);
  const values = points.map((p) => p[1]).sort((a, b) => b - a);
  // One outlier (the first request, compiling kernels) would flatten every other point:
  // the scale follows the rest, and the outlier is drawn at the top, marked.
  const top = opts.dots && values.length > 2 && values[0] > 3 * values[1] ? values[1] * 1.5 : values[0];
  const max = niceMax(Math.max(opts.floor || 0, opts.limit || 0, top || 0));
  valueAxis(node, f, max, fmt);
  timeAxis(node, f, window);
  const x = (t) => f.left + (1 - (now - t) / window) * (f.right - f.left);
  const y = (v) => f.bottom - (v / max) * (f.bottom - f.top);
  if (opts.limit) {
    node.append(svg("line", { x1: f.left, x2: f.right, y1: y(opts.limit), y2: y(opts.limit), class: "limit" }));
  }
  if (!points.length) {
    noData(node, f, opts.empty || "no data yet");
    return { f, x };
  }
  if (opts.dots) {
    for (const [t, v] of points) {
      const dot = svg("circle", { cx: x(t), cy: y(Math.min(v, max)), r: 2.5, class: v > max ? "dot over" : "dot" });
      const title = svg("title");
      title.textContent = fmt(v);
      dot.append(title);
      node.append(dot);
    }
  } else {
    const path = points.map(([t, v], i) => `${i ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`).join("");
    const first = x(points[0][0]).toFixed(1);
    const last = x(points[points.length - 1][0]).toFixed(1);
    node.append(svg("path", { d: `${path}L${last},${f.bottom}L${first},${f.bottom}Z`, class: "area" }));
    node.append(svg("path", { d: path, class: "line" }));
  }
  return { f, x };
}

function renderCharts(history, now) {
  drawLine($("chart-tps"), history, now, "tokens_per_s", (v) => fmtNum(v, v < 10 ? 1 : 0), { floor: 1 });
  const axisMs = (v) => (v >= 1000 ? `${fmtNum(v / 1000, v % 1000 ? 1 : 0)} s` : `${Math.round(v)} ms`);
  drawLine($("chart-ttft"), history, now, "ttft_ms", axisMs,
    { dots: true, floor: 10, empty: "no request finished yet" });
}

function drawMemoryChart(node, history, now, limit) {
  // Scaled to what was in use: a limit many times larger would flatten the line. The limit
  // shows as a dashed line when it is within reach.
  const used = history ? Math.max(0, ...history.memory_bytes.filter((v) => v !== null)) : 0;
  const near = limit && limit <= 2 * used ? limit : 0;
  const { f, x } = drawLine(node, history, now, "memory_bytes", fmtBytes, { limit: near });
  // The pressure level of each bucket, as a strip under the plot.
  if (!history) return;
  const step = history.bucket_s;
  for (let i = 0; i < history.t.length; i++) {
    const level = history.pressure[i];
    if (!level || now - history.t[i] > span(history, now)) continue;
    const x1 = Math.max(f.left, x(history.t[i] - step));
    node.append(svg("rect", { x: x1.toFixed(1), y: f.bottom + 1, width: Math.max(1, x(history.t[i]) - x1).toFixed(1), height: 3, class: `p-${level}` }));
  }
}

// -- one actor's snapshot --------------------------------------------------------------

async function openActor(name) {
  const url = `/actors/${encodeURIComponent(name)}`;
  $("drawer-title").textContent = name;
  $("drawer-raw").href = url;
  $("drawer-body").textContent = "loading…";
  $("drawer").hidden = false;
  try {
    const resp = await fetch(url, { headers: { Accept: "application/json", ...authHeaders() } });
    const body = await resp.json();
    $("drawer-body").textContent = JSON.stringify(body, null, 2);
  } catch (err) {
    $("drawer-body").textContent = `could not load ${url}: ${err}`;
  }
}

function setupDrawer() {
  $("drawer-close").addEventListener("click", () => { $("drawer").hidden = true; });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape") $("drawer").hidden = true;
  });
}

window.addEventListener("resize", () => {
  if (state.snapshot) {
    renderCharts(state.snapshot.history, state.snapshot.time);
    renderMemory(state.snapshot.memory, state.snapshot.history, state.snapshot.time);
  }
});

setupKey();
setupDrawer();
connect();
