"""The sampling side of the Tinker service: a vLLM engine agentrl launches, with the training
clients' adapters published into it.

Role: ``save_weights_for_sampler`` writes a training client's adapter as a peft folder and loads
it into the engine under its own name (vLLM's runtime LoRA routes, as serve publishes policy
versions); a sampling client then samples the base model or that adapter through the engine's
token-in generate route, with the sampled tokens' logprobs and, when asked, the prompt's.

Invariants:
- The engine starts on the first sampling need (a service that only trains never pays for it),
  once, and is one process of agentrl's engine layer (:class:`agentrl.engines.vllm.VLLMEngine`:
  its reaper, its health wait, its log under the state folder).
- Logprobs are the engine's processed logprobs (``--logprobs-mode processed_logprobs``): those of
  the distribution each token was drawn from; at temperature 1 with no truncation they are the
  model's own, the quantity ``forward`` computes.
- A published adapter is never replaced under the same name: a name is one snapshot of weights.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.tinker.wire import BadRequest, TinkerError

log = logging.getLogger(__name__)


class SamplerError(TinkerError):
    status = 503
    category = "server"


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" or "length"
    topk: list[list[tuple[int, float]]] | None = None  # per sampled token, when asked


@dataclass
class SampleResult:
    sequences: list[Sampled]
    prompt_logprobs: list[float] | None = None  # NaN at position 0
    topk_prompt: list[list[tuple[int, float]]] | None = None  # per position (empty at 0)
    target_prompt: Any = None  # float32 [len(prompt) - 1, K]: the request's target ids' logprobs
    alt_tokens: Any = None  # (int64 ids, float32 logprobs), each [len(prompt) - 1, k]


class Sampler:
    """One engine on ``model_path``, taking adapters up to ``max_rank``, launched when first needed."""

    def __init__(self, model_path: str, folder: Path, *, port: int, max_rank: int = 64, max_loras: int = 8,
                 max_model_len: int = 2048) -> None:
        self.model_path, self.folder, self.port = model_path, Path(folder), port
        self.max_rank, self.max_loras, self.max_model_len = max_rank, max_loras, max_model_len
        self.engine: Any = None
        self.pool: Any = None
        self.loaded: set[str] = set()
        self._starting = asyncio.Lock()

    async def start(self) -> None:
        async with self._starting:
            if self.pool is not None:
                return
            from agentrl.engines.config import EngineSpec
            from agentrl.engines.pool import EnginePool
            from agentrl.engines.vllm import VLLMEngine, wait_ports_free

            spec = EngineSpec(model=self.model_path, served_name="base", port=self.port,
                              lora_rank=self.max_rank, max_loras=self.max_loras,
                              max_model_len=self.max_model_len)
            self.folder.mkdir(parents=True, exist_ok=True)
            await wait_ports_free([spec], 60.0)
            engine = VLLMEngine(spec, self.folder)
            log.info("agentrl tinker: starting the sampling engine on port %d (log %s)", spec.port,
                     engine.log_path)
            engine.launch()
            try:
                await engine.start()
            except Exception as e:
                engine.stop()
                raise SamplerError(f"the sampling engine did not start: {e} (see {engine.log_path})") from e
            pool = EnginePool([engine.url])
            await pool.start()
            self.engine, self.pool = engine, pool
            log.info("agentrl tinker: sampling engine ready at %s", engine.url)

    async def publish(self, name: str, adapter_dir: Path) -> None:
        """Load the peft folder ``adapter_dir`` into the engine as adapter ``name``."""
        await self.start()
        if name in self.loaded:
            raise BadRequest(f"sampler weights {name} exist already; save under another name")
        engine = self.pool.engines[0]
        try:
            await self.pool.control(engine, "/v1/load_lora_adapter",
                                    {"lora_name": name, "lora_path": str(adapter_dir)}, timeout_s=120)
        except Exception as e:  # noqa: BLE001 - the engine's refusal, in its words
            raise SamplerError(f"the sampling engine did not load the adapter: {e}") from e
        self.loaded.add(name)

    async def unload(self, name: str) -> None:
        """Take adapter ``name`` out of the engine (its checkpoint was deleted or expired)."""
        if name not in self.loaded or self.pool is None:
            return
        self.loaded.discard(name)
        try:
            await self.pool.control(self.pool.engines[0], "/v1/unload_lora_adapter", {"lora_name": name},
                                    timeout_s=60)
        except Exception as e:  # noqa: BLE001 - it can no longer be named; the engine keeps the memory
            log.warning("agentrl tinker: the engine did not unload adapter %s: %s", name, e)

    async def sample(self, model: str, prompt: list[int], n: int, params: dict[str, Any], *,
                     prompt_logprobs: bool, topk_prompt: int, topk_sample: int = 0,
                     last_n: int | None = None) -> SampleResult:
        """``n`` sequences from ``model`` (``base`` or a published adapter); ``topk_sample``: the
        top-k logprobs of each sampled token's distribution too; ``last_n``: the prompt logprobs of
        the last ``last_n`` prompt tokens only (the others NaN, their top-k rows empty)."""
        await self.start()
        if model != "base" and model not in self.loaded:
            raise BadRequest(f"sampler weights {model} are not loaded")
        sp = _vllm_params(params, n, len(prompt), self.max_model_len)
        # one more than asked: the engine's list may lead with the sampled token, which need not be
        # among the top k (_top_sampled ranks what came and keeps k)
        sp["logprobs"] = topk_sample + 1 if topk_sample else 0
        if prompt_logprobs or topk_prompt:
            sp["prompt_logprobs"] = max(topk_prompt, 0)
        req = {"request_id": f"tinker-{secrets.token_hex(8)}", "token_ids": prompt, "model": model,
               "stream": False, "sampling_params": sp}
        gen = await self.pool.call(self.pool.engines[0], "/inference/v1/generate", req)
        sequences = []
        for choice in sorted(gen["choices"], key=lambda c: c["index"]):
            content = (choice.get("logprobs") or {}).get("content") or []
            tokens = list(choice.get("token_ids") or [c["token_id"] for c in content])
            topk = [_top_sampled(c.get("top_logprobs") or [], topk_sample) for c in content] \
                if topk_sample else None
            sequences.append(Sampled(tokens, [float(c["logprob"]) for c in content],
                                     "length" if choice.get("finish_reason") == "length" else "stop", topk))
        out = SampleResult(sequences)
        if "prompt_logprobs" in sp:
            rows = gen.get("prompt_logprobs") or [None] * len(prompt)
            if last_n is not None:  # scored: the last last_n positions only
                rows = [None] * (len(prompt) - last_n) + list(rows[len(prompt) - last_n:])
            out.prompt_logprobs = [math.nan if row is None else float(_entry(row, tok)["logprob"])
                                   for row, tok in zip(rows, prompt, strict=True)]
            if topk_prompt:
                out.topk_prompt = [[] if row is None else _topk(row, topk_prompt) for row in rows]
        return out

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)


def _entry(row: dict[str, Any], token: int) -> dict[str, Any]:
    got = row.get(str(token), row.get(token))  # JSON keys arrive as strings
    if got is None:
        raise SamplerError(f"the engine sent no prompt logprob for token {token}")
    return got


def _top_sampled(entries: list[dict[str, Any]], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely of a sampled position's top-logprob entries, best first (each token once)."""
    best = {int(e["token_id"]): float(e["logprob"]) for e in entries}
    return sorted(best.items(), key=lambda x: -x[1])[:k]


