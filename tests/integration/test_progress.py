"""Every stall explained (issue 10), between real worker processes on loopback.

World P (3 ranks, heartbeat timeout 3 s, the default progress threshold of 1 s) runs, in order: a fast phase
that must send no progress report at all; mismatches that never exchange a message (all_reduce vs
broadcast, gather vs scatter in a sub-group, reduces with different roots), which must raise
MismatchError on every rank within seconds; a straggler that `aiocoll status --json` names while
it is late (and the CollectiveTimeout names, with the line it is at, when it comes); a per-op
timeout on one rank that fails the others at once; a rank whose event loop blocks for 8 s
(beyond the 3 s liveness limit) yet stays a member while the job goes on; and last a SIGSTOPped
rank, reported lost within seconds. The refused-join checks start their own small groups of
processes against a coordinator.
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

from aiocoll.testing.world import free_port, outcome, run_world, unwrap

pytestmark = [pytest.mark.integration]

N = 3
BOUND = 8.0  # seconds: "came within a generous bound", well below every operation's own timeout
LONG = 60.0  # the operations' own timeout where another mechanism must act first
LIVENESS = 3.0  # AIOCOLL_HEARTBEAT_TIMEOUT for world P
BLOCK = 8.0  # how long rank 1's event loop is blocked: well past LIVENESS
TOKEN = "aiocoll-test-token"
_HERE = os.path.abspath(__file__)


def _line(marker: str) -> int:
    return next(
        n for n, t in enumerate(Path(_HERE).read_text().splitlines(), 1) if marker in t and "_line(" not in t
    )


async def _status_cli(pg: Any, *extra: str) -> str:
    rt = pg._rt
    env = dict(os.environ, AIOCOLL_TOKEN=TOKEN)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aiocoll",
        "status",
        "--coordinator",
        rt.session.address,
        "--job",
        rt.session.job,
        *extra,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def _job_status(pg: Any) -> dict[str, Any]:
    jobs = await pg._rt.session.status(pg._rt.session.job)
    return dict(jobs[0])


def _compute(seconds: float) -> None:
    """Keep the calling thread busy in Python for ``seconds`` (the GIL still switches threads)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(10_000))


async def _elsewhere(seconds: float) -> None:
    await asyncio.sleep(seconds)  # ELSEWHERE: late, but its loop runs; the timeout names this line


