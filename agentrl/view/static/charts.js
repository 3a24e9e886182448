// Line charts as SVG, drawn from columns of numbers. No library: axes, ticks, lines, a legend
// and a hover read-out. A chart's container gets data-points = how many points it plots.
"use strict";

function niceStep(span, target) {
  const raw = span / Math.max(1, target);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 2.5, 5, 10]) if (raw <= m * mag) return m * mag;
  return 10 * mag;
}

function ticks(lo, hi, target) {
  if (!(hi > lo)) return [lo];
  const step = niceStep(hi - lo, target);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  return out;
}

function tickLabel(v, step) {
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(1);
  const digits = Math.max(0, Math.min(6, -Math.floor(Math.log10(step || 1)) + (step < 1 ? 1 : 0)));
  return v.toFixed(step >= 1 ? 0 : digits);
}

// spec: {title, xLabel, yLabel, yMin, yMax, ref, empty, series: [{name, xs, ys, dash, dots, scatter}]}
// (scatter: faint points without a line)
function drawChart(box, spec) {
  const W = 460, H = 230, L = 54, R = 12, T = 10, B = 36;
  const series = spec.series.map((s) => {
    const pts = [];
    for (let i = 0; i < s.xs.length; i++) {
      const x = s.xs[i], y = s.ys[i];
      if (typeof x === "number" && typeof y === "number" && isFinite(x) && isFinite(y)) pts.push([x, y]);
    }
    return Object.assign({}, s, {pts});
  }).filter((s) => s.pts.length);
  const count = series.reduce((n, s) => n + s.pts.length, 0);
  box.dataset.points = String(count);
  box.replaceChildren(el("h3", {}, spec.title));
  if (!count) {
    box.append(el("div", {class: "nodata"}, spec.empty || "no data yet"));
    return;
  }
  const all = series.flatMap((s) => s.pts);
  let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
  let y0 = spec.yMin !== undefined ? spec.yMin : Math.min(...all.map((p) => p[1]));
  let y1 = spec.yMax !== undefined ? spec.yMax : Math.max(...all.map((p) => p[1]));
  if (spec.ref !== undefined) { y0 = Math.min(y0, spec.ref); y1 = Math.max(y1, spec.ref); }
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) {  // a flat series: a band around it (above it when the floor is fixed)
    const d = Math.abs(y0) * 0.1 || 1;
    if (spec.yMin === undefined) y0 -= d;
    y1 += d;
  }
  const pad = (y1 - y0) * 0.05;
  if (spec.yMin === undefined) y0 -= pad;
  if (spec.yMax === undefined) y1 += pad;
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const svg = svgEl("svg", {viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img"});
  const xt = ticks(x0, x1, 6), yt = ticks(y0, y1, 5);
  const xs = niceStep(x1 - x0, 6), ys = niceStep(y1 - y0, 5);
  for (const v of yt) {
    svg.append(svgEl("line", {x1: L, x2: W - R, y1: sy(v), y2: sy(v), class: "grid"}));
    const t = svgEl("text", {x: L - 6, y: sy(v) + 4, class: "tick", "text-anchor": "end"});
    t.textContent = tickLabel(v, ys);
    svg.append(t);
  }
  for (const v of xt) {
    const t = svgEl("text", {x: sx(v), y: H - B + 16, class: "tick", "text-anchor": "middle"});
    t.textContent = tickLabel(v, xs);
    svg.append(t);
  }
  const xl = svgEl("text", {x: (L + W - R) / 2, y: H - 4, class: "axis", "text-anchor": "middle"});
  xl.textContent = spec.xLabel || "";
  const yl = svgEl("text", {x: 12, y: (T + H - B) / 2, class: "axis", "text-anchor": "middle",
                            transform: `rotate(-90 12 ${(T + H - B) / 2})`});
  yl.textContent = spec.yLabel || "";
  svg.append(xl, yl, svgEl("rect", {x: L, y: T, width: W - L - R, height: H - T - B, class: "frame"}));
  if (spec.ref !== undefined) svg.append(svgEl("line", {x1: L, x2: W - R, y1: sy(spec.ref), y2: sy(spec.ref), class: "ref"}));
  series.forEach((s, j) => {
    const color = PALETTE[j % PALETTE.length];
    if (!s.scatter) {
      const d = s.pts.map((p, i) => (i ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1)).join("");
      svg.append(svgEl("path", {d, stroke: color, class: "line" + (s.dash ? " dash" : "")}));
    }
    if (s.scatter || s.dots || s.pts.length < 40) {
      for (const p of s.pts) {
        svg.append(svgEl("circle", {cx: sx(p[0]), cy: sy(p[1]), r: s.scatter ? 1.8 : 2.2, fill: color,
                                    "fill-opacity": s.scatter ? 0.25 : 1}));
      }
    }
  });
  const cursor = svgEl("line", {y1: T, y2: H - B, class: "cursor", visibility: "hidden"});
  svg.append(cursor);
  const readout = el("div", {class: "readout"}, "\u00a0");
  svg.addEventListener("mousemove", (ev) => {
    const r = svg.getBoundingClientRect();
    const x = x0 + ((ev.clientX - r.left) * W / r.width - L) / (W - L - R) * (x1 - x0);
    const parts = [];
    let at = null;
    for (const s of series) {
      let best = s.pts[0];
      for (const p of s.pts) if (Math.abs(p[0] - x) < Math.abs(best[0] - x)) best = p;
      at = at === null ? best[0] : at;
      parts.push(`${s.name} ${fmt(best[1])}`);
    }
    cursor.setAttribute("x1", sx(at)); cursor.setAttribute("x2", sx(at));
    cursor.setAttribute("visibility", "visible");
    readout.textContent = `${spec.xLabel} ${fmt(at)}: ` + parts.join(" · ");
  });
  svg.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); readout.textContent = "\u00a0"; });
  const legend = el("div", {class: "legend"});
  series.forEach((s, j) => {
    legend.append(el("span", {class: "key"}, el("i", {class: "swatch c" + (j % PALETTE.length)}), s.name));
  });
  box.append(svg, legend, readout);
}
