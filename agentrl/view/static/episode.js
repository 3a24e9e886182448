// One episode: its line, its calls (new messages, tool outputs, replies, tool calls) and every
// sample token by token. Trained tokens (loss mask 1) are coloured by the policy version that
// sampled them; hovering a token shows its id, raw token, version and behaviour logprob.
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

function renderCalls(calls) {
  const box = document.getElementById("calls");
  box.replaceChildren(...calls.map((c) => {
    const head = `call ${c.index}` + (c.parent !== null ? ` (continues call ${c.parent})` : "") +
      ` · ${c.engine} · ${c.prompt_tokens} prompt tokens · ${fmt(c.latency_s, 2)} s`;
    const replies = c.choices.map((ch, i) => el("div", {class: "msg assistant reply"},
      el("div", {class: "role"}, `reply${c.choices.length > 1 ? " " + i : ""} · ${ch.tokens} tokens · versions ${ch.versions.join(", ")} · ${ch.finish_reason}`),
      ch.content ? el("pre", {}, ch.content) : null, ...toolCalls(ch.tool_calls)));
    return el("section", {class: "card call", id: "call-" + c.index}, el("h3", {}, head),
      ...c.new_messages.map(message), ...replies);
  }));
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
    if (starts.has(at)) frag.append(el("span", {class: "callmark"}, `call ${starts.get(at)} ▸`));
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

async function renderSample(summary) {
  const box = el("section", {class: "card sample", id: "sample-" + summary.index});
  document.getElementById("samples").append(box);
  box.append(el("h3", {}, `sample ${summary.index}: ${summary.tokens} tokens, ${summary.trained} trained ` +
    `(loss mask), ${summary.versions.length} version${summary.versions.length === 1 ? "" : "s"}, calls ${summary.calls.join(" → ")}`));
  const area = el("div", {class: "tokens"});
  const counts = new Map();
  let offset = 0;
  for (;;) {
    const page = await api(`/episode/${encodeURIComponent(episodeId)}/sample/${summary.index}?offset=${offset}`);
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

async function start() {
  document.getElementById("episode-id").textContent = episodeId;
  try {
    const got = await api("/episode/" + encodeURIComponent(episodeId));
    renderEpisode(got.episode);
    renderCalls(got.calls);
    for (const s of got.samples) await renderSample(s);
    document.body.dataset.ready = "1";
    setStatus(`${got.calls.length} calls, ${got.samples.length} sample${got.samples.length === 1 ? "" : "s"}`, true);
  } catch (e) {
    setStatus(e.message, false);
  }
}

document.addEventListener("DOMContentLoaded", start);
