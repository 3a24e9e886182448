// A multi-agent episode's graph, drawn as SVG: one lane per role (in the order of the roles' first
// calls), one node per call (left to right in the order the calls completed), an edge from the call
// each one follows: turn (solid), fork (a sub-agent's first call, dashed) or compaction (a new
// context, dotted). A node's fill says what sampled it (legend); a ring marks a trained call.
"use strict";

function samplerLabel(s) {
  if (s === "policy:") return "default policy";
  if (s === "frozen") return "frozen base";
  return s;
}

function samplerColours(nodes) {
  const out = new Map();
  let k = 0;
  for (const n of nodes) {
    if (out.has(n.sampler)) continue;
    if (n.sampler === "frozen") out.set(n.sampler, "#9aa3ad");
    else if (n.sampler.startsWith("endpoint:")) out.set(n.sampler, "#ffffff");
    else out.set(n.sampler, PALETTE[k++ % PALETTE.length]);
  }
  return out;
}

// draws into `box`; onPick(node) is called when a node is clicked (or chosen with Enter)
function drawGraph(box, graph, onPick) {
  const LANE = 58, COL = 48, L = 150, T = 12, R = 24, RAD = 13;
  const lane = new Map(graph.roles.map((r, i) => [r, i]));
  const order = new Map(graph.nodes.map((n, i) => [n.id, i]));
  const byId = new Map(graph.nodes.map((n) => [n.id, n]));
  // as wide as its card at least, so the lanes run across it
  const W = Math.max(L + Math.max(1, graph.nodes.length) * COL + R, box.clientWidth - 26);
  const H = 2 * T + graph.roles.length * LANE;
  const at = (id) => [L + order.get(id) * COL + COL / 2, T + lane.get(byId.get(id).role) * LANE + LANE / 2];
  const colours = samplerColours(graph.nodes);
  const svg = svgEl("svg", {viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "graph", role: "img"});
  graph.roles.forEach((role, i) => {
    const y = T + i * LANE;
    svg.append(svgEl("rect", {x: 0, y, width: W, height: LANE, class: "lane" + (i % 2 ? " odd" : ""), "data-role": role}));
    const label = svgEl("text", {x: 8, y: y + LANE / 2 - 2, class: "lane-label"});
    label.textContent = role;
    const reward = graph.role_rewards[role];
    const sub = svgEl("text", {x: 8, y: y + LANE / 2 + 12, class: "lane-sub"});
    sub.textContent = reward === undefined ? "" : `reward ${fmt(reward)}`;
    svg.append(label, sub);
  });
  for (const [a, b, kind] of graph.edges) {
    const [x1, y1] = at(a), [x2, y2] = at(b);
    const mx = (x1 + x2) / 2;
    const d = y1 === y2 ? `M${x1} ${y1}L${x2} ${y2}` : `M${x1} ${y1}C${mx} ${y1} ${mx} ${y2} ${x2} ${y2}`;
    svg.append(svgEl("path", {d, class: "edge " + kind, "data-edge": `${a}-${b}`, "data-kind": kind}));
  }
  for (const n of graph.nodes) {
    const [x, y] = at(n.id);
    const g = svgEl("g", {class: "node" + (n.trained ? " trained" : "") + (n.session ? "" : " unrecorded"),
                          "data-node": n.id, tabindex: 0, role: "button"});
    const title = svgEl("title", {});
    title.textContent = `call ${n.id} · ${n.role} · ${samplerLabel(n.sampler)} · ${n.completion_tokens} tokens` +
      (n.versions.length ? ` · versions ${n.versions.join(", ")}` : "") + (n.trained ? " · trained" : "");
    const label = svgEl("text", {x, y: y + 4, "text-anchor": "middle"});
    label.textContent = String(n.id);
    g.append(title, svgEl("circle", {cx: x, cy: y, r: RAD, fill: colours.get(n.sampler)}), label);
    g.addEventListener("click", () => onPick(n));
    g.addEventListener("keydown", (ev) => { if (ev.key === "Enter") onPick(n); });
    svg.append(g);
  }
  const legend = el("div", {class: "legend"},
    ...[...colours].map(([s, c]) => el("span", {class: "key"}, el("i", {class: "swatch", "data-fill": c}), samplerLabel(s))),
    ...["turn", "fork", "compaction"].map((k) => el("span", {class: "key"}, el("i", {class: "edgekey " + k}), k)),
    el("span", {class: "key"}, el("i", {class: "ringkey"}), "trained"));
  // the swatches' colours through the DOM, not a style attribute (the page's CSP allows no inline style)
  legend.querySelectorAll("[data-fill]").forEach((i) => { i.style.background = i.dataset.fill; });
  box.replaceChildren(el("div", {class: "graphscroll"}, svg), legend);
}
