"""A world of forked processes on this host joined by shared memory only (client.data._shm and
client.data._shm_coll, without the public layer), for the tests of the shared-memory mechanics.

``shm_world(fn, n)`` forks ``n`` processes; each makes its ShmHost, dials the lower ranks, makes
the world's ShmGroup and returns ``await fn(ctx)``; the parent hands the addresses around
through pipes and collects every rank's result (or its traceback, or "killed" for a rank that
died). Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiocoll.client.data._shm import ShmHost, region_bytes
from aiocoll.client.data._shm_coll import ShmGroup
from aiocoll.client.data._shm_sched import ShmWaker

from aiocoll._types import ReduceOp

TOKEN = "shm-test-token"
JOB = "shm-test"


@dataclass
class Ctx:
    rank: int
    n: int
    host: ShmHost
    waker: ShmWaker
    group: ShmGroup
    addresses: list[str]
    seq: int = 0
    runner: Any = None  # what the group returned for the last operation started (its Stoppable)

    def run(self, kind: str, *args: Any, meta: dict[str, Any] | None = None) -> asyncio.Future[Any]:
        """Start one collective on the world group (``kind`` is a ShmGroup method)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def finish(result: Any, exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is None:
                fut.set_result(result)
            else:
                fut.set_exception(exc)

        sig = ShmGroup.signature(self.seq, meta if meta is not None else {"kind": kind})
        self.seq += 1
        self.runner = getattr(self.group, kind)(*args, sig, finish)
        return fut

    def all_reduce(self, x: np.ndarray, op: ReduceOp, dtype: str) -> asyncio.Future[Any]:
        """Start an all_reduce (it runs inside this call as far as it can)."""
        meta = {"kind": "all_reduce", "dtype": dtype, "op": op.value, "count": x.size}
        return self.run("all_reduce", x, op, dtype, meta=meta)


async def _setup(rank: int, n: int, conn: Any, chunk: int, token: str) -> Ctx:
    host = ShmHost(rank, token=token, job=JOB, regions=2, region_bytes=region_bytes(chunk))
    conn.send(host.listen())
    addresses = conn.recv()
    for peer in range(rank):
        await host.connect(peer, addresses[peer])
    for peer in range(rank + 1, n):
        await host.peer(peer, 20)
    waker = ShmWaker(host)
    group = ShmGroup(host, waker, 0, list(range(n)), rank, chunk=chunk, ranks_on_host=n, gid="w")
    host.on_lost(group.peer_lost)
    conn.send("ready")
    assert conn.recv() == "go"
    return Ctx(rank, n, host, waker, group, addresses)


def _child(rank: int, n: int, conn: Any, fn: Callable[[Ctx], Awaitable[Any]], chunk: int, token: str) -> None:
    async def main() -> Any:
        ctx = await _setup(rank, n, conn, chunk, token)
        try:
            return await asyncio.wait_for(fn(ctx), 60)
        finally:
            ctx.group.close()
            ctx.waker.close()
            ctx.host.close()

    try:
        conn.send(("ok", asyncio.run(main())))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", exc_attrs(exc)))


def exc_attrs(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        **{k: getattr(exc, k) for k in ("rank", "ranks", "seq") if hasattr(exc, k)},
    }


def _recv(conn: Any, deadline: float, what: str) -> Any:
    if not conn.poll(max(0.0, deadline - time.monotonic())):
        raise TimeoutError(f"no {what} from a rank in time")
    return conn.recv()


def shm_world(
    fn: Callable[[Ctx], Awaitable[Any]],
    n: int,
    *,
    chunk: int = 64 * 1024,
    timeout: float = 90.0,
    token: str = TOKEN,
) -> list[Any]:
    """Run ``fn`` on ``n`` forked ranks; returns each rank's ("ok", value) / ("error", text, attrs)
    / ("killed", signal)."""
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe() for _ in range(n)]
    procs = [ctx.Process(target=_child, args=(r, n, pipes[r][1], fn, chunk, token)) for r in range(n)]
    deadline = time.monotonic() + timeout
    for p in procs:
        p.start()
    try:
        addresses = [_recv(pipes[r][0], deadline, "address") for r in range(n)]
        for r in range(n):
            pipes[r][0].send(addresses)
        for r in range(n):
            assert _recv(pipes[r][0], deadline, "ready") == "ready"
        for r in range(n):
            pipes[r][0].send("go")
        out: list[Any] = []
        for r in range(n):
            conn = pipes[r][0]
            while not conn.poll(0.05):
                if not procs[r].is_alive() and not conn.poll(0.05):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {r} did not finish in {timeout}s")
            if conn.poll(0):
                out.append(conn.recv())
            else:
                procs[r].join(5)
                out.append(("killed", -(procs[r].exitcode or 0)))
        return out
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)


def values(results: list[Any]) -> list[Any]:
    """Every rank's value; raises with every failing rank's traceback."""
    bad = [f"rank {r}: {res}" for r, res in enumerate(results) if res[0] != "ok"]
    if bad:
        raise AssertionError("\n".join(bad))
    return [res[1] for res in results]


def dev_shm_in_use() -> list[str]:
    """What this process maps or holds open under /dev/shm (race-free, unlike listing the
    directory, which other jobs on the machine may write meanwhile)."""
    with open("/proc/self/maps") as maps:
        mapped = [line.split()[-1] for line in maps if "/dev/shm" in line]
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile (the listing's own descriptor)
            pass
    return mapped + [h for h in held if h.startswith("/dev/shm")]


async def polled_ping_pongs(pg: Any, seconds: float = 0.2, *, until_one_polled: bool = False) -> int:
    """After a barrier, 4-byte round trips between ranks 0 and 1 of ``pg`` for ``seconds``
    (longer than a pause of the polling after waits that outlasted it; other ranks only take
    part in the barrier); returns how many receives of this rank completed while it polled
    for them (in place, or with its event loop kept turning) instead of sleeping.
    ``until_one_polled``: rank 0 goes on past ``seconds`` until one of its receives did (for
    links that poll)."""
    await pg.barrier()
    transport = pg._rt.transport
    before = transport.polled_arrivals
    buf = np.ones(1, np.float32)  # rank 0 sends 1 to go on, 0 for the last round trip
    end = time.monotonic() + seconds
    # On a loaded machine a peer descheduled past the polling window makes every wait of a short
    # run a miss: with until_one_polled, rank 0 goes on (up to 30 s) until one of its receives
    # came while polling.
    latest = end + (30.0 if until_one_polled else 0.0)
    while pg.rank in (0, 1):
        if pg.rank == 0:
            now = time.monotonic()
            go_on = now < end or (transport.polled_arrivals == before and now < latest)
            buf[0] = 1.0 if go_on else 0.0
            last = buf[0] == 0.0
            await pg.send(buf, dst=1)
            await pg.recv(buf, src=1)
        else:
            await pg.recv(buf, src=0)
            last = buf[0] == 0.0
            await pg.send(buf, dst=0)
        if last:
            break
    return int(pg._rt.transport.polled_arrivals - before)
