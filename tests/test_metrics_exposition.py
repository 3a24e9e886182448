"""One /metrics answer from several registries (prometheus_client): a router's own families, the
series its host adds, and other processes' expositions labelled by process, merged one family per
name, so the whole parses as Prometheus text and every process's series add up."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from agentrl.router.metrics import RouterMetrics, exposition, series_families


def _router(calls: float, engines: list[str]) -> SimpleNamespace:
    router = SimpleNamespace(counters={"calls": calls, "errors_5xx": 1.0}, sessions={"a": 1},
                             pool=SimpleNamespace(version=3, engines=[
                                 SimpleNamespace(name=n, healthy=True, outstanding=2, version=3, served=7,
                                                 failures=0) for n in engines]),
                             metrics=RouterMetrics())
    router.metrics.watch(router)
    return router


def test_families_of_several_processes_merge_into_one_exposition() -> None:
    serve, child = _router(5, ["e0"]), _router(4, ["e0"])
    serve.metrics.request_seconds.labels("chat", 200).observe(0.02)
    child.metrics.request_seconds.labels("chat", 200).observe(0.3)
    child.metrics.request_seconds.labels("chat", 200).observe(0.4)
    child_text = exposition(child).decode()
    extra = {'policy_version{policy="a\\"b"}': 2, "rollout_episodes_total": 9, "buffer_depth": 4,
             "not a series": 1, "buffer_flag": True}
    text = exposition(serve, extra, [("process", "1", child_text), ("process", "2", "garbage {{")]).decode()

    lines = text.splitlines()
    types = [ln.split()[2] for ln in lines if ln.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "a family is declared twice"
    families = {f.name: f for f in text_string_to_metric_families(text)}
    calls = {s.labels.get("process", "0"): s.value for s in families["agentrl_router_calls"].samples}
    assert calls == {"0": 5.0, "1": 4.0} and families["agentrl_router_calls"].type == "counter"
    latency = families["agentrl_router_request_seconds"].samples
    counts = {s.labels.get("process", "0"): s.value for s in latency if s.name.endswith("_count")}
    assert counts == {"0": 1.0, "1": 2.0}
    above = [s for s in families["agentrl_router_request_seconds"].samples
             if s.name.endswith("_bucket") and s.labels["le"] == "0.25"]
    assert sorted((s.labels.get("process", "0"), s.value) for s in above) == [("0", 1.0), ("1", 0.0)]
    # the host's series join the router's families (policy_version: one family, two series)
    versions = {s.labels.get("policy"): s.value for s in families["agentrl_policy_version"].samples
                if "process" not in s.labels}
    assert versions == {None: 3.0, 'a"b': 2.0}
    assert families["agentrl_rollout_episodes"].type == "counter"
    assert families["agentrl_buffer_depth"].samples[0].value == 4.0
    assert "buffer_flag" not in text and "not a series" not in text
    assert [s.labels for s in families["agentrl_engine_healthy"].samples] == [
        {"engine": "e0"}, {"engine": "e0", "process": "1"}]


def test_a_series_key_that_is_not_one_is_skipped() -> None:
    families = series_families({"a_total": 1, "b{x=\"1\"}": 2.5, "{bad}": 3, "c": "text"})
    assert [(f.name, f.type, [s.value for s in f.samples]) for f in families] == [
        ("agentrl_a", "counter", [1.0]), ("agentrl_b", "gauge", [2.5])]
