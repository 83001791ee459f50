// The qv playground: chat (streamed), Clef decisions as bars, the server's state. Plain browser
// JavaScript, no build step; every URL is relative so the page works under a path prefix.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "qv.apiKey";
const PLOT_POINTS = 90;
const POLL_MS = 2000;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

// --- the API, with the key the page holds for this browser session ---

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch (_) {
    return `${response.status} ${response.statusText}`;
  }
}

async function api(path, body, signal) {
  const init = body === undefined ? { headers: headers() }
    : { method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body), signal };
  const response = await fetch(path, init);
  if (!response.ok) {
    const hint = response.status === 401 ? " (enter the server's API key above)" : "";
    throw new Error(`${path}: ${await errorText(response)}${hint}`);
  }
  return response;
}

// --- tabs and the key field ---

function showPanel(name) {
  for (const tab of document.querySelectorAll("button.tab")) tab.classList.toggle("active", tab.dataset.panel === name);
  for (const panel of document.querySelectorAll(".panel")) panel.hidden = panel.id !== `panel-${name}`;
}

function initHeader() {
  for (const tab of document.querySelectorAll("button.tab")) tab.addEventListener("click", () => showPanel(tab.dataset.panel));
  const key = $("api-key");
  key.value = sessionStorage.getItem(KEY_STORE) || "";
  key.addEventListener("change", () => {
    if (key.value) sessionStorage.setItem(KEY_STORE, key.value);
    else sessionStorage.removeItem(KEY_STORE);
    loadServerInfo();
  });
}

// --- images: uploaded files become data URLs, URLs are sent as they are ---

function imageList(fileInput, urlInput, addButton, thumbs) {
  const images = [];
  const render = () => {
    thumbs.replaceChildren(...images.map((src, i) => {
      const remove = el("button", { class: "secondary", title: "remove", text: "x" });
      remove.addEventListener("click", () => { images.splice(i, 1); render(); });
      return el("span", {}, el("img", { src, alt: `image ${i + 1}` }), remove);
    }));
  };
  fileInput.addEventListener("change", async () => {
    for (const file of fileInput.files) images.push(await readDataUrl(file));
    fileInput.value = "";
    render();
  });
  addButton.addEventListener("click", () => {
    if (urlInput.value.trim()) images.push(urlInput.value.trim());
    urlInput.value = "";
    render();
  });
  return { images, clear: () => { images.length = 0; render(); } };
}

function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// --- chat ---

const chat = { history: [], controller: null, images: null };

function chatRequest() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  const body = {
    model: $("model-name").dataset.model, messages: messages.concat(chat.history), stream: true,
    stream_options: { include_usage: true }, max_tokens: Number($("max-tokens").value) || 256,
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    chat_template_kwargs: { enable_thinking: $("thinking").checked },
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const tools = $("tools").value.trim();
  if (tools) {
    try { body.tools = JSON.parse(tools); } catch (err) { throw new Error(`the tools are not valid JSON: ${err.message}`); }
    body.tool_choice = $("tool-choice").value;
  }
  return body;
}

function userContent(text, images) {
  if (!images.length) return text;
  return [...images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text }];
}

function addMessage(role, content) {
  const node = el("div", { class: `msg ${role}` }, el("span", { class: "role", text: role }));
  if (Array.isArray(content)) {
    for (const part of content) {
      if (part.type === "image_url") node.append(el("img", { src: part.image_url.url, alt: "image" }));
      else node.append(el("div", { text: part.text }));
    }
  } else if (content !== undefined) {
    node.append(el("div", { text: content }));
  }
  $("messages").append(node);
  $("messages").scrollTop = $("messages").scrollHeight;
  return node;
}

// One assistant message as its stream arrives: thinking folded, text, tool calls shown as calls.
class AssistantView {
  constructor() {
    this.node = addMessage("assistant");
    this.thinking = el("details", { class: "thinking" }, el("summary", { text: "thinking" }));
    this.thinkingText = el("div");
    this.thinking.append(this.thinkingText);
    this.thinking.hidden = true;
    this.text = el("div", { class: "content" });
    this.calls = el("div");
    this.stats = el("span", { class: "stats" });
    this.node.append(this.thinking, this.text, this.calls, this.stats);
    this.content = "";
    this.toolCalls = [];
  }

