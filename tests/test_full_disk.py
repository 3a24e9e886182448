"""A full disk under the run directory corrupts nothing, and everything resumes when space frees.

Each test mounts a small tmpfs as the run directory (root only: mount needs it; CI runs as root)
and fills it with a file written until ENOSPC:
- the buffer: a put that hits ENOSPC leaves no torn record (the log scans clean), admission stops,
  the put waits in memory and lands once the space is back;
- the learner: a checkpoint save that hits ENOSPC leaves the previous checkpoint the newest, whole
  and loadable, and training goes on; the next save, with space, succeeds;
- serve (real engine, real rollout): it stops admitting episodes and says why in its status, its
  /metrics and its log; the buffer log has no corrupt region, a weights upload is refused with
  nothing half written, and serve resumes by itself when the filler is removed, nothing lost: a
  real learner then trains on the samples and publishes.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from agentrl.buffer.log import ScanReport, scan
from agentrl.engines.reaper import stop_process
from tests.conftest import free_port, start_vllm


@contextmanager
def small_filesystem(path: Path, mb: int) -> Iterator[Path]:
    """A tmpfs of ``mb`` MiB mounted at ``path`` until the block ends."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs as the run directory needs root (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m,mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Write a file in ``directory`` until its filesystem is full (ENOSPC); returns the file."""
    filler = directory / "filler"
    block = b"\0" * (1 << 16)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                os.write(fd, block)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                break
        while True:  # the last partial block
            try:
                if os.write(fd, b"\0" * 512) == 0:
                    break
            except OSError:
                break
    finally:
        os.close(fd)
    return filler


def _log_is_whole(path: Path) -> ScanReport:
    report = ScanReport()
    for _ in scan(path, report):
        pass
    assert report.corrupt_regions == 0 and report.truncated_bytes == 0, report
    return report


def test_a_put_that_hits_a_full_disk_waits_and_leaves_the_log_whole(tmp_path: Path) -> None:
    from agentrl.buffer import Buffer, BufferConfig
    from tests.test_learner_packing import make_samples

    with small_filesystem(tmp_path / "run", 4) as run:
        cfg = BufferConfig(path=str(run / "buffer"), batch_size=4, max_staleness=100, min_free_mb=1)

        async def main() -> None:
            buf = Buffer(cfg)
            assert buf.in_flight_allowance(0) > 0
            assert await buf.put(make_samples(4, seed=1)) == 4
            filler = fill(run)
            late = make_samples(64, seed=2)  # more than the page the log's tail may still have room in
            put = asyncio.create_task(buf.put(late))
            while not buf.stats()["disk_full"]:
                assert not put.done(), put
                await asyncio.sleep(0.05)
            stats = buf.stats()
            assert "no space left" in stats["disk_full_reason"] or "under buffer.min_free_mb" in \
                stats["disk_full_reason"], stats
            assert buf.in_flight_allowance(0) == 0  # admission stops
            await asyncio.sleep(1.5)
            assert not put.done()  # the put waits in memory, its samples not lost
            _log_is_whole(buf._journal.path)
            filler.unlink()
            assert await asyncio.wait_for(put, 30) == 64  # the put lands by itself
            stats = buf.stats()
            assert stats["disk_full"] == 0 and stats["produced"] == 68 and stats["identity_holds"]
            assert buf.in_flight_allowance(0) > 0
            buf.close()

        asyncio.run(main())
        report = _log_is_whole(run / "buffer" / "buffer.log")
        assert report.records == 68


def test_an_ack_on_a_full_disk_changes_nothing_and_goes_through_once_space_frees(tmp_path: Path) -> None:
    from dataclasses import replace

    from agentrl.buffer import Buffer, BufferConfig
    from agentrl.buffer.disk import DiskFull
    from tests.test_learner_packing import make_samples

    with small_filesystem(tmp_path / "run", 2) as run:
        cfg = BufferConfig(path=str(run / "buffer"), batch_size=4, max_staleness=100, min_free_mb=0)

        async def main() -> None:
            buf = Buffer(cfg)
            # ids long enough that the ack's record outgrows the page the log's tail may have room in
            await buf.put([replace(x, sample_id=f"{i}-" + "x" * 3000) for i, x in enumerate(make_samples(4))])
            batch = await buf.get_batch(0)
            assert batch is not None
            filler = fill(run)
            with pytest.raises(DiskFull):
                buf.ack(batch.batch_id)
            stats = buf.stats()
            assert stats["consumed"] == 0 and stats["leased"] == 4 and stats["disk_full"] == 1, stats
            filler.unlink()
            assert buf.ack(batch.batch_id)
            await asyncio.sleep(buf.disk.poll_s)  # the guard reads the free space again
            stats = buf.stats()
            assert stats["consumed"] == 4 and stats["identity_holds"] and stats["disk_full"] == 0, stats
            buf.close()

        asyncio.run(main())
        assert _log_is_whole(run / "buffer" / "buffer.log").records == 5  # 4 puts and the ack


