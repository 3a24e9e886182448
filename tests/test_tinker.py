"""``agentrl tinker`` against the official tinker SDK (0.38), on SmolLM2-135M with LoRA, over real HTTP.

The service runs as its own process (``python -m agentrl.cli tinker``); the SDK reaches it by base
URL and API key, exactly as a Tinker program does."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch

from tests.conftest import free_port

types = tinker.types

KEY_A, KEY_B = "tml-agentrl-test-alpha", "tml-agentrl-test-beta"
TEXT = "The capital of France is Paris, and the capital of Italy is Rome."


@contextlib.contextmanager
def running_service(folder: Path, *args: str) -> Iterator[str]:
    """``agentrl tinker`` on SmolLM2 as its own process, with KEY_A and KEY_B; its base URL."""
    from agentrl.models import resolve_model

    resolve_model("smollm2")  # built (or found) before the service starts
    keys = folder / "keys"
    keys.write_text(f"# two tenants\n{KEY_A}\n{KEY_B}\n")
    keys.chmod(0o600)
    port = free_port()
    log = open(folder / "service.log", "wb")  # noqa: SIM115 - closed below
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTRL_TINKER")}
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "tinker", "--model", "smollm2",
                             "--port", str(port), "--keys-file", str(keys),
                             "--state-dir", str(folder / "state"), *args], stdout=log,
                            stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (folder / "service.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the service did not come up in 300 s"
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield url
        assert proc.poll() is None, "the service died during the tests"
    finally:
        while OPEN:
            with contextlib.suppress(Exception):
                OPEN.pop().close()
        proc.terminate()
        proc.wait(60)
        log.close()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_service(tmp_path_factory.mktemp("tinker"), "--no-sampling", "--max-clients", "32") as url:
        yield url


@pytest.fixture(scope="module")
def reference() -> tuple[object, object]:
    """SmolLM2 in transformers, for hand computations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.models import resolve_model

    path = resolve_model("smollm2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


OPEN: list[object] = []  # the tests' ServiceClients, closed before their service stops


def _client(url: str, key: str = KEY_A) -> object:
    """A ServiceClient, closed (its session finished, its heartbeat stopped) when the test's service
    stops: left open, its heartbeat would warn for the rest of the test run."""
    client = tinker.ServiceClient(base_url=url, api_key=key)
    OPEN.append(client)
    return client


def _sft_datum(tokenizer: object, prompt_tokens: int = 5) -> tuple[object, list[int], np.ndarray]:
    """TEXT as a supervised datum: inputs and next-token targets, weight 0 on the prompt's tokens."""
    ids = tokenizer.encode(TEXT)
    weights = np.array([0.0] * (prompt_tokens - 1) + [1.0] * (len(ids) - prompt_tokens), dtype=np.float32)
    targets = np.array(ids[1:], dtype=np.int64)
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": targets, "weights": weights})
    return datum, ids, weights


def test_cross_entropy_equals_a_hand_computation_and_a_step_lowers_it(service, reference):
    """A fresh adapter (B = 0) is the base model: the service's per-token logprobs and ``loss:sum``
    equal transformers' within 1e-4; an optim_step lowers the loss; forward changes nothing."""
    model, tokenizer = reference
    caps = tinker.RestClient(base_url=service, api_key=KEY_A).get_server_capabilities().result()
    assert [(m.model_name, m.trainable, m.sampleable) for m in caps.supported_models] == \
        [("smollm2", True, False)]  # the service was started with --no-sampling
    tc = _client(service).create_lora_training_client(base_model="smollm2", rank=8, seed=3).result()
    assert tc.get_info().model_data.tokenizer_id  # the SDK loads the tokenizer from it
    datum, ids, weights = _sft_datum(tc.get_tokenizer())
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0]
    want_logp = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
    want_loss = float(-(want_logp * weights).sum())

    out = tc.forward_backward([datum], "cross_entropy").result()
    got_logp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(got_logp - want_logp).max() < 1e-4
    assert abs(out.metrics["loss:sum"] - want_loss) < 1e-4 * max(1.0, abs(want_loss))
    step = tc.optim_step(types.AdamParams(learning_rate=2e-3)).result()
    assert step.metrics["grad_norm"] > 0

    after = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    again = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert after < want_loss - 0.1, (want_loss, after)
    assert again == after  # forward accumulates nothing and steps nothing

    # data of different lengths share one padded forward pass: each datum's logprobs are its own
    short = types.Datum(model_input=types.ModelInput.from_ints(ids[:5]),
                        loss_fn_inputs={"target_tokens": np.array(ids[1:6], dtype=np.int64)})
    both = tc.forward([datum, short], "cross_entropy").result().loss_fn_outputs
    alone = [tc.forward([d], "cross_entropy").result().loss_fn_outputs[0] for d in (datum, short)]
    for together, single in zip(both, alone, strict=True):
        assert np.abs(together["logprobs"].to_numpy() - single["logprobs"].to_numpy()).max() < 1e-4


