"""How serve gets its vLLM engines: launched on this machine (or as Ray actors) with these options, or
already running at given URLs.

:class:`EngineOptions` are the launch options every engine of a run shares; :class:`EngineConfig`
is the ``engine`` section of serve's config tree (how many, on which ports, or which URLs) and
builds the per-process :class:`~agentrl.engines.vllm.EngineSpec` for engine ``i``
(:meth:`EngineConfig.spec`), so serve, ``serve --ray`` and tests launch engines from one place.
Only the standard library is imported here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from agentrl.engines.vllm import EngineSpec


@dataclass(kw_only=True)
class EngineOptions:
    max_model_len: int = 2048  # context length (prompt + completion tokens)
    dtype: str = "float32"  # fp32 on CPU keeps learner/engine logprobs in agreement
    enforce_eager: bool = True  # skip torch.compile: much faster start-up on CPU
    kv_cache_gb: float = 1.0  # KV cache size per engine on CPU
    gpu: bool = False  # launch the GPU build of vLLM
    cpu_cores: str = ""  # CPU engines: "" = vLLM's default (keeps one core free for a learner), "all", "0-3"
    tool_parser: str = "hermes"  # vLLM's tool-call parser for the model's chat template
    generation_config: Literal["vllm", "auto"] = "vllm"
    """vllm: the model folder's generation_config.json sampling defaults (temperature, top_k, top_p,
    min_p, penalties) are off, so a call samples with what it asks for and nothing else; auto: vLLM
    applies them to every request that leaves them unset (the router records what was applied, from
    the generate request, and the learner replays it)."""
    max_logprobs: int = 65
    """The most top logprobs a request may ask for (vLLM's --max-logprobs). The router reads each
    truncated training call's kept set from top_k + 1 processed top logprobs: keep it above
    router.max_kept_tokens."""
    lora_rank: int = 0
    """LoRA policies (learn.lora): the largest adapter rank the engines take (vLLM's --max-lora-rank,
    one of 8, 16, 32, 64, ...); 0: LoRA off. ``agentrl run`` sets it from learn.lora.rank."""
    max_loras: int = 4
    """With LoRA: adapter versions an engine holds and batches together at once (vLLM's
    --max-loras); serve keeps the buffer's max_staleness + 1 loaded, so this must be at least that."""
    extra_args: list[str] = field(default_factory=list)  # more vLLM command-line flags, passed as they are
    start_timeout_s: float = 600.0  # give up on an engine that is not healthy by then


@dataclass(kw_only=True)
class EngineConfig(EngineOptions):
    count: int = 1  # vLLM engines serve launches (ignored when `urls` is set)
    urls: list[str] = field(default_factory=list)  # use running engines instead of launching any
    base_port: int = 8100  # first engine's port; engine i listens on base_port + i
    max_restarts: int = 3
    """Relaunches in a row of an engine serve launched that died (an engine that then stays up for
    10 minutes starts a new row); after the last one fails, the engine is marked failed (-1: no
    limit, 0: never relaunch). Engines at ``urls`` are not serve's to relaunch."""
    restart_backoff_s: float = 2.0  # wait before the first relaunch in a row; doubles for each next one (at most 5 min)
    unhealthy_restart_s: float = 60.0
    """An engine whose process is up but whose ``/health`` has failed for this long (e.g. its
    engine core died and the API server stayed up) is killed and relaunched (0: only a process
    that exits is relaunched)."""

    def __post_init__(self) -> None:
        if self.max_restarts < -1 or self.restart_backoff_s < 0 or self.unhealthy_restart_s < 0:
            raise ValueError("engine.max_restarts must be -1 (no limit) or more, engine.restart_backoff_s and "
                             "engine.unhealthy_restart_s 0 or more")

    def spec(self, index: int, model: str, served_name: str, host: str = "127.0.0.1") -> EngineSpec:
        """The launch spec of engine ``index`` (port ``base_port + index``) serving ``model``."""
        from agentrl.engines.vllm import EngineSpec

        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineOptions)}
        return EngineSpec(model=model, served_name=served_name, host=host, port=self.base_port + index, **options)