async def world_p(pg: Any) -> dict[str, Any]:
    r = pg.rank
    out: dict[str, Any] = {}
    progress = pg._rt.engine.progress

    # -- the fast path sends nothing ----------------------------------------------------------
    await pg.barrier()
    before = progress.reports_sent
    coordinator_before = (await _job_status(pg))["progress_reports"] if r == 0 else 0
    x = np.ones(16, np.float32)
    for i in range(300):
        await pg.all_reduce(x)
        await pg.broadcast(x, src=i % N)
    await asyncio.sleep(1.5)  # three looks of the beat thread
    out["fast_reports_sent"] = progress.reports_sent - before
    if r == 0:
        out["fast_reports_received"] = (await _job_status(pg))["progress_reports"] - coordinator_before
    await pg.barrier()

    # -- mismatches that never exchange a message ---------------------------------------------
    g = await pg.new_group([0, 1, 2])
    t = np.ones(4, np.float32)
    if r < 2:
        out["allreduce_vs_broadcast"] = await outcome(lambda: g.all_reduce(t, timeout=LONG))
    else:
        out["allreduce_vs_broadcast"] = await outcome(lambda: g.broadcast(t, src=0, timeout=LONG))
    await pg.barrier()

    sub = await pg.new_group([1, 2])
    if sub is not None:
        y = np.ones(4, np.float32)
        if r == 1:  # group rank 0: receives from rank 2
            out["subgroup"] = await outcome(
                lambda: sub.gather(y, [np.empty(4, np.float32) for _ in range(2)], dst=0, timeout=LONG)
            )
        else:  # group rank 1: waits for rank 1's scatter
            out["subgroup"] = await outcome(lambda: sub.scatter(y, None, src=0, timeout=LONG))
    await pg.barrier()

    g = await pg.new_group([0, 1, 2])
    z = np.ones(4, np.float32)
    root = 0 if r < 2 else 2  # rank 2 believes itself the root: it only receives
    out["roots"] = await outcome(lambda: g.reduce(z, dst=root, timeout=LONG))
    if out["roots"]["error"] is None:  # its part was done (a sender): the group is broken now
        out["roots_next"] = await outcome(lambda: g.barrier(timeout=BOUND))
    await pg.barrier()

    # -- a straggler, named while it is late ---------------------------------------------------
    g = await pg.new_group([0, 1, 2])
    # Ranks 0 and 1 give up after 8 s, rank 2 comes 3 s after that; rank 0 asks for the status
    # (both forms at once) at 3 s, so that a loaded machine's slow command starts still has 5 s
    # to answer while the others wait.
    if r == 2:
        await _elsewhere(11.0)
        out["straggler"] = await outcome(lambda: g.barrier(timeout=BOUND))
    else:

        async def look() -> None:
            await asyncio.sleep(3.0)
            as_json, as_text = await asyncio.gather(_status_cli(pg, "--json"), _status_cli(pg))
            out["status_json"], out["status_text"] = json.loads(as_json), as_text

        looking = asyncio.ensure_future(look()) if r == 0 else None
        out["straggler"] = await outcome(lambda: g.barrier(timeout=8.0))
        if looking is not None:
            await looking
    await pg.barrier()

    # -- one rank's per-op timeout fails the others at once -------------------------------------
    g = await pg.new_group([0, 1, 2])
    w = np.ones(4, np.float32)
    if r == 2:
        await asyncio.sleep(4.0)
        out["gave_up"] = await outcome(lambda: g.all_reduce(w, timeout=BOUND))
    elif r == 1:
        out["gave_up"] = await outcome(lambda: g.all_reduce(w, timeout=1.0))
    else:
        out["gave_up"] = await outcome(lambda: g.all_reduce(w, timeout=LONG))
    await pg.barrier()

    # -- a busy event loop is alive -------------------------------------------------------------
    g = await pg.new_group([0, 1, 2])
    if r == 1:
        _compute(BLOCK)  # a long CPU step on the loop thread: no task runs, no timer fires
        out["busy_barrier"] = await outcome(lambda: g.barrier(timeout=LONG))
    else:

        async def look_busy() -> None:
            await asyncio.sleep(BLOCK - 2.0)
            out["busy_status"] = await _job_status(pg)

        looking = asyncio.ensure_future(look_busy()) if r == 0 else None
        out["busy_barrier"] = await outcome(lambda: g.barrier(timeout=LONG))
        if looking is not None:
            await looking
    v = np.full(4, r + 1, np.float32)
    await pg.all_reduce(v)
    out["after_busy"] = v.tolist()

    # -- a frozen rank is lost within seconds ----------------------------------------------------
    pids = await pg.all_gather_object(os.getpid())
    if r == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
        return out
    out["frozen"] = await outcome(lambda: pg.barrier(timeout=LONG))
    if r == 0:
        os.kill(pids[2], signal.SIGKILL)
    return out


@pytest.fixture(scope="module")
def world_p_results() -> list[dict[str, Any]]:
    env = {"AIOCOLL_HEARTBEAT_TIMEOUT": str(LIVENESS)}  # the progress threshold stays at its default
    results = run_world(world_p, N, timeout=150, env=env)
    values = [res.value for res in results[:2]]
    if any(v is None for v in values):
        unwrap(results[:2])
    return values


@pytest.mark.timeout(200)
def test_no_progress_report_is_sent_while_operations_complete_quickly(
    world_p_results: list[dict[str, Any]],
) -> None:
    for res in world_p_results:
        assert res["fast_reports_sent"] == 0
    assert world_p_results[0]["fast_reports_received"] == 0


def _assert_mismatch_everywhere(results: list[dict[str, Any]], key: str, ranks: list[int]) -> None:
    for r in ranks:
        res = results[r][key]
        assert res["error"] == "MismatchError", res
        assert res["elapsed"] < BOUND, res


@pytest.mark.timeout(200)
def test_all_reduce_against_broadcast_raises_mismatch_on_every_rank_naming_each_call(
    world_p_results: list[dict[str, Any]],
) -> None:
    _assert_mismatch_everywhere(world_p_results, "allreduce_vs_broadcast", [0, 1])
    message = world_p_results[0]["allreduce_vs_broadcast"]["message"]
    assert "all_reduce" in message and "broadcast" in message and "ranks 0, 1" in message