def test_a_compaction_that_does_not_fit_leaves_the_old_log_and_no_temporary_file(tmp_path: Path) -> None:
    from agentrl.buffer.disk import DiskFull
    from agentrl.buffer.log import Kind, Log, frame

    with small_filesystem(tmp_path / "run", 1) as run:
        log = Log(run / "buffer")
        list(log.recover())
        log.append([frame(Kind.PUT, bytes([i]) * 2000) for i in range(8)])
        before = log.path.read_bytes()
        filler = fill(run)
        with pytest.raises(DiskFull):
            log.rewrite([frame(Kind.PUT, bytes([9]) * 3000) for _ in range(8)])
        assert log.path.read_bytes() == before
        assert not log.path.with_suffix(".compact").exists()
        with pytest.raises(DiskFull):  # an append that does not fit leaves no torn record either
            log.append([frame(Kind.PUT, bytes([7]) * 20000)])
        assert log.path.read_bytes() == before
        filler.unlink()
        log.append([frame(Kind.PUT, b"after")])
        log.close()
        assert _log_is_whole(log.path).records == 9


def test_a_checkpoint_save_on_a_full_disk_keeps_the_previous_one_and_training_goes_on(
    tiny_model: str, tmp_path: Path
) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from agentrl.learner.checkpoint import latest_checkpoint
    from agentrl.learner.trainer import learn
    from tests.test_learner_policy_set import Serve, _cfg

    with small_filesystem(tmp_path / "learner", 64) as run:
        ckpts = run / "checkpoints"
        seen: dict[str, Any] = {}

        class FillingServe(Serve):
            """Fills the disk before step 2 (whose checkpoint then fails) and frees it before step 3."""

            async def get_batch(self, version: int, **policy: str) -> tuple[str, list[Any]] | None:
                if self.pulled == 1:
                    assert latest_checkpoint(ckpts).name == "step_000001"
                    seen["filler"] = fill(run)
                elif self.pulled == 2:
                    names = sorted(p.name for p in ckpts.iterdir())
                    seen["after_failed_save"] = (latest_checkpoint(ckpts), names)
                    seen["filler"].unlink()
                return await super().get_batch(version, **policy)

        serve = FillingServe(tiny_model, None)
        history = learn(_cfg(tiny_model, run, 3, checkpoint_every=1), serve)
        assert [r["version"] for r in history] == [1, 2, 3]  # training went on through the failed save
        kept, names = seen["after_failed_save"]
        assert kept is not None and kept.name == "step_000001", names
        assert not any(n.endswith(".tmp") for n in names), names  # no half checkpoint, its space freed
        # the kept checkpoint is whole: its metadata, its rank file and its meta read back
        meta = json.loads((kept / "meta.json").read_text())
        assert meta["step"] == 1 and meta["version"] == 1
        dcp.FileSystemReader(str(kept)).read_metadata()
        torch.load(kept / "rank_0.pt", weights_only=False)
        assert latest_checkpoint(ckpts).name == "step_000003"  # with the space back, saves succeed


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError:
        return 0, ""


def _wait(what: str, check: Any, timeout_s: float, out: Path) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}\n" + out.read_text(errors="replace")[-4000:])


