"""`aiocoll status --stacks` on a real job: each rank's Python stack as it is now.

One world of three processes under an embedded coordinator with a token: ranks 0 and 1 wait in
an all_reduce while rank 2 computes on its event loop thread (the loop cannot run). The stacks
come from each rank's beat thread all the same: rank 2's shows the function it computes in,
ranks 0 and 1 show the line they await at, the user's frames first. A rank stopped with SIGSTOP
is named as not answering within 1 s, and the request still returns at once. Without the token
nothing is shown.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiocoll.server import Coordinator

from aiocoll.testing.world import World

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

TOKEN = "live-stacks-token"
JOB = "stacks-job"
_HERE = os.path.abspath(__file__)


def _line(marker: str) -> int:
    return next(n for n, t in enumerate(Path(_HERE).read_text().splitlines(), 1) if t.endswith(marker))


def _compute(flag: str) -> None:
    deadline = time.monotonic() + 90
    while not os.path.exists(flag) and time.monotonic() < deadline:  # LOOPS
        sum(range(2000))  # BUSY


async def computing_while_others_wait(pg: Any, flag: str) -> dict[str, Any]:
    x = np.ones(4, np.float32)
    await pg.all_reduce(x)
    if pg.rank == 2:
        _compute(flag)  # COMPUTE
    await pg.all_reduce(x, timeout=120)  # WAITS
    return {"sum": float(x[0])}


def _status(port: int, *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("AIOCOLL_TOKEN", None)
    if token is not None:
        env["AIOCOLL_TOKEN"] = token
    cmd = [
        sys.executable,
        "-m",
        "aiocoll",
        "status",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--job",
        JOB,
        *args,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def _members(result: subprocess.CompletedProcess[str]) -> dict[int, dict[str, Any]]:
    assert result.returncode == 0, result.stdout + result.stderr
    (job,) = json.loads(result.stdout)
    return {m["rank"]: m for m in job["members"]}


async def test_status_stacks_show_where_each_rank_is_even_with_its_loop_blocked(tmp_path: Path) -> None:
    flag = tmp_path / "done-computing"
    async with Coordinator("127.0.0.1", 0, token=TOKEN) as coord:
        world = World(
            computing_while_others_wait, 3, args=(str(flag),), init_method=f"tcp://127.0.0.1:{coord.port}",
            token=TOKEN, job=JOB,
        )  # fmt: skip
        try:
            # Ranks 0 and 1 wait in seq 1; rank 2 holds the job back, its loop blocked.
            deadline = time.monotonic() + 60
            while True:
                job = json.loads((await asyncio.to_thread(_status, coord.port, "--json")).stdout or "[{}]")[0]
                if job.get("held_back_by") == [2]:
                    break
                assert time.monotonic() < deadline, job
                await asyncio.sleep(0.3)

            # Each rank has 1 s to answer; on a loaded machine the computing rank's beat thread
            # may miss it once in a while (what the answer says then is checked below).
            for _ in range(10):
                members = _members(await asyncio.to_thread(_status, coord.port, "--json", "--stacks"))
                if all(members[r]["stack"] for r in range(3)):
                    break
            busy = [{"file": _HERE, "line": _line(m), "function": "_compute"} for m in ("# LOOPS", "# BUSY")]
            assert members[2]["stack"][0] in busy, members[2]["stack"]
            assert members[2]["stack"][1] == {
                "file": _HERE,
                "line": _line("# COMPUTE"),
                "function": "computing_while_others_wait",
            }, members[2]["stack"]
            for rank in (0, 1):
                waits = {"file": _HERE, "line": _line("# WAITS"), "function": "computing_while_others_wait"}
                assert members[rank]["stack"][0] == waits, members[rank]["stack"]
                # the user's frames first: the library's (asyncio, aiocoll) come after every one of them
                files = [f["file"] for f in members[rank]["stack"]]
                assert files.index(_HERE) == 0 and all(not f.startswith(sys.prefix) for f in files[:1])

            for _ in range(10):
                text = await asyncio.to_thread(_status, coord.port, "--stacks")
                if "did not answer" not in text.stdout:
                    break
            assert text.returncode == 0 and f"{_HERE}:{_line('# COMPUTE')} in computing_" in text.stdout, (
                text.stdout
            )
            assert any(f"{_HERE}:{b['line']} in _compute" in text.stdout for b in busy), text.stdout
            assert "STACKS (the user's frames first, innermost first)" in text.stdout

            # A stopped rank cannot answer: named, and the request still returns within seconds.
            os.kill(world.procs[1].pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                members = _members(await asyncio.to_thread(_status, coord.port, "--json", "--stacks"))
                took = time.monotonic() - started
            finally:
                os.kill(world.procs[1].pid, signal.SIGCONT)
            assert members[1]["stack"] == [] and members[1]["stack_note"] == "did not answer within 1 s"
            assert members[0]["stack"] and took < 20, (members, took)

            # Without the token: nothing of the job.
            refused = await asyncio.to_thread(_status, coord.port, "--stacks", token=None)
            assert refused.returncode == 1 and "_compute" not in refused.stdout + refused.stderr
            wrong = await asyncio.to_thread(_status, coord.port, "--stacks", "--json", token="not-it")
            assert wrong.returncode == 1 and "_compute" not in wrong.stdout + wrong.stderr
        finally:
            flag.write_text("done")
            results = await asyncio.to_thread(world.join, 90)
    assert [r.value for r in results] == [{"sum": 9.0}] * 3, results  # 1 + 1 + 1, then 3 + 3 + 3