@pytest.mark.timeout(200)
def test_different_collectives_in_a_subgroup_and_different_roots_raise_mismatch(
    world_p_results: list[dict[str, Any]],
) -> None:
    res = world_p_results[1]["subgroup"]
    assert res["error"] == "MismatchError" and res["elapsed"] < BOUND, res
    assert "gather" in res["message"] and "scatter" in res["message"]
    # A rank whose own part completed (a sender into the reduce) hears of it on its next call.
    for r in (0, 1):
        res = world_p_results[r]
        first = res["roots"]
        assert first["error"] == "MismatchError" or res["roots_next"]["error"] == "MismatchError", res
        assert first["elapsed"] < BOUND


@pytest.mark.timeout(200)
def test_a_straggler_is_named_by_status_while_late_and_by_the_timeout(
    world_p_results: list[dict[str, Any]],
) -> None:
    jobs = world_p_results[0]["status_json"]
    job = jobs[0]
    assert 2 in job["held_back_by"], job
    members = {m["rank"]: m for m in job["members"]}
    for r in (0, 1):
        entries = members[r]["progress"]
        assert entries, members[r]
        entry = entries[0]
        assert set(entry) >= {"group", "seq", "op", "state", "waiting_for", "since"}
        assert entry["op"].startswith("barrier") and entry["state"] == "waiting"
        assert isinstance(entry["seq"], int) and entry["since"] > 1e9
        assert entry["group_name"] == entry["group"].replace("w", "world", 1), entry  # as said in messages
    assert any(2 in m["progress"][0]["waiting_for"] for r, m in members.items() if r < 2)
    assert members[2]["progress"] == []
    text = world_p_results[0]["status_text"]
    assert "WAITING FOR" in text and "held back by rank 2" in text
    waits = text[text.index("WAITING FOR") :].splitlines()  # the per-rank table, below the members
    rows = [line.split() for line in waits if line.split()[:1] in (["0"], ["1"])]
    assert rows and all(row[1].startswith("world") for row in rows), text  # the GROUP column
    for r in (0, 1):
        res = world_p_results[r]["straggler"]
        assert res["error"] == "CollectiveTimeout" and res["missing"] == [2], res
        assert "progress reports show that rank(s) [2] have not called" in res["message"], res
        # ... and where rank 2 is: its stack, asked by the coordinator when it found rank 2 behind.
        where = f"where they are now: rank 2 at {_HERE}:{_line('# ELSEWHERE')} in _elsewhere"
        assert where in res["message"], res


@pytest.mark.timeout(200)
def test_a_per_op_timeout_on_one_rank_fails_the_others_naming_it(
    world_p_results: list[dict[str, Any]],
) -> None:
    own = world_p_results[1]["gave_up"]
    assert own["error"] == "CollectiveTimeout", own
    other = world_p_results[0]["gave_up"]
    assert other["error"] == "CollectiveTimeout", other
    assert "rank 1 gave up" in other["message"]
    assert other["elapsed"] < BOUND  # its own timeout is 60 s


@pytest.mark.timeout(200)
def test_a_rank_whose_loop_is_busy_stays_a_member_and_is_shown_slow(
    world_p_results: list[dict[str, Any]],
) -> None:
    for r in (0, 1):
        assert world_p_results[r]["busy_barrier"]["error"] is None, world_p_results[r]["busy_barrier"]
        assert world_p_results[r]["after_busy"] == [6.0] * 4
    status = world_p_results[0]["busy_status"]
    members = {m["rank"]: m for m in status["members"]}
    assert all(m["alive"] for m in members.values()), members
    assert any(e["state"] == "slow" for e in members[1]["progress"]), members[1]
    assert 1 in status["held_back_by"]


@pytest.mark.timeout(200)
def test_a_frozen_rank_is_reported_lost_within_seconds(world_p_results: list[dict[str, Any]]) -> None:
    for r in (0, 1):
        res = world_p_results[r]["frozen"]
        assert res["error"] == "PeerLostError" and res["rank"] == 2, res
        assert res["elapsed"] < LIVENESS + 5.0


