"""A rank that runs out of data leaves in order while the others still wait for it, under the
launcher, through aiocoll.sync, on the links a plain ``aiocoll run`` picks on one host (shared
memory: the arena runs the collectives); and torch's new_subgroups shape, whose groups are closed
while other groups still work; and a message sent before its sender left, received after.

The uneven script: rank 0 runs three all_reduces, rank 1 one, then destroys its process group and
exits 0. Rank 0's second all_reduce must fail within a second with a PeerLostError that says rank
1 left (not a timeout after the group's whole deadline).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiocoll.testing.world import outcome, run_world

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

UNEVEN = """
import time, numpy as np
import aiocoll.sync as dist
dist.init_process_group(timeout=60)
rank = dist.get_rank()
x = np.ones(4, np.float32)
started = time.monotonic()
for i in range(3 if rank == 0 else 1):
    try:
        dist.all_reduce(x)
    except Exception as exc:
        print(f"uneven: rank {rank} call {i}: {type(exc).__name__} left={getattr(exc, 'left', None)} "
              f"rank={getattr(exc, 'rank', None)} after {time.monotonic() - started:.2f}s: {exc}", flush=True)
        break
else:
    print(f"uneven: rank {rank} finished its {i + 1} call(s)", flush=True)
dist.destroy_process_group()
"""

SUBGROUPS = """
import torch, torch.distributed as dist
import aiocoll.torch  # registers the backend
dist.init_process_group("aiocoll")
cur, subgroups = dist.new_subgroups_by_enumeration(ranks_per_subgroup_list=[[0, 2], [1, 3]])
cur_sub, sub_subgroups = dist.new_subgroups(group_size=1, group=cur)
assert len(sub_subgroups) == 2 and cur_sub.size() == 1
for g in sub_subgroups:
    dist.destroy_process_group(g)
for g in subgroups:
    dist.destroy_process_group(g)
t = torch.ones(2)
dist.all_reduce(t)
assert t.tolist() == [4.0, 4.0], t
print(f"subgroups: rank {dist.get_rank()} ok", flush=True)
dist.destroy_process_group()
"""


def _launch(script: str, nproc: int, tmp_path: Path) -> str:
    path = tmp_path / "script.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIOCOLL_", "MASTER_", "RANK", "WORLD_"))}
    out = subprocess.run(
        [sys.executable, "-m", "aiocoll", "run", "--nproc-per-node", str(nproc), str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    return log


def test_a_rank_that_leaves_in_order_is_told_to_the_one_waiting_within_a_second(tmp_path: Path) -> None:
    log = _launch(UNEVEN, 2, tmp_path)
    assert "uneven: rank 1 finished its 1 call(s)" in log, log[-4000:]
    found = re.search(r"uneven: rank 0 call 1: (\w+) left=(\w+) rank=(\w+) after ([\d.]+)s: (.*)", log)
    assert found, log[-4000:]
    kind, left, rank, _elapsed, message = found.groups()
    assert (kind, left, rank) == ("PeerLostError", "True", "1"), found.group(0)
    assert "rank 1 left" in message, message
    # (how soon is the conformance suite's to bound; here, a timeout would have said so above)


def test_torch_new_subgroups_closed_in_turn_leave_the_world_usable(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    log = _launch(SUBGROUPS, 4, tmp_path)
    for rank in range(4):
        assert f"subgroups: rank {rank} ok" in log, log[-4000:]


async def _sent_then_left(pg: Any) -> dict[str, Any] | None:
    """Rank 1 sends, then closes its process group; rank 0 receives only after the farewell came."""
    if pg.rank == 1:
        await pg.send(np.full(4, 7, np.float32), dst=0)
        await pg.destroy()
        return None
    await asyncio.sleep(1.0)  # rank 1's message, its farewell and its links' goodbye arrive meanwhile
    got = np.zeros(4, np.float32)
    first = await outcome(lambda: pg.recv(got, src=1, timeout=30))
    second = await outcome(lambda: pg.recv(np.zeros(4, np.float32), src=1, timeout=30))
    return {"first": first, "got": got.tolist(), "second": second}


@pytest.mark.parametrize("links", ["tcp", "shm"])
def test_a_message_sent_before_its_sender_left_is_still_received(links: str) -> None:
    results = run_world(_sent_then_left, 2, timeout=60, env={"AIOCOLL_TRANSPORT": links})
    assert results[1].ok, results[1].error
    assert results[0].ok, results[0].error and results[0].error.traceback
    out = results[0].value
    assert out["first"]["error"] is None and out["got"] == [7.0] * 4, out
    second = out["second"]
    assert second["error"] == "PeerLostError" and second["rank"] == 1 and second["left"] is True, second
    assert second["elapsed"] < 1.0, second


async def _gave_up_then_left(pg: Any) -> dict[str, Any] | None:
    """Rank 1 gives up on an all_reduce that rank 2 never calls and closes its process group at
    once; rank 0, which waits in the same all_reduce with a later deadline, is busy meanwhile (its
    loop blocked), so that rank 1's notice, its farewell and its links' goodbye reach it in one
    read. (Rank 1 gives up, not rank 0: rank 0 hosts the world's coordinator here, and its links'
    goodbye waits until the other ranks have left.)"""
    x = np.ones(4, np.float32)
    if pg.rank == 2:
        await asyncio.sleep(6.0)  # never in time; leaves after rank 0 was told
        return None
    if pg.rank == 1:
        said = await outcome(lambda: pg.all_reduce(x, timeout=0.5))
        await pg.destroy()
        return said
    waiting = asyncio.ensure_future(outcome(lambda: pg.all_reduce(x, timeout=30)))
    await asyncio.sleep(0.1)  # the all_reduce is under way
    import time

    time.sleep(2.5)  # noqa: ASYNC251 (the point: this rank's loop is busy while rank 1 gives up and leaves)
    return await waiting


@pytest.mark.parametrize("links", ["tcp", "shm"])
def test_a_peer_that_gave_up_and_left_at_once_is_said_to_have_given_up(links: str) -> None:
    """What rank 0 is told is the cause (rank 1 gave up after its deadline, waiting for rank 2),
    not rank 1's leaving that came with it, on every link: a link's goodbye is acted on after the
    notices that came before it in the same read."""
    results = run_world(_gave_up_then_left, 3, timeout=60, env={"AIOCOLL_TRANSPORT": links})
    assert all(r.ok for r in results), [r.error for r in results]
    leaver, waiter = results[1].value, results[0].value
    assert leaver["error"] == "CollectiveTimeout", leaver
    assert waiter["error"] == "CollectiveTimeout", waiter
    # (whom rank 1 names as the one it waited for depends on the links' algorithm: rank 0's stall
    # is seen from rank 1 too)
    told = "rank 1 gave up on it after its timeout of 0.5s, waiting for rank(s) ["
    assert told in waiter["message"], waiter
