// Models: local models, hub search, fit estimate, downloads with progress, load/switch.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  async function loadLocal() {
    const body = $("local-table").querySelector("tbody"); body.innerHTML = "";
    const [list, status] = await Promise.all([api.get("/ui/api/models/local"), api.get("/ui/api/status").catch(() => ({}))]);
    const served = status.ready ? status.model : null;  // its files are not offered for deletion
    if (!list.length) body.append(el("tr", {}, el("td", {colspan: 7, class: "muted"}, "No local models found.")));
    for (const m of list) {
      const load = el("button", {class: "ghost"}, "Load"); load.onclick = () => { $("load-model").value = m.name; $("load-mode").value = ""; loadModel(); };
      const estimate = el("button", {class: "ghost"}, "Fit"); estimate.onclick = () => { $("fit-repo").value = m.path; fit(); };
      const del = el("button", {class: "danger"}, "Delete");
      del.onclick = async () => { if (confirm(`Delete ${m.path}?`)) { await api.post("/ui/api/models/delete", {path: m.path}); loadLocal(); } };
      body.append(el("tr", {},
        el("td", {title: m.path}, m.name), el("td", {class: "muted"}, m.source), el("td", {class: "num", title: m.converted_bytes ? "the file on disk; its one-time conversion to this device's format is what loads into memory" : "on disk"},
          fmtBytes(m.size_bytes) + (m.converted_bytes ? ` · ${fmtBytes(m.converted_bytes)} converted` : "")),
        el("td", {}, [m.dtype, m.bits ? `${m.bits}-bit` : ""].filter(Boolean).join(" · ") || "—"),
        el("td", {class: "num"}, m.context || "—"), el("td", {}, (m.drafters || []).join(", ")),
        el("td", {}, el("div", {class: "row"}, load, estimate, m.source === "embedded" || m.name === served ? "" : del))));
    }
  }
  async function search() {
    const body = $("hub-table").querySelector("tbody"); body.innerHTML = "";
    try {
      const list = await api.get(`/ui/api/models/search?q=${encodeURIComponent($("hub-query").value)}`);
      for (const m of list.slice(0, 10)) {
        const pick = el("button", {class: "ghost"}, "Choose"); pick.onclick = () => { $("fit-repo").value = m.id; fit(); };
        body.append(el("tr", {}, el("td", {}, m.id), el("td", {class: "num muted"}, m.downloads ?? ""), el("td", {}, pick)));
      }
      if (!list.length) body.append(el("tr", {}, el("td", {class: "muted"}, "No match.")));
    } catch (e) { body.append(el("tr", {}, el("td", {class: "error"}, e.message))); }
  }
  async function fit() {
    const repo = $("fit-repo").value.trim(); if (!repo) return;
    const body = $("fit-table").querySelector("tbody"); body.innerHTML = "";
    $("fit-title").textContent = repo; $("fit-usable").textContent = "reading its config and weight headers…";
    try {
      const r = await api.get(`/ui/api/models/fit?repo=${encodeURIComponent(repo)}&drafter=${encodeURIComponent($("fit-drafter").value.trim())}`);
      const s = r.shape;
      const kvLayers = s.kv_layers ?? s.layers;
      const hybrid = s.state_layers ? `, ${s.state_layers} recurrent (state ${fmtBytes(s.state_bytes)})` : "";
      const moe = r.active_weights < r.weights ? `, ${fmtBytes(r.active_weights)} read per token (MoE)` : "";
      // Only hybrids say how many layers hold KV; a plain transformer's all do.
      const split = kvLayers !== s.layers || hybrid ? ` (${kvLayers} with KV${hybrid})` : "";
      $("fit-usable").textContent = `${r.model_type || "model"}: ${s.layers} layers${split}, ` +
        `${s.kv_heads} KV heads × ${s.head_dim}, ${s.bits ? s.bits + "-bit" : (s.dtype || "?")} weights${moe}; ` +
        `download ${fmtBytes(r.download_bytes)}; usable memory ${fmtBytes(r.usable.bytes)} (${r.usable.source})`;
      for (const row of r.rows) {
        body.append(el("tr", {class: "fit-row", "data-verdict": row.verdict},
          el("td", {class: "num"}, row.context.toLocaleString()), el("td", {class: "num"}, fmtBytes(row.weights)),
          el("td", {class: "num"}, fmtBytes(row.kv_cache) + (row.state ? ` + ${fmtBytes(row.state)} state` : "")),
          el("td", {class: "num"}, fmtBytes(row.drafter)),
          el("td", {class: "num"}, fmtBytes(row.overhead)), el("td", {class: "num"}, fmtBytes(row.total)),
          el("td", {}, el("span", {class: `badge ${row.verdict}`}, {green: "fits", yellow: "tight", red: "too big"}[row.verdict]))));
      }
    } catch (e) { $("fit-usable").textContent = ""; body.append(el("tr", {}, el("td", {colspan: 7, class: "error"}, e.message))); }
  }
  async function download() {
    const repo = $("fit-repo").value.trim(); if (!repo) return;
    try { await api.post("/ui/api/models/download", {repo_id: repo}); } catch (e) { alert(e.message); }
    pollDownloads();
  }
  let polling = null;
  async function pollDownloads() {
    const list = await api.get("/ui/api/models/downloads");
    const box = $("downloads"); box.innerHTML = "";
    for (const d of list) {
      const pct = d.total ? Math.min(100, (100 * d.done) / d.total) : (d.status === "done" ? 100 : 0);
      const bar = el("div", {class: "progress"}, el("div", {style: `width:${pct}%`}));
      box.append(el("div", {class: "download", "data-status": d.status, style: "margin-bottom:10px"},
        el("div", {class: "row"}, el("b", {}, d.repo_id), el("span", {class: "muted"}, `${d.status} · ${fmtBytes(d.done)} / ${fmtBytes(d.total)}`)),
        bar, d.error ? el("div", {class: "error"}, d.error) : ""));
    }
    const active = list.some((d) => d.status === "running" || d.status === "queued");
    if (active && !polling) polling = setInterval(pollDownloads, 700);
    if (!active && polling) { clearInterval(polling); polling = null; loadLocal(); }
  }
  async function loadModel() {
    $("load-status").textContent = "loading…"; $("load-go").disabled = true;
    try {
      const r = await api.post("/ui/api/models/load", {model: $("load-model").value.trim(), mode: $("load-mode").value, drafter: $("load-drafter").value.trim()});
      $("load-status").textContent = `serving ${r.model} (${r.mode})`;
    } catch (e) { $("load-status").textContent = e.message; }
    $("load-go").disabled = false; refreshGauge();
  }
  document.addEventListener("DOMContentLoaded", () => {
    $("refresh-local").onclick = loadLocal; $("hub-search").onclick = search; $("fit-go").onclick = fit;
    $("download-go").onclick = download; $("load-go").onclick = loadModel;
    $("hub-query").addEventListener("keydown", (e) => { if (e.key === "Enter") search(); });
    loadLocal(); pollDownloads();
  });
})();