def test_two_training_clients_on_one_base_do_not_touch_each_other(service, reference):
    """Client B's outputs are bit-identical before and after client A trains three steps, and A's
    own loss moves: one adapter each, one optimizer each."""
    _, tokenizer = reference
    sc = _client(service)
    a = sc.create_lora_training_client(base_model="smollm2", rank=4, seed=1).result()
    b = sc.create_lora_training_client(base_model="smollm2", rank=16, seed=2).result()
    datum, _, _ = _sft_datum(tokenizer)
    b.forward_backward([datum], "cross_entropy").result()
    b.optim_step(types.AdamParams(learning_rate=1e-3)).result()  # B is no longer the base model
    before = b.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    a_start = a.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    for _ in range(3):
        a.forward_backward([datum], "cross_entropy").result()
        a.optim_step(types.AdamParams(learning_rate=2e-3)).result()
    after = b.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.array_equal(before, after)
    assert a.forward([datum], "cross_entropy").result().metrics["loss:sum"] < a_start - 0.1


def test_the_policy_gradient_losses_match_their_definitions(service, reference):
    """importance_sampling, ppo, cispo, gspo and dro on one datum whose sampling logprobs are the
    model's own shifted by known amounts: each ``loss:sum`` equals its documented formula on the
    returned target logprobs."""
    _, tokenizer = reference
    tc = _client(service).create_lora_training_client(base_model="smollm2", rank=4, seed=5).result()
    ids = tokenizer.encode(TEXT)
    n = len(ids) - 1
    base = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64)})
    logp = tc.forward([base], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    rng = np.random.default_rng(0)
    q = (logp + rng.uniform(-0.5, 0.5, n)).astype(np.float32)  # ratios from 0.6 to 1.65: some clipped
    adv = rng.normal(0, 1, n).astype(np.float32)
    marked = (np.arange(n) >= 3).astype(np.float32)  # gspo's sequence ratio: all tokens but the first 3
    datum = types.Datum(model_input=base.model_input, loss_fn_inputs={
        "target_tokens": np.array(ids[1:], dtype=np.int64), "logprobs": q, "advantages": adv,
        "sequence_ratio_mask": marked})
    r = np.exp(logp.astype(np.float64) - q)
    seq = np.exp((logp.astype(np.float64) - q)[3:].mean())

    def gspo(lo: float, hi: float) -> float:
        return -np.minimum(seq * adv, np.clip(seq, lo, hi) * adv).sum()

    want = {
        "gspo": gspo(0.8, 1.2),
        "importance_sampling": -(r * adv).sum(),
        "ppo": -np.minimum(r * adv, np.clip(r, 0.8, 1.2) * adv).sum(),
        "cispo": -(np.clip(r, 0.8, 1.2) * logp * adv).sum(),
        "dro": -(logp * adv - 0.5 * 0.05 * (logp - q) ** 2).sum(),
    }
    for name, value in want.items():
        got = tc.forward([datum], name).result().metrics["loss:sum"]
        assert abs(got - value) < 1e-3, (name, got, value)
    tight = tc.forward([datum], "ppo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}).result()
    want_tight = -np.minimum(r * adv, np.clip(r, 0.95, 1.05) * adv).sum()
    assert abs(tight.metrics["loss:sum"] - want_tight) < 1e-3
    # gspo clipped: the sequence ratio lies outside [0.999, 1.001] (the mean offset is not ~0)
    assert abs(seq - 1) > 1e-3, seq
    clipped = tc.forward([datum], "gspo", {"clip_low_threshold": 0.999,
                                            "clip_high_threshold": 1.001}).result()
    assert abs(clipped.metrics["loss:sum"] - gspo(0.999, 1.001)) < 1e-3
    assert abs(gspo(0.999, 1.001) - gspo(0.8, 1.2)) > 1e-3  # the clip changed the loss


def test_bad_requests_are_4xx_in_the_sdks_types_and_the_service_keeps_serving(service, reference):
    _, tokenizer = reference
    datum, ids, _ = _sft_datum(tokenizer)

    with pytest.raises(tinker.AuthenticationError):
        _client(service, "tml-not-a-key-of-this-service").create_lora_training_client(
            base_model="smollm2", rank=4).result()

    a = _client(service, KEY_A).create_lora_training_client(base_model="smollm2", rank=4).result()
    b_service = _client(service, KEY_B)
    other = b_service.create_lora_training_client(base_model="smollm2", rank=4).result()
    with httpx.Client(base_url=service, headers={"X-API-Key": KEY_B}) as raw:
        # another tenant's training client is unknown to this key, whatever the route
        r = raw.post("/api/v1/get_info", json={"model_id": a.model_id})
        assert r.status_code == 404 and r.json()["category"] == "user"
        r = raw.post("/api/v1/optim_step", json={"model_id": a.model_id, "adam_params": {}})
        assert r.status_code == 404
        # a body that is not the message it claims to be
        r = raw.post("/api/v1/forward_backward", content=b"\xff\x00garbage",
                     headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 400 and "ForwardBackwardRequest" in r.json()["error"]
        r = raw.post("/api/v1/optim_step", content=b"{not json")
        assert r.status_code == 400
        r = raw.post("/api/v1/no_such_route", json={})
        assert r.status_code == 404 and "not a route" in r.json()["error"]
        r = raw.post("/api/v1/forward_backward", content=b"\0" * (65 << 20),
                     headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 413

    beyond = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
        "target_tokens": np.array(ids[1:-1] + [10**6], dtype=np.int64)})
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        other.forward_backward([beyond], "cross_entropy").result()
    fresh = b_service.create_lora_training_client(base_model="smollm2", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="unknown loss_fn"):
        fresh.forward_backward([datum], "no_such_loss").result()
    fresh = b_service.create_lora_training_client(base_model="smollm2", rank=4).result()
    short = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
        "target_tokens": np.array(ids[1:3], dtype=np.int64)})
    with pytest.raises(tinker.BadRequestError, match="target_tokens must be"):
        fresh.forward_backward([short], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="not served here"):
        b_service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()

    # and it still trains: a well-formed request of a fresh client goes through
    ok = b_service.create_lora_training_client(base_model="smollm2", rank=4).result()
    assert ok.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0