  add(delta) {
    const reasoning = delta.reasoning_content ?? delta.reasoning;
    if (reasoning) { this.thinking.hidden = false; this.thinkingText.textContent += reasoning; }
    if (delta.content) { this.content += delta.content; this.text.textContent = this.content; }
    for (const call of delta.tool_calls || []) {
      const slot = this.toolCalls[call.index] ??= { id: call.id, type: "function", function: { name: "", arguments: "" } };
      if (call.id) slot.id = call.id;
      if (call.function?.name) slot.function.name += call.function.name;
      if (call.function?.arguments) slot.function.arguments += call.function.arguments;
    }
    this.calls.replaceChildren(...this.toolCalls.map((c) => el("div", { class: "tool-call", text: `call ${c.function.name}(${c.function.arguments})` })));
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  message() {
    const message = { role: "assistant", content: this.content };
    if (this.toolCalls.length) message.tool_calls = this.toolCalls;
    return message;
  }
}

async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function sendChat(event) {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text && !chat.images.images.length) return;
  showError("");
  const content = userContent(text, [...chat.images.images]);
  chat.history.push({ role: "user", content });
  addMessage("user", content);
  $("chat-input").value = "";
  chat.images.clear();
  const view = new AssistantView();
  chat.controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let tokens = 0;
  let events = 0;
  try {
    const response = await api("v1/chat/completions", chatRequest(), chat.controller.signal);
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.content || delta.reasoning_content || delta.reasoning || delta.tool_calls) events += 1;
        view.add(delta);
      }
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
    });
    const seconds = (performance.now() - started) / 1000;
    view.stats.textContent = `${tokens} tokens in ${seconds.toFixed(2)} s, ${events} streamed pieces`;
    view.node.dataset.tokens = String(tokens);
    view.node.dataset.pieces = String(events);
    view.node.dataset.done = "1";
  } catch (err) {
    if (err.name !== "AbortError") showError(err.message);
    view.stats.textContent = err.name === "AbortError" ? "stopped" : "failed";
  } finally {
    chat.history.push(view.message());
    chat.controller = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("chat-send").disabled = busy;
  $("chat-stop").hidden = !busy;
}

function initChat() {
  chat.images = imageList($("chat-file"), $("chat-image-url"), $("chat-add-url"), $("chat-images"));
  $("chat-form").addEventListener("submit", sendChat);
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
  });
  $("chat-stop").addEventListener("click", () => chat.controller?.abort());
  $("chat-clear").addEventListener("click", () => { chat.history = []; $("messages").replaceChildren(); });
}

// --- decisions (POST /v1/systemone) ---

const QUESTION_HINTS = {
  noul: "no options: the answer is the probability of yes",
  choice: "one option per line: name, or name: what it means",
  score: "one level per line, lowest first",
};
let clefImages = null;

function addQuestion(type, id = "", instructions = "", criteria = "") {
  const kind = el("select");
  for (const t of ["noul", "choice", "score"]) kind.append(el("option", { value: t, text: t }));
  kind.value = type;
  const name = el("input", { type: "text", placeholder: "id", value: id });
  const what = el("input", { type: "text", placeholder: "instructions", value: instructions });
  const options = el("textarea", { rows: "3", placeholder: QUESTION_HINTS[type] });
  options.value = criteria;
  const remove = el("button", { class: "secondary", type: "button", text: "remove" });
  const box = el("div", { class: "question" }, name, kind, what, remove, options);
  const showOptions = () => { options.hidden = kind.value === "noul"; options.placeholder = QUESTION_HINTS[kind.value]; };
  kind.addEventListener("change", showOptions);
  remove.addEventListener("click", () => box.remove());
  showOptions();
  $("questions").append(box);
}

