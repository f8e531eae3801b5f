// Roofline: measured bandwidth → plain-decode ceiling; plain and speculative tok/s against it.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  let chart = null;
  function draw(r) {
    const labels = r.lanes.map((l) => modeName(l.mode));
    const data = r.lanes.map((l) => +l.tok_s.toFixed(2));
    const colors = r.lanes.map((l) => l.tok_s > r.ceiling_tok_s ? "#3ecf8e" : (l.mode === "baseline" ? "#6ea8fe" : "#a78bfa"));
    if (chart) chart.destroy();
    chart = new Chart($("chart-roof"), {
      data: {labels, datasets: [
        {type: "bar", label: "measured tok/s", data, backgroundColor: colors},
        // On its own hidden 0..1 axis, so the ceiling spans the whole plot, not only the bars' centres.
        {type: "line", label: "plain-decode ceiling", xAxisID: "edge",
          data: [{x: 0, y: +r.ceiling_tok_s.toFixed(2)}, {x: 1, y: +r.ceiling_tok_s.toFixed(2)}],
          borderColor: "#f87171", borderDash: [6, 4], pointRadius: 0, borderWidth: 2},
      ]},
      options: {scales: {y: {beginAtZero: true, title: {display: true, text: "tokens / second"}},
        edge: {type: "linear", min: 0, max: 1, display: false}}},
    });
    const body = $("roof-table").querySelector("tbody"); body.innerHTML = "";
    let best = 0;
    for (const l of r.lanes) {
      best = Math.max(best, l.vs_ceiling);
      body.append(el("tr", {}, el("td", {}, modeName(l.mode)), el("td", {class: "num"}, l.tok_s.toFixed(1)),
        el("td", {class: "num"}, l.mean_accepted.toFixed(2)), el("td", {class: `num ${l.vs_ceiling > 1 ? "v-green" : ""}`}, l.vs_ceiling.toFixed(2) + "×")));
    }
    $("r-bw").textContent = (r.bandwidth_bytes_per_s / 1e9).toFixed(1) + " GB/s";
    $("r-bytes").textContent = fmtBytes(r.model_bytes);
    $("r-ceiling").textContent = r.ceiling_tok_s.toFixed(1) + " tok/s";
    $("r-best").textContent = best.toFixed(2) + "×";
    const warn = $("roof-warnings"); warn.innerHTML = "";
    for (const w of r.warnings || []) warn.append(el("div", {}, "⚠ " + w));
    warn.hidden = !(r.warnings || []).length;
  }
  function go() {
    const modes = [...document.querySelectorAll(".roof-mode:checked")].map((c) => c.value);
    $("roof-go").disabled = true; $("roof-status").textContent = "starting…";
    api.stream("/ui/api/roofline", {modes, max_tokens: +$("roof-max").value || 48}, (ev) => {
      if (ev.type === "status") $("roof-status").textContent = ev.text;
      else if (ev.type === "result") { draw(ev); $("roof-status").textContent = "measured just now on " + ev.device; document.body.dataset.roofline = "1"; }
      else if (ev.type === "error") $("roof-status").textContent = ev.message;
    }, (err) => { if (err) $("roof-status").textContent = err.message; $("roof-go").disabled = false; });
  }
  document.addEventListener("DOMContentLoaded", () => { $("roof-go").onclick = go; });
})();
