"""What an all_reduce (4 bytes unless ``--bytes``) costs per call through torch.distributed: an
empty Python backend (a ProcessGroup subclass whose every call completes at once), gloo, and
aiocoll's backend "aiocoll", beside aiocoll.sync and the async API on the same ranks. A
developer's tool that separates what torch's dispatch to a Python backend costs (the empty
backend) from what is aiocoll's; docs/PERFORMANCE.md quotes it.

Two more backends step from the empty one towards aiocoll's, each adding one part of its call:
"work" reads c10d's reduce op and returns aiocoll's torch Work (already complete), "bridge" also
issues an operation that does nothing through the loop-thread bridge (aiocoll._sync_loop), driven
on the calling thread as a real one is. What aiocoll's backend costs beyond "bridge" is the async
core's operation itself.

Run it under the launcher (under the bench lock on a shared machine):

    aiocoll run --nproc-per-node 1 scripts/backend_overhead.py    # per-call cost, no peer
    aiocoll run --nproc-per-node 2 scripts/backend_overhead.py --iters 2000 --rounds 5
    aiocoll run --nproc-per-node 2 scripts/backend_overhead.py --profile aiocoll   # cProfile, rank 0
    aiocoll run --nproc-per-node 1 scripts/backend_overhead.py --count aiocoll     # opcodes per call

``--count`` traces rank 0's calling thread as scripts/op_cost.py --count does (opcodes, Python
and C calls per call, waits left out): numbers that do not move with the machine's load.

``--beside`` asks what a call costs beside aiocoll's operation rather than in a loop of its own:
each of a few calls (a call of the empty backend; a torch op on a one-element tensor; pure
Python, called directly and as a backend's body; a call that releases the GIL; a sum over 256
KiB; the one-element tensor's numpy view, torch's and aiocoll's working array; c10d's reduce op
read as ``.op.value`` and as aiocoll's backend reads it) is timed alone, in a tight loop, and
then before each 4-byte ``aiocoll.sync`` all_reduce, less that all_reduce's own time (alternated
rounds, medians; rank 0 prints):

    aiocoll run --nproc-per-node 2 scripts/backend_overhead.py --beside

``--bytes N`` makes every all_reduce N bytes (float32) instead of 4, in both modes: where the
torch backend's time goes beside a large operation, whose numpy view of the tensor is not
remembered (see aiocoll.device._tensors). Its paths then include ``sync_np``, aiocoll.sync on a
numpy array of that size (what ``aiocoll bench --api sync`` times with numpy buffers), and
``--beside`` adds a row for the working array of a tensor of that size.

aiocoll.sync.init_process_group makes torch's default group on "aiocoll" over its own world (the
torch path measured here is that group); gloo and the empty backend are torch new_groups. The
paths run in interleaved rounds; rank 0 prints, per path, the median over rounds of the wall
time per call and the CPU time per call (this process, every thread), and the ratios to the
async API's.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import select
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as td
from op_cost import Counter  # (this script's folder is first on the import path)

import aiocoll.sync as dist
from aiocoll._sync_loop import Outcome, get_loop_thread
from aiocoll._torch_work import AiocollWork
from aiocoll._work import Work as CoreWork
from aiocoll.device._tensors import as_working
from aiocoll.torch import _reduce_op


class _DoneWork(td.Work):
    """A Work that completed at its creation (what the least a Python backend returns costs)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._tensors = tensors

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(self._tensors)
        return future


class EmptyBackend(td.ProcessGroup):
    """Completes every all_reduce and barrier at once, moving nothing."""

    def __init__(self, store: Any, rank: int, size: int, timeout: Any) -> None:
        super().__init__(rank, size)

    def getBackendName(self) -> str:
        return "empty"

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> td.Work:
        return _DoneWork(tensors)

    def barrier(self, opts: Any = None) -> td.Work:
        return _DoneWork([])


class WorkBackend(EmptyBackend):
    """The empty backend plus aiocoll's backend's reading of the reduce op and its torch Work."""

    def __init__(self, store: Any, rank: int, size: int, timeout: Any) -> None:
        super().__init__(store, rank, size, timeout)
        self._done = Outcome()
        self._done._set_result(None)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> td.Work:
        _reduce_op(opts)
        return AiocollWork(self._done, "allreduce", tensors)