def test_save_state_and_load_state_resume_to_identical_next_step_losses(service, reference):
    """save_state after two steps; a third step's loss on that client, on a second client given
    load_state_with_optimizer, and on one created from the state, are the same; load_state without
    the optimizer has the weights (same logprobs) but a fresh AdamW (a different next step)."""
    _, tokenizer = reference
    sc = _client(service)
    datum, _, _ = _sft_datum(tokenizer)
    adam = types.AdamParams(learning_rate=2e-3)

    def step(client: object) -> float:
        client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(adam).result()
        return client.forward([datum], "cross_entropy").result().metrics["loss:sum"]

    first = sc.create_lora_training_client(base_model="smollm2", rank=4, seed=7).result()
    step(first), step(first)
    path = first.save_state("after-two").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/after-two")
    logp = first.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    want = step(first)

    second = sc.create_lora_training_client(base_model="smollm2", rank=4, seed=8).result()
    second.load_state_with_optimizer(path).result()
    assert abs(step(second) - want) < 1e-5
    third = sc.create_training_client_from_state_with_optimizer(path).result()
    assert abs(step(third) - want) < 1e-5

    weights_only = sc.create_lora_training_client(base_model="smollm2", rank=4, seed=9).result()
    weights_only.load_state(path).result()
    got = weights_only.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.array_equal(got, logp)
    assert abs(step(weights_only) - want) > 1e-4  # a fresh AdamW's first step is not the third step

    # another tenant cannot read it, and a hostile path is refused
    other = _client(service, KEY_B).create_lora_training_client(base_model="smollm2", rank=4).result()
    with pytest.raises(tinker.NotFoundError):
        other.load_state(path).result()
    with httpx.Client(base_url=service, headers={"X-API-Key": KEY_A}) as raw:
        for bad in ("tinker://../weights/x", f"tinker://{first.model_id}/weights/..", "/etc/passwd",
                    f"tinker://{first.model_id}/weights/a/../../b"):
            r = raw.post("/api/v1/load_weights",
                         json={"model_id": first.model_id, "path": bad, "optimizer": False})
            assert r.status_code == 400, (bad, r.text)


