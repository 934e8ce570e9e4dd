"""The shared-memory exchange (client.data._shm) between real processes: who may attach, what a
killed rank leaves behind, what a waiting rank costs, and memory that turns out not shared."""

from __future__ import annotations

import asyncio
import mmap
import os
import resource
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from aiocoll.client.data._shm import ShmHost, ShmUnavailable, region_bytes
from aiocoll.client.data._shm_layout import DONE, INP, RED
from aiocoll.client.data._shm_sched import ShmOp
from shm_world import JOB, TOKEN, Ctx, dev_shm_in_use, shm_world, values

from aiocoll._errors import AuthenticationError
from aiocoll._types import ReduceOp
from aiocoll.protocol import ClientHandshake

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NOBODY = 65534


def _host(rank: int, token: str = TOKEN) -> ShmHost:
    return ShmHost(rank, token=token, job=JOB, regions=1, region_bytes=region_bytes(64 * 1024))


async def test_two_hosts_share_memory_and_see_each_others_writes() -> None:
    a, b = _host(0), _host(1)
    try:
        a.listen()
        peer_of_b = await b.connect(0, a.address)
        peer_of_a = await a.peer(1, 5)
        assert peer_of_a.shared and peer_of_b.shared
        b.mem[5000:5004] = b"ping"
        assert peer_of_a.mem[5000:5004] == b"ping"  # a reads b's arena through its own mapping
        os.eventfd_write(peer_of_b.efd, 1)
        assert os.eventfd_read(a.efd) == 1
    finally:
        a.close()
        b.close()
        a.close()  # twice is fine


async def test_a_process_without_the_token_cannot_attach() -> None:
    a, intruder = _host(0), _host(1, token="not-the-token")
    try:
        a.listen()
        with pytest.raises(AuthenticationError):
            await intruder.connect(0, a.address)
        for _ in range(100):
            if a.rejected:
                break
            await asyncio.sleep(0.01)
        assert a.rejected == 1 and not a.peers and not intruder.peers
    finally:
        a.close()
        intruder.close()


def _dial_as_nobody(address: str) -> int:
    """In a forked child: become uid 65534, dial, speak the handshake with the right token.
    Exit status: 3 when the listener closed without answering (what we expect), 4 when it
    answered, 5 for anything else.

    The listener checks credentials as soon as it accepts, before reading a byte, so its close
    may come before our hello is sent (EPIPE on send) or after (EOF or ECONNRESET on receive):
    all three are the same refusal, seen at different moments."""
    try:
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect("\0" + address[1:])
        hs = ClientHandshake(TOKEN, role="peer", job=JOB, extra={"rank": 1, "to": 0})
        s.sendall(hs.start())
        data = s.recv(4096)
        return 3 if not data else 4
    except (BrokenPipeError, ConnectionResetError):
        return 3
    except BaseException:
        return 5


async def test_a_process_of_another_user_cannot_attach_even_with_the_token() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to become another user in a child")
    a = _host(0)
    try:
        a.listen()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os._exit(_dial_as_nobody(a.address))
        _, status = await asyncio.get_running_loop().run_in_executor(None, os.waitpid, pid, 0)
        assert os.waitstatus_to_exitcode(status) == 3
        assert a.rejected == 1 and not a.peers
    finally:
        a.close()


async def test_memory_that_is_not_shared_is_refused_on_both_sides() -> None:
    a, b = _host(0), _host(1)
    # b maps something else than a's arena (as in two containers whose descriptors do not
    # carry the memory): a private anonymous mapping of the same size.
    b._map = lambda fd, size: mmap.mmap(-1, size)  # type: ignore[method-assign]
    try:
        a.listen()
        with pytest.raises(ShmUnavailable, match="not shared"):
            await b.connect(0, a.address)
        with pytest.raises(ShmUnavailable):
            await a.peer(1, 1.0)
        assert a.rejected == 1
    finally:
        a.close()
        b.close()


async def test_an_address_in_another_namespace_is_unavailable_not_an_error() -> None:
    b = _host(1)
    try:
        with pytest.raises(ShmUnavailable, match="not reachable"):
            await b.connect(0, "@aiocoll-nobody-listens-here")
    finally:
        b.close()


