// The episode browser: the filters live in the page's query (a plain GET form), the rows come
// from /view/api/episodes, newest first, a page at a time. The first page refreshes itself.
"use strict";

const PAGE = 50;
const REFRESH_MS = 5000;
const FIELDS = ["env", "reward_min", "reward_max", "version_min", "version_max", "error_kind", "truncation", "role", "policy"];

function query() {
  const q = new URLSearchParams(location.search);
  const out = new URLSearchParams();
  for (const f of FIELDS) if (q.get(f)) out.set(f, q.get(f));
  out.set("offset", String(Math.max(0, parseInt(q.get("offset") || "0", 10) || 0)));
  out.set("limit", String(PAGE));
  return out;
}

function fillSelect(id, values, fixed, label) {
  const sel = document.getElementById(id);
  // a refresh keeps what the person has chosen but not yet applied
  const want = sel.options.length ? sel.value : (new URLSearchParams(location.search).get(id) || "");
  const opts = [...fixed, ...values.map((v) => [v, label ? label(v) : v])];
  if (want && !opts.some(([v]) => v === want)) opts.push([want, want]);
  sel.replaceChildren(...opts.map(([v, label]) => el("option", {value: v, selected: v === want}, label)));
}

function fillInputs() {
  const q = new URLSearchParams(location.search);
  for (const f of ["reward_min", "reward_max", "version_min", "version_max"]) {
    document.getElementById(f).value = q.get(f) || "";
  }
}

function versions(r) {
  if (r.version_min === null || r.version_min === undefined) return "–";
  return r.version_min === r.version_max ? String(r.version_min) : `${r.version_min}–${r.version_max}`;
}

function row(r) {
  const link = el("a", {href: VIEW + "/episode/" + encodeURIComponent(r.episode_id)}, r.episode_id.slice(0, 12));
  const trunc = r.truncated ? (r.truncation || "yes") : "";
  return el("tr", {class: r.error_kind ? "failed" : ""},
    el("td", {}, link), el("td", {}, fmtTime(r.time)), el("td", {}, r.env), el("td", {}, r.task_id),
    el("td", {class: "num"}, fmt(r.reward)), el("td", {class: "num"}, r.turns), el("td", {class: "num"}, r.tool_calls ?? "–"),
    el("td", {}, versions(r)), el("td", {}, (r.roles || []).join(", ")), el("td", {}, trunc), el("td", {title: r.error || ""}, r.error_kind || ""),
    el("td", {class: "num"}, r.completion_tokens), el("td", {class: "num"}, fmt(r.seconds, 1)));
}

function pager(total, offset) {
  const box = document.getElementById("pager");
  const q = new URLSearchParams(location.search);
  const link = (off, label) => { q.set("offset", String(off)); return el("a", {href: "?" + q.toString()}, label); };
  const end = Math.min(total, offset + PAGE);
  box.replaceChildren(
    offset > 0 ? link(Math.max(0, offset - PAGE), "← newer") : el("span", {}, ""),
    el("span", {class: "count", id: "match-count"}, total ? `${offset + 1}–${end} of ${total} matching` : "no matching episodes"),
    end < total ? link(offset + PAGE, "older →") : el("span", {}, ""));
}

async function load() {
  const q = query();
  try {
    const got = await api("/episodes?" + q.toString());
    fillSelect("env", got.facets.envs, [["", "any"]]);
    fillSelect("error_kind", got.facets.error_kinds, [["", "any"], ["none", "no error"], ["any", "any error"]]);
    fillSelect("truncation", got.facets.truncations, [["", "any"], ["no", "not truncated"], ["yes", "truncated"]]);
    // a multi-agent run's roles, and what sampled them ("policy:" is the default policy)
    fillSelect("role", got.facets.roles, [["", "any"]]);
    fillSelect("policy", got.facets.policies, [["", "any"]], (v) => (v === "policy:" ? "default policy" : v));
    document.getElementById("rows").replaceChildren(...got.rows.map(row));
    pager(got.total, got.offset);
    setStatus(`${got.indexed} episodes indexed`, true);
  } catch (e) {
    setStatus(e.message, false);
  }
  if (q.get("offset") === "0") setTimeout(load, REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", () => { fillInputs(); load(); });
