"""The rank side of `aiocoll bench` for collectives: runs in each spawned worker process.

A worker joins an aiocoll process group (and, with ``--vs gloo``, a torch.distributed gloo group
in the same process), then for every op and size runs both implementations one after the other —
alternating which goes first from size to size, so drifting machine noise falls on both — and
sends its per-iteration times to the parent through a queue. Imports numpy and aiocoll in the
child only; torch only when the run asks for gloo or torch tensors. gloo's blocking calls run on the
event loop's thread, in slices that let the loop breathe between iterations. Every op is checked for a
correct result once per size before it is timed, so a benchmark never times a no-op.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import resource
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

from ._bench_common import SizedOp, contender_gap, run_loop
from ._bench_servers import quiet_logs

__all__ = ["Buffers", "OpRunner", "pingpong", "time_blocking", "worker_main"]

Msg = tuple[Any, ...]


def pingpong(pg: Any, buf: Any, rank: int) -> Callable[[], Any]:
    """One round trip of aiocoll's ping-pong between ranks 0 and 1 (a send and a receive on each;
    other ranks idle); scripts/op_cost.py times it too."""

    async def ping() -> None:
        await pg.send(buf, 1)
        await pg.recv(buf, 1)

    async def pong() -> None:
        await pg.recv(buf, 0)
        await pg.send(buf, 0)

    async def idle() -> None:
        return None

    return ping if rank == 0 else pong if rank == 1 else idle


class Buffers:
    """The input/output buffers of one op at one size, as numpy arrays or torch tensors."""

    def __init__(
        self, sized: SizedOp, dtype: str, use_torch: bool, rank: int, world_size: int, device: Any = None
    ) -> None:
        self.sized = sized
        self.rank = rank
        self.n = world_size
        if use_torch:
            import torch

            tdtype = getattr(torch, dtype)
            self.inp: Any = torch.zeros(sized.in_count, dtype=tdtype, device=device)
            self.out: Any = torch.zeros(sized.out_count, dtype=tdtype, device=device)
        else:
            import numpy as np

            self.inp = np.zeros(sized.in_count, dtype=dtype)
            self.out = np.zeros(sized.out_count, dtype=dtype)
        self._torch = use_torch

    def fill(self, buf: Any, value: float) -> None:
        if self._torch:
            buf.fill_(value)
        else:
            buf[...] = value

    def fill_blocks(self, buf: Any, values: list[int]) -> None:
        """Fill block j of ``buf`` (split into len(values) equal parts) with values[j]."""
        block = len(buf) // len(values)
        for j, value in enumerate(values):
            self.fill(buf[j * block : (j + 1) * block], value)

    def blocks_equal(self, buf: Any, values: list[int]) -> bool:
        block = len(buf) // len(values)
        return all(self.equal(buf[j * block : (j + 1) * block], v) for j, v in enumerate(values))

    def equal(self, buf: Any, value: float) -> bool:
        return bool((buf == value).all())

    def zero(self) -> None:
        self.fill(self.inp, 0)
        self.fill(self.out, 0)


class OpRunner:
    """How one implementation runs one op: ``run()`` once, ``check()`` once for correctness."""

    def __init__(self, impl: str, op: str, bufs: Buffers, pg: Any) -> None:
        self.impl = impl
        self.op = op
        self.b = bufs
        self.pg = pg

    # The aiocoll calls (awaitables); gloo's are the same names on torch.distributed, blocking.
    def calls(self) -> Callable[[], Any]:
        pg, b, rank = self.pg, self.b, self.b.rank
        op = self.op
        if op == "all_reduce":
            return lambda: pg.all_reduce(b.inp)
        if op == "broadcast":
            return lambda: pg.broadcast(b.inp, src=0)
        if op == "reduce":
            return lambda: pg.reduce(b.inp, dst=0)
        if op == "all_gather":
            return lambda: pg.all_gather_into_tensor(b.out, b.inp)
        if op == "reduce_scatter":
            return lambda: pg.reduce_scatter_tensor(b.out, b.inp)
        if op == "all_to_all":
            return lambda: pg.all_to_all_single(b.out, b.inp)
        if op == "barrier":
            return lambda: pg.barrier()
        if op == "sendrecv":
            return self._pingpong(rank)
        raise ValueError(f"unknown op {op!r}")

    def _pingpong(self, rank: int) -> Callable[[], Any]:
        pg, buf = self.pg, self.b.inp
        if self.impl == "aiocoll":
            return pingpong(pg, buf, rank)

        def ping_sync() -> None:
            pg.send(buf, 1)
            pg.recv(buf, 1)

        def pong_sync() -> None:
            pg.recv(buf, 0)
            pg.send(buf, 0)

        return ping_sync if rank == 0 else pong_sync if rank == 1 else (lambda: None)

    def prepare_check(self) -> None:
        b, n, rank = self.b, self.b.n, self.b.rank
        op = self.op
        if op == "all_to_all":
            b.fill_blocks(b.inp, [rank * n + j for j in range(n)])
        elif op == "sendrecv":
            b.fill(b.inp, 7 if rank == 0 else 0)
        else:
            b.fill(b.inp, rank + 1)
        b.fill(b.out, 0)

    def verify(self) -> str | None:
        """None when the result is right, else what was wrong."""
        b, n, rank = self.b, self.b.n, self.b.rank
        op = self.op
        total = n * (n + 1) // 2
        if op == "all_reduce":
            ok = b.equal(b.inp, total)
        elif op == "broadcast":
            ok = b.equal(b.inp, 1)
        elif op == "reduce":
            ok = b.equal(b.inp, total) if rank == 0 else True
        elif op == "all_gather":
            ok = b.blocks_equal(b.out, [j + 1 for j in range(n)])
        elif op == "reduce_scatter":
            ok = b.equal(b.out, total)
        elif op == "all_to_all":
            ok = b.blocks_equal(b.out, [j * n + rank for j in range(n)])
        elif op == "sendrecv":
            ok = b.equal(b.inp, 7) if rank in (0, 1) else True
        else:
            ok = True
        return None if ok else f"{self.impl} {op} gave a wrong result on rank {rank} at {b.sized.size} bytes"


class _AlgorithmHook:
    """Records which algorithm aiocoll ran for each kind of collective, and can force one.

    The process group takes no per-call algorithm argument, so the benchmark wraps the planner's
    ``choose_algorithm`` in this worker process only: ``--algorithm`` wins wherever the kind
    offers it (other kinds keep their default), and every choice is recorded so the table can
    show what actually ran. Nothing outside the benchmark's own processes is affected.
    """

    def __init__(self, forced: str | None) -> None:
        from aiocoll.algorithms import _plan

        self.forced = forced
        self.last: dict[str, str] = {}
        self._offered = _plan.ALGORITHMS
        self._choose = _plan.choose_algorithm
        _plan.choose_algorithm = self._chosen

    def _chosen(self, kind: str, nbytes: int, world_size: int) -> str:
        algorithm = self._choose(kind, nbytes, world_size)
        if self.forced is not None and self.forced in self._offered.get(kind, ()):
            algorithm = self.forced
        self.last[kind] = algorithm
        return algorithm


_Usage = tuple[float, float, int, int, dict[str, int]]


def _thread_ticks() -> dict[str, int]:
    """CPU clock ticks (user + system) of each thread of this process, by thread id (Linux)."""
    ticks = {}
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as handle:
                fields = handle.read().rpartition(")")[2].split()
            ticks[tid] = int(fields[11]) + int(fields[12])  # utime, stime (stat fields 14, 15)
    except OSError:
        pass
    return ticks


def _rusage() -> _Usage:
    """(wall clock, CPU seconds, voluntary and involuntary context switches, per-thread ticks)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime
    return time.perf_counter(), cpu, usage.ru_nvcsw, usage.ru_nivcsw, _thread_ticks()


