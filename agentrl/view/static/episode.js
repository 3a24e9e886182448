// One episode: its line, its calls (new messages, tool outputs, replies, tool calls) and every
// sample token by token. Trained tokens (loss mask 1) are coloured by the policy version that
// sampled them; hovering a token shows its id, raw token, version and behaviour logprob. A
// multi-agent episode shows its graph (graph.js); a node opens its call from its role's session.
"use strict";

const episodeId = decodeURIComponent(location.pathname.split("/").pop());

function stat(k, v) { return el("div", {class: "stat"}, el("span", {class: "k"}, k), el("span", {class: "v"}, v)); }

function renderEpisode(ep) {
  const box = document.getElementById("episode-facts");
  if (!ep) {
    box.replaceChildren(el("p", {class: "note"}, "No line in episodes.jsonl: the episode is still being played (or the run stopped before it ended)."));
    return;
  }
  const vs = ep.versions || [];
  box.replaceChildren(stat("environment", ep.env), stat("task", ep.task_id), stat("reward", fmt(ep.reward)),
    stat("turns", ep.turns), stat("truncation", ep.truncated ? (ep.truncation || "yes") : "no"),
    stat("error kind", ep.error_kind || "none"), stat("versions", vs.length ? `${Math.min(...vs)}–${Math.max(...vs)}` : "–"),
    stat("completion tokens", ep.completion_tokens), stat("seconds", fmt(ep.seconds, 2)), stat("finished", fmtTime(ep.time)));
  if (ep.error) box.append(el("p", {class: "error"}, ep.error));
}

function toolCalls(calls) {
  return (calls || []).map((c) => el("div", {class: "toolcall"}, el("span", {class: "tag"}, "tool call"),
    el("code", {}, c.name), el("pre", {}, c.arguments)));
}

function message(m) {
  const label = m.role === "tool" ? "tool output" : m.role;
  return el("div", {class: "msg " + m.role}, el("div", {class: "role"}, label + (m.tool_call_id ? ` (${m.tool_call_id})` : "")),
    m.content ? el("pre", {}, m.content) : null, ...toolCalls(m.tool_calls));
}

function callCards(calls) {
  return calls.map((c) => {
    const head = `call ${c.index}` + (c.parent !== null ? ` (continues call ${c.parent})` : "") +
      ` · ${c.engine} · ${c.prompt_tokens} prompt tokens · ${fmt(c.latency_s, 2)} s`;
    const replies = c.choices.map((ch, i) => el("div", {class: "msg assistant reply"},
      el("div", {class: "role"}, `reply${c.choices.length > 1 ? " " + i : ""} · ${ch.tokens} tokens · versions ${ch.versions.join(", ")} · ${ch.finish_reason}`),
      ch.content ? el("pre", {}, ch.content) : null, ...toolCalls(ch.tool_calls)));
    return el("section", {class: "card call", id: "call-" + c.index}, el("h3", {}, head),
      ...c.new_messages.map(message), ...replies);
  });
}

function renderCalls(calls) {
  document.getElementById("calls").replaceChildren(...callCards(calls));
}

function versionClass(versions) {
  const order = new Map(versions.map((v, i) => [v, i]));
  return (v) => "v" + (order.get(v) % PALETTE.length);
}

function tooltipFor(page, i, box) {
  const tip = document.getElementById("tooltip");
  const text = page.text ? JSON.stringify(page.text[i]) : "";
  const raw = page.raw && page.raw[i] && page.raw[i] !== page.text[i] ? ` raw ${JSON.stringify(page.raw[i])}` : "";
  let line = `#${page.offset + i} · id ${page.ids[i]} ${text}${raw}`;
  if (page.mask[i]) {
    const lp = page.logprob[i];
    line += ` · trained · version ${page.version[i]} · logprob ${fmt(lp, 4)} (p ${fmt(Math.exp(lp), 3)})`;
  } else {
    line += " · prompt (not trained)";
  }
  tip.textContent = line;
  tip.hidden = false;
  box.dataset.hover = String(page.offset + i);
}

function renderTokens(area, page, summary) {
  const cls = versionClass(summary.versions);
  const special = new Set(page.special);
  const starts = new Map(page.spans.map((s) => [s.start, s.call]));
  const frag = document.createDocumentFragment();
  for (let i = 0; i < page.ids.length; i++) {
    const at = page.offset + i;
    if (starts.has(at)) frag.append(el("span", {class: "callmark", "data-call": starts.get(at)}, `call ${starts.get(at)} ▸`));
    let c = "tok " + (page.mask[i] ? "t " + cls(page.version[i]) : "p");
    if (special.has(i)) c += " sp";
    const text = page.text ? page.text[i] : `[${page.ids[i]}]`;
    frag.append(el("span", {class: c, "data-i": i, "data-v": page.mask[i] ? page.version[i] : null}, text));
  }
  area.append(frag);
  area.addEventListener("mouseover", (ev) => {
    const t = ev.target.closest(".tok");
    if (t && t.parentNode === area) tooltipFor(page, Number(t.dataset.i), area);
  });
}

