"""A sample request's ``target_prompt_logprobs`` and ``prompt_alt_tokens_k``: scored on the training
side's model with the sampler weights loaded into a scratch adapter (SmolLM2-135M, fp32), equal to
``forward``'s logprobs on the same weights; the training clients beside it are left as they were;
and the wire forms the SDK reads back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from agentrl.tinker.sampler import Sampled, SampleResult
from agentrl.tinker.trainer import ATTN, Trainer
from agentrl.tinker.wire import BadRequest, Datum, ForwardBackward, sample_result, target_cells

PROMPT = [1, 504, 3575, 282, 4649, 314, 7042, 30, 378, 6611, 314]


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    from agentrl.models import resolve_model

    return Trainer(resolve_model("smollm2"))


def _forward(trainer: Trainer, name: str, targets: np.ndarray) -> np.ndarray:
    """``forward``'s logprobs of ``targets`` ([len(PROMPT) - 1, K]) on adapter ``name``."""
    fb = ForwardBackward("m", 0, "cross_entropy", {}, [Datum(PROMPT[:-1], {"target_tokens": targets})],
                         forward_only=True)
    return trainer.forward_backward(name, fb)[0][0]["logprobs"]


def _train_a_step(trainer: Trainer, name: str) -> None:
    targets = np.array(PROMPT[1:], dtype=np.int64)
    fb = ForwardBackward("m", 0, "cross_entropy", {}, [Datum(PROMPT[:-1], {"target_tokens": targets})])
    trainer.forward_backward(name, fb)
    trainer.optim_step(name, {**trainer.check_adam({}), "learning_rate": 1e-2})


def test_target_logprobs_and_alternatives_are_forwards_on_the_sampler_weights(trainer: Trainer,
                                                                             tmp_path: Path) -> None:
    rows = len(PROMPT) - 1
    trained = trainer.create(4, ATTN, seed=1)
    _train_a_step(trainer, trained)
    folder = trainer.export(trained, tmp_path / "sampler")
    _train_a_step(trainer, trained)  # the live adapter moves on; the sampler weights stay as saved
    other = trainer.create(8, ATTN + ["gate_proj"], seed=2)  # another client on the same base
    _train_a_step(trainer, other)
    fresh = trainer.create(4, ATTN, seed=3)  # B = 0: the base model

    targets = np.stack([np.array(PROMPT[1:]), np.full(rows, 42), np.arange(rows) * 1000], axis=1)
    targets[::3, 2] = -1  # asks nothing there
    other_before = _forward(trainer, other, np.clip(targets, 0, None))
    n_params = len(list(trainer.model.named_parameters()))

    scored, alt = trainer.score_prompt(folder, PROMPT, targets, 5, 0.8, 7)
    assert len(list(trainer.model.named_parameters())) == n_params  # the scratch adapter is gone
    assert scored.shape == targets.shape and scored.dtype == np.float32
    assert (scored[targets == -1] == 0.0).all()
    # the saved weights, not the live adapter (which took a step since) nor the base model
    live = trainer.create(4, ATTN, seed=1)
    trainer.load(live, {"weights": _saved_weights(folder), "rank": 4, "targets": ATTN}, optimizer=False)
    expected = _forward(trainer, live, np.clip(targets, 0, None))
    mask = targets >= 0
    assert np.abs(scored[mask] - expected[mask]).max() < 1e-4
    assert np.abs(scored[mask] - _forward(trainer, trained, np.clip(targets, 0, None))[mask]).max() > 1e-2

    base, _ = trainer.score_prompt(None, PROMPT, targets, 0, 1.0, None)
    assert np.abs(base[mask] - _forward(trainer, fresh, np.clip(targets, 0, None))[mask]).max() < 1e-4
    assert np.abs(base[mask] - scored[mask]).max() > 1e-2

    ids, lps = alt
    assert ids.shape == lps.shape == (rows, 5) and ids.dtype == np.int64
    assert ((ids >= 0) & (ids < trainer.vocab)).all()
    again, _ = trainer.score_prompt(folder, PROMPT, ids, 0, 1.0, None)
    assert np.abs(again - lps).max() < 1e-6  # each draw's logprob is the model's
    assert (trainer.score_prompt(folder, PROMPT, None, 5, 0.8, 7)[1][0] == ids).all()  # the seed fixes them
    greedy = trainer.score_prompt(folder, PROMPT, None, 3, 0.0, None)[1]
    assert (greedy[0] == greedy[0][:, :1]).all()
    assert (greedy[1][:, 0] >= scored[:, 0] - 1e-6).all()  # the most likely token: at least the prompt's own

    # every client's adapter trainable and as it was
    assert all(p.requires_grad for k, p in trainer.model.named_parameters() if ".lora_" in k)
    assert np.array_equal(_forward(trainer, other, np.clip(targets, 0, None)), other_before)
    for name in (trained, other, fresh, live):
        trainer.drop(name)


