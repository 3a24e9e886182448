"""Where the learner's per-step metrics go besides ``learner.jsonl``: Prometheus, TensorBoard, W&B.

- :class:`MetricsServer`: ``GET /metrics`` in Prometheus text format (``prometheus_client``'s
  exposition of a registry of its own) from a daemon thread of the learner (rank 0), so a scrape
  never waits on a training step. Gauges hold the latest step's
  values (step, version, loss, reward, staleness, tokens/s, idle fraction, ...).
- :func:`make_writers`: the optional writers a config asks for. TensorBoard and W&B live behind
  extras (``agentrl[tensorboard]``, ``agentrl[wandb]``) and are imported only when enabled; a
  missing extra is an error that says what to install.

Writers get flat ``{name: number}`` dicts (:func:`flatten`); nested sections become ``a/b``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agentrl.errors import AgentrlError

if TYPE_CHECKING:
    from agentrl.learner.config import LearnConfig

log = logging.getLogger(__name__)

# The gauges every learner exposes (and their help text); any other numeric metric of a step is
# exposed too, as agentrl_learner_<name>.
HEADLINE = {
    "step": "Optimizer steps taken.",
    "version": "Policy version of the learner's weights.",
    "loss": "Loss of the last step.",
    "reward_mean": "Mean episode reward in the last batch.",
    "staleness_mean": "Mean staleness (learner version minus sample version) of the last batch.",
    "staleness_max": "Largest staleness in the last batch.",
    "tokens_per_s": "Trained tokens per second in the last step.",
    "idle_fraction": "Fraction of wall-clock time the learner waited for batches.",
}


class MissingExtra(AgentrlError, RuntimeError):
    """An optional writer was asked for but its package is not installed."""


def flatten(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of ``row`` as floats, nested keys joined with ``/`` (bools and strings dropped)."""
    out: dict[str, float] = {}
    for k, v in row.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "/"))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[name] = float(v)
    return out


def _metric_name(key: str) -> str:
    return "agentrl_learner_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class MetricsServer:
    """Prometheus ``/metrics`` for the learner; ``update(row)`` after each step."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._latest: dict[str, float] = {}
        self._steps = 0
        self._started = time.time()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics here")
                    return
                body = server.text().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                return

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="learner-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/metrics"

    def update(self, row: dict[str, Any]) -> None:
        flat = flatten(row)
        with self._lock:
            self._latest = flat
            self._steps += 1

    def collect(self) -> Iterator[Metric]:
        """The families of one scrape (a ``prometheus_client`` collector of this server's registry)."""
        with self._lock:
            latest, steps = dict(self._latest), self._steps
        yield CounterMetricFamily("agentrl_learner_steps", "Steps this learner process has taken.",
                                  value=steps)
        for key, help_text in HEADLINE.items():
            family = GaugeMetricFamily(_metric_name(key), help_text)
            if key in latest:
                family.add_metric([], latest[key])
            yield family
        for key, v in latest.items():
            if key not in HEADLINE and key != "time":
                yield GaugeMetricFamily(_metric_name(key), f"The last step's {key}.", value=v)
        yield GaugeMetricFamily("agentrl_learner_uptime_seconds", "Seconds since the learner started.",
                                value=time.time() - self._started)

    def text(self) -> str:
        return generate_latest(self._registry).decode()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class Writer(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    """TensorBoard event files (``torch.utils.tensorboard``; needs the ``tensorboard`` package)."""

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise MissingExtra("learn.tensorboard=true needs TensorBoard: pip install 'agentrl[tensorboard]' "
                               f"(or pip install tensorboard); import failed: {e}") from None
        self.log_dir = log_dir
        self._w = SummaryWriter(log_dir=str(log_dir))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self._w.add_scalar(k, v, global_step=step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbWriter:
    """Weights & Biases (``wandb.init`` once, ``wandb.log`` per step); files under run_dir/wandb."""

    def __init__(self, project: str, run_dir: Path, *, entity: str = "", name: str = "", mode: str = "",
                 config: dict[str, Any] | None = None) -> None:
        try:
            import wandb
        except ImportError as e:
            raise MissingExtra("learn.wandb.project needs Weights & Biases: pip install 'agentrl[wandb]' "
                               f"(or pip install wandb); import failed: {e}") from None
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, entity=entity or None, name=name or None, mode=mode or None,
                               dir=str(run_dir), config=config or {}, reinit=True)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


def make_writers(cfg: LearnConfig, run_dir: Path, config: dict[str, Any] | None = None) -> list[Writer]:
    """The writers ``cfg`` (a LearnConfig) enables: TensorBoard if ``tensorboard``, W&B if
    ``wandb.project``."""
    writers: list[Writer] = []
    if cfg.tensorboard:
        writers.append(TensorBoardWriter(run_dir / "tensorboard"))
        log.info("TensorBoard events in %s", run_dir / "tensorboard")
    if cfg.wandb.project:
        writers.append(WandbWriter(cfg.wandb.project, run_dir, entity=cfg.wandb.entity, name=cfg.wandb.name,
                                   mode=cfg.wandb.mode, config=config))
        log.info("logging to Weights & Biases project %s", cfg.wandb.project)
    return writers


def start_metrics_server(cfg: LearnConfig, run_dir: Path) -> MetricsServer | None:
    """The learner's /metrics per ``cfg.metrics_port`` (-1: none); its URL is logged and written to
    run_dir."""
    if cfg.metrics_port < 0:
        return None
    server = MetricsServer(cfg.metrics_host, cfg.metrics_port)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "learner_metrics_url").write_text(server.url + "\n")
    log.info("learner metrics at %s", server.url)
    return server
