// What both pages share: the API key (asked for on a 401, kept in localStorage, sent only as a Bearer
// header), fetch with it, a reader for server-sent events over fetch (EventSource cannot send headers, and
// a key in the URL would end up in access logs), and the tab switch.
"use strict";
(function () {
  const KEY_STORE = "pagedllm.apiKey";
  let keyWaiters = [];

  function apiKey() { return localStorage.getItem(KEY_STORE) || ""; }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = apiKey();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  function askForKey(reason) {
    const dialog = document.getElementById("key-dialog");
    document.getElementById("key-reason").textContent = reason || "This server needs an API key.";
    dialog.hidden = false;
    document.getElementById("key-input").focus();
    return new Promise((resolve) => keyWaiters.push(resolve));
  }

  function closeKeyDialog(saved) {
    document.getElementById("key-dialog").hidden = true;
    document.getElementById("key-input").value = "";
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((w) => w(saved));
  }

  // fetch with the key; on a 401 ask for the key once and retry.
  async function apiFetch(path, options) {
    const opts = Object.assign({}, options || {});
    for (let attempt = 0; ; attempt++) {
      opts.headers = headers(options && options.headers);
      const response = await fetch(path, opts);
      if (response.status !== 401 || attempt > 0) return response;
      const saved = await askForKey(apiKey() ? "The API key was not accepted; enter it again." : "This server needs an API key.");
      if (!saved) return response;
    }
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error) return body.error.message + (body.error.param ? " (" + body.error.param + ")" : "");
    } catch (e) { /* not JSON */ }
    return "HTTP " + response.status;
  }

  // Calls onEvent(name, data) for each event of a text/event-stream body until it ends.
  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const raw = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        let name = "message", data = [];
        for (const line of raw.split(/\r?\n/)) {
          if (line.startsWith("event:")) name = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) onEvent(name, data.join("\n"));
      }
    }
  }

  const views = {};
  function registerView(name, hooks) { views[name] = hooks; }

  function showView() {
    const name = location.hash === "#dashboard" ? "dashboard" : "chat";
    for (const [view, hooks] of Object.entries(views)) {
      const active = view === name;
      document.getElementById(view + "-view").hidden = !active;
      document.getElementById("tab-" + view).classList.toggle("active", active);
      (active ? hooks.show : hooks.hide)();
    }
  }

  function setStatus(text) { document.getElementById("server-status").textContent = text; }

  document.addEventListener("DOMContentLoaded", () => {
    document.getElementById("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const value = document.getElementById("key-input").value.trim();
      if (value) localStorage.setItem(KEY_STORE, value);
      closeKeyDialog(Boolean(value));
    });
    document.getElementById("key-cancel").addEventListener("click", () => closeKeyDialog(false));
    document.getElementById("key-forget").addEventListener("click", () => { localStorage.removeItem(KEY_STORE); closeKeyDialog(false); });
    document.getElementById("key-button").addEventListener("click", () => askForKey("Enter the server's API key."));
    window.addEventListener("hashchange", showView);
    showView();
  });

  window.Paged = { apiFetch, errorMessage, readEvents, registerView, setStatus, askForKey };
})();
