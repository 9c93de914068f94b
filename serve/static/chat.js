// The chat page: talks to this server's own OpenAI endpoints (/props, /v1/chat/completions), streams answers.
// Model output is only ever placed with textContent / setAttribute, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const SAMPLING = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "max_tokens", "seed"];
const INTEGERS = new Set(["top_k", "max_tokens", "seed"]);
const history = [];          // the conversation: {role, content[, tool_calls]} sent with every request
let controller = null;       // the running request's AbortController
let props = null;            // what the server reported at /props

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(text, bad) {
  $("server-status").textContent = text;
  $("server-status").classList.toggle("bad", !!bad);
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  const who = document.createElement("span");
  who.className = "role";
  who.textContent = role;
  const body = document.createElement("span");
  body.className = "content";
  body.textContent = text || "";
  div.append(who, body);
  $("messages").append(div);
  div.scrollIntoView({block: "end"});
  return div;
}

function note(div, cls, text) {
  const span = document.createElement("span");
  span.className = cls;
  span.textContent = text;
  div.append(span);
  div.scrollIntoView({block: "end"});
  return span;
}

// What a failed response means to a person: the server's own message, with what to do for the common cases.
async function explain(resp) {
  let message = resp.statusText || "error";
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (e) { /* not JSON */ }
  if (resp.status === 401) return "401: " + message + " (enter the server's key in the API key box)";
  if (resp.status === 429) return "429: the server is busy (" + message + "); try again in a moment";
  if (resp.status === 503) return "503: " + message + " (the model is still loading or failed to load)";
  return resp.status + ": " + message;
}

async function loadProps() {
  let resp;
  try {
    resp = await fetch("/props", {headers: headers()});
  } catch (e) {
    setStatus("the server cannot be reached", true);
    return;
  }
  if (resp.status === 401) {
    $("key-hint").textContent = "This server needs an API key.";
    setStatus("API key needed", true);
    $("api-key").focus();
    return;
  }
  if (!resp.ok) {
    setStatus(await explain(resp), true);
    setTimeout(loadProps, 2000);
    return;
  }
  props = await resp.json();
  $("key-hint").textContent = "";
  $("model-name").textContent = props.model;
  setStatus("ready");
  const defaults = props.default_generation_settings || {};
  for (const name of SAMPLING) {
    if (defaults[name] !== undefined && defaults[name] !== null) $(name).placeholder = String(defaults[name]);
  }
  const features = props.features || {};
  $("jump-forward-box").hidden = !features.jump_forward;
  $("tools-option").hidden = !features.tools;  // the template writes a tool-call syntax the server knows
  $("speculative-box").hidden = !features.speculative;
}

// The request body from the settings; a problem the user can fix here is thrown as an Error.
function requestBody() {
  const body = {model: props ? props.model : undefined, messages: [], stream: true,
                stream_options: {include_usage: true}};
  const system = $("system").value.trim();
  if (system) body.messages.push({role: "system", content: system});
  body.messages.push(...history);
  for (const name of SAMPLING) {
    const raw = $(name).value.trim();
    if (raw === "") continue;
    const value = Number(raw);
    if (!Number.isFinite(value)) throw new Error(name + " must be a number");
    body[name] = INTEGERS.has(name) ? Math.trunc(value) : value;
  }
  const kind = $("format-kind").value;
  const spec = $("format-spec").value;
  if (kind === "json_schema") {
    let schema;
    try { schema = JSON.parse(spec); } catch (e) { throw new Error("the JSON schema is not valid JSON: " + e.message); }
    body.response_format = {type: "json_schema", json_schema: {name: "schema", schema: schema}};
  } else if (kind === "json_object") {
    body.response_format = {type: "json_object"};
  } else if (kind === "regex") {
    body.structured_outputs = {regex: spec};
  } else if (kind === "tools") {
    let tools;
    try { tools = JSON.parse(spec); } catch (e) { throw new Error("the tools are not valid JSON: " + e.message); }
    body.tools = tools;
    body.tool_choice = $("tool-choice").value;
  }
  if ($("logprobs").checked) { body.logprobs = true; body.top_logprobs = 5; }
  if (!$("jump-forward-box").hidden) body.jump_forward = $("jump_forward").checked;
  if (!$("speculative-box").hidden && !$("speculative").checked) body.speculative = false;
  return body;
}

// A collapsed block of the answer (its reasoning, its tool calls), made before the content on first use.
function block(div, cls, title) {
  let details = div.querySelector("details." + cls);
  if (!details) {
    details = document.createElement("details");
    details.className = cls;
    const summary = document.createElement("summary");
    summary.textContent = title;
    details.append(summary);
    div.querySelector(".content").before(details);
  }
  return details;
}