def _saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    """A peft folder's tensors under the trainer's checkpoint keys (``{adapter}`` for the name)."""
    from safetensors.torch import load_file

    out = {}
    for key, value in load_file(str(folder / "adapter_model.safetensors")).items():
        key = key.removeprefix("base_model.model.")
        for ab in ("lora_A", "lora_B"):
            key = key.replace(f".{ab}.", f".{ab}.{{adapter}}.")
        out[key] = value
    return out


def test_target_cells_read_dense_and_sparse_and_refuse_what_does_not_fit() -> None:
    dense = target_cells({"data": [5, -1, 7, 8], "dtype": "int64", "shape": [2, 2]}, 2, 100)
    assert dense.tolist() == [[5, -1], [7, 8]]
    sparse = target_cells({"data": [9, 3], "dtype": "int64", "shape": [3, 2],
                           "sparse_crow_indices": [0, 1, 1, 2], "sparse_col_indices": [1, 0]}, 3, 100)
    assert sparse.tolist() == [[-1, 9], [-1, -1], [3, -1]]
    bad = [
        ({"data": [1, 2], "dtype": "float32", "shape": [1, 2]}, "int64"),
        ({"data": [1, 2], "dtype": "int64", "shape": [2]}, "2-D"),
        ({"data": [1, 2], "dtype": "int64", "shape": [3, 1]}, r"\[2, K\]"),
        ({"data": [1, 2, 3], "dtype": "int64", "shape": [2, 2]}, "does not hold"),
        ({"data": [1, 200], "dtype": "int64", "shape": [2, 1]}, "outside the vocabulary"),
        ({"data": [1, -2], "dtype": "int64", "shape": [2, 1]}, "outside the vocabulary"),
        ({"data": [1], "dtype": "int64", "shape": [2, 2], "sparse_crow_indices": [0, 1, 2],
          "sparse_col_indices": [0]}, "inconsistent sparse"),
        ({"data": [1], "dtype": "int64", "shape": [2, 2], "sparse_crow_indices": [0, 1, 1],
          "sparse_col_indices": [5]}, "inconsistent sparse"),
        ({"data": ["x"], "dtype": "int64", "shape": [2, 1]}, "target_prompt_logprobs"),
        ({"data": [1] * 130, "dtype": "int64", "shape": [2, 65]}, "K from 1 to 64"),
    ]
    for obj, match in bad:
        with pytest.raises(BadRequest, match=match):
            target_cells(obj, 2, 100)


def test_the_sdk_reads_target_logprobs_and_alternatives_back() -> None:
    """The protobuf response (what SDK 0.38 asks for) through the SDK's own decoder; the JSON one as
    TensorData objects."""
    import orjson
    from tinker.proto.response_conv import deserialize_sample_response

    result = SampleResult([Sampled([4, 5], [-0.5, -1.5], "length")])
    result.target_prompt = np.array([[-0.25, 0.0], [-3.0, -1.0]], dtype=np.float32)
    result.alt_tokens = (np.array([[7, 8, 7], [1, 2, 3]], dtype=np.int64),
                         np.array([[-1.0, -2.0, -1.0], [-0.5, -0.75, -4.0]], dtype=np.float32))
    got = deserialize_sample_response(sample_result(result, proto=True)[0])
    assert got.target_prompt_logprobs.to_numpy().tolist() == result.target_prompt.tolist()
    assert got.prompt_alt_tokens.tokens.to_numpy().tolist() == result.alt_tokens[0].tolist()
    assert got.prompt_alt_tokens.logprobs.to_numpy().tolist() == result.alt_tokens[1].tolist()
    assert got.sequences[0].tokens == [4, 5]
    body = orjson.loads(sample_result(result, proto=False)[0])
    assert body["target_prompt_logprobs"] == {"data": [-0.25, 0.0, -3.0, -1.0], "dtype": "float32",
                                              "shape": [2, 2]}
    assert body["prompt_alt_tokens"]["tokens"] == {"data": [7, 8, 7, 1, 2, 3], "dtype": "int64",
                                                   "shape": [2, 3]}
