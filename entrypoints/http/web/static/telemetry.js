// Live telemetry: the engine's round events over SSE, drawn with Chart.js.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const MAX_POINTS = 300;
  let charts = {}, n = 0, hist = {}, requests = {}, reqOrder = [], updated = 0, drafted = 0, accepted = 0;
  const tried = [], hits = [], sources = {};
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
    charts.time.data.labels = ids.map((id) => id.slice(-6));
    charts.time.data.datasets[0].data = ids.map((id) => (requests[id].prefill_s || 0) * 1000);
    charts.time.data.datasets[1].data = ids.map((id) => (requests[id].decode_s || 0) * 1000);
    charts.time.update("none");
    charts.position.data.labels = tried.map((_, i) => String(i + 1));
    charts.position.data.datasets[0].data = tried.map((t, i) => (t ? (100 * hits[i]) / t : 0));
    charts.position.update("none");
    charts.source.data.labels = Object.keys(sources);
    charts.source.data.datasets[0].data = Object.values(sources);
    charts.source.update("none");
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
      sources[ev.source] = (sources[ev.source] || 0) + 1;
      if (drafted) $("k-accept").textContent = ((accepted / drafted) * 100).toFixed(1) + "%";
      $("k-rounds").textContent = (+$("k-rounds").textContent || 0) + 1;
      $("k-batch").textContent = ev.batch;
    } else if (ev.type === "request") {
      log(`request ${ev.request_id} started`);
    } else if (ev.type === "prefill") {
      log(`request ${ev.request_id}: prompt prefilled, first token out`);
    } else if (ev.type === "cap") {
      log(`cap ${ev.old} → ${ev.new} (${ev.reason})`);
    } else if (ev.type === "finished") {
      requests[ev.request_id] = ev; reqOrder.push(ev.request_id);
      $("k-requests").textContent = (+$("k-requests").textContent || 0) + 1;
      if (ev.cached_prompt_tokens) $("k-cache").textContent = (+$("k-cache").textContent || 0) + 1;
      log(`request ${ev.request_id}: prefill ${(ev.prefill_s * 1000).toFixed(1)} ms, ${ev.generated_tokens} tokens at ${ev.tok_s.toFixed(1)} tok/s, ${ev.mean_accepted.toFixed(2)} tokens/round, ${ev.cached_prompt_tokens} cached prompt tokens`);
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
    charts.source = new Chart($("chart-source"), {type: "doughnut", data: {labels: [], datasets: [{data: [],
      backgroundColor: ["#6ea8fe", "#3ecf8e", "#a78bfa", "#f5c04a", "#f87171"]}]}, options: {plugins: {legend: {position: "right"}}}});
    const source = new EventSource("/ui/api/telemetry/stream?replay=500");
    source.onmessage = (m) => onEvent(JSON.parse(m.data));
    document.addEventListener("status", (e) => applyTotals(e.detail));
  });
})();
