"""The least Python a small awaited operation over shared memory can run: a developer's yardstick
for the per-operation path, beside MPI in the same invocation. docs/PERFORMANCE.md quotes it.

Two forked processes share one anonymous mapping: a slot and a sequence counter per rank. An
all_reduce writes its slot, publishes its counter, spins until the peer's counter arrives, adds
the peer's slot into the tensor, and then waits for the peer to have read its slot before the
next one may overwrite it. A ping-pong round trip is one counter bump each way. Each runs as an
awaited coroutine in a uvloop event loop, the way an aiocoll operation is awaited; there are no
argument checks, no record, no deadline, no failure detection and no sleeping (both ranks spin,
so it needs a core per rank). What aiocoll runs beyond this is the price of those.

    python scripts/shm_floor.py                 # floor and MPI, 4-byte all_reduce and ping-pong
    python scripts/shm_floor.py --ops 50000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

_ROW = 8  # int64 counters per rank: [published, read]
_SLOT = 16  # float32 elements per rank's slot


def _ranks(job: Callable[[int, np.ndarray, np.ndarray], float], ops: int) -> float:
    """Run ``job(rank, counters, slots)`` on two forked processes over one shared mapping;
    returns rank 0's microseconds per operation."""
    mem = mmap.mmap(-1, 4096)
    counters = np.frombuffer(mem, np.int64, count=2 * _ROW)
    slots = np.frombuffer(mem, np.float32, count=2 * _SLOT, offset=1024)
    result = np.frombuffer(mem, np.float64, count=1, offset=2048)
    pids = []
    for rank in (0, 1):
        pid = os.fork()
        if pid == 0:
            seconds = job(rank, counters, slots)
            if rank == 0:
                result[0] = seconds / ops * 1e6
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    return float(result[0])


def _sides(rank: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(my slot, the peer's slot, my row, the peer's row)."""
    peer = 1 - rank
    mine, theirs = slots[_SLOT * rank : _SLOT * rank + 1], slots[_SLOT * peer : _SLOT * peer + 1]
    return mine, theirs, _ROW * rank, _ROW * peer


def _in_loop(main: Coroutine[Any, Any, float]) -> float:
    try:
        import uvloop

        return uvloop.run(main)
    except ImportError:
        return asyncio.run(main)


def all_reduce_floor(ops: int, warmup: int) -> float:
    def job(rank: int, counters: np.ndarray, slots: np.ndarray) -> float:
        mine, theirs, me, peer = _sides(rank, slots)
        x = np.zeros(1, np.float32)
        seq = 0

        async def all_reduce(x: np.ndarray) -> np.ndarray:
            nonlocal seq
            seq += 1
            mine[:] = x
            counters[me] = seq
            while counters[peer] < seq:
                pass
            np.add(mine, theirs, out=x)
            counters[me + 1] = seq  # my read of the peer's slot is done
            while counters[peer + 1] < seq:
                pass
            return x

        async def main() -> float:
            for _ in range(warmup):
                await all_reduce(x)
            start = time.perf_counter()
            for _ in range(ops):
                await all_reduce(x)
            return time.perf_counter() - start

        return _in_loop(main())

    return _ranks(job, ops)


def ping_pong_floor(ops: int, warmup: int) -> float:
    """Microseconds one way."""

    def job(rank: int, counters: np.ndarray, slots: np.ndarray) -> float:
        mine, theirs, me, peer = _sides(rank, slots)
        x = np.zeros(1, np.float32)

        async def send(i: int) -> None:
            mine[:] = x
            counters[me] = i

        async def recv(i: int) -> None:
            while counters[peer] < i:
                pass
            x[:] = theirs

        async def round_trip(i: int) -> None:
            if rank == 0:
                await send(i)
                await recv(i)
            else:
                await recv(i)
                await send(i)

        async def main() -> float:
            for i in range(1, warmup + 1):
                await round_trip(i)
            start = time.perf_counter()
            for i in range(warmup + 1, warmup + ops + 1):
                await round_trip(i)
            return (time.perf_counter() - start) / 2

        return _in_loop(main())

    return _ranks(job, ops)


def mpi_rank(ops: int, warmup: int) -> None:
    """One rank of the MPI side (run under mpiexec): the same two loops with mpi4py."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    x, y = np.zeros(1, np.float32), np.zeros(1, np.float32)
    for _ in range(warmup):
        comm.Allreduce(x, y)
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(ops):
        comm.Allreduce(x, y)
    reduce_us = (time.perf_counter() - start) / ops * 1e6
    other = 1 - comm.rank
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(ops):
        if comm.rank == 0:
            comm.Send(x, other)
            comm.Recv(y, other)
        else:
            comm.Recv(y, other)
            comm.Send(y, other)
    ping_us = (time.perf_counter() - start) / ops / 2 * 1e6
    if comm.rank == 0:
        print(f"{reduce_us} {ping_us}", flush=True)


def mpi_times(ops: int, warmup: int) -> tuple[float, float] | None:
    """MPI's (all_reduce us/op, ping-pong us one way), or None without mpi4py and mpiexec."""
    from aiocoll.cli._bench_mpi import MpiUnavailable, find_mpiexec

    try:
        mpiexec = find_mpiexec()
    except MpiUnavailable as exc:
        print(f"no MPI side: {exc}", file=sys.stderr)
        return None
    cmd = [mpiexec, "-n", "2", sys.executable, __file__, "--mpi-rank"]
    cmd += ["--ops", str(ops), "--warmup", str(warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout.split()
    return float(out[0]), float(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ops", type=int, default=20000, help="timed operations (default 20000)")
    parser.add_argument("--warmup", type=int, default=500, help="untimed operations first (default 500)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of floor then MPI (default 1)")
    parser.add_argument("--mpi-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mpi_rank:
        mpi_rank(args.ops, args.warmup)
        return
    for round_ in range(1, args.rounds + 1):
        reduce_us = all_reduce_floor(args.ops, args.warmup)
        ping_us = ping_pong_floor(args.ops, args.warmup)
        mpi = mpi_times(args.ops, args.warmup)
        line = f"round {round_}: floor all_reduce 4 B {reduce_us:.2f} us/op"
        line += f", ping-pong {ping_us:.2f} us one way"
        if mpi is not None:
            line += (
                f"; MPI {mpi[0]:.2f} and {mpi[1]:.2f}; floor/MPI {reduce_us / mpi[0]:.2f}x and "
                f"{ping_us / mpi[1]:.2f}x (load {os.getloadavg()[0]:.1f})"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