function readQuestions() {
  const questions = {};
  for (const box of $("questions").children) {
    const [name, kind, what, , options] = box.querySelectorAll("input, select, button, textarea");
    const id = name.value.trim() || `q${Object.keys(questions).length + 1}`;
    const question = { type: kind.value };
    if (what.value.trim()) question.instructions = what.value.trim();
    const lines = options.value.split("\n").map((l) => l.trim()).filter(Boolean);
    if (kind.value === "score") question.criteria = lines;
    if (kind.value === "choice") {
      question.criteria = {};
      for (const line of lines) {
        const at = line.indexOf(":");
        if (at < 0) question.criteria[line] = null;
        else question.criteria[line.slice(0, at).trim()] = line.slice(at + 1).trim() || null;
      }
    }
    questions[id] = question;
  }
  return questions;
}

function readState() {
  const text = $("clef-state").value;
  if (document.querySelector("input[name=state-kind]:checked").value === "text") return text;
  try { return JSON.parse(text); } catch (err) { throw new Error(`the state is not valid JSON: ${err.message}`); }
}

function barRow(label, p, top) {
  const fill = el("div");
  fill.style.width = `${(100 * p).toFixed(1)}%`;
  return el("div", { class: `bar-row${top ? " top" : ""}` }, el("span", { class: "label", title: label, text: label }),
    el("div", { class: "bar" }, fill), el("span", { text: p.toFixed(4) }));
}

function scoreScale(score, levels) {
  const scale = el("div", { class: "scale" });
  const at = (v) => `${levels > 1 ? (100 * v) / (levels - 1) : 50}%`;
  for (let i = 0; i < levels; i++) {
    const tick = el("span", { class: "tick", text: String(i) });
    tick.style.left = at(i);
    scale.append(tick);
  }
  const marker = el("span", { class: "marker", title: `expected score ${score}` });
  marker.style.left = at(score);
  scale.append(marker);
  return scale;
}

function answerView(id, answer) {
  const box = el("div", { class: "answer", "data-question": id });
  if (answer.type === "noul") {
    box.append(el("h4", { text: `${id} (noul): P(yes) ${answer.noul.toFixed(4)}` }),
      barRow("yes", answer.noul, answer.noul >= 0.5), barRow("no", 1 - answer.noul, answer.noul < 0.5));
  } else if (answer.type === "choice") {
    box.append(el("h4", { text: `${id} (choice): ${answer.choice}, confidence ${answer.confidence.toFixed(4)}` }));
    for (const [option, p] of Object.entries(answer.probabilities)) box.append(barRow(option, p, option === answer.choice));
  } else {
    const levels = Object.keys(answer.probabilities).length;
    box.append(el("h4", { text: `${id} (score): expected ${answer.score.toFixed(4)} on 0..${levels - 1}` }),
      scoreScale(answer.score, levels));
    const best = Math.max(...Object.values(answer.probabilities));
    for (const [level, p] of Object.entries(answer.probabilities)) {
      box.append(barRow(`${level} · ${answer.legend[level]}`, p, p === best));
    }
  }
  return box;
}

async function sendDecision() {
  showError("");
  const button = $("clef-send");
  button.disabled = true;
  try {
    const body = { model: "clef", state: readState(), questions: readQuestions() };
    if (clefImages.images.length) body.images = [...clefImages.images];
    const result = await (await api("v1/systemone", body)).json();
    $("answers").replaceChildren(...Object.entries(result.answers).map(([id, a]) => answerView(id, a)));
    $("clef-usage").textContent = `${result.usage.input_tokens} tokens`;
    $("clef-raw").textContent = JSON.stringify(result, null, 2);
  } catch (err) {
    showError(err.message);
  } finally {
    button.disabled = false;
  }
}

function initDecisions() {
  clefImages = imageList($("clef-file"), $("clef-image-url"), $("clef-add-url"), $("clef-images"));
  addQuestion("noul", "outage", "Is a service down?");
  addQuestion("score", "urgency", "How urgent is it?", "Can wait\nThis week\nToday");
  addQuestion("choice", "team", "Which team should take it?", "billing: money matters\ntech\nops: outages");
  for (const button of document.querySelectorAll("[data-add]")) {
    button.addEventListener("click", () => addQuestion(button.dataset.add));
  }
  $("clef-send").addEventListener("click", sendDecision);
}

// --- server: /server_info once, /metrics every POLL_MS ---

