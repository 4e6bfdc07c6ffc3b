// motet's page: a chat streamed from POST /v1/chat/completions (SSE read off the fetch
// body, so the stop button can abort it) and the live expert map from GET /experts.
// No framework, no build step; the DOM ids are the ones the browser test reads.
"use strict";

const $ = (id) => document.getElementById(id);
const POLL_STREAMING_MS = 400;
const POLL_IDLE_MS = 3000;
const TIERS = ["disk", "RAM", "device"];
const KEY_STORE = "motet-api-key";  // a server started with an API key wants it on the API
const RAMP = ["#2c115f", "#721f81", "#b73779", "#f1605d", "#feb078", "#fcfdbf"].map(rgb);

const state = {
  model: null,
  history: [],     // the whole conversation, sent in full each turn
  abort: null,     // the AbortController of the answer in flight, null when idle
  experts: null,   // the last /experts snapshot, decoded
  glow: null,      // per cell: 1 when just routed, fading on each later poll
  geom: null,      // where the last draw put the cells, for the tooltip
  wakePoll: null,  // ends the poll loop's wait early
};

// ---- the API ---------------------------------------------------------------------------

// fetch, with the API key when one was given; a 401 shows the key box.
async function api(path, init = {}) {
  const key = localStorage.getItem(KEY_STORE);
  const headers = { ...init.headers, ...(key ? { Authorization: `Bearer ${key}` } : {}) };
  const res = await fetch(path, { ...init, headers });
  if (res.status === 401) $("key-form").hidden = false;
  return res;
}

// ---- chat ----------------------------------------------------------------------------

function node(tag, className, text = "") {
  const el = document.createElement(tag);
  el.className = className;
  el.textContent = text;
  return el;
}

function addMessage(role, text) {
  $("empty")?.remove();
  const el = node("div", `msg ${role}`);
  el.append(node("span", "text", text));
  $("messages").append(el);
  scrollDown();
  return el;
}

const addMeta = (el, text) => el.append(node("span", "meta", text));
const scrollDown = () => ($("messages").scrollTop = $("messages").scrollHeight);

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
}

async function send() {
  const content = $("prompt").value.trim();
  if (!content || state.abort) return;
  $("prompt").value = "";
  const history = state.history;  // "New" during the answer starts another one
  history.push({ role: "user", content });
  addMessage("user", content);
  const el = addMessage("assistant", "");
  const textEl = el.querySelector(".text");
  Object.assign(el.dataset, { state: "streaming", chunks: "0" });
  const abort = (state.abort = new AbortController());
  setBusy(true);
  state.wakePoll?.();  // switch the map to fast polling now
  let text = "";
  try {
    const maxTokens = parseInt($("max-tokens").value, 10);
    const request = { model: state.model || "default", messages: history, stream: true };
    if (maxTokens > 0) request.max_tokens = maxTokens;
    const res = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(request),
      signal: abort.signal,
    });
    if (!res.ok) throw new Error(await errorText(res));
    for await (const data of sseData(res.body)) {
      if (data === "[DONE]") break;
      const frame = JSON.parse(data);
      if (frame.error) throw new Error(frame.error.message || JSON.stringify(frame.error));
      if (frame.colibri) {
        addMeta(el, turnSummary(frame.colibri.stats || {}));
        continue;
      }
      const choice = frame.choices?.[0];
      if (choice?.delta?.content) {
        text += choice.delta.content;
        textEl.textContent = text;
        el.dataset.chunks = String(Number(el.dataset.chunks) + 1);
        scrollDown();
      }
      if (choice?.finish_reason) el.dataset.finish = choice.finish_reason;
    }
    el.dataset.state = "done";
  } catch (err) {
    if (err.name === "AbortError") {
      el.dataset.state = "stopped";
      addMeta(el, "stopped");
    } else {
      el.dataset.state = "error";
      el.classList.add("error");
      addMeta(el, err.message);
    }
  } finally {
    // Keep the turns alternating: a failed turn with no answer leaves no user turn behind.
    if (text) history.push({ role: "assistant", content: text });
    else history.pop();
    state.abort = null;
    setBusy(false);
    state.wakePoll?.();  // one more look, to catch the last tokens' experts
  }
}

// Yields the data of each server-sent event in a fetch body.
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += value;
      let m;
      while ((m = /\r?\n\r?\n/.exec(buf))) {
        const event = buf.slice(0, m.index);
        buf = buf.slice(m.index + m[0].length);
        const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield data;
      }
    }
  } finally {
    reader.releaseLock();
  }
}

async function errorText(res) {
  const body = await res.text();
  try {
    return JSON.parse(body).error.message;
  } catch {
    return `${res.status} ${res.statusText}${body ? ": " + body.slice(0, 200) : ""}`;
  }
}

