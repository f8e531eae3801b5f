// Shared helpers and the header gauge (tok/s and model memory on every page).
"use strict";
const api = {
  async json(method, path, body) {
    const opts = {method, headers: {}};
    if (body !== undefined) { opts.headers["Content-Type"] = "application/json"; opts.body = JSON.stringify(body); }
    const r = await fetch(path, opts);
    const data = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error(data.error || `HTTP ${r.status}`);
    return data;
  },
  get(path) { return this.json("GET", path); },
  post(path, body) { return this.json("POST", path, body || {}); },
  // POST that answers with server-sent events; calls onEvent(obj) per `data:` frame. Returns an AbortController.
  stream(path, body, onEvent, onEnd) {
    const ctrl = new AbortController();
    (async () => {
      let error = null;
      try {
        const r = await fetch(path, {method: "POST", headers: {"Content-Type": "application/json"},
          body: JSON.stringify(body), signal: ctrl.signal});
        if (!r.ok) { const d = await r.json().catch(() => ({})); throw new Error(d.error || `HTTP ${r.status}`); }
        const reader = r.body.getReader(); const dec = new TextDecoder(); let buf = "";
        for (;;) {
          const {value, done} = await reader.read();
          if (done) break;
          buf += dec.decode(value, {stream: true});
          let i;
          while ((i = buf.indexOf("\n\n")) >= 0) {
            const frame = buf.slice(0, i); buf = buf.slice(i + 2);
            for (const line of frame.split("\n")) if (line.startsWith("data: ")) onEvent(JSON.parse(line.slice(6)));
          }
        }
      } catch (e) { if (e.name !== "AbortError") error = e; }
      if (onEnd) onEnd(error);
    })();
    return ctrl;
  },
};
// One name for plain decoding on every page: the server says "baseline" (the mode) or "none" (a round's source).
function modeName(m) { return m === "baseline" || m === "none" ? "plain" : m; }
function fmtBytes(n) {
  if (!n) return "—";
  const u = ["B", "KB", "MB", "GB", "TB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(n >= 100 || i === 0 ? 0 : 1)} ${u[i]}`;
}
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v); else e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}
const CHART_DEFAULTS = () => {
  Chart.defaults.color = "#8b93a7"; Chart.defaults.borderColor = "#2a3140";
  Chart.defaults.font.family = "system-ui, sans-serif"; Chart.defaults.animation = false;
  Chart.defaults.maintainAspectRatio = false;
};
let lastStatus = null;
async function refreshGauge() {
  try {
    const s = await api.get("/ui/api/status");
    lastStatus = s;
    const state = document.getElementById("g-state");
    state.textContent = s.ready ? "ready" : (s.error ? "error" : "loading");
    state.className = "pill " + (s.ready ? "ok" : (s.error ? "err" : "load"));
    state.title = s.error || "";
    document.getElementById("g-model").textContent = s.model;
    document.getElementById("g-mode").textContent = "mode " + modeName(s.mode);
    const toks = s.live_tok_s || s.last_tok_s || 0;
    document.getElementById("g-toks").textContent = toks.toFixed(1);
    document.getElementById("g-mem").textContent = fmtBytes(s.model_bytes);
    document.getElementById("g-active").textContent = fmtBytes(s.memory && s.memory.active);
    document.dispatchEvent(new CustomEvent("status", {detail: s}));
  } catch (e) { /* the login page and a restarting server land here */ }
}
document.addEventListener("DOMContentLoaded", () => {
  if (window.Chart) CHART_DEFAULTS();
  refreshGauge(); setInterval(refreshGauge, 1500);
});
