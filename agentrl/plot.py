"""``agentrl plot RUN_DIR``: PNG charts of a run from its JSONL logs, readable at a glance.

Inputs (each optional; charts whose data is missing are skipped):

- ``learner.jsonl``: one row per optimizer step (reward, staleness, ``is/*`` and ``mismatch/*``
  statistics, tokens/s, idle fraction, wait/train/sync seconds);
- ``episodes.jsonl``: one row per finished episode (reward, time, error, truncated);
- ``serve_metrics.jsonl``: serve's ``status()`` every few seconds (router counters, rollout
  counters, buffer, sandbox pool latencies).

Figures are drawn with matplotlib's object API on the Agg canvas (no pyplot, no display, no global
state), so plotting works on headless machines and from any thread. A log whose last line is cut
short (the run is still writing) is read up to that line.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#7f7f7f"]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file; a missing file is empty, unparsable lines (a torn tail) are skipped."""
    if not path.exists():
        return []
    rows: list[dict[str, Any]] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except ValueError:
                log.warning("%s:%d is not JSON; skipped", path, n)
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


@dataclass
class RunLogs:
    """The three logs of one run directory, plus the earliest timestamp (the time axis' zero)."""

    run_dir: Path
    learner: list[dict[str, Any]] = field(default_factory=list)
    episodes: list[dict[str, Any]] = field(default_factory=list)
    serve: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def read(cls, run_dir: str | Path) -> RunLogs:
        d = Path(run_dir)
        return cls(d, read_jsonl(d / "learner.jsonl"), read_jsonl(d / "episodes.jsonl"),
                   read_jsonl(d / "serve_metrics.jsonl"))

    @property
    def t0(self) -> float:
        times = [r["time"] for rows in (self.learner, self.episodes, self.serve) for r in rows[:1]
                 if isinstance(r.get("time"), int | float)]
        return min(times, default=0.0)

    def minutes(self, rows: Iterable[dict[str, Any]]) -> list[float]:
        t0 = self.t0
        return [(r.get("time", t0) - t0) / 60.0 for r in rows]


# -- small helpers ---------------------------------------------------------------------------------

def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (shorter at the start), same length as input."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _get(row: dict[str, Any], key: str) -> Any:
    """``row[key]``, dotted keys reaching into nested dicts; None where a part is missing."""
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _num(row: dict[str, Any], key: str) -> float | None:
    """``row[key]`` as a float; dotted keys reach into nested dicts (``sandbox.exec_p50_ms``)."""
    node = _get(row, key)
    if isinstance(node, bool) or not isinstance(node, int | float):
        return None
    return float(node)


def _steps(rows: list[dict[str, Any]]) -> list[float]:
    """The learner step of each row (its position where a row lacks one)."""
    return [r.get("step", i + 1) for i, r in enumerate(rows)]


def _have(rows: list[Any], axes: list[Any], what: str) -> bool:
    """Whether there are rows to chart; if not, every axis says it has no ``what``."""
    if not rows:
        for ax in axes:
            _no_data(ax, what)
    return bool(rows)


def _series(rows: list[dict[str, Any]], key: str, xs: list[float]) -> tuple[list[float], list[float]]:
    pairs = [(x, v) for x, r in zip(xs, rows, strict=True) if (v := _num(r, key)) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _rates(xs_min: list[float], counts: list[float | None], per: float) -> tuple[list[float], list[float]]:
    """Finite differences of a cumulative counter: (midpoint minutes, increase per ``per`` seconds).

    A counter that goes down (serve restarted) restarts the series instead of plotting a negative rate.
    """
    out_x, out_y = [], []
    prev: tuple[float, float] | None = None
    for x, c in zip(xs_min, counts, strict=True):
        if c is None:
            continue
        if prev is not None and x > prev[0] and c >= prev[1]:
            out_x.append((x + prev[0]) / 2)
            out_y.append((c - prev[1]) / ((x - prev[0]) * 60.0) * per)
        prev = (x, c)
    return out_x, out_y


def _style(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=11, loc="left")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax.spines[["top", "right"]].set_visible(False)


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best", framealpha=0.85, edgecolor="none")


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} yet", ha="center", va="center", transform=ax.transAxes, color="#888")
    ax.set_xticks([])
    ax.set_yticks([])