function turnSummary(s) {
  const parts = [];
  if (s.emitted_tokens != null) parts.push(`${s.emitted_tokens} tokens`);
  if (s.decode_tokens_per_s) parts.push(`${s.decode_tokens_per_s.toFixed(1)} tok/s`);
  const ttft = s.time_to_first_token_s;
  if (ttft != null) parts.push(`first token ${(ttft * 1e3).toFixed(0)} ms`);
  if (s.reused_tokens) parts.push(`${s.reused_tokens} of ${s.prompt_tokens} prompt tokens reused`);
  return parts.join(" · ");
}

// ---- expert map ----------------------------------------------------------------------

function hexBytes(hex) {
  const out = new Uint8Array(hex.length >> 1);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(hex.substr(2 * i, 2), 16);
  return out;
}

async function pollLoop() {
  for (;;) {
    try {
      const res = await api("/experts", { cache: "no-store" });
      if (!res.ok) throw new Error(`${res.status}`);
      applyExperts(await res.json());
      $("health").dataset.ok = "yes";
    } catch {
      $("health").dataset.ok = "no";
    }
    await new Promise((wake) => {
      state.wakePoll = wake;
      setTimeout(wake, state.abort ? POLL_STREAMING_MS : POLL_IDLE_MS);
    });
  }
}

function applyExperts(x) {
  const n = x.rows * x.cols;
  const hits = hexBytes(x.hits || "");
  if (state.glow?.length !== n) state.glow = new Float32Array(n);
  // HITS is a window of steps named by seq: a new seq lights its cells, the rest fade.
  const fresh = x.seq !== state.experts?.seq;
  let hitCount = 0;
  for (let i = 0; i < n; i++) {
    const hit = (hits[i >> 3] >> (7 - (i & 7))) & 1;
    state.glow[i] = hit && fresh ? 1 : state.glow[i] * 0.5;
    hitCount += hit;
  }
  state.experts = { ...x, bytes: hexBytes(x.map), hitCount };
  draw();
  Object.assign($("expert-map").dataset, { seq: x.seq, hits: hitCount, rows: x.rows, cols: x.cols });
  const plural = (n, what) => `${n} ${what}${n === 1 ? "" : "s"}`;
  const dense = x.cols === 1 ? " (dense)" : "";
  $("map-shape").textContent = `${plural(x.rows, "layer")} × ${plural(x.cols, "expert")}${dense}`;
  $("tok-s").textContent = (x.tokens_per_s || 0).toFixed(1);
  $("slots").textContent = `${x.slots_busy}/${x.slots_total}`;
  const pips = Array.from({ length: Math.min(x.slots_total, 32) }, (_, i) => i < x.slots_busy);
  $("slot-pips").replaceChildren(...pips.map((busy) => node("i", busy ? "busy" : "")));
  const ent = x.entropy || [];
  $("entropy").textContent = x.cols > 1 && ent.length
    ? `${(ent.reduce((a, b) => a + b, 0) / ent.length).toFixed(2)} / ${Math.log2(x.cols).toFixed(0)} bits`
    : "–";
}

function draw() {
  const x = state.experts;
  if (!x) return;
  const canvas = $("expert-map"), wrap = $("map-wrap");
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue(name).trim();
  // Cells as large as the panel and the window allow (capped, never much taller than
  // wide), centred; layer labels left, expert numbers on top, entropy bars right.
  const width = wrap.clientWidth, labelW = 34, top = 18, entW = x.cols > 1 ? 64 : 0;
  const maxH = clamp(window.innerHeight - 330, 220, 1200);
  const cw = clamp(Math.floor((width - labelW - entW) / x.cols), 2, 64);
  const ch = clamp(Math.floor((maxH - top) / x.rows), 2, Math.max(cw, 20));
  const mapW = cw * x.cols, height = top + ch * x.rows + 4;
  const ox = labelW + Math.floor((width - labelW - entW - mapW) / 2);
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(height * dpr);
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  state.geom = { ox, top, cw, ch };

  // The colour scale spans the heats present (log2 buckets), so a busy map keeps contrast.
  let lo = 63, hi = 0;
  for (const b of x.bytes) if (b & 63) [lo, hi] = [Math.min(lo, b & 63), Math.max(hi, b & 63)];
  const span = Math.max(1, hi - lo + 1);
  $("heat-max").textContent = hi
    ? `${count(2 ** (lo - 1))} – ${count(2 ** hi - 1)} routed tokens`
    : "no token routed yet";
  const gap = cw >= 6 && ch >= 6 ? 1 : 0, hitColor = color("--hit");
  for (let i = 0; i < x.rows * x.cols; i++) {
    const heat = x.bytes[i] & 63, tier = x.bytes[i] >> 6, glow = state.glow[i];
    const px = ox + (i % x.cols) * cw, py = top + Math.floor(i / x.cols) * ch;
    const w = cw - gap, h = ch - gap, outline = w >= 8 && h >= 8;
    ctx.globalAlpha = tier === 1 ? 0.5 : 1;
    const fill = heat ? ramp(0.12 + (0.88 * (heat - lo + 1)) / span) : color("--cell-empty");
    ctx.fillStyle = ctx.strokeStyle = fill;
    ctx.lineWidth = 2;
    if (tier === 0 && heat && outline) ctx.strokeRect(px + 1, py + 1, w - 2, h - 2);  // on disk: hollow
    else ctx.fillRect(px, py, w, h);
    if (glow > 0.06) {  // routed lately: a glowing outline (a bright cell when too small)
      ctx.globalAlpha = glow;
      ctx.fillStyle = ctx.strokeStyle = ctx.shadowColor = hitColor;
      ctx.shadowBlur = outline ? 8 : 0;
      if (outline) ctx.strokeRect(px + 1, py + 1, w - 2, h - 2);
      else ctx.fillRect(px, py, w, h);
      ctx.shadowBlur = 0;
    }
  }
  ctx.globalAlpha = 1;
  ctx.fillStyle = color("--muted");
  ctx.font = "10px ui-monospace, 'Liberation Mono', monospace";
  ctx.textBaseline = "middle";
  ctx.textAlign = "right";
  for (let r = 0; r < x.rows; r += Math.ceil(12 / ch)) ctx.fillText(`L${r}`, ox - 6, top + r * ch + ch / 2);
  ctx.textAlign = "center";
  for (let c = 0; c < x.cols; c += Math.ceil(22 / cw)) ctx.fillText(`${c}`, ox + c * cw + cw / 2, top / 2);
  if (!entW) return;
  const left = ox + mapW + 10, most = Math.log2(x.cols);
  ctx.textAlign = "left";
  ctx.fillText("entropy", left, top / 2);
  ctx.fillStyle = color("--entropy");
  (x.entropy || []).forEach((bits, r) => {
    const w = Math.max(1, ((entW - 14) * Math.min(bits, most)) / most);
    ctx.fillRect(left, top + r * ch + ch * 0.25, w, Math.max(1, ch * 0.5));
  });
}

