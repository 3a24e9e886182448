"""``EnginePool.follow``: a rollout worker's own router takes serve's view of the engine pool
(``/admin/engines``) as its own: who is in, at which version, with which adapters, and where."""

from __future__ import annotations

import pytest

from agentrl.engines.errors import NoEngineAvailable
from agentrl.engines.pool import EnginePool, adapter_name


def view(*engines: dict, version: int = 3, versions: dict | None = None) -> dict:
    return {"version": version, "versions": versions or {}, "engines": list(engines), "counters": {}}


def test_the_pool_takes_serves_membership_versions_and_adapters() -> None:
    pool = EnginePool(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    pool.follow(view(
        {"url": "http://10.0.0.1:8000", "name": "engine-0", "healthy": False, "version": 2},
        {"url": "http://10.0.0.2:8000/", "name": "engine-1", "healthy": True, "version": 3,
         "adapters": {"policy": [2, 3], "critic": [1]}},
        versions={"critic": 1},
    ))
    assert pool.version == 3 and pool.versions == {"critic": 1}
    assert [e.healthy for e in pool.engines] == [False, True]
    assert pool.engines[1].version == 3
    # a call to the default policy goes to its newest adapter on that engine, by serve's naming
    assert pool.engines[1].adapter() == (adapter_name(3), 3)
    assert pool.engines[1].adapter("critic") == (adapter_name(1, "critic"), 1)
    assert pool.engines[1].adapter("policy:lag1") == (adapter_name(2), 2)
    for _ in range(3):  # the engine serve has out takes nothing here
        assert pool.pick("s") is pool.engines[1]


def test_an_engine_that_moves_loses_its_sessions_and_a_new_one_joins() -> None:
    pool = EnginePool(["http://10.0.0.1:8000"])
    assert pool.pick("sess-a") is pool.engines[0]
    pool.follow(view({"url": "http://10.0.0.9:8000", "name": "engine-0", "healthy": True},
                     {"url": "http://10.0.0.2:8000", "name": "engine-1", "healthy": True}))
    assert [e.url for e in pool.engines] == ["http://10.0.0.9:8000", "http://10.0.0.2:8000"]
    assert all(e.healthy for e in pool.engines)
    assert "sess-a" not in pool._affinity  # its prefix cache stayed on the old process


def test_serve_taking_every_engine_out_leaves_none_and_garbage_changes_nothing() -> None:
    pool = EnginePool(["http://10.0.0.1:8000"])
    before = (pool.version, [e.status() for e in pool.engines])
    for garbage in ({}, {"engines": "x"}, {"engines": [None, 7, {"url": 5}]}, {"engines": None}):
        pool.follow(garbage)
    assert [e.status() for e in pool.engines] == before[1]
    pool.follow(view({"url": "http://10.0.0.1:8000", "healthy": "yes"}))  # only True lets it in
    with pytest.raises(NoEngineAvailable):
        pool.pick(None)


def test_each_rollout_workers_router_is_on_serves_metrics() -> None:
    from agentrl.serve.app import prometheus_series

    status = {"rollout": {"workers": [
        {"worker": "worker-0", "router": {"calls": 12, "errors_5xx": 1}},
        {"worker": "worker-1", "restarting": True},  # no router yet: nothing of it
        {"worker": 'w"1', "router": {"calls": 3, "note": "x"}},
    ]}}
    series = prometheus_series(status)
    assert series['router_calls_total{worker="worker-0"}'] == 12
    assert series['router_errors_5xx_total{worker="worker-0"}'] == 1
    assert series['router_calls_total{worker="w\\"1"}'] == 3
    assert not any("note" in k or "worker-1" in k for k in series)