// The tool calls so far, one line each: name(arguments), in the block's summary by name.
function showCalls(div, calls) {
  const details = block(div, "tool-calls", "");
  details.querySelector("summary").textContent = "tool calls: " + calls.map((c) => c.function.name).join(", ");
  for (const [i, call] of calls.entries()) {
    let line = details.querySelectorAll(".call")[i];
    if (!line) {
      line = document.createElement("span");
      line.className = "call";
      details.append(line);
    }
    line.textContent = call.function.name + "(" + call.function.arguments + ")";
  }
}

function tokenSpan(item) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = item.token;
  const lines = [item.token + "  logprob " + item.logprob.toFixed(3)];
  for (const alt of item.top_logprobs || []) lines.push(JSON.stringify(alt.token) + "  " + alt.logprob.toFixed(3));
  span.setAttribute("title", lines.join("\n"));
  return span;
}

async function send(text) {
  const user = {role: "user", content: text};
  let body;
  try {
    history.push(user);
    body = requestBody();
  } catch (e) {
    history.pop();
    note(bubble("system", "Not sent"), "error", e.message);
    return;
  }
  bubble("user", text);
  const div = bubble("assistant", "");
  div.dataset.state = "running";
  const content = div.querySelector(".content");
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let firstToken = null, finish = null, usage = null, answer = "", failure = null;
  const calls = [];  // tool calls, joined from their streamed pieces by index
  try {
    const resp = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), body: JSON.stringify(body),
                                                      signal: controller.signal});
    if (!resp.ok) throw new Error(await explain(resp));
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            const delta = choice.delta || {};
            if (delta.reasoning_content) {
              if (firstToken === null) firstToken = performance.now();
              block(div, "reasoning", "reasoning").append(document.createTextNode(delta.reasoning_content));
            }
            for (const piece of delta.tool_calls || []) {
              if (firstToken === null) firstToken = performance.now();
              if (!calls[piece.index]) calls[piece.index] = {id: piece.id, type: "function",
                                                              function: {name: "", arguments: ""}};
              const fn = piece.function || {};
              if (fn.name) calls[piece.index].function.name = fn.name;
              calls[piece.index].function.arguments += fn.arguments || "";
              showCalls(div, calls);
            }
            const piece = delta.content || "";
            if (piece) {
              if (firstToken === null) firstToken = performance.now();
              answer += piece;
              const tokens = choice.logprobs && choice.logprobs.content;
              if (tokens && tokens.length) {
                for (const item of tokens) content.append(tokenSpan(item));
              } else {
                content.append(document.createTextNode(piece));
              }
              div.scrollIntoView({block: "end"});
            }
            if (choice.finish_reason) finish = choice.finish_reason;
          }
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else if (e instanceof TypeError) failure = "the server cannot be reached (is logitproc serve still running?)";
    else failure = e.message;
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
  const ended = performance.now();
  if (failure !== null) {
    note(div, "error", failure);
    div.dataset.state = "error";
    if (!answer) history.pop();  // the question was not answered: it is not part of the conversation
  }
  if (calls.length) history.push({role: "assistant", content: answer, tool_calls: calls});
  else if (answer) history.push({role: "assistant", content: answer});
  if (failure === null) div.dataset.state = finish || "done";
  const parts = [];
  if (finish) parts.push("finish: " + finish);
  if (firstToken !== null) parts.push("first token " + ((firstToken - started) / 1000).toFixed(2) + " s");
  const generated = usage ? usage.completion_tokens : null;
  if (generated) {
    parts.push(generated + " tokens");
    if (generated > 1 && firstToken !== null && ended > firstToken) {
      parts.push(((generated - 1) / ((ended - firstToken) / 1000)).toFixed(1) + " tok/s");
    }
  }
  if (parts.length) note(div, "meta", parts.join(" · "));
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("new-chat").addEventListener("click", () => {
  if (controller) controller.abort();
  history.length = 0;
  $("messages").replaceChildren();
  $("prompt").focus();
});
$("format-kind").addEventListener("change", () => {
  const kind = $("format-kind").value;
  $("format-spec").hidden = kind === "text" || kind === "json_object";
  $("tool-choice-box").hidden = kind !== "tools";
  $("format-spec").placeholder = kind === "regex" ? "[A-Z][a-z]+ is the capital of [A-Z][a-z]+\\."
    : kind === "tools" ? '[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", '
      + '"properties": {"city": {"type": "string"}}, "required": ["city"]}}}]'
    : '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}';
});
$("api-key").value = sessionStorage.getItem("logitproc-api-key") || "";
$("api-key").addEventListener("change", () => {
  sessionStorage.setItem("logitproc-api-key", $("api-key").value.trim());
  loadProps();
});
loadProps();