def _topk(row: dict[str, Any], k: int) -> list[tuple[int, float]]:
    ranked = sorted(((int(t), float(e["logprob"]), e.get("rank") or 0) for t, e in row.items()),
                    key=lambda x: -x[1])
    return [(t, lp) for t, lp, _ in ranked[:k]]


def _vllm_params(params: dict[str, Any], n: int, prompt_len: int, max_model_len: int) -> dict[str, Any]:
    """The SDK's ``SamplingParams`` as vLLM's: checked, with the sampled tokens' logprobs asked for."""
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    room = max_model_len - prompt_len
    max_tokens = params.get("max_tokens")
    if max_tokens is None:
        max_tokens = min(16, room)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= room:
        raise BadRequest(f"max_tokens must be an integer from 1 to {room} (the context is {max_model_len} "
                         f"tokens, the prompt {prompt_len}); got {max_tokens!r}")
    out: dict[str, Any] = {"n": n, "max_tokens": max_tokens, "logprobs": 0}
    for name, lo, hi in (("temperature", 0.0, 100.0), ("top_p", 1e-6, 1.0)):
        value = params.get(name, 1.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
            raise BadRequest(f"{name} must be a number in [{lo}, {hi}]; got {value!r}")
        out[name] = float(value)
    top_k = params.get("top_k", -1)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < -1:
        raise BadRequest(f"top_k must be -1 (off) or a positive integer; got {top_k!r}")
    out["top_k"] = 0 if top_k in (-1, 0) else top_k
    seed = params.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise BadRequest(f"seed must be an integer; got {seed!r}")
        out["seed"] = seed
    stop = params.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list):
            raise BadRequest("stop must be a string, a list of strings or a list of token ids")
        if not stops:
            out["ignore_eos"] = True  # [] turns every stop off, EOS too
        elif all(isinstance(s, str) for s in stops):
            out["stop"] = stops
        elif all(isinstance(s, int) and not isinstance(s, bool) for s in stops):
            out["stop_token_ids"] = stops
        else:
            raise BadRequest("stop must be strings or token ids, not both")
    return out
