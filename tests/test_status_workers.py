"""``agentrl status`` of a serve on a Ray cluster lists its rollout workers and restart counts."""

from __future__ import annotations

from agentrl.cli.status import format_status


def test_status_of_a_ray_serve_lists_rollout_workers_and_restarts() -> None:
    status = {
        "uptime_s": 120.0,
        "version": 3,
        "engines": [{"name": "engine-0", "url": "http://10.0.0.2:8100", "healthy": True, "version": 3}],
        "rollout": {
            "in_flight": 12.0,
            "episodes": 40.0,
            "failed": 1.0,
            "truncated": 2.0,
            "reward_sum": 10.0,
            "restarts": {"workers": 1, "engines": 0, "respawned": 0},
            "workers": [
                {
                    "worker": "worker-0",
                    "node_id": "a1b2c3d4e5f6a7b8",
                    "pid": 4242,
                    "in_flight": 12,
                    "episodes": 30,
                    "failed": 1,
                },
                {"worker": "worker-1", "restarting": True},
            ],
        },
        "buffer": {"depth": 8},
        "router": {"calls": 100},
    }
    text = format_status("http://serve:8000", status)
    assert "2 rollout workers | restarts: workers 1 engines 0 replaced 0" in text
    row0 = next(line for line in text.splitlines() if "worker-0" in line).split()
    assert row0 == ["worker-0", "a1b2c3d4e5f6", "4,242", "12", "30", "1"]
    assert "restarting" in next(line for line in text.splitlines() if "worker-1" in line)
    assert "in flight 12" in text and "episodes 40" in text
