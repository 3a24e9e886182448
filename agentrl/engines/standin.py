"""The stand-in engine: a process that answers the vLLM routes agentrl calls, without a model.

For benchmarks and tests that need many engines on one machine (issue #37); never used by default.
It speaks what the router, the engine pool and the weight updater send to a vLLM 0.32 engine started
with ``--enable-scale-out``: chat and completion render / derender, token-in generate (plain and
streamed) with per-token logprobs and per-token weight-version spans, ``/health``, ``/is_paused``,
``/v1/models``, a Prometheus ``/metrics`` under vLLM's series names, and the control routes (pause,
resume, weight version, prefix-cache reset, ``/collective_rpc`` reloads, the NCCL update routes and
LoRA adapter loading) as fast no-ops that keep the version bookkeeping the real ones keep.

Invariants:
- Rendering is the real engine's: the model folder's tokenizer and chat template through
  ``apply_chat_template``, as vLLM calls it, so prompt ids (and the router's continuation logic) are
  the real ones. Sampled ids are not: they are pseudo-random non-special ids from a seeded generator;
  a sequence ends at ``max_tokens`` ("length"), with an eos token drawn with ``eos_probability`` per
  token ("stop", unless ``ignore_eos``) or at a ``stop_token_ids`` id; logprobs are negative
  floats, and with ``top_k`` the shown top logprobs are "processed" (the kept ones sum to
  probability 1, the rest are vLLM's -9999.0), so the router's processed-logprobs check passes.
- Time is a throughput model (:class:`Throughput`), not compute: ``tokens_per_s`` decode tokens a
  second shared equally by the running requests, ``prefill_s_per_token`` of engine time per prompt
  token admitted (again after a preemption: recompute), and ``kv_tokens`` of KV cache (a running
  request holds its prompt and output tokens); when the running requests outgrow it, the last one
  admitted is preempted (counted, requeued at the front, its output kept). A step costs one sleep
  and a few Python operations per token, so one process stands in for dozens of engines.
- A token carries the weight version set when it was generated; ``pause(mode=keep)`` freezes the
  requests in flight until ``resume``.

The throughput model is :mod:`agentrl.engines.standin_model`, the rendering
:mod:`agentrl.engines.standin_render`; this module is the HTTP app and the process.

Run it: ``python -m agentrl.engines.standin --port P --model DIR [--tokens-per-s ...]``; it prints
``standin engine ready on http://127.0.0.1:P`` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import random
import secrets
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from agentrl.engines.pool import dumps, loads
from agentrl.engines.standin_model import Sequence, StandinConfig, Throughput
from agentrl.engines.standin_render import Tokenizer, parse_tool_calls, sampling_params

log = logging.getLogger(__name__)


# -- the HTTP app ----------------------------------------------------------------------------------
class StandinEngine:
    """The routes, over one :class:`Throughput` and one :class:`Tokenizer`."""

    def __init__(self, model_dir: str, config: StandinConfig | None = None, *, served_name: str | None = None,
                 max_model_len: int = 2048) -> None:
        self.model_dir = str(model_dir)
        self.config = config or StandinConfig()
        self.served_name = served_name or Path(model_dir).name
        self.max_model_len = max_model_len
        self.tok = Tokenizer(self.model_dir)
        self.model = Throughput(self.config, self.tok.vocab, self.tok.eos_ids)
        self.adapters: dict[str, str] = {}  # LoRA name -> path
        self._rng = random.Random(self.config.seed)
        self._ids = itertools.count()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 2**20)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics)
        r.add_get("/is_paused", self.is_paused)
        r.add_get("/v1/models", self.models)
        r.add_get("/weight_info", self.weight_info)
        r.add_post("/v1/chat/completions/render", self.render_chat)
        r.add_post("/v1/completions/render", self.render_completion)
        r.add_post("/inference/v1/generate", self.generate)
        r.add_post("/v1/chat/completions/derender", self.derender_chat)
        r.add_post("/v1/completions/derender", self.derender_completion)
        r.add_post("/pause", self.pause)
        r.add_post("/resume", self.resume)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_post("/collective_rpc", self.collective_rpc)
        for path in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                     "/finish_weight_update"):
            r.add_post(path, self.weight_transfer)
        r.add_post("/v1/load_lora_adapter", self.load_lora)
        r.add_post("/v1/unload_lora_adapter", self.unload_lora)

        async def lifecycle(_: web.Application) -> Any:
            self.model.start()
            yield
            await self.model.close()

        app.cleanup_ctx.append(lifecycle)
        return app

    # -- render / generate / derender ------------------------------------------------------------
    async def render_chat(self, request: web.Request) -> web.Response:
        body = loads(await request.read())
        try:
            ids = self.tok.render_chat(body)
        except Exception as e:  # a template that raises: the client's request, as vLLM answers it
            return _error(f"the chat template failed: {e}", 400)
        if len(ids) >= self.max_model_len:
            return _error(f"This model's maximum context length is {self.max_model_len} tokens; your "
                          f"request has {len(ids)} input tokens", 400)
        return web.json_response(self._gen_request("chatcmpl", ids, body, chat=True))

    async def render_completion(self, request: web.Request) -> web.Response:
        body = loads(await request.read())
        prompts = body.get("prompt")
        many = isinstance(prompts, list) and prompts and not isinstance(prompts[0], int)
        out = [self._gen_request("cmpl", self.tok.encode(p), body, chat=False)
               for p in (prompts if many else [prompts])]
        return web.json_response(out)

    def _gen_request(self, kind: str, ids: list[int], body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
        return {"request_id": f"{kind}-{secrets.token_hex(8)}", "token_ids": ids, "token_offsets": None,
                "features": None, "content_parts": None,
                "sampling_params": sampling_params(body, self.tok.defaults, len(ids), self.max_model_len,
                                                   chat=chat),
                "model": body.get("model"), "reasoning_ended": None, "reasoning_parser_kwargs": None,
                "return_token_ids": None, "output_mode": "tokens", "stream": False, "stream_options": None,
                "cache_salt": None, "priority": 0, "kv_transfer_params": None, "ec_transfer_params": None}

    def _sequences(self, req: dict[str, Any]) -> list[Sequence]:
        sp = req.get("sampling_params") or {}
        prompt = req["token_ids"]
        n = int(sp.get("n") or 1)
        max_tokens = sp.get("max_tokens")
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt)
        seed = sp.get("seed")
        changed = asyncio.Event()
        seqs = []
        for i in range(n):
            rng = random.Random(self._rng.random() if seed is None else seed * 1_000_003 + i)
            seqs.append(Sequence(prompt_len=len(prompt), max_tokens=max(1, int(max_tokens)), rng=rng,
                                 logprobs=sp.get("logprobs"), top_k=int(sp.get("top_k") or 0),
                                 ignore_eos=bool(sp.get("ignore_eos")),
                                 stop_token_ids=frozenset(sp.get("stop_token_ids") or ()), index=i,
                                 stream=bool(req.get("stream")), changed=changed))
        return seqs

    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = loads(await request.read())
        model = req.get("model")
        if model not in (None, self.served_name, *self.adapters):
            return _error(f"The model `{model}` does not exist.", 404, "NotFoundError")
        if len(req.get("token_ids") or []) >= self.max_model_len:
            return _error(f"This model's maximum context length is {self.max_model_len} tokens; your "
                          f"request has {len(req['token_ids'])} input tokens", 400)
        seqs = self._sequences(req)
        rid = f"generate-tokens-{req.get('request_id') or next(self._ids)}"
        self.model.submit(seqs)
        try:
            if req.get("stream"):
                return await self._stream(request, rid, seqs)
            while not all(s.done for s in seqs):
                seqs[0].changed.clear()
                await seqs[0].changed.wait()
        finally:
            self.model.abort(seqs)  # no-op for the finished ones; a client that left frees its room
        n_out = sum(len(s.ids) for s in seqs)
        n_in = len(req["token_ids"])
        return _json({
            "request_id": rid, "model": model, "created": int(time.time()),
            "usage": {"prompt_tokens": n_in, "total_tokens": n_in + n_out, "completion_tokens": n_out,
                      "prompt_tokens_details": None, "completion_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
            "output_mode": "tokens", "choices": [_choice(s, 0, s.spans) for s in seqs]})

    async def _stream(self, request: web.Request, rid: str, seqs: list[Sequence]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        sent = [0] * len(seqs)  # tokens sent per choice; -1 once its last event went out
        changed = seqs[0].changed
        while True:
            changed.clear()
            choices = []
            last = []
            for i, s in enumerate(seqs):
                if sent[i] < 0 or not (len(s.ids) > sent[i] or s.done):
                    continue
                if s.done:
                    # the last event of a choice holds its last token, its finish and the cumulative
                    # version spans (as vLLM's, whose steps make one token each)
                    if len(s.ids) - 1 > sent[i]:
                        choices.append(_choice(s, sent[i], None, len(s.ids) - 1))
                    last.append(_choice(s, max(sent[i], len(s.ids) - 1), s.spans))
                    sent[i] = -1
                else:
                    choices.append(_choice(s, sent[i], None))
                    sent[i] = len(s.ids)
            for group in (choices, last):
                if group:
                    event = {"request_id": rid, "usage": None, "output_mode": "tokens", "choices": group}
                    await resp.write(b"data: " + dumps(event) + b"\n\n")
            if all(x < 0 for x in sent):
                break
            await changed.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def derender_chat(self, request: web.Request) -> web.Response:
        body = loads(await request.read())
        gen, chat = body["generate_response"], body.get("chat_request") or {}
        parse = bool(chat.get("tools")) and chat.get("tool_choice") in (None, "auto")
        choices = []
        for ch in gen["choices"]:
            text = self.tok.decode(ch.get("token_ids") or [])  # special tokens kept, as vLLM's derender does
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None,
                                       "annotations": None, "audio": None, "function_call": None}
            if parse:
                calls, message["content"] = parse_tool_calls(text)
                if calls:
                    message["tool_calls"] = [{"id": f"chatcmpl-tool-{secrets.token_hex(8)}",
                                              "type": "function", "function": c} for c in calls]
            message["reasoning"] = None
            logprobs = None
            if chat.get("logprobs") and (ch.get("logprobs") or {}).get("content"):
                logprobs = {"content": [self._chat_logprob(e, int(chat.get("top_logprobs") or 0))
                                        for e in ch["logprobs"]["content"]]}
            choices.append({"index": ch.get("index", 0), "message": message, "logprobs": logprobs,
                            "finish_reason": ch.get("finish_reason"), "stop_reason": ch.get("stop_reason"),
                            "token_ids": None, "routed_experts": None})
        return web.json_response({
            "id": gen.get("request_id"), "object": "chat.completion", "created": int(time.time()),
            "model": chat.get("model"), "choices": choices, "service_tier": None,
            "system_fingerprint": None, "usage": _usage(body.get("prompt_tokens", 0), gen),
            "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None})

    def _chat_logprob(self, e: dict[str, Any], top: int) -> dict[str, Any]:
        def one(x: dict[str, Any]) -> dict[str, Any]:
            text = self.tok.token(x["token_id"])
            return {"token": text, "logprob": x["logprob"], "bytes": list(text.encode())}

        return dict(one(e), top_logprobs=[one(x) for x in (e.get("top_logprobs") or [])[: max(top, 1)]])

    async def derender_completion(self, request: web.Request) -> web.Response:
        body = loads(await request.read())
        comp = body.get("completion_request") or {}
        gens = body["generate_responses"]
        choices = []
        for gen in gens:
            for ch in gen["choices"]:
                ids = ch.get("token_ids") or []
                logprobs = None
                if comp.get("logprobs") is not None:
                    tokens = [self.tok.token(t) for t in ids]
                    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
                    entries = (ch.get("logprobs") or {}).get("content") or []
                    shown = max(comp["logprobs"], 1)
                    logprobs = {"text_offset": offsets if tokens else [],
                                "token_logprobs": [e["logprob"] for e in entries], "tokens": tokens,
                                "top_logprobs": [{self.tok.token(x["token_id"]): x["logprob"]
                                                  for x in (e.get("top_logprobs") or [])[:shown]}
                                                 for e in entries]}
                choices.append({"index": len(choices), "text": self.tok.decode(ids),
                                "logprobs": logprobs, "finish_reason": ch.get("finish_reason"),
                                "stop_reason": ch.get("stop_reason"), "token_ids": None,
                                "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None})
        prompt_tokens = sum(body.get("prompt_tokens") or [0])
        usage = _usage(prompt_tokens, {"choices": [c for g in gens for c in g["choices"]]})
        return web.json_response({
            "id": gens[0].get("request_id") if gens else None, "object": "text_completion",
            "created": int(time.time()), "model": comp.get("model"), "choices": choices,
            "service_tier": None, "system_fingerprint": None, "usage": usage, "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": None})

    # -- control ---------------------------------------------------------------------------------
    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode == "abort":
            self.model.abort([*self.model.running, *self.model.waiting])
        elif mode == "wait":
            while self.model.running or self.model.waiting:
                await asyncio.sleep(self.config.step_s)
        self.model.set_paused(True)
        return web.json_response({"status": "paused"})

    async def health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def is_paused(self, _: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.model.paused})

    async def weight_info(self, _: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.model.version})

    async def weight_transfer(self, _: web.Request) -> web.Response:
        """The NCCL weight-transfer routes: nothing to receive (the version comes with its own call)."""
        return web.json_response({"status": "ok"})

    async def resume(self, _: web.Request) -> web.Response:
        self.model.set_paused(False)
        return web.json_response({"status": "resumed"})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = loads(await request.read())
        self.model.version = str(body["new_version"])
        return web.json_response({"success": True, "new_version": self.model.version})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if request.query.get("reset_running_requests", "").lower() == "true":
            self.model.reset_prefix_cache()
        return web.json_response({"success": True})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = loads(await request.read())
        method = body.get("method")
        answers: dict[str, Any] = {
            "reload_weights": None,
            "agentrl_reload_weights": {"reload_s": 0.0, "retie_s": 0.0, "tied": False, "head": "untied"},
            "agentrl_stage_head": {"started": False},
            "agentrl_head_staged": {"ready": True, "ok": False, "seconds": 0.0, "error": "nothing staged"},
            "agentrl_retie_word_embeddings": False,
            "agentrl_capture_experts": 0,
            "agentrl_routed_experts": [],
        }
        if method not in answers:
            return _error(f"Call to collective_rpc method failed: the stand-in engine has no "
                          f"method {method!r}", 500, "InternalServerError")
        return web.json_response({"results": [answers[method]]})

    async def load_lora(self, request: web.Request) -> web.Response:
        body = loads(await request.read())
        self.adapters[body["lora_name"]] = body.get("lora_path", "")
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        body = loads(await request.read())
        if self.adapters.pop(body["lora_name"], None) is None:
            return _error(f"The lora adapter '{body['lora_name']}' cannot be found.", 404, "NotFoundError")
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    async def models(self, _: web.Request) -> web.Response:
        now = int(time.time())
        cards = [{"id": name, "object": "model", "created": now, "owned_by": "vllm", "root": root,
                  "parent": parent, "max_model_len": self.max_model_len, "permission": []}
                 for name, root, parent in [(self.served_name, self.model_dir, None),
                                            *((a, p, self.served_name) for a, p in self.adapters.items())]]
        return web.json_response({"object": "list", "data": cards})

    async def metrics(self, _: web.Request) -> web.Response:
        m, c = self.model, self.model.counters
        labels = f'engine="0",model_name="{self.served_name}"'
        series = [
            ("vllm:num_requests_running", "gauge", len(m.running)),
            ("vllm:num_requests_waiting", "gauge", len(m.waiting)),
            ("vllm:kv_cache_usage_perc", "gauge", min(1.0, m.kv_used / max(1, self.config.kv_tokens))),
            ("vllm:num_preemptions_total", "counter", c["preemptions"]),
            ("vllm:prompt_tokens_total", "counter", c["prompt_tokens"]),
            ("vllm:generation_tokens_total", "counter", c["generation_tokens"]),
        ]
        lines = []
        for name, kind, value in series:
            lines += [f"# TYPE {name} {kind}", f"{name}{{{labels}}} {float(value)}"]
        lines.append("# TYPE vllm:request_success_total counter")
        lines += [f'vllm:request_success_total{{{labels},finished_reason="{r}"}} {float(c[r])}'
                  for r in ("stop", "length", "abort")]
        lines += ["# TYPE vllm:iteration_tokens_total histogram",
                  f"vllm:iteration_tokens_total_count{{{labels}}} {float(c['steps'])}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def _choice(s: Sequence, start: int, spans: list[dict[str, Any]] | None,
            end: int | None = None) -> dict[str, Any]:
    """A generate choice with the tokens ``start:end`` (all of them outside a stream); the finish
    only with the last token."""
    end = len(s.ids) if end is None else end
    last = end == len(s.ids)
    return {"index": s.index, "finish_reason": s.finish_reason if last else None,
            "stop_reason": s.stop_reason if last else None, "token_ids": s.ids[start:end],
            "routed_experts": None, "sampling_mask": None,
            "weight_versions": [dict(x) for x in spans] if spans is not None else None,
            "logprobs": {"content": s.entries[start:end]} if s.logprobs is not None else None}


def _usage(prompt_tokens: int, gen: dict[str, Any]) -> dict[str, Any]:
    n_out = sum(len(ch.get("token_ids") or []) for ch in gen.get("choices") or [])
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n_out, "completion_tokens": n_out,
            "prompt_tokens_details": None, "completion_tokens_details": None}


def _json(body: Any) -> web.Response:
    return web.Response(body=dumps(body), content_type="application/json")


def _error(message: str, status: int, kind: str = "BadRequestError") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


# -- the process -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m agentrl.engines.standin", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the model folder (its tokenizer and chat template)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name it answers to (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-model-len", type=int, default=2048)
    defaults = StandinConfig()
    for name in StandinConfig.__dataclass_fields__:
        value = getattr(defaults, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    a = p.parse_args(argv)
    config = StandinConfig(**{k: getattr(a, k) for k in StandinConfig.__dataclass_fields__})
    logging.basicConfig(level=logging.WARNING)
    engine = StandinEngine(a.model, config, served_name=a.served_model_name, max_model_len=a.max_model_len)

    async def serve() -> None:
        runner = web.AppRunner(engine.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, a.host, a.port).start()
        print(f"standin engine ready on http://{a.host}:{a.port}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
