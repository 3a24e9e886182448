// The run page: polls /view/api/series and redraws the charts when a log has grown, without a
// reload. Charts whose data a run does not write (no learner here, no sandbox) say so.
"use strict";

const POLL_MS = 2000;
const revs = {learner: -1, serve: -1, episodes: -1};
const data = {learner: null, serve: null, episodes: null};
let t0 = null;

function col(src, key) { return (data[src] && data[src].cols[key]) || []; }
function minutes(src) { return col(src, "time").map((t) => (t === null || t0 === null ? null : (t - t0) / 60)); }
function keysOf(src, test) { return Object.keys((data[src] && data[src].cols) || {}).filter(test).sort(); }

// finite differences of a cumulative counter, per `per` seconds; a counter that went down
// (serve restarted) starts again instead of drawing a negative rate
function rate(xs, counts, per) {
  const ox = [], oy = [];
  let prev = null;
  for (let i = 0; i < xs.length; i++) {
    const x = xs[i], c = counts[i];
    if (x === null || c === null) continue;
    if (prev && x > prev[0] && c >= prev[1]) {
      ox.push((x + prev[0]) / 2);
      oy.push((c - prev[1]) / ((x - prev[0]) * 60) * per);
    }
    prev = [x, c];
  }
  return [ox, oy];
}

// trailing mean over the last `window` values (shorter at the start)
function movingAverage(ys, window) {
  const out = [];
  let total = 0, n = 0;
  for (let i = 0; i < ys.length; i++) {
    total += ys[i]; n++;
    if (i >= window) { total -= ys[i - window]; n--; }
    out.push(total / n);
  }
  return out;
}

function learnerSeries(keys) {
  const steps = col("learner", "step");
  return keys.map((k) => ({name: k, xs: steps, ys: col("learner", k)}));
}

function charts() {
  const serveMin = minutes("serve");
  const [tokX, tokY] = rate(serveMin, col("serve", "router.completion_tokens"), 1);
  const [rateX, rateY] = rate(serveMin, col("serve", "rollout.episodes"), 60);
  // the weights' spread (mismatch/ratio_std) is measured on every step, the is/* weights under tis or mis
  const isKeys = keysOf("learner", (k) => (k.startsWith("is/") && !k.includes("frac")) || k === "mismatch/ratio_std");
  const fracKeys = keysOf("learner", (k) => k.startsWith("is/") && k.includes("frac"));
  const klKeys = keysOf("learner", (k) => k.startsWith("mismatch/kl") || k === "mismatch/abs_log_ratio");
  const epBin = data.episodes ? data.episodes.bin : 1;
  const epX = col("episodes", "episode"), epR = col("episodes", "reward");
  const epWin = Math.max(5, Math.floor(epR.length / 20));
  const specs = {
    "reward": {title: "Reward per learner step", xLabel: "step", yLabel: "reward",
               series: learnerSeries(["reward_mean"]), empty: "no learner steps yet"},
    "episode-reward": {title: "Reward per episode" + (epBin > 1 ? ` (means of ${epBin})` : ""), xLabel: "episode",
                       yLabel: "reward", empty: "no finished episodes yet",
                       series: [{name: epBin > 1 ? "bin mean" : "episode", xs: epX, ys: epR, scatter: true},
                                {name: `moving average (${epWin})`, xs: epX, ys: movingAverage(epR, epWin)}]},
    "staleness": {title: "Staleness (versions behind)", xLabel: "step", yLabel: "versions", yMin: 0,
                  series: learnerSeries(["staleness_mean", "staleness_max"]), empty: "no learner steps yet"},
    "importance": {title: "Importance weights π_old / μ", xLabel: "step", yLabel: "weight", ref: 1,
                   series: learnerSeries(isKeys), empty: "no importance-weight statistics yet"},
    "clipped": {title: "Share of tokens clipped or masked", xLabel: "step", yLabel: "fraction", yMin: 0,
                series: learnerSeries(fracKeys), empty: "no clipping statistics yet"},
    "mismatch": {title: "Train/inference mismatch KL", xLabel: "step", yLabel: "nats per token",
                 series: learnerSeries(klKeys), empty: "no mismatch statistics yet"},
    "throughput": {title: "Tokens per second", xLabel: "minutes", yLabel: "tokens/s", yMin: 0,
                   series: [{name: "learner: trained", xs: minutes("learner"), ys: col("learner", "tokens_per_s")},
                            {name: "serve: generated", xs: tokX, ys: tokY}], empty: "no token counts yet"},
    "episodes-rate": {title: "Finished episodes per minute", xLabel: "minutes", yLabel: "episodes/min", yMin: 0,
                      series: [{name: "episodes/min", xs: rateX, ys: rateY}], empty: "no serve metrics yet"},
    "idle": {title: "Learner idle fraction (waiting for batches)", xLabel: "step", yLabel: "fraction",
             yMin: 0, yMax: 1, series: learnerSeries(["idle_fraction"]), empty: "no learner steps yet"},
    "sandbox": {title: "Sandbox latency", xLabel: "minutes", yLabel: "ms", yMin: 0,
                series: [["sandbox.exec_p50_ms", "exec p50"], ["sandbox.exec_p99_ms", "exec p99"],
                         ["sandbox.acquire_p50_ms", "acquire p50"], ["sandbox.acquire_p99_ms", "acquire p99"]]
                  .map(([k, name]) => ({name, xs: serveMin, ys: col("serve", k), dash: k.includes("acquire")})),
                empty: "no sandbox metrics (this run has no sandbox, or serve has not reported yet)"},
    "rollout": {title: "Rollout and buffer", xLabel: "minutes", yLabel: "count", yMin: 0,
                series: [["rollout.in_flight", "episodes in flight"], ["buffer.depth", "buffer depth"],
                         ["version", "policy version"], ["rollout.concurrency.limit", "concurrency limit"]].map(([k, name]) => ({name, xs: serveMin, ys: col("serve", k)})),
                empty: "no serve metrics yet"},
  };
  // a multi-agent run: each role's reward, from its episodes' role rewards (episodes.jsonl)
  const roleKeys = keysOf("episodes", (k) => k.startsWith("role_reward."));
  if (roleKeys.length) {
    specs["role-reward"] = {title: `Reward per role (moving average over ${epWin} points)`, xLabel: "episode",
      yLabel: "reward", empty: "no multi-agent episodes yet",
      series: roleKeys.map((k) => roleSeries(k.slice("role_reward.".length), epX, col("episodes", k), epWin))};
  }
  return specs;
}