def usage_per_op(before: _Usage, iters: int) -> dict[str, float]:
    """What the timed iterations since ``before`` cost this process per operation: CPU time
    (µs, every thread), voluntary context switches (it blocked: waits, wake-ups), involuntary
    ones (it was preempted: the CPU was wanted elsewhere), and how many threads did a tenth or
    more of that CPU work (under load each runnable thread gets its own share of the cores)."""
    wall, cpu, voluntary, involuntary, ticks = _rusage()
    cpu -= before[1]
    grown = [t - before[4].get(tid, 0) for tid, t in ticks.items()]
    busy = sum(1 for g in grown if g > 0.1 * sum(grown)) if sum(grown) > 0 else 0
    return {
        "cpu_us": cpu * 1e6 / iters,
        "cpu_share": cpu / (wall - before[0]) if wall > before[0] else 0.0,
        "vcsw": (voluntary - before[2]) / iters,
        "ivcsw": (involuntary - before[3]) / iters,
        "busy_threads": busy,
    }


async def _time_aiocoll(runner: OpRunner, warmup: int, iters: int) -> tuple[list[float], dict[str, float]]:
    pg = runner.pg
    call = runner.calls()
    if runner.op != "barrier":
        runner.prepare_check()
        await pg.barrier()
        await call()
        problem = runner.verify()
        if problem:
            raise AssertionError(problem)
        runner.b.zero()
    await pg.barrier()
    for _ in range(warmup):
        await call()
    await pg.barrier()
    times = []
    clock = time.perf_counter
    before = _rusage()
    for _ in range(iters):
        start = clock()
        await call()
        times.append(clock() - start)
    return times, usage_per_op(before, iters)