def test_training_runs_and_checkpoints_are_listed_published_given_ttls_and_deleted(service):
    """The RestClient's calls on one key's run: its checkpoints listed (with the TTL and metadata
    save_state set), weights info, a TTL out of range refused; another key reads a checkpoint only
    while it is published, and never lists, deletes or re-publishes it; a deleted checkpoint is
    gone from the listing and from load_state."""
    from datetime import UTC, datetime

    sc = _client(service, KEY_A)
    tc = sc.create_lora_training_client(base_model="smollm2", rank=4, seed=3, train_mlp=False,
                                        user_metadata={"purpose": "listing"}).result()
    first = tc.save_state("first", ttl_seconds=7200, user_metadata={"step": "0"}).result().path
    second = tc.save_state("second").result().path
    rest = tinker.RestClient(base_url=service, api_key=KEY_A)

    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [first, second]
    assert [c.checkpoint_type for c in listed] == ["training", "training"]
    assert all(c.size_bytes > 0 and not c.public for c in listed)
    assert listed[0].user_metadata == {"step": "0"} and listed[1].expires_at is None
    left = (listed[0].expires_at - datetime.now(UTC)).total_seconds()
    assert 7000 < left <= 7200
    run = rest.get_training_run(tc.model_id).result()
    assert (run.training_run_id, run.lora_rank, run.is_lora) == (tc.model_id, 4, True)
    assert run.last_checkpoint.tinker_path == second and run.user_metadata == {"purpose": "listing"}
    runs = rest.list_training_runs(limit=100).result().training_runs
    assert tc.model_id in [r.training_run_id for r in runs]
    mine = rest.list_user_checkpoints(limit=100).result().checkpoints
    assert {first, second} <= {c.tinker_path for c in mine}
    info = rest.get_weights_info_by_tinker_path(first).result()
    assert (info.base_model, info.lora_rank, info.train_attn, info.train_mlp) == ("smollm2", 4, True, False)
    session_id = tc.model_id.split(":train:")[0]  # the SDK names a training client after its session
    assert tc.model_id in rest.get_session(session_id).result().training_run_ids

    rest.set_checkpoint_ttl_from_tinker_path(second, 3600).result()
    rest.set_checkpoint_ttl_from_tinker_path(first, None).result()
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[first].expires_at is None and listed[second].expires_at is not None
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds must be"):
        rest.set_checkpoint_ttl_from_tinker_path(second, 60).result()

    b = _client(service, KEY_B)
    b_rest = tinker.RestClient(base_url=service, api_key=KEY_B)
    with pytest.raises(tinker.NotFoundError):
        b.create_training_client_from_state(first).result()
    with pytest.raises(tinker.NotFoundError):
        b_rest.list_checkpoints(tc.model_id).result()
    rest.publish_checkpoint_from_tinker_path(first).result()
    assert {c.tinker_path: c.public for c in rest.list_checkpoints(tc.model_id).result().checkpoints}[first]
    copy = b.create_training_client_from_state(first).result()  # published: B may load it
    assert copy.get_info().lora_rank == 4
    assert b_rest.get_weights_info_by_tinker_path(first).result().lora_rank == 4
    for attempt in (b_rest.delete_checkpoint_from_tinker_path, b_rest.unpublish_checkpoint_from_tinker_path):
        with pytest.raises(tinker.NotFoundError):
            attempt(first).result()
    rest.unpublish_checkpoint_from_tinker_path(first).result()
    with pytest.raises(tinker.NotFoundError):
        b.create_training_client_from_state(first).result()

    rest.delete_checkpoint_from_tinker_path(first).result()
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [second]
    with pytest.raises(tinker.NotFoundError):
        sc.create_training_client_from_state(first).result()
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(first).result()