function shown(name, value) {
  if (typeof value === "object") return JSON.stringify(value);
  if (name.endsWith("_bytes") && value >= 1024) {
    const gib = value / 2 ** 30;
    return `${gib >= 1 ? `${gib.toFixed(2)} GiB` : `${(value / 2 ** 20).toFixed(1)} MiB`} (${value.toLocaleString("en")})`;
  }
  return typeof value === "number" ? value.toLocaleString("en") : String(value);
}

function fillTable(table, entries) {
  table.replaceChildren(...entries.map(([k, v]) => el("tr", {}, el("td", { text: k }), el("td", { text: shown(k, v) }))));
}

async function loadServerInfo() {
  try {
    const info = await (await api("server_info")).json();
    $("model-name").textContent = `${info.model} · qv ${info.version}`;
    $("model-name").dataset.model = info.model;
    fillTable($("server-model"), [["model", info.model], ["folder", info.model_root], ["device", info.device],
      ["max_model_len", info.max_model_len], ["CUDA graphs", info.cuda_graphs ? `on (${info.cuda_graph_sizes.join(", ")})` : "off"],
      ["speculation", info.spec], ["Clef decisions", info.clef ? "served" : "not served"],
      ["images", info.images ? "accepted" : "off"], ["API key", info.api_key_required ? "required" : "none"]]);
    const levers = Object.entries(info.levers_changed);
    fillTable($("server-levers"), levers.length ? levers : [["(none)", "every lever at its default"]]);
    const plan = info.memory_plan || {};
    $("server-plan-summary").textContent = plan.summary || "no memory plan";
    fillTable($("server-plan"), Object.entries(plan).filter(([k]) => k !== "summary"));
    showError("");
  } catch (err) {
    $("model-name").textContent = "not connected";
    showError(err.message);
  }
}

function parseMetrics(text) {
  const sums = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const name = line.split(/[{ ]/, 1)[0];
    const value = Number(line.slice(line.lastIndexOf(" ") + 1));
    sums[name] = (sums[name] || 0) + value;
  }
  return sums;
}

const series = { tps: [], running: [], waiting: [], kv: [] };
let lastTokens = null;

function push(list, value) {
  list.push(value);
  if (list.length > PLOT_POINTS) list.shift();
}

function plot(svg, lists, top) {
  const max = Math.max(top, ...lists.flat());
  svg.replaceChildren(...lists.map((list, i) => {
    const first = PLOT_POINTS - list.length;  // the newest point at the right edge
    const points = list.map((v, j) => `${(300 * (first + j)) / (PLOT_POINTS - 1)},${58 - (56 * v) / (max || 1)}`).join(" ");
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", points);
    if (i) line.setAttribute("class", "second");
    return line;
  }));
}

async function pollMetrics() {
  try {
    const m = parseMetrics(await (await api("metrics")).text());
    const tokens = m["vllm:generation_tokens_total"] ?? m["vllm:generation_tokens"] ?? 0;
    const now = performance.now() / 1000;
    if (lastTokens) push(series.tps, Math.max(0, (tokens - lastTokens[0]) / (now - lastTokens[1])));
    lastTokens = [tokens, now];
    push(series.running, m["vllm:num_requests_running"] || 0);
    push(series.waiting, m["vllm:num_requests_waiting"] || 0);
    push(series.kv, m["vllm:kv_cache_usage_perc"] || 0);
    $("now-tps").textContent = series.tps.length ? series.tps.at(-1).toFixed(1) : "-";
    $("now-running").textContent = series.running.at(-1);
    $("now-waiting").textContent = series.waiting.at(-1);
    $("now-kv").textContent = `${(100 * series.kv.at(-1)).toFixed(1)}%`;
    plot($("plot-tps"), [series.tps], 1);
    plot($("plot-requests"), [series.running, series.waiting], 1);
    plot($("plot-kv"), [series.kv], 1);
  } catch (err) {
    $("now-tps").textContent = "no metrics";
  } finally {
    setTimeout(pollMetrics, POLL_MS);
  }
}

initHeader();
initChat();
initDecisions();
loadServerInfo();
pollMetrics();
