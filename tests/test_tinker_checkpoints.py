"""The Tinker service's checkpoint store (agentrl/tinker/checkpoints.py) without a model: TTLs that
expire on the store's clock, what another tenant may read, and paths that would leave the folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.tinker.checkpoints import CheckpointStore, Ref, parse
from agentrl.tinker.wire import BadRequest, NotFound

RUN = "s-0123:train:0"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def saved(store: CheckpointStore, tenant: str, name: str, **settings: object) -> Ref:
    store.record_run(tenant, RUN, base_model="smollm2", rank=4, targets=["q_proj", "v_proj"])
    ref = Ref(RUN, "weights", name)
    store.file(tenant, ref).write_bytes(b"weights")
    store.saved(tenant, ref, **settings)
    return ref


def test_a_checkpoint_past_its_ttl_is_gone_at_the_next_look_and_the_service_hears_of_it(
        tmp_path: Path) -> None:
    clock, removed = Clock(), []
    store = CheckpointStore(tmp_path, clock, on_remove=lambda tenant, ref: removed.append((tenant, ref)))
    short = saved(store, "a", "short", ttl_seconds=3600)
    kept = saved(store, "a", "kept")
    clock.now += 3599
    assert {c["checkpoint_id"] for c in store.checkpoints("a", RUN)} == {"weights/short", "weights/kept"}
    clock.now += 2
    assert [c["checkpoint_id"] for c in store.checkpoints("a", RUN)] == ["weights/kept"]
    assert not store.file("a", short).exists() and store.file("a", kept).exists()
    assert removed == [("a", short)]
    with pytest.raises(NotFound):
        store.locate("a", short)
    # a TTL removed in time keeps it; a TTL out of the SDK's range is refused
    store.set_ttl("a", kept, 7200)
    store.set_ttl("a", kept, None)
    clock.now += 10**6
    assert store.locate("a", kept)[1] == "a"
    with pytest.raises(BadRequest, match="ttl_seconds must be"):
        store.set_ttl("a", kept, 59)
    # a run.json this store did not record (no run id) is never acted on, even when it says expired
    stray = tmp_path / "a" / "stray"
    stray.mkdir()
    (stray / "x.pt").write_bytes(b"x")
    (stray / "run.json").write_text('{"checkpoints": {"weights/x": {"expires_at": 1}}}')
    assert store.expire() == [] and (stray / "x.pt").exists() and (tmp_path / "a" / "x.pt").exists() is False


def test_another_tenant_reads_only_what_is_published_and_changes_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, Clock())
    ref = saved(store, "a", "shared")
    with pytest.raises(NotFound):
        store.locate("b", ref)
    store.publish("a", ref, True)
    assert store.locate("b", ref) == (store.file("a", ref), "a")
    assert store.weights_info("b", ref)["lora_rank"] == 4
    for change in (lambda: store.delete("b", ref), lambda: store.publish("b", ref, False),
                   lambda: store.set_ttl("b", ref, 3600)):
        with pytest.raises(NotFound):
            change()
    with pytest.raises(NotFound):
        store.run("b", RUN)
    store.publish("a", ref, False)
    with pytest.raises(NotFound):
        store.locate("b", ref)
    assert store.runs("a") == [RUN] and store.runs("b") == []


def test_paths_that_would_leave_the_state_folder_are_refused() -> None:
    for bad in ("tinker://../weights/x", f"tinker://{RUN}/weights/..", "/etc/passwd", "tinker://x/y/z",
                f"tinker://{RUN}/weights/a/../../b", f"tinker://{RUN}/weights/", "tinker://./weights/x", 7):
        with pytest.raises(BadRequest):
            parse(bad)
    assert parse(f"tinker://{RUN}/sampler_weights/step-1.0").checkpoint_id == "sampler_weights/step-1.0"
    with pytest.raises(BadRequest):
        parse(f"tinker://{RUN}/sampler_weights/x", ("weights",))
