"""A Tinker program for tests/test_tinker.py, run with whichever tinker SDK is first on the path:
``python tests/tinker_client.py URL KEY MODEL_DIR`` prints one JSON line of what it saw."""

from __future__ import annotations

import json
import sys

import numpy as np
import tinker
from tinker import types
from transformers import AutoTokenizer


def main(url: str, key: str, model_dir: str) -> None:
    ids = AutoTokenizer.from_pretrained(model_dir).encode(
        "The capital of France is Paris, and the capital of Italy is Rome.")
    weights = np.array([0.0] * 4 + [1.0] * (len(ids) - 5), dtype=np.float32)
    targets = np.array(ids[1:], dtype=np.int64)
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": targets, "weights": weights})
    service = tinker.ServiceClient(base_url=url, api_key=key)
    client = service.create_lora_training_client(base_model="smollm2", rank=4, seed=3)
    if not hasattr(client, "forward_backward"):  # 0.38 answers a future of the client
        client = client.result()
    first = client.forward_backward([datum], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=2e-3)).result()
    after = client.forward([datum], "cross_entropy").result()
    path = client.save_state("one-step").result().path
    print(json.dumps({"sdk": tinker.__version__, "loss": first.metrics["loss:sum"],
                      "logprobs": [float(x) for x in first.loss_fn_outputs[0]["logprobs"].data],
                      "loss_after_step": after.metrics["loss:sum"], "saved": path}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
