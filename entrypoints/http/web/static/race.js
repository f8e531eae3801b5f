// Race: plain decoding and each chosen mode on one prompt, side by side where the engine can batch them; then
// each lane alone `repeats` times for its tok/s (median, min-max). The server checks token ids.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  let running = null;
  function lane(mode) {
    return el("div", {class: "card lane", id: `lane-${mode}`},
      el("h2", {}, modeName(mode)),
      el("div", {class: "out"}), el("div", {class: "meta"}, "waiting…"));
  }
  function start() {
    if (running) return;
    const modes = [...document.querySelectorAll(".race-mode:checked")].map((c) => c.value);
    const lanes = $("lanes"); lanes.innerHTML = ""; $("race-verdict").innerHTML = "";
    $("race-layout").textContent = ""; $("race-status").textContent = "";
    for (const m of ["baseline", ...modes]) lanes.append(lane(m));
    $("race-go").disabled = true;
    const body = {prompt: $("race-prompt").value, modes, max_tokens: +$("race-max").value, repeats: +$("race-repeats").value};
    running = api.stream("/ui/api/race", body, (ev) => {
      if (ev.type === "layout") {
        $("race-layout").textContent = ev.text;
        $("race-layout").className = `muted ${ev.side_by_side ? "side-by-side" : "one-by-one"}`;
      } else if (ev.type === "status") {
        $("race-status").textContent = ev.text;
      } else if (ev.type === "timing") {
        const t = el("div", {class: `timing${ev.noisy ? " noisy" : ""}`},
          `alone: ${ev.median.toFixed(1)} tok/s median of ${ev.samples.length} (${ev.low.toFixed(1)}–${ev.high.toFixed(1)})` +
          (ev.noisy ? ` · noisy: spread ${Math.round(100 * ev.spread)}%` : ""));
        $(`lane-${ev.mode}`).append(t);
      } else if (ev.type === "text") {
        const l = $(`lane-${ev.mode}`); l.querySelector(".out").textContent += ev.text;
        l.querySelector(".meta").textContent = "decoding…";
      } else if (ev.type === "lane_done") {
        $(`lane-${ev.mode}`).querySelector(".meta").textContent =
          `${ev.tokens} tokens in ${ev.seconds.toFixed(1)} s · ${ev.tok_s.toFixed(1)} tok/s in the race · ${ev.mean_accepted.toFixed(2)} tokens/round · ` +
          ({length: "hit the token limit", stop: "finished", cancelled: "stopped"}[ev.finish_reason] || ev.finish_reason);
      } else if (ev.type === "verdict") {
        $("race-status").textContent = "";
        const v = $("race-verdict");
        v.append(el("div", {class: "verdict-lines", id: "verdict-lines"}, ...ev.lanes.map((l) => el("div", {class: l.noisy ? "noisy" : ""}, l.summary))));
        if (ev.identical) {
          v.append(el("div", {class: "verdict ok", id: "verdict"}, "✓ identical — every mode produced exactly plain decoding's token ids"));
        } else {
          const d = el("div", {class: "verdict fail", id: "verdict"}, "✗ diverged");
          for (const l of ev.lanes.filter((x) => !x.identical)) {
            d.append(el("div", {style: "font-size:13px;font-weight:400;margin-top:6px"},
              `${l.mode}: first difference at token ${l.divergence} (plain ${l.expected}, ${l.mode} ${l.got}) after “${l.context}”`));
          }
          v.append(d);
        }
        for (const l of ev.lanes) $(`lane-${l.mode}`).querySelector("h2").append(" ", el("span", {class: `badge ${l.identical ? "green" : "red"}`}, l.identical ? "identical" : `diverged at ${l.divergence}`));
      } else if (ev.type === "error") {
        $("race-verdict").append(el("div", {class: "verdict fail"}, ev.message));
      }
    }, (err) => {
      if (err) $("race-verdict").append(el("div", {class: "verdict fail"}, err.message));
      running = null; $("race-go").disabled = false;
    });
  }
  document.addEventListener("DOMContentLoaded", () => { $("race-go").onclick = start; });
})();
