"""Network partitions between the learner and serve (#41 item 2).

A real serve (tiny model, vLLM engine, arithmetic episodes in Docker) and a resuming learner whose
``--serve`` is a TCP proxy (``tests/netproxy.py``) that partitions them three ways, each followed
by healing: a blackhole longer than the buffer's lease (nothing answers; open connections go
silent for good), a drop (connections reset and refused), and a publish cut in the middle of its
upload. After each the learner must still run, make a step, and bring serve to its own version;
at the end the buffer's log is audited by sample id (``tests/chaos_harness.audit``): nothing
acknowledged twice or lost, no batch trained twice, the accounting identity holds.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from agentrl.client import get_json
from tests.chaos_harness import Run, audit
from tests.netproxy import Proxy

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.slow]

LEASE_S = 15.0  # the buffer's lease in this test: the blackhole outlasts it
START_S = 600.0  # serve's start (a vLLM engine) and the learner's first step on a busy machine
RECOVER_S = 300.0  # a step after healing


def _wait(run: Run, until, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not until():
        for name, proc in (("serve", run.serve), ("learner", run.learner)):
            assert proc is not None and proc.poll() is None, (
                f"{name} exited with {proc and proc.returncode} while waiting for {what}\n"
                + _tail(run))
        if time.monotonic() >= deadline:
            # what each process is doing: `agentrl` prints its threads' stacks on SIGUSR1 and goes on
            for proc in (run.serve, run.learner):
                if proc is not None and proc.poll() is None:
                    proc.send_signal(signal.SIGUSR1)
            time.sleep(3)
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n" + _tail(run, 12000))
        time.sleep(0.5)


def _tail(run: Run, chars: int = 4000) -> str:
    out = run.run_dir.parent
    return "\n".join(f"--- {n}\n" + (out / n).read_text(errors="replace")[-chars:]
                     for n in ("learn.out", "serve.out") if (out / n).exists())


def _learner_version(run: Run) -> int:
    lines = (run.run_dir / "learner.jsonl").read_text().splitlines()
    return json.loads(lines[-1])["version"]


def _serve_version(run: Run) -> int | None:
    status, body = get_json(f"{run.url}/admin/status", run.token(), timeout_s=10.0)
    return body.get("version") if status == 200 else None


def _stats(run: Run) -> dict:  # type: ignore[type-arg]
    status, body = get_json(f"{run.url}/buffer/stats", run.token(), timeout_s=10.0)
    assert status == 200, status
    return body


def _ask_for_a_batch(run: Run) -> None:
    """A lease attempt that takes nothing (no batch is that large): serve expires overdue leases."""
    status, _ = get_json(f"{run.url}/buffer/batch?learner_version=0&batch_size=1000000&timeout_s=0",
                         run.token(), timeout_s=10.0)
    assert status in (200, 204), status


def _healed(run: Run, proxy: Proxy, what: str) -> dict[str, int]:
    """After healing: a new step, and serve (asked directly, not through the proxy) at the
    learner's version once the learner has published it."""
    steps = run.steps()
    t0 = time.monotonic()
    _wait(run, lambda: run.steps() > steps, RECOVER_S, f"a learner step after the {what} healed")
    step_s = time.monotonic() - t0
    _wait(run, lambda: _serve_version(run) == _learner_version(run), RECOVER_S,
          f"serve at the learner's version after the {what}")
    return {"steps_before": steps, "step_after_heal_s": round(step_s, 1), "version": _learner_version(run)}


@pytest.mark.timeout(1500)
def test_the_learner_rides_out_partitions_from_serve_and_no_sample_is_trained_twice_or_lost(
        tmp_path: Path, tiny_tools_model: str) -> None:
    (tmp_path / "run").mkdir()
    run = Run(tmp_path / "run", "tiny-tools", "arithmetic", f"--buffer.lease_s={LEASE_S}")
    proxy = Proxy(run.port)
    run.learn_args = [f"--serve={proxy.url}" if a.startswith("--serve=") else a for a in run.learn_args]
    run.learn_args.append("--weights.transport.chunk_timeout_s=20")  # a cut upload is sent again sooner
    figures: dict[str, dict[str, float]] = {}
    try:
        run.start_serve()
        run.start_learner()
        _wait(run, lambda: run.steps() >= 2, START_S, "the learner's first steps")

        # (a) a blackhole longer than a lease, while the learner holds one: the lease expires on
        # serve's side (leases expire when a batch is next asked for: the test asks, directly), so
        # the learner's ack after healing is refused and the batch's samples come back to the buffer
        _wait(run, lambda: _stats(run)["leased_batches"] >= 1, RECOVER_S, "a batch leased to the learner")
        proxy.set_mode("blackhole")
        t0 = time.monotonic()
        before = _stats(run)
        time.sleep(2 * LEASE_S)
        _ask_for_a_batch(run)
        during = _stats(run)
        proxy.set_mode("pass")
        figures["blackhole"] = {"partition_s": round(time.monotonic() - t0, 1),
                                **_healed(run, proxy, "blackhole")}
        assert during.get("leases_expired", 0) > before.get("leases_expired", 0), (before, during)
        _wait(run, lambda: _stats(run).get("acks_rejected", 0) > before.get("acks_rejected", 0), RECOVER_S,
              "the learner's ack of its expired lease (refused)")

        # (b) a drop: every connection reset, new ones refused
        proxy.set_mode("drop")
        t0 = time.monotonic()
        time.sleep(LEASE_S)
        proxy.set_mode("pass")
        figures["drop"] = {"partition_s": round(time.monotonic() - t0, 1), **_healed(run, proxy, "drop")}

        # (c) the next publish cut in the middle of its upload (the tiny model's weights are 3 MB;
        # no other call of the learner's sends 1 MB)
        proxy.cut_after(1 << 20)
        t0 = time.monotonic()
        _wait(run, lambda: proxy.cuts == 1, RECOVER_S, "a publish to cut")
        figures["cut_publish"] = {"cut_after_s": round(time.monotonic() - t0, 1),
                                  **_healed(run, proxy, "cut publish")}
    finally:
        run.stop()
        proxy.close()
    result = audit(run)
    print(json.dumps({"figures": figures, "audit": result}))
    assert result["identity"], result
    assert result["produced"] > 0 and result["consumed"] > 0, result
    assert result["unaccounted"] == 0 and result["lost_samples"] == 0, result
    assert result["double_trained"] == 0, result  # no sample acked in two batches, no batch trained twice
    log = (tmp_path / "learn.out").read_text(errors="replace")
    # the wait is not silent, whatever the learner was doing when the partition began (riding out
    # an ack or a batch, a chunk or a commit of a publish)
    assert any(m in log for m in ("got no answer", "no answer from serve", "; retrying in",
                                  "weight publish attempt")), log[-3000:]
    # the batch whose lease expired in the blackhole: its ack refused, its samples not trained again
    assert "was not acknowledged" in log, log[-3000:]