def test_copy_weights_keeps_a_readable_checkpoint_after_its_source_is_gone(service, reference):
    """RestClient.copy_weights: A's checkpoint copied by A into a project is a new run of A's, listed,
    with the source's weights exactly and its optimizer state; B copies it only once A has published
    it, and B's copy outlives A's unpublishing and deleting the source; a retry under the same
    idempotency key gets the same copy; access tokens, a missing destination and a bad TTL are 4xx."""
    _, tokenizer = reference
    datum, _, _ = _sft_datum(tokenizer)
    sc, rest = _client(service), tinker.RestClient(base_url=service, api_key=KEY_A)
    b, b_rest = _client(service, KEY_B), tinker.RestClient(base_url=service, api_key=KEY_B)
    tc = sc.create_lora_training_client(base_model="smollm2", rank=4, seed=11).result()
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=2e-3)).result()
    source = tc.save_state("to-copy").result().path
    logp = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    def logprobs_of(client: object, path: str) -> np.ndarray:
        loaded = client.create_training_client_from_state_with_optimizer(path).result()
        return loaded.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    mine = rest.copy_weights(source, "proj-archive", ttl_seconds=3600).result()
    assert mine.endswith("/weights/to-copy") and mine != source
    run = mine[len("tinker://"):].split("/")[0]
    record = rest.get_training_run(run).result()
    assert record.user_metadata == {"copied_from": source, "project_id": "proj-archive"}
    listed = {c.tinker_path: c for c in rest.list_checkpoints(run).result().checkpoints}
    assert listed[mine].expires_at is not None
    assert np.array_equal(logprobs_of(sc, mine), logp)

    with pytest.raises(tinker.NotFoundError):  # not published: B cannot copy it
        b_rest.copy_weights(source, "proj-b").result()
    rest.publish_checkpoint_from_tinker_path(source).result()
    theirs = b_rest.copy_weights(source, "proj-b").result()
    rest.unpublish_checkpoint_from_tinker_path(source).result()
    rest.delete_checkpoint_from_tinker_path(source).result()
    assert np.array_equal(logprobs_of(b, theirs), logp)  # B's own now: the source's fate is not its
    assert np.array_equal(logprobs_of(sc, mine), logp)
    with pytest.raises(tinker.NotFoundError):
        b.create_training_client_from_state(mine).result()  # A's copy stays A's

    with httpx.Client(base_url=service, headers={"X-API-Key": KEY_A}) as raw:
        body = {"source_path": mine, "destination_project_id": "p"}
        once = raw.post("/api/v1/copy_weights", json=body, headers={"X-Idempotency-Key": "k-1"})
        again = raw.post("/api/v1/copy_weights", json=body, headers={"X-Idempotency-Key": "k-1"})
        other = raw.post("/api/v1/copy_weights", json=body, headers={"X-Idempotency-Key": "k-2"})
        assert once.status_code == 200 and once.json() == again.json()
        assert other.json()["tinker_path"] != once.json()["tinker_path"]
        for bad, headers in (({"source_path": mine}, {}),
                             ({**body, "ttl_seconds": 5}, {}),
                             ({**body, "source_path": "tinker://../weights/x"}, {}),
                             (body, {"X-Tinker-Weights-Access-Token": "t"})):
            r = raw.post("/api/v1/copy_weights", json=bad, headers=headers)
            assert r.status_code == 400, (bad, r.text)
        gone = raw.post("/api/v1/copy_weights", json={**body, "source_path": source})
        assert gone.status_code == 404


def test_forward_backward_custom_trains_as_its_loss_says(service, reference):
    """The SDK runs a custom loss on the client (a forward, its loss's gradient sent back as
    cross-entropy weights): a custom loss written as the weighted negative log-likelihood trains a
    client exactly as cross_entropy trains its twin (same seed, same step)."""
    _, tokenizer = reference
    sc = _client(service)
    datum, _, weights = _sft_datum(tokenizer)
    custom = sc.create_lora_training_client(base_model="smollm2", rank=4, seed=11).result()
    builtin = sc.create_lora_training_client(base_model="smollm2", rank=4, seed=11).result()

    def nll(data: list, logprobs: list) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum(-(lp * torch.tensor(weights)).sum() for lp in logprobs)
        return loss, {"custom": 1.0}

    out = custom.forward_backward_custom([datum], nll).result()
    assert out.metrics["custom"] == 1.0
    want = builtin.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert abs(out.metrics["loss:sum"] - want) < 1e-4
    for client in (custom, builtin):
        client.optim_step(types.AdamParams(learning_rate=2e-3)).result()
    a, b = (c.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
            for c in (custom, builtin))
    assert np.abs(a - b).max() < 1e-5


