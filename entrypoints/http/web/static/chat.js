// Chat: sessions in SQLite on the server, one streamed turn at a time.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  let current = null, streaming = null;

  async function loadSessions(selectId) {
    const list = await api.get("/ui/api/sessions");
    const ul = $("session-list"); ul.innerHTML = "";
    for (const s of list) {
      const li = el("li", {class: s.id === (selectId || (current && current.id)) ? "active" : "", "data-id": s.id},
        el("span", {class: "t"}, s.title), el("span", {class: "n"}, s.messages));
      li.onclick = () => openSession(s.id);
      ul.append(li);
    }
    return list;
  }
  // A reply's end, as a person reads it; "length" alone said little.
  const FINISH = {length: "hit the max-tokens limit", stop: "finished", tool_calls: "called a tool", cancelled: "stopped"};
  const fixed = (x, n) => (typeof x === "number" ? x.toFixed(n) : x);
  function statsLine(st) {
    if (!st) return null;
    const parts = [];
    if (st.mode) parts.push(modeName(st.mode));
    if (st.completion_tokens !== undefined) parts.push(`${st.completion_tokens} tokens`);
    if (st.tok_s !== undefined) parts.push(`${fixed(st.tok_s, 1)} tok/s`);
    if (st.mean_accepted !== undefined) parts.push(`${fixed(st.mean_accepted, 2)} tokens/round`);
    if (st.cached_prompt_tokens !== undefined) parts.push(`${st.cached_prompt_tokens} cached prompt tokens`);
    const end = st.outcome === "cancelled" ? "cancelled" : st.finish_reason;
    const line = el("div", {class: "stats"}, ...parts.map((p) => el("span", {}, p)));
    if (end) line.append(el("span", {class: `finish ${end === "length" || end === "cancelled" ? "cut" : ""}`, "data-finish": end}, FINISH[end] || end));
    return line;
  }
  // Markdown through marked, then DOMPurify: a model's reply is untrusted text (no script, no handlers, and no
  // images or forms: a reply must not make the browser fetch anything). User messages stay plain text.
  const PURIFY = {FORBID_TAGS: ["img", "style", "form", "input", "button", "video", "audio", "source"]};
  function markdown(target, text) {
    if (!window.marked || !window.DOMPurify) { target.textContent = text; return; }
    target.innerHTML = DOMPurify.sanitize(marked.parse(text, {gfm: true, breaks: false}), PURIFY);
    for (const pre of target.querySelectorAll("pre")) {
      const copy = el("button", {class: "ghost copy-code", title: "Copy this code"}, "Copy");
      copy.onclick = () => copyText(pre.querySelector("code")?.textContent ?? pre.textContent, copy);
      pre.prepend(copy);
    }
  }
  async function copyText(text, button) {
    try { await navigator.clipboard.writeText(text); } catch { return; }
    const was = button.textContent; button.textContent = "Copied"; setTimeout(() => { button.textContent = was; }, 1200);
  }
  function bubble(role, text, thinking, stats, id) {
    const div = el("div", {class: `msg ${role}`});
    const think = el("details", {}, el("summary", {}, "Thinking"), el("div", {class: "think"}, thinking || ""));
    if (!thinking) think.style.display = "none";
    const body = el("div", {class: "body"});
    div.dataset.text = text || "";
    if (role === "assistant") markdown(body, text || ""); else body.textContent = text || "";
    const copy = el("button", {class: "ghost copy-msg", title: "Copy the message"}, "Copy");
    copy.onclick = () => copyText(div.dataset.text, copy);
    const actions = el("div", {class: "actions"}, copy);
    if (id !== undefined && role === "user") {
      const edit = el("button", {class: "ghost edit-msg", title: "Edit this message and send it again"}, "Edit");
      edit.onclick = () => rewind(id, false);
      actions.append(edit);
    }
    if (id !== undefined && role === "assistant") {
      const again = el("button", {class: "ghost regen-msg", title: "Drop this reply and generate it again"}, "Regenerate");
      again.onclick = () => { const asked = userBefore(id); if (asked !== undefined) rewind(asked, true); };
      actions.append(again);
    }
    div.append(think, body, actions);
    const s = statsLine(stats); if (s) div.append(s);
    return div;
  }
  function render(messages) {
    const box = $("messages"); box.innerHTML = "";
    if (!messages.length) box.append(el("div", {class: "empty"}, "Start a conversation. Replies stream from the served model."));
    for (const m of messages) {
      const b = bubble(m.role, m.content, m.thinking, m.role === "assistant" ? m.stats : null, m.id);
      if (m.role === "assistant") b.dataset.done = "1";  // a saved reply is complete
      box.append(b);
    }
    box.scrollTop = box.scrollHeight;
  }
  function applySettings(st) {
    if (!st) return;
    for (const k of ["system", "temperature", "max_tokens", "top_p", "top_k", "mode"]) if (st[k] !== undefined && $(k)) $(k).value = st[k];
    $("seed").value = st.seed ?? "";
    $("stop-strings").value = (st.stop || []).join("\n");
    $("thinking").value = st.thinking === true ? "on" : st.thinking === false ? "off" : "default";
  }
  async function openSession(id) {
    current = await api.get(`/ui/api/sessions/${id}`);
    $("session-title").value = current.title;
    applySettings(current.settings);
    render(current.messages);
    history.replaceState(null, "", `/ui/chat#${id}`);
    await loadSessions(id);
  }
  async function newSession() {
    const s = await api.post("/ui/api/sessions", {title: ""});
    await openSession(s.id);
    return s;
  }
  function options() {
    const th = $("thinking").value;
    return {
      system: $("system").value, mode: $("mode").value, max_tokens: +$("max_tokens").value || 256,
      temperature: +$("temperature").value || 0, top_p: +$("top_p").value || 1, top_k: +$("top_k").value || 0,
      seed: $("seed").value === "" ? null : +$("seed").value,
      stop: $("stop-strings").value.split("\n").filter((s) => s), thinking: th === "default" ? null : th === "on",
    };
  }
  // The user message a reply answered (regenerate resends it).
  function userBefore(id) {
    const list = (current && current.messages) || [];
    const at = list.findIndex((m) => m.id === id);
    for (let i = at - 1; i >= 0; i--) if (list[i].role === "user") return list[i].id;
    return undefined;
  }
  // Drop a user message and what follows; resend it (regenerate) or put it back in the composer (edit).
  async function rewind(id, resend) {
    if (streaming || !current) return;
    const r = await api.post(`/ui/api/sessions/${current.id}/rewind`, {message_id: id});
    current = await api.get(`/ui/api/sessions/${current.id}`);
    render(current.messages);
    if (resend) send(r.content); else { $("prompt").value = r.content; $("prompt").focus(); }
  }
  async function send(again) {
    const text = typeof again === "string" ? again : $("prompt").value.trim();
    if (!text || streaming) return;
    if (!current) await newSession();
    if (typeof again !== "string") $("prompt").value = "";
    const box = $("messages");
    if (box.querySelector(".empty")) box.innerHTML = "";
    box.append(bubble("user", text));
    const reply = bubble("assistant", "", "");
    reply.classList.add("streaming", "waiting");  // a typing indicator until the first token
    box.append(reply); box.scrollTop = box.scrollHeight;
    const body = reply.querySelector(".body"), think = reply.querySelector("details"), thinkText = reply.querySelector(".think");
    let answer = "", drawn = false, stopped = false;
    const draw = () => { drawn = false; markdown(body, answer); };
    $("send").disabled = true; $("stop").disabled = false;
    $("stop").onclick = () => { if (streaming) { stopped = true; streaming.abort(); } };
    streaming = api.stream(`/ui/api/sessions/${current.id}/chat`, {content: text, options: options()}, (ev) => {
      if (ev.type === "text" || ev.type === "thinking") reply.classList.remove("waiting");
      if (ev.type === "text") {
        answer += ev.text; reply.dataset.text = answer;
        if (!drawn) { drawn = true; requestAnimationFrame(draw); }  // one render per frame, not per token
      }
      else if (ev.type === "thinking") { think.style.display = ""; thinkText.textContent += ev.text; }
      else if (ev.type === "done") { markdown(body, answer); const s = statsLine(ev.stats); if (s) reply.append(s); reply.dataset.done = "1"; }
      else if (ev.type === "error") body.append(el("div", {class: "error"}, ev.message));
      box.scrollTop = box.scrollHeight;
    }, (err) => {
      reply.classList.remove("waiting");
      if (stopped && !reply.dataset.done) {  // marked at once, not only after a reload
        markdown(body, answer);
        reply.append(statsLine({outcome: "cancelled"}));
        reply.dataset.done = "1";
      } else if (err) body.append(el("div", {class: "error"}, err.message));
      reply.classList.remove("streaming"); streaming = null;
      $("send").disabled = false; $("stop").disabled = true;
      // The saved turn, with its message ids (edit, regenerate) and final stats.
      api.get(`/ui/api/sessions/${current.id}`).then((s) => {
        const shown = $("messages").querySelectorAll(".msg").length;
        current = s; $("session-title").value = s.title;
        if (s.messages.length === shown) render(s.messages);  // the same turns, now with ids (a failed save keeps the page)
      });
      loadSessions(current.id);
    });
  }
  document.addEventListener("DOMContentLoaded", async () => {
    // Narrow screens: sessions and settings are drawers over the conversation.
    const chat = document.querySelector(".chat");
    const drawer = (name) => () => { chat.classList.toggle(`show-${name}`); chat.classList.remove(`show-${name === "sessions" ? "settings" : "sessions"}`); };
    $("toggle-sessions").onclick = drawer("sessions"); $("close-sessions").onclick = () => chat.classList.remove("show-sessions");
    $("toggle-settings").onclick = drawer("settings"); $("close-settings").onclick = () => chat.classList.remove("show-settings");
    $("session-list").addEventListener("click", () => chat.classList.remove("show-sessions"));
    $("send").onclick = send;
    $("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } });
    $("new-session").onclick = newSession;
    $("session-title").addEventListener("change", async () => {
      if (!current) return;
      await api.json("PATCH", `/ui/api/sessions/${current.id}`, {title: $("session-title").value});
      loadSessions(current.id);
    });
    $("delete-session").onclick = async () => {
      if (!current || !confirm(`Delete “${current.title}”?`)) return;
      await api.json("DELETE", `/ui/api/sessions/${current.id}`);
      current = null; render([]); $("session-title").value = "";
      const list = await loadSessions();
      if (list.length) openSession(list[0].id);
    };
    $("export-md").onclick = () => current && (location.href = `/ui/api/sessions/${current.id}/export?format=md`);
    $("export-json").onclick = () => current && (location.href = `/ui/api/sessions/${current.id}/export?format=json`);
    document.addEventListener("status", (e) => {
      const sel = $("mode");
      sel.options[0].textContent = `served (${modeName(e.detail.mode)})`;
      if (sel.options.length > 1) return;
      for (const m of e.detail.modes) if (m === "baseline" || m === "lookup" || (e.detail.drafters || []).includes(m)) sel.append(el("option", {value: m}, modeName(m)));
      if (current && current.settings && current.settings.mode) sel.value = current.settings.mode;
    });
    const list = await loadSessions();
    const wanted = location.hash.slice(1);
    if (wanted && list.some((s) => s.id === wanted)) openSession(wanted);
    else if (list.length) openSession(list[0].id);
  });
})();