function legend(summary, counts) {
  const cls = versionClass(summary.versions);
  return el("div", {class: "legend versions"}, el("span", {class: "key"}, el("i", {class: "swatch prompt"}), "prompt (not trained)"),
    ...summary.versions.map((v) => el("span", {class: "key ver", "data-v": v}, el("i", {class: "swatch " + cls(v)}),
      `version ${v}: ${counts.get(v) || 0} tokens`)));
}

// one sample of session `sid` (the episode's own, or a role's), token by token, appended to `parent`
async function renderSample(summary, sid, parent, boxId) {
  const box = el("section", {class: "card sample", id: boxId});
  parent.append(box);
  box.append(el("h3", {}, `sample ${summary.index}: ${summary.tokens} tokens, ${summary.trained} trained ` +
    `(loss mask), ${summary.versions.length} version${summary.versions.length === 1 ? "" : "s"}, calls ${summary.calls.join(" → ")}`));
  const area = el("div", {class: "tokens"});
  const counts = new Map();
  let offset = 0;
  for (;;) {
    const page = await api(`/episode/${encodeURIComponent(sid)}/sample/${summary.index}?offset=${offset}`);
    if (page.tokenizer_error && !box.querySelector(".note")) box.append(el("p", {class: "note"}, page.tokenizer_error));
    page.mask.forEach((m, i) => { if (m) counts.set(page.version[i], (counts.get(page.version[i]) || 0) + 1); });
    const sub = el("span", {class: "page"});
    area.append(sub);
    renderTokens(sub, page, summary);
    offset = page.offset + page.ids.length;
    if (offset >= page.total || !page.ids.length) break;
  }
  box.append(legend(summary, counts), area);
  box.dataset.loaded = "1";
}

const roleSessions = new Map();  // session id -> its /episode answer (calls and samples)

// a node of the graph: its call's card and the sample (of its role's session) that holds it
async function openNode(node, graph) {
  const box = document.getElementById("node-detail");
  box.dataset.loaded = "";
  box.dataset.node = String(node.id);
  document.querySelectorAll("svg.graph .node").forEach((g) => g.classList.toggle("picked", g.dataset.node === String(node.id)));
  const head = el("h3", {}, `call ${node.id} · ${node.role} · ${samplerLabel(node.sampler)} · ` +
    `${node.completion_tokens} tokens` + (node.versions.length ? ` · versions ${node.versions.join(", ")}` : "") +
    (node.trained ? " · trained" : " · not trained"));
  box.replaceChildren(head);
  if (!node.session || !graph.sessions[node.session]) {
    box.append(el("p", {class: "note"}, node.session
      ? `sessions/${node.session}.jsonl is not in the run directory: this call's tokens are not available.`
      : "A call to an external endpoint: it was not recorded in a router session, so there are no tokens to show."));
    box.dataset.loaded = "1";
    return;
  }
  try {
    let got = roleSessions.get(node.session);
    if (!got) {
      got = await api("/episode/" + encodeURIComponent(node.session));
      roleSessions.set(node.session, got);
    }
    if (box.dataset.node !== String(node.id)) return;  // another node was picked meanwhile
    const sample = got.samples.find((s) => s.calls.includes(node.call));
    box.append(el("p", {class: "note"}, `session ${node.session}, call ${node.call}` +
      (sample ? `: in sample ${sample.index} of the session (calls ${sample.calls.join(" → ")})` : "")));
    if (sample) await renderSample(sample, node.session, box, "node-sample");
    // where this call's tokens start, in a sample of several calls (a role's turns)
    const mark = box.querySelector(`#node-sample .callmark[data-call="${node.call}"]`);
    if (mark) mark.classList.add("here");
    if (box.dataset.node !== String(node.id)) return;
    box.append(...callCards(got.calls.filter((c) => c.index === node.call)));
    box.dataset.loaded = "1";
  } catch (e) {
    box.append(el("p", {class: "error"}, e.message));
    box.dataset.loaded = "1";
  }
}

function renderGraph(graph) {
  document.getElementById("graph-section").hidden = false;
  // the hover read-out above the node's tokens, not below the (empty) episode samples
  document.getElementById("graph").after(document.getElementById("tooltip"));
  drawGraph(document.getElementById("graph"), graph, (n) => openNode(n, graph));
}

async function start() {
  document.getElementById("episode-id").textContent = episodeId;
  try {
    const got = await api("/episode/" + encodeURIComponent(episodeId));
    renderEpisode(got.episode);
    if (got.graph) renderGraph(got.graph);
    renderCalls(got.calls);
    if (got.graph && !got.calls.length) {
      const note = "A multi-agent episode: its calls are in its roles' sessions. Pick a node of the graph.";
      document.getElementById("samples").append(el("p", {class: "note"}, note));
      document.getElementById("calls").append(el("p", {class: "note"}, note));
    }
    const samples = document.getElementById("samples");
    for (const s of got.samples) await renderSample(s, episodeId, samples, "sample-" + s.index);
    document.body.dataset.ready = "1";
    const what = got.graph ? `${got.graph.nodes.length} calls by ${got.graph.roles.length} roles` :
      `${got.calls.length} calls, ${got.samples.length} sample${got.samples.length === 1 ? "" : "s"}`;
    setStatus(what, true);
  } catch (e) {
    setStatus(e.message, false);
  }
}

document.addEventListener("DOMContentLoaded", start);