def test_sdk_0_19_and_0_38_see_the_same_training(service):
    """One program, run with the SDK 0.38 (protobuf requests) and with 0.19 (JSON requests, the
    oldest release open projects still pin; scripts/setup.sh puts it in .sdk/): the same losses,
    logprobs and step; unknown request fields are ignored."""
    import json

    from agentrl.models import resolve_model

    old_sdk = Path(__file__).resolve().parents[1] / ".sdk" / "tinker-0.19.0"
    assert (old_sdk / "tinker" / "__init__.py").is_file(), "scripts/setup.sh --tests fetches tinker 0.19.0"
    script = Path(__file__).with_name("tinker_client.py")
    seen = {}
    for name, path in (("0.38", ""), ("0.19", str(old_sdk))):
        env = {**os.environ, "PYTHONPATH": path} if path else {k: v for k, v in os.environ.items()
                                                              if k != "PYTHONPATH"}
        out = subprocess.run([sys.executable, str(script), service, KEY_A, resolve_model("smollm2")],
                             capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        seen[name] = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["0.38"]["sdk"] == "0.38.0" and seen["0.19"]["sdk"] == "0.19.0"
    for key in ("loss", "loss_after_step"):
        assert abs(seen["0.38"][key] - seen["0.19"][key]) < 1e-5, (key, seen)
    assert np.abs(np.array(seen["0.38"]["logprobs"]) - np.array(seen["0.19"]["logprobs"])).max() < 1e-5
    assert seen["0.38"]["loss_after_step"] < seen["0.38"]["loss"] - 0.1
    with httpx.Client(base_url=service, headers={"X-API-Key": KEY_A}) as raw:
        r = raw.post("/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "9.9",
                                                     "a_field_from_a_future_sdk": {"x": 1}})
        assert r.status_code == 200 and r.json()["session_id"]


def test_a_program_that_ends_frees_its_training_clients(tmp_path):
    """With room for two training clients: while a program holds both, a full service says so with a
    4xx; once the program has exited (without finishing its session), its session misses heartbeats
    for the session TTL and a new client gets a place, not before the TTL."""
    script = (
        "import sys, tinker\n"
        "sc = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])\n"
        "for _ in range(2):\n"
        "    sc.create_lora_training_client(base_model='smollm2', rank=4).result()\n"
        "print('holding', flush=True)\n"
        "sys.stdin.read()\n"
    )
    ttl = 12
    with running_service(tmp_path, "--no-sampling", "--max-clients", "2", "--session-ttl", str(ttl)) as url:
        program = subprocess.Popen([sys.executable, "-c", script, url, KEY_A], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert program.stdout.readline().strip() == "holding", program.stderr.read()[-2000:]
            sc = _client(url, KEY_B)
            with pytest.raises(tinker.BadRequestError, match="2 training clients at most"):
                sc.create_lora_training_client(base_model="smollm2", rank=4).result()
            program.stdin.close()  # the program exits; its session is not finished
            assert program.wait(timeout=120) == 0, program.stderr.read()[-2000:]
        finally:
            program.kill()
            program.wait()
        ended = time.monotonic()
        while True:  # refused until the TTL has passed since the program's last heartbeat, then placed
            try:
                client = _client(url, KEY_B).create_lora_training_client(base_model="smollm2", rank=4)
                client = client.result()
                break
            except tinker.BadRequestError as e:
                assert "2 training clients at most" in str(e)
                assert time.monotonic() - ended < ttl + 60, "the exited program's clients were never freed"
                time.sleep(1)
        assert client.get_info().model_id
        log = (tmp_path / "service.log").read_text()
        assert f"ended (no heartbeat for over {ttl} s); freed 2 training clients" in log, log[-3000:]


def test_a_client_that_closes_finishes_its_session_at_once(service):
    """Leaving a ``ServiceClient``'s ``with`` block (as tinker-cookbook's loops do) posts
    ``/sessions/{id}/finish``: it is answered, and the session is over (its heartbeat is then
    unknown); another key cannot finish it."""
    with _client(service) as sc:
        sc.create_lora_training_client(base_model="smollm2", rank=4)
    with httpx.Client(base_url=service, headers={"X-API-Key": KEY_A}) as a, \
            httpx.Client(base_url=service, headers={"X-API-Key": KEY_B}) as b:
        created = a.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"})
        sid = created.json()["session_id"]
        finish = f"/api/v1/sessions/{sid}/finish"
        body = {"reason": {"type": "success"}, "detail": None}
        assert b.post(finish, json=body).status_code == 404
        assert a.post(finish, json=body).status_code == 200
        assert a.post("/api/v1/session_heartbeat", json={"session_id": sid}).status_code == 404
        assert a.post(finish, json=body).status_code == 404