class BridgeBackend(EmptyBackend):
    """The "work" backend plus an operation that does nothing, issued through the bridge."""

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> td.Work:
        _reduce_op(opts)
        loop = get_loop_thread()
        outcome = loop.issue(lambda: CoreWork.born(None, loop.loop))
        return AiocollWork(outcome, "allreduce", tensors)


def _pure_python() -> int:
    total = 0
    for i in range(120):
        total += i
    return total


class PurePythonBackend(EmptyBackend):
    """The empty backend, running the pure-Python loop of --beside at each all_reduce."""

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> td.Work:
        _pure_python()
        return _DoneWork(tensors)


def beside(empty: Any, pure: Any, iters: int, rounds: int, nbytes: int) -> dict[str, tuple[float, float]]:
    """Per call: (µs alone in a tight loop, µs it adds before each aiocoll.sync all_reduce of ``nbytes``)."""
    t = torch.zeros(1, dtype=torch.float32)
    x = np.zeros(max(1, nbytes // 4), dtype=np.float32)
    sized = torch.zeros(x.size, dtype=torch.float32)
    big = np.zeros(64 * 1024, dtype=np.float32)
    opts = td.AllreduceOptions()
    opts.reduceOp = td.ReduceOp.SUM
    calls: dict[str, Callable[[], Any] | None] = {
        "none": None,
        "empty backend": lambda: td.all_reduce(t, group=empty),
        "t.add_(0)": lambda: t.add_(0),
        "pure Python": _pure_python,
        # the same loop as a backend's body: alone, the sum of the two rows above, or more
        "pure in backend": lambda: td.all_reduce(t, group=pure),
        "select, 0 s": lambda: select.select([], [], [], 0),  # (releases the GIL)
        "sum of 256 KiB": big.sum,
        # a tensor's working array and c10d's reduce op, as torch makes them and as aiocoll reads them
        "t.numpy()": t.numpy,
        "as_working(t)": lambda: as_working(t),
        # a tensor of the all_reduce's size: above the remembered views' bound, a new view each call
        f"as_working({nbytes} B)": lambda: as_working(sized),
        "op.op.value": lambda: opts.reduceOp.op.value,
        "_reduce_op": lambda: _reduce_op(opts),
    }
    alone = {name: _timed(call, iters)[0] if call is not None else 0.0 for name, call in calls.items()}

    def with_all_reduce(call: Callable[[], Any] | None) -> float:
        wall = time.perf_counter()
        for _ in range(iters):
            if call is not None:
                call()
            dist.all_reduce(x)
        return (time.perf_counter() - wall) * 1e6 / iters

    added: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():  # warm up
        with_all_reduce(call)
    for r in range(rounds):
        # each call's time less the bare all_reduce's of the same round (times drift with the load)
        order = list(calls) if r % 2 == 0 else list(calls)[::-1]
        found = {}
        for name in order:
            dist.barrier()
            found[name] = with_all_reduce(calls[name])
        for name in calls:
            added[name].append(found[name] - found["none"])
    return {name: (alone[name], statistics.median(added[name])) for name in calls}


def _timed(call: Callable[[], Any], iters: int) -> tuple[float, float]:
    """(wall µs, CPU µs of the whole process) per call over ``iters`` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        call()
    return (time.perf_counter() - wall) * 1e6 / iters, (time.process_time() - cpu) * 1e6 / iters


PATHS = ["empty", "work", "bridge", "gloo", "aiocoll", "sync", "sync_np"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=1000, help="calls per path per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are kept")
    parser.add_argument("--profile", choices=PATHS, help="cProfile this path on rank 0")
    parser.add_argument(
        "--count",
        choices=PATHS,
        help="count opcodes and calls per call of this path on rank 0's calling thread",
    )
    parser.add_argument("--top", type=int, default=30, help="lines of --count detail")
    parser.add_argument("--bytes", type=int, default=4, help="every all_reduce's size in bytes (float32)")
    parser.add_argument(
        "--beside",
        action="store_true",
        help="only time a few calls alone and beside an aiocoll.sync all_reduce (see the docstring)",
    )
    args = parser.parse_args()

    td.Backend.register_backend("empty", EmptyBackend, devices=["cpu"])
    td.Backend.register_backend("work", WorkBackend, devices=["cpu"])
    td.Backend.register_backend("bridge", BridgeBackend, devices=["cpu"])
    td.Backend.register_backend("pure", PurePythonBackend, devices=["cpu"])
    dist.init_process_group("gloo")  # aiocoll; torch's default group runs on "aiocoll" over it
    rank = dist.get_rank()
    if args.beside:
        found = beside(
            td.new_group(backend="empty"), td.new_group(backend="pure"), args.iters, args.rounds, args.bytes
        )
        if rank == 0:
            ranks, rounds = dist.get_world_size(), args.rounds
            size = f"{args.bytes}-byte all_reduce"
            print(f"# us per call, {ranks} rank(s), {size}, medians of {rounds} rounds of {args.iters}")
            print(f"{'call':>15} {'alone':>7} {'added beside the all_reduce':>28}")
            for name, (alone_us, added_us) in found.items():
                print(f"{name:>15} {alone_us:7.2f} {added_us:28.2f}")
        dist.destroy_process_group()
        return
    gloo = td.new_group(backend="gloo")
    empty = td.new_group(backend="empty")
    work = td.new_group(backend="work")
    bridge = td.new_group(backend="bridge")
    core = dist.group.WORLD.core  # type: ignore[union-attr]
    loop = get_loop_thread()
    count = max(1, args.bytes // 4)
    t = torch.zeros(count, dtype=torch.float32)
    a = np.zeros(count, dtype=np.float32)

    async def async_round(iters: int) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(iters):
            await core.all_reduce(t)
        return (time.perf_counter() - wall) * 1e6 / iters, (time.process_time() - cpu) * 1e6 / iters

    paths: dict[str, Callable[[int], tuple[float, float]]] = {
        "empty": lambda n: _timed(lambda: td.all_reduce(t, group=empty), n),
        "work": lambda n: _timed(lambda: td.all_reduce(t, group=work), n),
        "bridge": lambda n: _timed(lambda: td.all_reduce(t, group=bridge), n),
        "gloo": lambda n: _timed(lambda: td.all_reduce(t, group=gloo), n),
        "aiocoll": lambda n: _timed(lambda: td.all_reduce(t), n),
        "sync": lambda n: _timed(lambda: dist.all_reduce(t), n),
        "sync_np": lambda n: _timed(lambda: dist.all_reduce(a), n),
        # the whole round runs on the loop thread: what the async API costs a coroutine
        "async": lambda n: loop.run(async_round(n)),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    for run in paths.values():  # warm up every path
        td.barrier(group=gloo)
        run(max(1, args.iters // 10))
    for r in range(args.rounds):
        order = list(paths) if r % 2 == 0 else list(paths)[::-1]
        for name in order:
            td.barrier(group=gloo)
            results[name].append(paths[name](args.iters))
    if args.profile and rank == 0:
        td.barrier(group=gloo)
        profiler, on_loop = cProfile.Profile(), cProfile.Profile()
        loop.call(on_loop.enable)  # the loop thread's part, profiled apart
        profiler.enable()
        paths[args.profile](args.iters)
        profiler.disable()
        loop.call(on_loop.disable)
        print("## the calling thread")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        print("## the loop thread")
        pstats.Stats(on_loop).sort_stats("tottime").print_stats(30)
    elif args.profile:
        td.barrier(group=gloo)
        paths[args.profile](args.iters)
    if args.count:
        td.barrier(group=gloo)
        counter = Counter() if rank == 0 else None
        calls = min(args.iters, 300)
        if counter is not None:
            counter.start()
        paths[args.count](calls)
        if counter is not None:
            counter.stop()
            print(f"## {args.count}, counted on the calling thread")
            print(counter.report(calls, args.top))
    if rank == 0:
        base = statistics.median(w for w, _ in results["async"])
        ranks = dist.get_world_size()
        print(f"# {args.bytes}-byte all_reduce, {ranks} rank(s), {args.rounds} rounds of {args.iters}")
        print(f"{'path':>8} {'wall us/call':>13} {'cpu us/call':>12} {'wall/async':>11}")
        for name, rows in results.items():
            wall = statistics.median(w for w, _ in rows)
            cpu = statistics.median(c for _, c in rows)
            print(f"{name:>8} {wall:13.1f} {cpu:12.1f} {wall / base:11.2f}")
    td.barrier(group=gloo)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