# gloo's calls block. They run on the event loop's own thread, as a plain torch script would run
# them: measured side by side, gloo in a worker thread came out 1.3-6x slower (thread hand-offs on
# two cores). Between iterations, at most every _GLOO_SLICE seconds, the loop gets a turn so the
# aiocoll session's heartbeats never lapse during a long gloo segment; no timed region includes it.
_GLOO_SLICE = 0.5


async def time_blocking(
    runner: OpRunner, warmup: int, iters: int, *, on_device: bool = False
) -> tuple[list[float], dict[str, float]]:
    """Check, warm up and time a blocking implementation (gloo here, MPI in _bench_mpi's ranks).

    ``on_device``: CUDA tensors, whose calls (NCCL's) return once the work is queued on a
    stream; each timed call then includes waiting for the device, as aiocoll's does."""
    dist = runner.pg
    call = runner.calls()
    if on_device:
        from aiocoll.device._cuda import synchronize

        issue = call

        def call() -> Any:
            issue()
            synchronize()

    clock = time.perf_counter
    slice_start = clock()

    async def breathe() -> None:
        nonlocal slice_start
        if clock() - slice_start > _GLOO_SLICE:
            await asyncio.sleep(0)
            slice_start = clock()

    if runner.op != "barrier":
        runner.prepare_check()
        dist.barrier()
        call()
        problem = runner.verify()
        if problem:
            raise AssertionError(problem)
        runner.b.zero()
    dist.barrier()
    for _ in range(warmup):
        call()
        await breathe()
    dist.barrier()
    times = []
    before = _rusage()
    for _ in range(iters):
        start = clock()
        call()
        times.append(clock() - start)
        await breathe()
    return times, usage_per_op(before, iters)