# -- refused joins ---------------------------------------------------------------------------

_JOINER = """
import asyncio, logging, sys, time
import aiocoll
logging.basicConfig(level=logging.WARNING)
async def main():
    t0 = time.monotonic()
    try:
        pg = await aiocoll.init_process_group(sys.argv[1], rank=int(sys.argv[2]), world_size=int(sys.argv[3]),
                                              timeout=float(sys.argv[5]), job=sys.argv[4])
    except Exception as exc:
        print(f"{type(exc).__name__}|{time.monotonic() - t0:.2f}|{exc}", flush=True)
        return
    print("joined", flush=True)
    await pg.destroy()
asyncio.run(main())
"""


def _wait_members(url: str, job: str, count: int) -> None:
    """Until ``count`` members of ``job`` wait in its rendezvous, as the coordinator says."""

    async def members() -> None:
        import aiocoll

        session = await aiocoll.connect_store(url, token=TOKEN, job="watching", timeout=30)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    jobs = await session.status(job)
                except aiocoll.DistError:  # no such job yet
                    jobs = []
                if jobs and jobs[0]["members_total"] >= count:
                    return
                assert time.monotonic() < deadline, f"{count} members of job {job!r} did not join: {jobs}"
                await asyncio.sleep(0.05)
        finally:
            await session.aclose()

    asyncio.run(members())


@pytest.mark.timeout(120)
def test_a_refused_join_fails_the_members_already_waiting_at_once(tmp_path: Path) -> None:
    port = free_port()
    env = dict(os.environ, AIOCOLL_TOKEN=TOKEN)
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "aiocoll", "coordinator", "--port", str(port), "--log-level", "WARNING"],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"tcp://127.0.0.1:{port}"
        for job, late in (("dup", ["1", "3"]), ("size", ["2", "4"])):
            waiting = [
                subprocess.Popen(
                    [sys.executable, "-c", _JOINER, url, str(rank), "3", job, "60"],
                    env=env,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for rank in (0, 1)
            ]
            _wait_members(url, job, 2)  # both are waiting in the rendezvous now
            started = time.monotonic()
            refused = subprocess.run(
                [sys.executable, "-c", _JOINER, url, late[0], late[1], job, "60"],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert refused.stdout.startswith("RendezvousError|"), refused.stdout + refused.stderr
            for proc in waiting:
                text, _ = proc.communicate(timeout=30)
                name, _, message = text.strip().partition("|")
                assert name == "RendezvousError", text
                assert "refused a join" in message
                assert ("same rank" in message) if job == "dup" else ("world size 4" in message)
            assert time.monotonic() - started < BOUND  # not the 60 s rendezvous timeout
        # A wrong token: the waiting members only hear of it (in their log), they are not failed.
        waiting = [
            subprocess.Popen(
                [sys.executable, "-c", _JOINER, url, str(rank), "3", "tok", "6"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in (0, 1)
        ]
        _wait_members(url, "tok", 2)
        wrong = subprocess.run(
            [sys.executable, "-c", _JOINER, url, "2", "3", "tok", "60"],
            env=dict(env, AIOCOLL_TOKEN="not-the-token"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert wrong.stdout.startswith("RendezvousError|") or wrong.stdout.startswith("AuthenticationError|")
        for proc in waiting:
            out, err = proc.communicate(timeout=30)
            assert out.startswith("RendezvousError|") and "timed out" in out, out + err  # their own timeout
            assert "event=join_refused" in err and "give it the same token" in err, err
    finally:
        coordinator.terminate()
        coordinator.wait(10)


@pytest.mark.timeout(60)
def test_aiocoll_run_passes_the_liveness_and_progress_limits_to_its_coordinator_and_workers() -> None:
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiocoll",
            "run",
            "--heartbeat-timeout",
            "4",
            "--progress-after",
            "2",
            "--no-python",
            "sh",
            "-c",
            "echo HB=$AIOCOLL_HEARTBEAT_TIMEOUT PA=$AIOCOLL_PROGRESS_AFTER",
        ],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert shown.returncode == 0, shown.stderr
    assert "HB=4 PA=2" in shown.stdout
