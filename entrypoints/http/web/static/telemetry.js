// Live telemetry: the engine's events over SSE (rounds, prefill progress, cache hits, batch width), drawn with Chart.js.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const MAX_POINTS = 300;
  let charts = {}, n = 0, hist = {}, requests = {}, reqOrder = [], updated = 0, drafted = 0, accepted = 0;
  const running = new Set(), numbers = {};
  // Requests by their arrival number and what ran them ("#3 dspark"), not by an opaque id's tail.
  const label = (id) => `#${numbers[id] ??= Object.keys(numbers).length + 1}` + (requests[id] ? ` ${modeName(requests[id].source)}` : "");
  let finishedCount = 0;
  function showRequests() {  // finished ones, and those still running (the tile read 0 while one ran)
    $("k-requests").textContent = finishedCount + (running.size ? ` (+${running.size} running)` : "");
  }
  const tried = [], hits = [], sources = {};
  const prompts = {}, promptOrder = [], cacheSources = {live: 0, memory: 0, disk: 0};
  let t0 = null, widest = 0, cacheHits = 0;
  function prompt(id) {
    if (!prompts[id]) {
      prompts[id] = {cached: 0, done: 0, total: 0, source: "none"}; promptOrder.push(id);
      if (promptOrder.length > 50) delete prompts[promptOrder.shift()];
    }
    return prompts[id];
  }
  function line(id, label, color, stepped) {
    return new Chart($(id), {type: "line", data: {labels: [], datasets: [{label, data: [], borderColor: color,
      backgroundColor: color + "33", fill: true, pointRadius: 0, borderWidth: 1.5, stepped: !!stepped, tension: 0}]},
      options: {plugins: {legend: {display: false}}, scales: {x: {ticks: {maxTicksLimit: 8}}, y: {beginAtZero: true}}}});
  }
  function push(chart, x, y) {
    chart.data.labels.push(x); chart.data.datasets[0].data.push(y);
    if (chart.data.labels.length > MAX_POINTS) { chart.data.labels.shift(); chart.data.datasets[0].data.shift(); }
  }
  function redraw() {
    charts.toks.update("none"); charts.cap.update("none");
    const keys = Object.keys(hist).map(Number).sort((a, b) => a - b);
    charts.accept.data.labels = keys.map(String); charts.accept.data.datasets[0].data = keys.map((k) => hist[k]);
    charts.accept.update("none");
    const ids = reqOrder.slice(-20);
    charts.time.data.labels = ids.map(label);
    charts.time.data.datasets[0].data = ids.map((id) => (requests[id].prefill_s || 0) * 1000);
    charts.time.data.datasets[1].data = ids.map((id) => (requests[id].decode_s || 0) * 1000);
    charts.time.update("none");
    charts.position.data.labels = tried.map((_, i) => String(i + 1));
    charts.position.data.datasets[0].data = tried.map((t, i) => (t ? (100 * hits[i]) / t : 0));
    charts.position.update("none");
    charts.source.data.labels = Object.keys(sources);
    charts.source.data.datasets[0].data = Object.values(sources);
    charts.source.update("none");
    const shown = promptOrder.slice(-8);
    charts.prefill.data.labels = shown.map((id) => `${label(id)} (cache: ${prompts[id].source})`);
    charts.prefill.data.datasets[0].data = shown.map((id) => prompts[id].cached);
    charts.prefill.data.datasets[1].data = shown.map((id) => Math.max(prompts[id].done - prompts[id].cached, 0));
    charts.prefill.data.datasets[2].data = shown.map((id) => Math.max(prompts[id].total - Math.max(prompts[id].done, prompts[id].cached), 0));
    charts.prefill.update("none");
    charts.batch.update("none");
    document.body.dataset.updates = String(++updated);
  }
  let pending = false;
  function schedule() { if (!pending) { pending = true; requestAnimationFrame(() => { pending = false; redraw(); }); } }
  function log(text) {
    const box = $("events"); box.prepend(el("div", {}, text));
    while (box.childNodes.length > 60) box.lastChild.remove();
  }
  function onEvent(ev) {
    if (ev.type === "hello") { applyTotals(ev.snapshot); return; }
    if (ev.type === "round") {
      n++;
      push(charts.toks, n, +ev.tok_s.toFixed(1));
      push(charts.cap, n, ev.cap);
      if (ev.drafted) hist[ev.accepted] = (hist[ev.accepted] || 0) + 1;
      drafted += ev.drafted; accepted += ev.accepted;
      ev.positions.forEach((ok, i) => { tried[i] = (tried[i] || 0) + 1; hits[i] = (hits[i] || 0) + ok; });
      sources[modeName(ev.source)] = (sources[modeName(ev.source)] || 0) + 1;
      if (drafted) $("k-accept").textContent = ((accepted / drafted) * 100).toFixed(1) + "%";
      $("k-rounds").textContent = (+$("k-rounds").textContent || 0) + 1;
      if (t0 === null) $("k-batch").textContent = ev.batch;  // a serial engine: no batch events
    } else if (ev.type === "request") {
      running.add(ev.request_id); label(ev.request_id); showRequests();
      log(`request ${label(ev.request_id)} started`);
    } else if (ev.type === "cache") {
      const p = prompt(ev.request_id);
      p.cached = ev.cached; p.total = ev.prompt_tokens; p.source = ev.source; p.done = Math.max(p.done, ev.cached);
      if (ev.cached) {
        cacheHits++; cacheSources[ev.source] = (cacheSources[ev.source] || 0) + 1;
        $("k-cache").textContent = cacheHits;
        $("k-cache-src").textContent = Object.entries(cacheSources).map(([k, v]) => `${k} ${v}`).join(" · ");
      }
      log(`request ${label(ev.request_id)}: ${ev.cached} of ${ev.prompt_tokens} prompt tokens cached (${ev.source}), ${ev.prefill} to prefill`);
    } else if (ev.type === "prefill") {
      const p = prompt(ev.request_id);
      p.done = Math.max(p.done, ev.done); p.total = ev.total || p.total;
      if (ev.first_token) log(`request ${label(ev.request_id)}: prompt prefilled, first token out`);
      else log(`request ${label(ev.request_id)}: prefill ${ev.done} / ${ev.total} tokens`);
    } else if (ev.type === "batch") {
      if (t0 === null) t0 = ev.t;
      push(charts.batch, (ev.t - t0).toFixed(1) + "s", ev.width);
      widest = Math.max(widest, ev.width);
      $("k-batch").textContent = ev.width; $("k-batch-max").textContent = widest;
    } else if (ev.type === "batch_speculation") {
      log(`batch of ${ev.width}: ${ev.speculate ? `speculating, cap ${ev.cap}` : "plain batched steps"} (${ev.reason}; expected ${ev.speculative_tok_s.toFixed(1)} vs ${ev.plain_tok_s.toFixed(1)} tok/s plain)`);
    } else if (ev.type === "cap") {
      log(`cap ${ev.old} → ${ev.new} (${ev.reason})`);
    } else if (ev.type === "switch") {
      log(`request ${label(ev.request_id)}: source ${ev.old} → ${ev.new} (${ev.reason})`);
    } else if (ev.type === "finished") {
      requests[ev.request_id] = ev; reqOrder.push(ev.request_id);
      if (prompts[ev.request_id]) prompts[ev.request_id].done = prompts[ev.request_id].total;
      running.delete(ev.request_id); finishedCount++; showRequests();
      log(`request ${label(ev.request_id)}: prefill ${(ev.prefill_s * 1000).toFixed(1)} ms, ${ev.generated_tokens} tokens at ${ev.tok_s.toFixed(1)} tok/s, ${ev.mean_accepted.toFixed(2)} tokens/round, ${ev.cached_prompt_tokens} cached prompt tokens` +
        (ev.source_switches ? `, ${ev.source_switches} source switches (${Object.entries(ev.source_rounds || {}).map(([k, v]) => `${k} ${v}`).join(" · ")} rounds)` : ""));
    }
    schedule();
  }
  function applyTotals(s) {
    const t = (s && s.totals) || {};
    if (t.drafted && !drafted) $("k-accept").textContent = ((t.accepted / t.drafted) * 100).toFixed(1) + "%";
  }
  document.addEventListener("DOMContentLoaded", () => {
    charts.toks = line("chart-toks", "tok/s", "#6ea8fe");
    charts.cap = line("chart-cap", "cap", "#a78bfa", true);
    charts.accept = new Chart($("chart-accept"), {type: "bar", data: {labels: [], datasets: [{label: "rounds", data: [], backgroundColor: "#3ecf8e"}]},
      options: {plugins: {legend: {display: false}}, scales: {x: {title: {display: true, text: "drafts accepted in the round"}}, y: {beginAtZero: true}}}});
    charts.time = new Chart($("chart-time"), {type: "bar", data: {labels: [], datasets: [
      {label: "prefill ms", data: [], backgroundColor: "#f5c04a"}, {label: "decode ms", data: [], backgroundColor: "#6ea8fe"}]},
      options: {scales: {x: {stacked: true}, y: {stacked: true, beginAtZero: true}}}});
    charts.position = new Chart($("chart-position"), {type: "bar", data: {labels: [], datasets: [{label: "accepted %", data: [], backgroundColor: "#a78bfa"}]},
      options: {plugins: {legend: {display: false}}, scales: {x: {title: {display: true, text: "draft position (tried rounds only)"}}, y: {beginAtZero: true, max: 100}}}});
    charts.prefill = new Chart($("chart-prefill"), {type: "bar", data: {labels: [], datasets: [
      {label: "cached", data: [], backgroundColor: "#3ecf8e"}, {label: "prefilled", data: [], backgroundColor: "#f5c04a"},
      {label: "to prefill", data: [], backgroundColor: "#4b5563"}]},
      options: {indexAxis: "y", scales: {x: {stacked: true, beginAtZero: true}, y: {stacked: true}}}});
    charts.batch = line("chart-batch", "rows", "#f87171", true);
    charts.source = new Chart($("chart-source"), {type: "doughnut", data: {labels: [], datasets: [{data: [],
      backgroundColor: ["#6ea8fe", "#3ecf8e", "#a78bfa", "#f5c04a", "#f87171"]}]}, options: {plugins: {legend: {position: "right"}}}});
    const source = new EventSource("/ui/api/telemetry/stream?replay=500");
    source.onmessage = (m) => onEvent(JSON.parse(m.data));
    document.addEventListener("status", (e) => applyTotals(e.detail));
  });
})();