async def _worker(rank: int, cfg: dict[str, Any], put: Callable[[Msg], None]) -> None:
    import aiocoll

    dist: Any = None
    theirs = next((c for c in cfg["vs"] if c in ("gloo", "nccl")), None)  # torch.distributed's
    device = None
    if cfg["tensor"] == "torch-cuda":
        from aiocoll.device._cuda import device_count, set_device

        device = set_device(rank % device_count())
    apis = cfg.get("apis", [])
    if theirs or cfg["tensor"] != "numpy" or "torch" in apis:
        # Import torch before joining: an import of seconds inside the running group would stall
        # the event loop past the coordinator's heartbeat timeout.
        warnings.simplefilter("ignore", FutureWarning)  # torch's renames of *_tensor ops
        import torch.distributed

        if theirs:
            dist = torch.distributed
    n = cfg["world_size"]
    pg = await aiocoll.init_process_group(
        f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=n,
        token=cfg["token"],
        job=cfg["job"],
        timeout=cfg["timeout"],
    )
    if dist is not None:
        timeout = datetime.timedelta(seconds=cfg["timeout"])
        store = dist.TCPStore(
            "127.0.0.1", cfg["gloo_port"], is_master=False, wait_for_workers=False, timeout=timeout
        )
        await asyncio.to_thread(
            dist.init_process_group, theirs, store=store, rank=rank, world_size=n, timeout=timeout
        )
    from ._bench_api import join_apis, leave_apis

    blocking = await join_apis(apis, rank, cfg, dist)  # --api: aiocoll.sync, the torch backend
    put(("ready", rank))
    use_torch = cfg["tensor"] != "numpy"
    hook = _AlgorithmHook(cfg["algorithm"])
    impls = ["aiocoll", *apis, theirs] if theirs else ["aiocoll", *apis]
    step = 0
    for op in cfg["ops"]:
        sizes = [0] if op == "barrier" else cfg["sizes"]
        for size in sizes:
            sized = SizedOp(op, size, n, cfg["itemsize"])
            order = impls if step % 2 == 0 else impls[::-1]
            step += 1
            algorithm = "-"
            for impl in order:
                if impl == "aiocoll":
                    hook.last.pop(op, None)
                    bufs = Buffers(sized, cfg["dtype"], use_torch, rank, n, device)
                    times, usage = await _time_aiocoll(
                        OpRunner(impl, op, bufs, pg), cfg["warmup"], cfg["iters"]
                    )
                    algorithm = hook.last.get(op, "p2p" if op == "sendrecv" else "-")
                    if pg._providers.ran == "arena":  # the group's table says which row ran it
                        algorithm = "shm"  # read each other's memory (no algorithm over links)
                    if device is not None:
                        from aiocoll.device._staged_ops import StagedOp

                        algorithm = f"{algorithm}+{StagedOp.last_path}"  # which device path ran
                elif contender_gap(impl, op, cfg["tensor"]) is not None:
                    times, usage = [], {}  # the row shows "-" for it (the header says why)
                else:
                    bufs = Buffers(sized, cfg["dtype"], use_torch or impl != "sync", rank, n, device)
                    runner = OpRunner(impl, op, bufs, blocking.get(impl, dist))
                    on_device = device is not None
                    times, usage = await time_blocking(
                        runner, cfg["warmup"], cfg["iters"], on_device=on_device
                    )
                if op == "sendrecv":
                    # one iteration is a round trip; report the one-way time, and only from rank 0
                    times = [t / 2 for t in times] if rank == 0 else []
                put(
                    (
                        "times",
                        rank,
                        op,
                        sized.size,
                        impl,
                        times,
                        algorithm if impl == "aiocoll" else "",
                        usage,
                    )
                )
    await leave_apis(blocking, dist)
    await pg.destroy()
    if dist is not None:
        await asyncio.to_thread(dist.destroy_process_group)
    put(("done", rank))


def worker_main(rank: int, cfg: dict[str, Any], queue: Any) -> None:
    """Entry point of a spawned bench worker; reports ``("error", rank, text)`` instead of dying silently."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # two cores: no thread pools fighting the ranks
    if cfg["transport"] is not None:  # --transport: the link factory reads it when the group forms
        os.environ["AIOCOLL_TRANSPORT"] = cfg["transport"]
    quiet_logs(cfg["verbose"])

    def put(message: Msg) -> None:
        queue.put(message)

    try:
        run_loop(_worker(rank, cfg, put), cfg["loop"])
    except BaseException as exc:
        put(("error", rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        raise SystemExit(1) from None