// one role's points (bins without the role are skipped) and their moving average
function roleSeries(role, xs, ys, window) {
  const px = [], py = [];
  ys.forEach((y, i) => { if (y !== null) { px.push(xs[i]); py.push(y); } });
  return {name: role, xs: px, ys: movingAverage(py, window)};
}

function last(src, key) {
  const c = col(src, key);
  for (let i = c.length - 1; i >= 0; i--) if (c[i] !== null) return c[i];
  return null;
}

function summary() {
  const box = document.getElementById("summary-live");
  const items = [
    ["learner steps", data.learner ? data.learner.rows : 0],
    ["last reward (step)", fmt(last("learner", "reward_mean"))],
    ["policy version", fmt(last("serve", "version") ?? last("learner", "version"))],
    ["episodes", data.episodes ? data.episodes.rows : 0],
    ["failed episodes", fmt(last("serve", "rollout.failed"))],
    ["in flight", fmt(last("serve", "rollout.in_flight"))],
  ];
  box.replaceChildren(...items.map(([k, v]) => el("div", {class: "stat"}, el("span", {class: "k"}, k), el("span", {class: "v"}, v))));
}

function render() {
  const grid = document.getElementById("charts");
  for (const [id, spec] of Object.entries(charts())) {
    let box = document.getElementById("chart-" + id);
    if (!box) { box = el("section", {class: "card chartbox", id: "chart-" + id}); grid.append(box); }
    drawChart(box, spec);
  }
  summary();
}

async function poll() {
  try {
    const got = await api("/series?rev=" + [revs.learner, revs.serve, revs.episodes].join(","));
    let changed = false;
    for (const name of ["learner", "serve", "episodes"]) {
      revs[name] = got[name].rev;
      if (!got[name].unchanged) { data[name] = got[name]; changed = true; }
    }
    if (got.t0 !== null) t0 = got.t0;
    if (changed) render();
    setStatus("live · updated " + new Date().toLocaleTimeString(undefined, {hour12: false}), true);
  } catch (e) {
    setStatus(e.message, false);
  }
  setTimeout(poll, POLL_MS);
}

async function start() {
  try {
    const info = await api("/run");
    document.getElementById("run-name").textContent = info.name;
    document.title = "agentrl · " + info.name;
    const facts = [["model", info.model], ["environment", info.env], ["group size", info.group_size],
                   ["batch size", info.batch_size], ["staleness bound", info.max_staleness]];
    document.getElementById("summary-run").replaceChildren(...facts.filter(([, v]) => v !== null && v !== "" && v !== undefined)
      .map(([k, v]) => el("div", {class: "stat"}, el("span", {class: "k"}, k), el("span", {class: "v"}, v))));
  } catch (e) {
    setStatus(e.message, false);
  }
  render();
  poll();
}

document.addEventListener("DOMContentLoaded", start);