@pytest.mark.vllm
@pytest.mark.docker
def test_serve_on_a_full_disk_stops_admitting_corrupts_nothing_and_resumes_when_space_frees(
    tmp_path: Path, tiny_tools_model: str
) -> None:
    from safetensors.torch import load_file

    from agentrl.errors import AgentrlError
    from agentrl.weights.transfer import publish, serialize_state_dict

    engine = start_vllm(tiny_tools_model, tmp_path / "engine-logs")  # its log is not on the small disk
    try:
        with small_filesystem(tmp_path / "run", 48) as run:
            port = free_port()
            token = "full-disk-admin-token"
            env = dict(os.environ, AGENTRL_ADMIN_TOKEN=token, PYTHONUNBUFFERED="1")
            out = tmp_path / "serve.out"
            cmd = [sys.executable, "-m", "agentrl.cli", "serve", f"--run_dir={run}", f"--router.port={port}",
                   f'--engine.urls=["{engine.url}"]', "--env.name=arithmetic", "--env.group_size=2",
                   "--buffer.batch_size=64", "--buffer.max_staleness=20", "--buffer.min_free_mb=4",
                   "--env.max_concurrency=4", "--env.max_tokens=32"]
            with open(out, "wb") as log_file:
                serve = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
            base = f"http://127.0.0.1:{port}"
            try:
                def status() -> dict[str, Any]:
                    code, body = _get(f"{base}/admin/status", token)
                    assert serve.poll() is None, out.read_text(errors="replace")[-4000:]
                    return json.loads(body) if code == 200 else {}

                _wait("serve to produce episodes",
                      lambda: (status().get("rollout") or {}).get("episodes", 0) >= 4, 600, out)
                before = status()
                assert before["buffer"]["disk_full"] == 0, before["buffer"]

                # --- fill the disk
                filler = fill(run)
                full = _wait("serve to say the disk is full",
                             lambda: (s := status()) and s["buffer"]["disk_full"] == 1 and s, 60, out)
                assert full["buffer"]["disk_full_reason"], full["buffer"]
                code, metrics = _get(f"{base}/metrics", token)
                assert code == 200 and "buffer_disk_full 1" in metrics
                # admission stops: once the episodes in flight are done (their puts wait), the count
                # stops growing
                _wait("the episodes in flight to end",
                      lambda: status()["rollout"]["in_flight"] == 0, 120, out)
                held = status()
                time.sleep(8)
                still = status()
                assert still["rollout"]["in_flight"] == 0
                assert still["buffer"]["produced"] == held["buffer"]["produced"]
                assert still["rollout"]["episodes"] == held["rollout"]["episodes"]
                # nothing written so far is corrupt
                _log_is_whole(run / "buffer" / "buffer.log")
                # a weights upload is refused (a 5xx the learner's client retries) and leaves no half version
                state = load_file(str(Path(tiny_tools_model) / "model.safetensors"))
                state = {k: v + 0.01 if k.endswith("norm.weight") else v for k, v in state.items()}
                data = serialize_state_dict(state)
                with pytest.raises(AgentrlError):
                    asyncio.run(publish(data, 1, base, token, attempts=1))
                weights = run / "weights"
                assert not [p for p in weights.glob("v*") if p.is_dir() and not (p / "loaded.json").exists()]
                assert not list(weights.glob("*.staging"))
                assert status()["version"] == 0

                # --- free the space: serve resumes by itself
                filler.unlink()
                _wait("serve to say the disk has room", lambda: status()["buffer"]["disk_full"] == 0, 60, out)
                _wait("new episodes",
                      lambda: status()["rollout"]["episodes"] > still["rollout"]["episodes"] + 2, 300, out)
                # a real learner trains on what was held and publishes (the refused version goes through)
                learn = subprocess.run(
                    [sys.executable, "-m", "agentrl.cli", "learn", f"--serve={base}",
                     f"--run_dir={tmp_path / 'learner'}", "--steps=2", "--batch_size=4", "--max_staleness=20",
                     "--lr=1e-3"], capture_output=True, text=True, env=env, timeout=600)
                assert learn.returncode == 0, learn.stdout[-3000:] + learn.stderr[-3000:]
                assert status()["version"] == 2
                assert (weights / "v2" / "loaded.json").exists()
                after = status()["buffer"]
                assert after["consumed"] >= 8 and after["identity_holds"], after
                assert after["produced"] == after["consumed"] + after["dropped"] + after["pending"]
                assert after["produced"] > held["buffer"]["produced"]
                _log_is_whole(run / "buffer" / "buffer.log")
                text = out.read_text(errors="replace")
                assert "disk full:" in text and "disk space is back" in text
            finally:
                stop_process(serve, 90, kill_wait_s=10)
            assert serve.returncode == 0, out.read_text(errors="replace")[-4000:]
            # every logged episode's samples are in the buffer log (none lost while full)
            episodes = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
            ids = {i for e in episodes for i in e.get("sample_ids", [])}
            report = ScanReport()
            from agentrl.buffer.journal import Put, decode_record

            put_ids = {r.entry.sample_id for k, p in scan(run / "buffer" / "buffer.log", report)
                       if isinstance(r := decode_record(k, p), Put)}
            assert report.corrupt_regions == 0
            assert ids and ids <= put_ids
    finally:
        engine.stop()


def test_serve_on_a_disk_already_full_says_so_and_keeps_the_runs_admin_token(tmp_path: Path) -> None:
    """A serve started (or started again) on a full disk cannot take its first steps: it exits 1
    with what is wrong and what to do (before: an OSError traceback), and the run's admin token,
    which a learner of the run reads, is not emptied on the way."""
    with small_filesystem(tmp_path / "mnt", 4) as mnt:
        run_dir = mnt / "run"
        run_dir.mkdir()
        (run_dir / "admin_token").write_text("the-runs-token")
        fill(mnt)
        env = {k: v for k, v in os.environ.items() if k != "AGENTRL_ADMIN_TOKEN"}
        out = subprocess.run([sys.executable, "-m", "agentrl.cli", "serve", f"--run_dir={run_dir}",
                              f"--router.port={free_port()}", f"--engine.base_port={free_port()}"],
                             capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 1, out.stderr[-3000:]
        assert "agentrl serve: no space left in" in out.stderr and "free some space" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
        assert (run_dir / "admin_token").read_text() == "the-runs-token"
