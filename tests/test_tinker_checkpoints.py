"""The Tinker service's checkpoint store (agentrl/tinker/checkpoints.py) without a model: TTLs that
expire on the store's clock, what another tenant may read, and paths that would leave the folder."""

from __future__ import annotations

import json
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


class RecordingSampler:
    """Stands in for the sampling engine: records the adapters loaded and unloaded."""

    def __init__(self, during_load: object = None) -> None:
        self.loaded: list[tuple[str, Path]] = []
        self.unloaded: list[str] = []
        self.during_load = during_load

    async def publish(self, name: str, folder: Path) -> None:
        import asyncio

        await asyncio.sleep(0.05)  # an engine's load takes a while: other requests meet it
        if callable(self.during_load):
            self.during_load()
        self.loaded.append((name, folder))

    async def unload(self, name: str) -> None:
        self.unloaded.append(name)


def test_sampler_weights_saved_before_a_restart_load_again_at_their_first_sample(tmp_path: Path) -> None:
    """A restarted service has none of the saved sampler weights in its engine: the first sample of
    one loads it from the checkpoint folder (once, however many requests meet the load), for its
    owner and for another key while it is published; deleted ones, and ones deleted during their
    load, are 404s; a save under a name already on disk is refused instead of overwriting it."""
    import asyncio
    from types import SimpleNamespace

    from agentrl.tinker.service import TinkerService

    keys = ["tml-owner", "tml-other"]
    first = TinkerService(SimpleNamespace(vocab=100), base_model="smollm2", model_path="/m", keys=keys,
                          state_dir=tmp_path)
    owner, other = (first.tenants[k] for k in keys)
    first.store.record_run(owner, RUN, base_model="smollm2", rank=4, targets=["q_proj"])
    refs = [Ref(RUN, "sampler_weights", name) for name in ("kept", "gone", "racing")]
    for ref in refs:
        first.store.file(owner, ref).mkdir(parents=True)
        (first.store.file(owner, ref) / "adapter_model.safetensors").write_bytes(b"w")
        first.store.saved(owner, ref)
    kept, gone, racing = refs

    sampler = RecordingSampler()
    service = TinkerService(SimpleNamespace(vocab=100), base_model="smollm2", model_path="/m", keys=keys,
                            state_dir=tmp_path, sampler=sampler)

    async def play() -> None:
        assert service._sampler_path(owner, None, kept.path) == kept.path
        names = await asyncio.gather(*(service._engine_model(owner, kept.path) for _ in range(3)))
        assert len(set(names)) == 1 and sampler.loaded == [(names[0], service.store.file(owner, kept))]
        assert await service._engine_model(owner, kept.path) == names[0] and len(sampler.loaded) == 1
        assert await service._engine_model(owner, None) == "base"

        with pytest.raises(NotFound):  # not published: another key cannot read it
            service._sampler_path(other, None, kept.path)
        service.store.publish(owner, kept, True)
        assert service._sampler_path(other, None, kept.path) == kept.path

        service.store.delete(owner, gone)
        with pytest.raises(NotFound):
            service._sampler_path(owner, None, gone.path)
        with pytest.raises(NotFound):
            await service._engine_model(owner, gone.path)

        sampler.during_load = lambda: service.store.delete(owner, racing)
        with pytest.raises(NotFound, match="deleted, expired or unpublished"):
            await service._engine_model(owner, racing.path)
        assert racing.path not in service.published and sampler.unloaded == [sampler.loaded[-1][0]]

        # a training client's save under a name already on disk (saved before the restart)
        from agentrl.tinker.service import Model
        from agentrl.tinker.wire import BadRequest

        service.models[RUN] = Model(owner, RUN, "a0", 4, ["q_proj"])
        with pytest.raises(BadRequest, match="exist already"):
            await service.save_weights_for_sampler(Request(owner, {"model_id": RUN, "path": "kept"}))
        assert (service.store.file(owner, kept) / "adapter_model.safetensors").read_bytes() == b"w"

    asyncio.run(play())


class Request(dict):
    """What a route reads of an aiohttp request: the tenant the middleware set, and its body."""

    def __init__(self, tenant: str, body: dict[str, object]) -> None:
        super().__init__(tenant=tenant)
        self.body = json.dumps(body).encode()

    async def read(self) -> bytes:
        return self.body


def test_a_sampler_folder_still_being_written_is_not_listed(tmp_path: Path) -> None:
    """``save_weights_for_sampler`` writes ``sampler/<name>.tmp`` and renames it (a copy writes a
    hidden ``.copying-*``): a listing meanwhile shows only the whole checkpoints."""
    store = CheckpointStore(tmp_path, Clock())
    saved(store, "a", "w")
    sampler = store.run_dir("a", RUN) / "sampler"
    for name in ("done", "half.tmp", ".copying-1a2b"):
        (sampler / name).mkdir(parents=True)
        (sampler / name / "adapter_config.json").write_text("{}")
    listed = sorted(c["checkpoint_id"] for c in store.checkpoints("a", RUN))
    assert listed == ["sampler_weights/done", "weights/w"]
