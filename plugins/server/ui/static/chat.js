// The chat page: conversations kept in localStorage, replies streamed from /v1/chat/completions (stream:
// true), Stop (aborts the request: the server frees its KV blocks), Regenerate, a system prompt, sampling
// settings and the model list from /v1/models. Replies render as markdown (markdown.js) as they arrive.
"use strict";
(function () {
  const STORE = "pagedllm.conversations";
  const SETTINGS = "pagedllm.chatSettings";
  const $ = (id) => document.getElementById(id);
  const el = {
    list: $("conversation-list"), messages: $("messages"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
    regenerate: $("regenerate"), model: $("model"), system: $("system-prompt"), temperature: $("temperature"),
    topP: $("top-p"), maxTokens: $("max-tokens"), stats: $("chat-stats"),
  };
  let conversations = load();
  let current = conversations.length ? conversations[0].id : null;
  let controller = null;  // the AbortController of the reply streaming now, if any

  function load() {
    try { return JSON.parse(localStorage.getItem(STORE) || "[]"); } catch (e) { return []; }
  }
  function save() { localStorage.setItem(STORE, JSON.stringify(conversations)); }
  function conversation() { return conversations.find((c) => c.id === current) || null; }

  function newConversation() {
    const c = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat", messages: [],
      system: el.system.value, updated: Date.now() };
    conversations.unshift(c);
    current = c.id;
    save();
    return c;
  }

  function renderList() {
    el.list.textContent = "";
    for (const c of conversations) {
      const li = document.createElement("li");
      li.className = c.id === current ? "active" : "";
      const title = document.createElement("span");
      title.textContent = c.title;
      const del = document.createElement("button");
      del.type = "button"; del.textContent = "\u00d7"; del.title = "Delete"; del.setAttribute("aria-label", "Delete chat");
      del.addEventListener("click", (e) => {
        e.stopPropagation();
        conversations = conversations.filter((x) => x.id !== c.id);
        if (current === c.id) current = conversations.length ? conversations[0].id : null;
        save(); renderAll();
      });
      li.append(title, del);
      li.addEventListener("click", () => { if (!controller) { current = c.id; renderAll(); } });
      el.list.append(li);
    }
  }

  function messageElement(msg) {
    const div = document.createElement("div");
    div.className = "message " + msg.role;
    div.dataset.role = msg.role;
    div.dataset.state = msg.state || "done";
    const body = document.createElement("div");
    body.className = "body";
    div.append(body);
    const meta = document.createElement("span");
    meta.className = "meta";
    div.append(meta);
    fillMessage(div, msg);
    return div;
  }

  function fillMessage(div, msg) {
    const body = div.querySelector(".body");
    if (msg.role === "assistant") body.innerHTML = window.PagedMarkdown.render(msg.content);  // escaped first
    else body.textContent = msg.content;
    div.dataset.state = msg.state || "done";
    const meta = div.querySelector(".meta");
    const notes = [];
    if (msg.state === "stopped") notes.push("stopped");
    if (msg.error) notes.push("error: " + msg.error);
    if (msg.finish) notes.push(msg.finish === "length" ? "hit max tokens" : "finished: " + msg.finish);
    if (msg.tokens) notes.push(msg.tokens + " tokens" + (msg.seconds ? ", " + (msg.tokens / msg.seconds).toFixed(1) + " tok/s" : ""));
    meta.textContent = notes.join(" \u00b7 ");
    meta.hidden = notes.length === 0;
  }

  function renderMessages() {
    el.messages.textContent = "";
    const c = conversation();
    if (!c) return;
    for (const msg of c.messages) el.messages.append(messageElement(msg));
    el.messages.scrollTop = el.messages.scrollHeight;
  }

  function renderAll() {
    const c = conversation();
    if (c) el.system.value = c.system || "";
    renderList(); renderMessages(); updateButtons();
  }

  function updateButtons() {
    const busy = controller !== null;
    el.send.disabled = busy;
    el.stop.hidden = !busy;
    const c = conversation();
    el.regenerate.disabled = busy || !c || !c.messages.some((m) => m.role === "user");
  }

  function settings() {
    const num = (input, fallback) => { const v = parseFloat(input.value); return Number.isFinite(v) ? v : fallback; };
    return { model: el.model.value || undefined, temperature: num(el.temperature, 0.7), top_p: num(el.topP, 1),
      max_tokens: Math.max(1, Math.round(num(el.maxTokens, 512))) };
  }

  function saveSettings() {
    localStorage.setItem(SETTINGS, JSON.stringify({ temperature: el.temperature.value, top_p: el.topP.value,
      max_tokens: el.maxTokens.value, model: el.model.value }));
  }

  function restoreSettings() {
    try {
      const s = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
      if (s.temperature !== undefined) el.temperature.value = s.temperature;
      if (s.top_p !== undefined) el.topP.value = s.top_p;
      if (s.max_tokens !== undefined) el.maxTokens.value = s.max_tokens;
      return s.model;
    } catch (e) { return undefined; }
  }

  async function loadModels(preferred) {
    try {
      const response = await window.Paged.apiFetch("/v1/models");
      if (!response.ok) { window.Paged.setStatus(await window.Paged.errorMessage(response)); return; }
      const models = (await response.json()).data || [];
      el.model.textContent = "";
      for (const m of models) {
        const option = document.createElement("option");
        option.value = m.id; option.textContent = m.id + (m.max_model_len ? " (" + m.max_model_len + " ctx)" : "");
        el.model.append(option);
      }
      if (preferred && models.some((m) => m.id === preferred)) el.model.value = preferred;
      window.Paged.setStatus(models.length ? "connected" : "no models");
    } catch (e) {
      window.Paged.setStatus("server unreachable");
    }
  }

  // Stream the assistant's reply to the conversation's messages (the last message must be the user's).
  async function reply(c) {
    const wire = [];
    if (c.system && c.system.trim()) wire.push({ role: "system", content: c.system });
    for (const m of c.messages) if (!m.error || m.content) wire.push({ role: m.role, content: m.content });
    const msg = { role: "assistant", content: "", state: "streaming" };
    c.messages.push(msg);
    const div = messageElement(msg);
    el.messages.append(div);
    controller = new AbortController();
    updateButtons();
    const started = performance.now();
    let pending = false;
    const paint = () => {  // at most one repaint per frame, however fast tokens arrive
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => { pending = false; fillMessage(div, msg); el.messages.scrollTop = el.messages.scrollHeight; });
    };
    try {
      const body = Object.assign({ messages: wire, stream: true, stream_options: { include_usage: true } }, settings());
      const response = await window.Paged.apiFetch("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!response.ok) throw new Error(await window.Paged.errorMessage(response));
      await window.Paged.readEvents(response, (name, data) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
        if (chunk.usage) msg.tokens = chunk.usage.completion_tokens;
        for (const choice of chunk.choices || []) {
          if (choice.delta && choice.delta.content) { msg.content += choice.delta.content; paint(); }
          if (choice.finish_reason) msg.finish = choice.finish_reason;
        }
      });
      msg.state = "done";
    } catch (e) {
      if (controller.signal.aborted) msg.state = "stopped";
      else { msg.state = "error"; msg.error = e.message || String(e); }
    } finally {
      msg.seconds = (performance.now() - started) / 1000;
      controller = null;
      fillMessage(div, msg);
      c.updated = Date.now();
      save(); updateButtons(); renderList();
    }
  }

  async function send() {
    const text = el.prompt.value.trim();
    if (!text || controller) return;
    const c = conversation() || newConversation();
    c.system = el.system.value;
    if (!c.messages.length) c.title = text.slice(0, 40);
    c.messages.push({ role: "user", content: text });
    el.prompt.value = "";
    save(); renderAll();
    await reply(c);
  }

  async function regenerate() {
    const c = conversation();
    if (!c || controller) return;
    while (c.messages.length && c.messages[c.messages.length - 1].role !== "user") c.messages.pop();
    if (!c.messages.length) return;
    c.system = el.system.value;
    save(); renderMessages();
    await reply(c);
  }

  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  el.prompt.addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } });
  el.stop.addEventListener("click", () => { if (controller) controller.abort(); });
  el.regenerate.addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", () => { if (!controller) { newConversation(); renderAll(); el.prompt.focus(); } });
  el.system.addEventListener("change", () => { const c = conversation(); if (c) { c.system = el.system.value; save(); } });
  for (const input of [el.temperature, el.topP, el.maxTokens, el.model]) input.addEventListener("change", saveSettings);

  const preferred = restoreSettings();
  let loaded = false;
  window.Paged.registerView("chat", {
    show: () => { if (!loaded) { loaded = true; loadModels(preferred); } renderAll(); },
    hide: () => {},
  });
})();
