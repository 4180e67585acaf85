// The engine dashboard: reads /ui/events (server-sent events of the engine core's snapshots) only while this
// tab is shown -- the core records nothing for it otherwise -- and draws the queues, the KV block pool, the
// batch of each step, throughput and each request's queue / prefill / decode time.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue("--" + name).trim();
  const STATE_COLORS = ["free", "cached", "inuse", "shared"];  // pool_snapshot.py: FREE, CACHED, IN_USE, SHARED
  const HISTORY = 120;  // snapshots kept for the throughput chart (60 s at two a second)
  let hello = null, controller = null, retry = null;
  let steps = [], tps = [];
  let last = null;

  function setValue(id, text, value) {
    const node = $(id);
    node.textContent = text;
    node.dataset.value = value === undefined ? "" : String(value);
  }

  function fmt(n, digits) { return Number.isFinite(n) ? n.toFixed(digits === undefined ? 0 : digits) : "-"; }

  function canvas2d(id) {
    // Drawn at the device's pixel ratio and the canvas's laid-out width; its height is the markup's.
    const c = $(id);
    if (!c.dataset.h) c.dataset.h = String(c.height);
    const ratio = window.devicePixelRatio || 1;
    const w = c.clientWidth || c.width, h = Number(c.dataset.h);
    if (c.width !== Math.round(w * ratio) || c.height !== Math.round(h * ratio)) {
      c.width = Math.round(w * ratio); c.height = Math.round(h * ratio); c.style.height = h + "px";
    }
    const ctx = c.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    return { ctx, w, h };
  }

  function drawPool(kv) {
    const { ctx, w, h } = canvas2d("kv-canvas");
    if (!kv) { ctx.fillStyle = color("muted"); ctx.fillText("no KV pool to show (a data-parallel engine)", 8, 20); return; }
    const n = kv.cells.length;
    // The largest square cell that fits every cell in the canvas.
    let size = Math.floor(Math.sqrt((w * h) / Math.max(n, 1)));
    while (size > 1 && Math.floor(w / size) * Math.floor(h / size) < n) size--;
    const cols = Math.max(1, Math.floor(w / size));
    const gap = size >= 6 ? 1 : 0;
    for (let i = 0; i < n; i++) {
      ctx.fillStyle = color(STATE_COLORS[kv.cells[i]]);
      ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, size - gap, size - gap);
    }
    $("kv-caption").textContent = kv.num_blocks + " blocks of " + kv.block_size + " tokens" +
      (kv.blocks_per_cell > 1 ? ", one cell per " + kv.blocks_per_cell + " blocks" : ", one cell per block");
    const legend = $("kv-legend");
    legend.textContent = "";
    [["free", "free", kv.free], ["cached", "cached (evictable)", kv.cached], ["inuse", "in use", kv.in_use],
     ["shared", "shared by several requests", kv.shared]].forEach(([cls, label, count]) => {
      const item = document.createElement("span");
      item.id = "kv-" + cls;
      item.dataset.value = String(count);
      const sw = document.createElement("span");
      sw.className = "swatch " + cls;
      item.append(sw, document.createTextNode(label + " " + count));
      legend.append(item);
    });
  }

  function drawBars(id, series, keys) {
    const { ctx, w, h } = canvas2d(id);
    const max = Math.max(1, ...series.map((s) => keys.reduce((a, k) => a + s[k[0]], 0)));
    const bw = w / Math.max(series.length, HISTORY / 2);
    series.forEach((s, i) => {
      let y = h - 14;
      for (const [key, cls] of keys) {
        const bh = (s[key] / max) * (h - 28);
        ctx.fillStyle = color(cls);
        ctx.fillRect(i * bw, y - bh, Math.max(1, bw - 1), bh);
        y -= bh;
      }
    });
    ctx.fillStyle = color("muted");
    ctx.fillText("max " + fmt(max), 4, 11);
  }

  function drawLines(id, series, keys) {
    const { ctx, w, h } = canvas2d(id);
    const max = Math.max(1, ...series.flatMap((s) => keys.map((k) => s[k[0]])));
    for (const [key, cls] of keys) {
      ctx.strokeStyle = color(cls); ctx.lineWidth = 2; ctx.beginPath();
      series.forEach((s, i) => {
        const x = (i / (HISTORY - 1)) * w, y = h - 14 - (s[key] / max) * (h - 28);
        if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
      });
      ctx.stroke();
    }
    ctx.fillStyle = color("muted");
    ctx.fillText("max " + fmt(max) + " tok/s", 4, 11);
  }

  function drawTimelines(snap) {
    const { ctx, w, h } = canvas2d("timeline-canvas");
    const span = 30, now = snap.time, labelW = 150;
    const rows = snap.requests.slice(-Math.floor(h / 14));
    const x = (t) => labelW + Math.max(0, (1 - (now - t) / span)) * (w - labelW - 4);
    rows.forEach((r, i) => {
      const y = i * 14 + 2;
      ctx.fillStyle = color("text");
      const tag = r.state === "finished" ? (r.finish_reason || "done") : r.state;
      ctx.fillText(r.request_id.slice(-10) + " " + r.prompt_tokens + "+" + r.output_tokens + " " + tag, 2, y + 10);
      const end = r.finished || now;
      const seg = (from, to, cls) => {
        if (from === null || to === null || to < now - span) return;
        ctx.fillStyle = color(cls);
        ctx.fillRect(x(from), y, Math.max(1, x(to) - x(from)), 11);
      };
      const scheduled = r.scheduled === null ? (r.state === "waiting" || r.state === "preempted" ? end : r.arrival) : r.scheduled;
      seg(r.arrival, scheduled, "queue");
      if (r.scheduled !== null || r.state === "prefill" || r.state === "decode") {
        const first = r.first_token === null ? end : r.first_token;
        seg(scheduled, first, "prefill");
        if (r.first_token !== null) seg(r.first_token, end, "decode");
      }
      if (r.preempted !== null) seg(r.preempted, r.resumed === null ? end : r.resumed, "preempted");  // waiting to be recomputed
    });
    ctx.fillStyle = color("muted");
    ctx.fillText("-" + span + " s", labelW, h - 2);
    ctx.fillText("now", w - 24, h - 2);
    if (!rows.length) ctx.fillText("no requests yet: send one from the Chat tab, or run a load", labelW, 20);
  }

  function update(message) {
    const snap = message.snapshot, stats = message.stats;
    window.Paged.setStatus(message.healthy ? "connected" : "engine not running");
    if (!snap) { $("dashboard-status").textContent = message.healthy ? "engine healthy" : "engine not running"; return; }
    last = message;
    const window_s = Math.max(snap.window_s, 1e-3);
    const promptTps = snap.prefill_tokens / window_s, genTps = snap.generated_tokens / window_s;
    setValue("m-running", String(snap.num_running), snap.num_running);
    setValue("m-waiting", String(snap.num_waiting), snap.num_waiting);
    setValue("m-preempted", snap.num_preempted + " / " + stats.num_preemptions, snap.num_preempted);
    if (snap.kv) {
      const held = snap.kv.in_use + snap.kv.shared;
      setValue("m-kv", held + " (" + fmt((100 * held) / Math.max(1, snap.kv.num_blocks), 1) + "%)", held);
    }
    setValue("m-hit", fmt(100 * stats.prefix_cache_hit_rate, 1) + "%", stats.prefix_cache_hit_rate);
    setValue("m-prompt-tps", fmt(promptTps), promptTps);
    setValue("m-gen-tps", fmt(genTps, 1), genTps);
    const stepMs = snap.num_steps ? (1000 * snap.busy_s) / snap.num_steps : NaN;
    setValue("m-step", snap.num_steps ? fmt(stepMs, 1) + " ms" : "idle", snap.num_steps ? stepMs : 0);
    setValue("m-steps", String(stats.num_steps), stats.num_steps);
    steps = steps.concat(snap.steps).slice(-HISTORY);
    tps = tps.concat([{ prompt: promptTps, gen: genTps }]).slice(-HISTORY);
    drawPool(snap.kv);
    drawBars("batch-canvas", steps, [["prefill_tokens", "prefill"], ["decode_tokens", "decode"]]);
    drawLines("tps-canvas", tps, [["prompt", "prefill"], ["gen", "decode"]]);
    drawTimelines(snap);
    $("dashboard-status").textContent = (message.healthy ? "engine healthy" : "engine not running") +
      (hello ? " \u00b7 " + hello.model + " \u00b7 max_num_seqs " + hello.max_num_seqs + " \u00b7 max_model_len " + hello.max_model_len : "") +
      " \u00b7 updated " + new Date().toLocaleTimeString();
  }

  async function connect() {
    const mine = controller = new AbortController();
    try {
      const response = await window.Paged.apiFetch("/ui/events", { signal: mine.signal });
      if (!response.ok) throw new Error(await window.Paged.errorMessage(response));
      $("dashboard-status").textContent = "connected, waiting for the first snapshot";
      await window.Paged.readEvents(response, (name, data) => {
        const parsed = JSON.parse(data);
        if (name === "hello") hello = parsed; else update(parsed);
      });
      throw new Error("the server closed the event stream");
    } catch (e) {
      if (mine.signal.aborted) return;  // the tab was left: disconnect() ended it
      $("dashboard-status").textContent = "disconnected (" + (e.message || e) + "); retrying";
      retry = setTimeout(connect, 2000);
    }
  }

  function disconnect() {
    clearTimeout(retry);
    if (controller) { const c = controller; controller = null; c.abort(); }
  }

  window.addEventListener("resize", () => { if (last) update(last); });
  window.Paged.registerView("dashboard", { show: () => { if (!controller) connect(); }, hide: disconnect });
})();