# -- charts: each fills a list of axes and says whether it had anything to draw -----------------------

def chart_reward(logs: RunLogs, axes: list[Any]) -> bool:
    ax1, ax2 = axes
    drew = False
    steps = [r.get("step", i + 1) for i, r in enumerate(logs.learner)]
    x, y = _series(logs.learner, "reward_mean", steps)
    if x:
        ax1.plot(x, y, "o-", color=PALETTE[0], ms=3, lw=1.5, label="batch mean reward")
        if len(y) >= 5:
            ax1.plot(x, moving_average(y, max(3, len(y) // 10)), color=PALETTE[1], lw=2, label="moving "
                                                                                               "average")
        by_env = [
            r.get("reward_by_env") if isinstance(r.get("reward_by_env"), dict) else {} for r in logs.learner
        ]
        for i, name in enumerate(sorted({n for d in by_env for n in d})):  # a mix: each environment's own
            pairs = [(s, float(d[name])) for s, d in zip(steps, by_env, strict=True)
                     if isinstance(d.get(name), int | float)]
            ax1.plot(
                [p[0] for p in pairs], [p[1] for p in pairs], "--", color=PALETTE[(i + 2) % len(PALETTE)],
                lw=1, label=name,
            )
        drew = True
    else:
        _no_data(ax1, "learner steps")
    _style(ax1, "Reward per learner step", "step", "reward")
    _legend(ax1)

    rewards = [float(r["reward"]) for r in logs.episodes if isinstance(r.get("reward"), int | float)]
    if rewards:
        idx = list(range(1, len(rewards) + 1))
        ax2.scatter(idx, rewards, s=4, alpha=0.15, color=PALETTE[0], label="episode", rasterized=True)
        window = max(10, len(rewards) // 20)
        ax2.plot(idx, moving_average(rewards, window), color=PALETTE[1], lw=2, label="moving average "
                                                                                     f"({window})")
        failed = [i for i, r in zip(idx, logs.episodes, strict=False) if r.get("error")]
        if failed:
            ax2.scatter(failed, [min(rewards)] * len(failed), marker="x", s=12, color="#444",
                        label=f"failed ({len(failed)})")
        drew = True
    else:
        _no_data(ax2, "episodes")
    _style(ax2, "Reward per episode", "episode (finish order)", "reward")
    _legend(ax2)
    return drew


def chart_staleness(logs: RunLogs, axes: list[Any]) -> bool:
    ax1, ax2 = axes
    rows, steps = logs.learner, _steps(logs.learner)
    if not _have(rows, axes, "learner steps"):
        return False
    for key, color, label in (("staleness_mean", PALETTE[0], "mean"), ("staleness_max", PALETTE[1], "max")):
        x, y = _series(rows, key, steps)
        if x:
            ax1.plot(x, y, "o-" if key.endswith("mean") else "s--", color=color, ms=3, label=label)
    from matplotlib.ticker import MaxNLocator

    _style(ax1, "Staleness of trained samples (versions behind)", "step", "versions")
    ax1.set_ylim(bottom=0)
    ax1.yaxis.set_major_locator(MaxNLocator(integer=True))
    _legend(ax1)

    hists = [r.get("staleness_hist") or {} for r in rows]
    levels = sorted({int(k) for h in hists for k in h})
    if levels:
        totals = [max(1, sum(h.values())) for h in hists]
        bottom = [0.0] * len(rows)
        for j, lev in enumerate(levels):
            frac = [h.get(str(lev), 0) / t for h, t in zip(hists, totals, strict=True)]
            ax2.bar(steps, frac, bottom=bottom, width=0.9, color=PALETTE[j % len(PALETTE)], label=f"{lev} "
                                                                                                  "behind")
            bottom = [b + f for b, f in zip(bottom, frac, strict=True)]
        ax2.set_ylim(0, 1)
    else:
        _no_data(ax2, "staleness histogram")
    _style(ax2, "Share of samples by staleness", "step", "fraction of batch")
    if levels:
        ax2.legend(fontsize=8, frameon=False, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return True


def chart_importance(logs: RunLogs, axes: list[Any]) -> bool:
    ax1, ax2, ax3 = axes
    rows = logs.learner
    keys = sorted({k for r in rows for k in r if k.startswith(("is/", "mismatch/")) or k.startswith("is_")})
    if not _have(keys, axes, "importance-weight statistics"):
        return False
    steps = _steps(rows)
    weights = ("is/", "is_", "mismatch/ratio_std")  # the spread on every step, is/* under tis or mis
    weight_keys = [k for k in keys if k.startswith(weights) and "frac" not in k]
    frac_keys = [k for k in keys if "frac" in k]
    kl_keys = [k for k in keys if k.startswith("mismatch/kl") or k == "mismatch/abs_log_ratio"]
    for ax, group, title, ylabel in (
            (ax1, weight_keys, "Importance weights pi_old / mu", "weight"),
            (ax2, frac_keys, "Share of tokens clipped or masked", "fraction"),
            (ax3, kl_keys, "Train/inference mismatch KL(mu || pi)", "nats per token")):
        for j, key in enumerate(group):
            x, y = _series(rows, key, steps)
            if x:
                ax.plot(x, y, "o-", ms=3, color=PALETTE[j % len(PALETTE)], label=key)
        if not group:
            _no_data(ax, ylabel)
        _style(ax, title, "step", ylabel)
        _legend(ax)
    if weight_keys:
        ax1.axhline(1.0, color="#888", lw=1, ls=":")
    return True


def chart_throughput(logs: RunLogs, axes: list[Any]) -> bool:
    ax1, ax2 = axes
    drew = False
    x, y = _series(logs.learner, "tokens_per_s", logs.minutes(logs.learner))
    if x:
        ax1.plot(x, y, "o-", ms=3, color=PALETTE[0], label="learner: trained tokens/s")
        drew = True
    if logs.serve:
        xs = logs.minutes(logs.serve)
        rx, ry = _rates(xs, [_num(r, "router.completion_tokens") for r in logs.serve], per=1.0)
        if rx:
            ax1.plot(rx, ry, "-", color=PALETTE[2], label="serve: generated tokens/s")
            drew = True
    if not ax1.lines:
        _no_data(ax1, "token counts")
    if ax1.lines:
        ax1.set_ylim(bottom=0)
    _style(ax1, "Tokens per second", "minutes since start", "tokens/s")
    _legend(ax1)

    ep_x: list[float] = []
    ep_y: list[float] = []
    if logs.serve:
        ep_x, ep_y = _rates(
            logs.minutes(logs.serve), [_num(r, "rollout.episodes") for r in logs.serve], per=60.0
        )
    if not ep_x and logs.episodes:
        # one-minute bins of episodes.jsonl when serve's periodic metrics are absent
        mins = sorted(logs.minutes(logs.episodes))
        bins: dict[int, int] = {}
        for m in mins:
            bins[int(m)] = bins.get(int(m), 0) + 1
        ep_x = [b + 0.5 for b in range(0, int(mins[-1]) + 1)]
        ep_y = [float(bins.get(b, 0)) for b in range(0, int(mins[-1]) + 1)]
    if ep_x:
        ax2.plot(ep_x, ep_y, "-", color=PALETTE[3], label="episodes/min")
        ax2.set_ylim(0, max(ep_y) * 1.15 or 1)
        drew = True
    else:
        _no_data(ax2, "episodes")
    _style(ax2, "Finished episodes per minute", "minutes since start", "episodes/min")
    _legend(ax2)
    return drew


def chart_learner_time(logs: RunLogs, axes: list[Any]) -> bool:
    ax1, ax2 = axes
    rows, steps = logs.learner, _steps(logs.learner)
    if not _have(rows, axes, "learner steps"):
        return False
    x, y = _series(rows, "idle_fraction", steps)
    if x:
        ax1.plot(x, y, "o-", ms=3, color=PALETTE[1], label="idle fraction (waiting for batches)")
        ax1.set_ylim(0, 1)
    else:
        _no_data(ax1, "idle fraction")
    _style(ax1, "Learner idle fraction (cumulative)", "step", "fraction of wall time")
    _legend(ax1)

    bottom = [0.0] * len(rows)
    for j, (key, label) in enumerate(
        (("wait_s", "wait for batch"), ("train_s", "train"), ("sync_s", "weight sync"))
    ):
        vals = [_num(r, key) or 0.0 for r in rows]
        ax2.bar(steps, vals, bottom=bottom, width=0.9, color=PALETTE[(j + 1) % len(PALETTE)], label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    _style(ax2, "Where each learner step's time went", "step", "seconds")
    _legend(ax2)
    return True


def chart_sandbox(logs: RunLogs, axes: list[Any]) -> bool:
    ax1, ax2 = axes
    rows = [r for r in logs.serve if isinstance(r.get("sandbox"), dict)]
    if not rows:
        return False
    xs = logs.minutes(rows)
    for j, (key, label) in enumerate((("exec_p50_ms", "exec p50"), ("exec_p99_ms", "exec p99"),
                                      ("acquire_p50_ms", "acquire p50"), ("acquire_p99_ms", "acquire p99"))):
        x, y = _series(rows, f"sandbox.{key}", xs)
        if x:
            ax1.plot(x, y, "-" if "exec" in key else "--", color=PALETTE[j % len(PALETTE)], label=label)
    if not ax1.lines:
        _no_data(ax1, "sandbox latencies")
    else:
        ax1.set_ylim(bottom=0)
    _style(ax1, "Sandbox latency", "minutes since start", "milliseconds")
    _legend(ax1)
    for j, (key, label) in enumerate(
        (("in_use", "in use"), ("warm", "warm (idle)"), ("creating", "creating"))
    ):
        x, y = _series(rows, f"sandbox.{key}", xs)
        if x:
            ax2.plot(x, y, "-", color=PALETTE[j % len(PALETTE)], label=label)
    for j, key in enumerate(("timeouts", "oom_kills", "infra_errors")):
        x, y = _series(rows, f"sandbox.{key}", xs)
        if x and max(y) > 0:
            ax2.plot(x, y, ":", color=PALETTE[(j + 3) % len(PALETTE)], label=f"{key} (total)")
    _style(ax2, "Sandbox pool", "minutes since start", "sandboxes")
    _legend(ax2)
    return True


def chart_serve(logs: RunLogs, axes: list[Any]) -> bool:
    ax1, ax2 = axes
    rows = logs.serve
    if not rows:
        return False
    xs = logs.minutes(rows)
    for j, (key, label) in enumerate((("rollout.in_flight", "episodes in flight"), ("buffer.depth", "buffer "
                                                                                                    "depth"),
                                      ("buffer.leased", "leased to learner"))):
        x, y = _series(rows, key, xs)
        if x:
            ax1.plot(x, y, "-", color=PALETTE[j % len(PALETTE)], label=label)
    _style(ax1, "Rollout and buffer", "minutes since start", "samples / episodes")
    _legend(ax1)
    x, y = _series(rows, "version", xs)
    if x:
        ax2.step(x, y, where="post", color=PALETTE[0], label="policy version served")
    x, y = _series(rows, "buffer.dropped", xs)
    if x and max(y) > 0:
        ax2b = ax2.twinx()
        ax2b.plot(x, y, ":", color=PALETTE[1], label="dropped samples (total)")
        ax2b.set_ylabel("dropped samples")
        ax2b.legend(fontsize=8, frameon=False, loc="lower right")
    _style(ax2, "Policy version and dropped samples", "minutes since start", "version")
    _legend(ax2)
    return True


def chart_scoring(logs: RunLogs, axes: list[Any]) -> bool:
    """The scoring stage (docs/scoring.md): each reward component per episode, and per scorer its
    mean latency and its failures over time. Nothing to draw in a run without the stage."""
    ax1, ax2 = axes
    scored = [(i, r["info"]["rewards"]) for i, r in enumerate(logs.episodes, start=1)
              if isinstance(r.get("info"), dict) and isinstance(r["info"].get("rewards"), dict)]
    rows = [r for r in logs.serve if isinstance(_get(r, "rollout.scoring"), dict)]
    if not scored and not rows:
        return False
    names = sorted({k for _, rewards in scored for k in rewards})
    for j, name in enumerate(names):
        pts = [(i, float(v)) for i, rewards in scored if isinstance(v := rewards.get(name), int | float)]
        if pts:
            window = max(5, len(pts) // 20)
            ax1.plot(
                [p[0] for p in pts], moving_average([p[1] for p in pts], window),
                color=PALETTE[j % len(PALETTE)], lw=2, label=f"{name} (moving average, {window})",
            )
    if not scored:
        _no_data(ax1, "scored episodes")
    _style(ax1, "Reward components", "episode (finish order)", "reward")
    _legend(ax1)
    xs = logs.minutes(rows)
    scorers = sorted({n for r in rows for n in (_get(r, "rollout.scoring.scorers") or {})})
    for j, name in enumerate(scorers):
        key = f"rollout.scoring.scorers.{name}"
        pts = [(x, secs / calls) for x, r in zip(xs, rows, strict=True)
               if (calls := _num(r, key + ".calls")) and (secs := _num(r, key + ".seconds")) is not None]
        if pts:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=PALETTE[j % len(PALETTE)],
                     label=f"{name}: mean seconds per call (since start)")
    x, y = _series(rows, "rollout.scoring.failed", xs)
    if x and max(y) > 0:
        ax2b = ax2.twinx()
        ax2b.plot(x, y, ":", color="#444", label="episodes failed in scoring (total)")
        ax2b.set_ylabel("failed episodes")
        ax2b.legend(fontsize=8, frameon=False, loc="lower right")
    if not rows:
        _no_data(ax2, "serve metrics")
    _style(ax2, "Scorers", "minutes since start", "seconds")
    _legend(ax2)
    return True


def chart_distill(logs: RunLogs, axes: list[Any]) -> bool:
    """On-policy distillation (docs/scoring.md): each learner step's teacher KL, the mean
    ``log mu - log pi_teacher`` over the trained tokens a teacher scored, and how many those were.
    Nothing to draw in a run without a teacher."""
    ax1, ax2 = axes
    rows = [r for r in logs.learner if isinstance(r.get("teacher_kl"), int | float)]
    if not rows:
        return False
    steps = [r.get("step", i + 1) for i, r in enumerate(rows)]
    kl = [float(r["teacher_kl"]) for r in rows]
    ax1.plot(steps, kl, "o-", color=PALETTE[0], ms=3, lw=1.5, label="teacher KL (log mu - log pi_T, mean)")
    if len(kl) >= 5:
        ax1.plot(steps, moving_average(kl, max(3, len(kl) // 10)), color=PALETTE[1], lw=2, label="moving "
                                                                                                 "average")
    topk = [
        (s, float(r["distill/topk_kl"])) for s, r in zip(steps, rows, strict=True) if "distill/topk_kl" in r
    ]
    if topk:  # a top-k teacher: the forward KL over its top-k tokens (learn.loss.distill_topk_coef)
        ax1.plot([s for s, _ in topk], [v for _, v in topk], "s-", color=PALETTE[3], ms=3, lw=1.5,
                 label="forward KL over the teacher's top-k")
    ax1.axhline(0.0, color="#999", lw=0.8)
    _style(ax1, "Distillation: the student's distance to its teacher", "step", "nats per token")
    _legend(ax1)
    ax2.plot(steps, [float(r.get("teacher_tokens", 0)) for r in rows], "o-", color=PALETTE[2], ms=3, lw=1.5,
             label="tokens a teacher scored, trained this step")
    _style(ax2, "Teacher-scored tokens per step", "step", "tokens")
    _legend(ax2)
    versioned = [(r.get("step", i + 1), r) for i, r in enumerate(rows) if "teacher_version_max" in r]
    if versioned:  # self-distillation: the student's own policy some versions back
        ax2b = ax2.twinx()
        ax2b.step([s for s, _ in versioned], [r["teacher_version_max"] for _, r in versioned], where="post",
                  color=PALETTE[3], label="teacher's policy version (newest in the step)")
        ax2b.plot([s for s, _ in versioned], [r.get("version", s) for s, r in versioned], ":", color="#444",
                  label="student's version")
        ax2b.set_ylabel("policy version")
        ax2b.legend(fontsize=8, frameon=False, loc="lower right")
    return True


Chart = Callable[[RunLogs, list[Any]], bool]
# name -> (draw function, number of panels)
CHARTS: dict[str, tuple[Chart, int]] = {
    "reward": (chart_reward, 2), "staleness": (chart_staleness, 2),
    "importance_weights": (chart_importance, 3), "throughput": (chart_throughput, 2),
    "learner_time": (chart_learner_time, 2), "sandbox": (chart_sandbox, 2), "serve": (chart_serve, 2),
    "scoring": (chart_scoring, 2), "distill": (chart_distill, 2),
}


def _figure(panels: int, title: str) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2 * panels, 3.8), dpi=110, layout="constrained")
    axes = list(fig.subplots(1, panels))
    fig.suptitle(title, fontsize=12, fontweight="bold")
    return fig, axes


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per chart with data (and ``overview.png`` with all of them) under ``out_dir``
    (default ``RUN_DIR/plots``); return the paths written. Raises FileNotFoundError when the
    directory holds none of the three logs."""
    logs = RunLogs.read(run_dir)
    if not (logs.learner or logs.episodes or logs.serve):
        raise FileNotFoundError(f"{run_dir} has no learner.jsonl, episodes.jsonl or serve_metrics.jsonl "
                                "with data; is it a run directory?")
    out = Path(out_dir) if out_dir is not None else logs.run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    name = logs.run_dir.resolve().name
    written: list[Path] = []
    drawn: list[str] = []
    for chart, (draw, panels) in CHARTS.items():
        fig, axes = _figure(panels, f"{name}: {chart.replace('_', ' ')}")
        if not draw(logs, axes):
            log.info("no data for the %s chart; skipped", chart)
            continue
        path = out / f"{chart}.png"
        fig.savefig(path)
        written.append(path)
        drawn.append(chart)
    if drawn:
        written.append(_overview(logs, drawn, out / "overview.png", name))
    return written


def _overview(logs: RunLogs, charts: list[str], path: Path, name: str) -> Path:
    """All charts stacked in one tall PNG, one row per chart."""
    from matplotlib.figure import Figure

    width = max(CHARTS[c][1] for c in charts)
    fig = Figure(figsize=(5.2 * width, 3.6 * len(charts)), dpi=90, layout="constrained")
    fig.suptitle(f"{name}: {len(logs.learner)} learner steps, {len(logs.episodes)} episodes",
                 fontsize=14, fontweight="bold")
    grid = fig.add_gridspec(len(charts), width)
    for row, chart in enumerate(charts):
        draw, panels = CHARTS[chart]
        axes = [fig.add_subplot(grid[row, col]) for col in range(panels)]
        draw(logs, axes)
    fig.savefig(path)
    return path