async def killed_mid_collective(ctx: Ctx) -> dict[str, Any]:
    # what the forked process inherited from the test runner (a multiprocessing semaphore of an
    # earlier test, say) is not ours: only what appears from here on counts
    inherited = set(dev_shm_in_use())
    x = np.ones(1 << 18, np.float32)  # 1 MiB: 16 steps of 64 KiB
    for _ in range(3):
        await ctx.all_reduce(x, ReduceOp.SUM, "float32")
    if ctx.rank == 2:
        assert not set(dev_shm_in_use()) - inherited  # all of its shared memory is anonymous (memfd)
        publish = ctx.group._publish
        calls = [0]

        def publish_then_die(counter: int, t: int) -> None:
            publish(counter, t)
            calls[0] += 1
            if calls[0] == 7:  # inside the next all_reduce, a few steps in
                os.kill(os.getpid(), signal.SIGKILL)

        ctx.group._publish = publish_then_die  # type: ignore[method-assign]
    start = time.monotonic()
    try:
        for _ in range(50):
            await ctx.all_reduce(x, ReduceOp.SUM, "float32")
    except Exception as exc:
        elapsed = time.monotonic() - start
        return {
            "type": type(exc).__name__,
            "rank": getattr(exc, "rank", None),
            "after": elapsed,
            "dev_shm": sorted(set(dev_shm_in_use()) - inherited),
        }
    return {"type": None}


def test_a_rank_killed_mid_collective_fails_every_survivor_and_leaves_nothing() -> None:
    results = shm_world(killed_mid_collective, 3, chunk=64 * 1024)
    assert results[2] == ("killed", signal.SIGKILL)
    for survivor in values(results[:2]):
        assert survivor["type"] == "PeerLostError" and survivor["rank"] == 2, survivor
        assert survivor["after"] < 5.0, survivor
        assert survivor["dev_shm"] == []  # nothing under /dev/shm, so nothing there to leak


async def waits_for_a_late_peer(ctx: Ctx) -> dict[str, Any]:
    x = np.ones(4, np.float32)
    await ctx.all_reduce(x, ReduceOp.SUM, "float32")
    if ctx.rank == 1:
        await asyncio.sleep(1.5)
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    sleeps, completed = ctx.group.sleeps, ctx.group.completed
    late = ctx.all_reduce(x, ReduceOp.SUM, "float32")
    queued = not late.done() and isinstance(ctx.runner, ShmOp)  # (rank 0: its peer is not there)
    await late
    after = resource.getrusage(resource.RUSAGE_SELF)
    out = {
        "cpu": after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime,
        "slept": ctx.group.sleeps - sleeps,
        "completed": ctx.group.completed - completed,
        "queued": queued,
        "x": x.tolist(),
    }
    # A reduce_scatter of one step goes the same way: rank 0's is queued from its wait for the
    # late rank 1, and each rank gets its part of the sum.
    parts = [np.full(2, 1.0 + j + ctx.rank, np.float32) for j in range(ctx.n)]
    mine = np.zeros(2, np.float32)
    if ctx.rank == 1:
        await asyncio.sleep(0.3)
    completed = ctx.group.completed
    meta = {"kind": "reduce_scatter", "dtype": "float32", "op": "sum", "count": 2}
    late = ctx.run("reduce_scatter", mine, parts, ReduceOp.SUM, "float32", meta=meta)
    out["scatter_queued"] = not late.done() and isinstance(ctx.runner, ShmOp)
    await late
    out["scatter"] = mine.tolist()
    out["scatter_completed"] = ctx.group.completed - completed
    await ctx.all_reduce(x, ReduceOp.SUM, "float32")  # (both ranks past the late one)
    row = ctx.group._ctl[0]
    before = [row[INP], row[RED], row[DONE]]
    if ctx.rank == 0:
        # One that rank 1 never calls, stopped while it sleeps (as the engine does at its
        # deadline): what rank 0 published for it is taken back, so no late peer completes it.
        # (A loop turn first: the group then runs it inside the call, however long the calls
        # before took on a busy machine, and queues it only once its spin is over.)
        await asyncio.sleep(0)
        never = ctx.all_reduce(x, ReduceOp.SUM, "float32")
        out["published"] = row[INP] - before[0]
        await asyncio.sleep(0.2)  # (asleep in the loop meanwhile)
        ctx.runner.stop()
        out["taken_back"] = [row[INP], row[RED], row[DONE]] == before and not never.done()
    else:
        # Rank 1 stays (a rank that left would fail rank 0's operation before it is stopped)
        # until rank 0 has published its part and taken it back (or 10 s passed).
        step = ctx.group.step + 1
        deadline = time.monotonic() + 10
        seen = False
        while time.monotonic() < deadline:
            seen |= row[INP] >= step
            if seen and row[INP] < step:
                break
            await asyncio.sleep(0.005)
    return out


