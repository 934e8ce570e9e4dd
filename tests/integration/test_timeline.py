"""The timeline: a 4-rank job run by ``aiocoll run`` with ``AIOCOLL_TIMELINE=DIR`` leaves one
record per rank, and ``aiocoll timeline DIR -o FILE`` merges them into one Chrome trace with a
track per rank, every operation once per rank, and the wait of the ranks that waited for a late
one visible as a longer event. Each record says its rank's clock offset to the coordinator's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SCRIPT = r"""
import asyncio, time
import numpy as np
import aiocoll

async def main():
    async with await aiocoll.init_process_group() as pg:
        x = np.ones(1000, dtype=np.float32)
        for _ in range(3):
            await pg.all_reduce(x)
        await pg.broadcast(x, src=0)
        if pg.rank == 3:
            time.sleep(0.6)  # the others wait for it in the next all_reduce
        await pg.all_reduce(np.ones(4, dtype=np.float64))

aiocoll.run(main())
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIOCOLL_", "MASTER_", "TORCHELASTIC_"))}
    env.update(extra)
    return env


def test_a_timeline_has_a_track_per_rank_every_operation_once_and_the_waits(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    records = tmp_path / "timeline"
    run = subprocess.run(
        [sys.executable, "-m", "aiocoll", "run", "--nproc-per-node", "4", str(script)],
        env=_env(AIOCOLL_TIMELINE=str(records), AIOCOLL_TOKEN="timeline-test"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert len(list(records.glob("rank*.jsonl"))) == 4
    # Each rank says its clock's offset to the coordinator's, as its heartbeats measured it: on
    # one host the clocks are one, so the offset is within the bound it gives (half a round trip).
    for path in records.glob("rank*.jsonl"):
        clocks = [line for line in map(json.loads, path.read_text().splitlines()[1:]) if "clock" in line]
        assert clocks and all(abs(c["clock"]) <= c["error"] + 2e-6 for c in clocks), (path, clocks)

    out = tmp_path / "trace.json"
    merged = subprocess.run(
        [sys.executable, "-m", "aiocoll", "timeline", str(records), "-o", str(out)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert merged.returncode == 0, merged.stderr
    assert "operations of 4 rank(s)" in merged.stdout
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    tracks = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(tracks) == [0, 1, 2, 3]
    assert all(name.startswith(f"rank {p} (") for p, name in tracks.items())
    ops = [e for e in events if e["ph"] == "X"]
    for rank in range(4):
        mine = sorted((e for e in ops if e["pid"] == rank), key=lambda e: e["ts"])
        world = [e for e in mine if e["args"]["group"] == mine[-1]["args"]["group"]]
        assert [e["name"] for e in world] == ["all_reduce"] * 3 + ["broadcast", "all_reduce"], mine
        seqs = [e["args"]["seq"] for e in world]
        assert seqs == sorted(seqs) and len(set(seqs)) == 5, "every operation once per rank"
        assert all(e["args"]["outcome"] == "ok" for e in world)
        assert world[0]["args"]["bytes"] == 4000 and world[-1]["args"]["bytes"] == 32
    last = {e["pid"]: e for e in ops if e["name"] == "all_reduce" and e["args"].get("bytes") == 32}
    for rank in (0, 1, 2):
        assert last[rank]["dur"] >= 400_000, f"rank {rank} waited 0.6 s for rank 3: {last[rank]['dur']} us"
    assert last[3]["dur"] < 300_000, "the late rank itself did not wait"
    # Arrival: when each rank entered the operation after the first, how long it waited for the
    # last one (rank 3), also as a "waiting for rank 3" slice on each waiting rank's second track.
    for rank in (0, 1, 2):
        args = last[rank]["args"]
        assert args["last_rank"] == 3 and args["waited_for_last_us"] >= 400_000, args
        assert args["entered_after_first_us"] < 300_000, args
    assert last[3]["args"]["waited_for_last_us"] == 0 and last[3]["args"]["entered_after_first_us"] >= 400_000
    waits = [e for e in events if e["ph"] in "BE" and e["name"] == "waiting for rank 3"]
    assert {e["pid"] for e in waits} >= {0, 1, 2} and 3 not in {e["pid"] for e in waits}, waits
    assert "for rank 3 to enter it" in merged.stdout, merged.stdout

    # Without the variable nothing is written; a directory without records is refused clearly.
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = subprocess.run(
        [sys.executable, "-m", "aiocoll", "timeline", str(empty), "-o", str(tmp_path / "x.json")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1 and "AIOCOLL_TIMELINE" in refused.stderr