function showTooltip(ev) {
  const x = state.experts, g = state.geom, tip = $("tooltip");
  const c = Math.floor((ev.offsetX - g?.ox) / g?.cw), r = Math.floor((ev.offsetY - g?.top) / g?.ch);
  if (!x || !(r >= 0 && r < x.rows && c >= 0 && c < x.cols)) {
    tip.hidden = true;
    return;
  }
  const i = r * x.cols + c, heat = x.bytes[i] & 63;
  const routed = heat ? `${count(2 ** (heat - 1))}–${count(2 ** heat - 1)} tokens` : "never routed";
  const ent = x.entropy?.[r];
  tip.textContent = [
    `MoE layer ${r} · expert ${c}`,
    `tier   ${TIERS[x.bytes[i] >> 6] ?? "?"}`,
    `heat   ${heat}: ${routed}`,
    `now    ${state.glow[i] === 1 ? "routed since the last look" : "idle"}`,
    x.cols > 1 && ent != null ? `layer entropy ${ent.toFixed(2)} of ${Math.log2(x.cols)} bits` : "",
  ].filter(Boolean).join("\n");
  tip.hidden = false;
  const wrap = $("map-wrap");
  tip.style.left = `${Math.min(ev.offsetX + 14, wrap.clientWidth - tip.offsetWidth - 4)}px`;
  tip.style.top = `${ev.offsetY + 14}px`;
}

function rgb(hex) {
  const v = parseInt(hex.slice(1), 16);
  return [v >> 16, (v >> 8) & 255, v & 255];
}

function ramp(t) {
  const f = clamp(t, 0, 1) * (RAMP.length - 1), k = Math.min(Math.floor(f), RAMP.length - 2);
  const [a, b] = [RAMP[k], RAMP[k + 1]];
  return `rgb(${a.map((v, j) => Math.round(v + (b[j] - v) * (f - k))).join(",")})`;
}

const clamp = (v, lo, hi) => Math.min(hi, Math.max(lo, v));
const count = (n) => n.toLocaleString();

// ---- start ---------------------------------------------------------------------------

async function loadModel() {
  try {
    const res = await api("/v1/models");
    if (!res.ok) throw new Error(`${res.status}`);
    state.model = (await res.json()).data[0].id;
    $("model").textContent = state.model;
    $("model").title = `served model: ${state.model}`;
  } catch {
    $("model").textContent = "no model";
  }
}

function newConversation() {
  state.abort?.abort();
  state.history = [];
  const hint = node("p", "hint", "A new conversation. Ask something.");
  hint.id = "empty";
  $("messages").replaceChildren(hint);
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  send();
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    send();
  }
});
$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  localStorage.setItem(KEY_STORE, $("api-key").value.trim());
  $("key-form").hidden = true;
  loadModel();
  state.wakePoll?.();
});
$("stop").addEventListener("click", () => state.abort?.abort());
$("clear").addEventListener("click", newConversation);
$("expert-map").addEventListener("mousemove", showTooltip);
$("expert-map").addEventListener("mouseleave", () => ($("tooltip").hidden = true));
window.addEventListener("resize", draw);
matchMedia("(prefers-color-scheme: light)").addEventListener("change", draw);
loadModel();
pollLoop();