def test_a_rank_waiting_for_a_late_peer_sleeps_instead_of_spinning() -> None:
    early, late = values(shm_world(waits_for_a_late_peer, 2))
    assert early["x"] == late["x"] == [4.0] * 4
    assert early["slept"] >= 1
    assert early["queued"] and early["completed"] == late["completed"] == 1, (early, late)
    assert early["published"] == 1 and early["taken_back"], early
    assert early["scatter_queued"], early
    assert early["scatter_completed"] == late["scatter_completed"] == 1, (early, late)
    assert early["scatter"] == [3.0, 3.0] and late["scatter"] == [5.0, 5.0], (early, late)
    # 1.5 s of waiting: a spinning rank would burn about that much CPU; a sleeping one almost none
    assert early["cpu"] < 0.5, early


def gathers_pinned_to(cpus: list[int]) -> Callable[[Ctx], Awaitable[dict[str, Any]]]:
    """Each rank pinned to its CPU of ``cpus``, twenty all_gathers of several steps each."""

    async def gathers(ctx: Ctx) -> dict[str, Any]:
        os.sched_setaffinity(0, {cpus[ctx.rank]})
        x = np.full(96 * 1024, ctx.rank + 1, np.float32)  # 384 KiB: three 128 KiB steps
        outs = [np.zeros_like(x) for _ in range(ctx.n)]
        beside, correct = ctx.group.beside, True
        for i in range(20):
            x[0] = i
            await ctx.run("all_gather", outs, x, meta={"kind": "all_gather", "count": x.size})
            correct &= all(o[0] == i and (o[1:] == j + 1).all() for j, o in enumerate(outs))
        return {"beside": ctx.group.beside - beside, "correct": correct}

    return gathers


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin two ranks apart")
def test_ranks_sharing_a_core_see_it_when_they_wait_and_ranks_apart_do_not() -> None:
    # Two ranks on one core: a rank that spun for its peer would hold the peer off the core for
    # a time slice, so a wait for a peer seen last on our own CPU is recognised (and sleeps at
    # once unless every core is busy: then it yields). Ranks on cores of their own never take
    # that path (they spin, as a peer on another core is close).
    cpu, other = sorted(os.sched_getaffinity(0))[:2]
    together = values(shm_world(gathers_pinned_to([cpu, cpu]), 2))
    apart = values(shm_world(gathers_pinned_to([cpu, other]), 2))
    assert all(r["correct"] for r in together + apart), (together, apart)
    assert sum(r["beside"] for r in together) > 0, together
    assert [r["beside"] for r in apart] == [0, 0], apart


async def a_survivor_leaves_after_a_loss(ctx: Ctx) -> dict[str, Any]:
    x = np.ones(4, np.float32)
    await ctx.all_reduce(x, ReduceOp.SUM, "float32")
    if ctx.rank == 1:
        # as if rank 2 had died and only rank 1 had seen it yet: rank 1 fails and leaves, and
        # rank 0 sees rank 1's socket close while rank 2's is still open
        ctx.group.peer_lost(2, "simulated")
        ctx.host.close()
        return {"type": "left"}
    try:
        await ctx.all_reduce(x, ReduceOp.SUM, "float32")
    except Exception as exc:
        return {"type": type(exc).__name__, "rank": getattr(exc, "rank", None), "text": str(exc)}
    return {"type": None}


def test_a_survivor_that_leaves_after_a_loss_is_not_named_as_the_lost_rank() -> None:
    first, left, third = values(shm_world(a_survivor_leaves_after_a_loss, 3))
    assert left == {"type": "left"}
    # rank 0 names the rank rank 1 had lost; rank 2 itself is alive, so it names rank 1
    assert first["type"] == "PeerLostError" and first["rank"] == 2, first
    assert "rank 1 lost it first" in first["text"], first
    assert third["type"] == "PeerLostError" and third["rank"] == 1, third
