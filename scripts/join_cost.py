"""What a warm join costs each process and the coordinator: N processes forked from one that
imported the session (as `aiocoll bench --op rendezvous` forks them), each connected before the
release, join one round; each reports when it started its join after the release, the join's wall
time, its CPU time and minor page faults (getrusage around ``join``), and the coordinator (its
own process, as scripts/store_cost.py runs it) its CPU time over the rendezvous. A developer's
tool; docs/PERFORMANCE.md quotes it.

    python scripts/join_cost.py --procs 64
    python scripts/join_cost.py --procs 64 --calls     # + Python calls of one process's join
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import resource
import secrets
import statistics
import sys
import time
from typing import Any

from store_cost import Server, _serve_aiocoll  # the coordinator in a process of its own


def _cpu_and_faults() -> tuple[float, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt


def _participant(
    rank: int, procs: int, port: int, token: str, job: str, calls: bool, go: Any, release: Any, results: Any
) -> None:
    import uvloop
    from aiocoll.client.control.session import CoordinatorSession

    async def main() -> None:
        session = await CoordinatorSession.connect(
            "127.0.0.1", port, token=token, job=job, role="worker", timeout=60
        )
        released = asyncio.get_running_loop().run_in_executor(None, release.wait, 60)
        results.put(("ready", rank))
        go.wait()
        began = time.monotonic()
        cpu, faults = _cpu_and_faults()
        count = [0]
        if calls and rank == 0:

            def profile(frame: Any, event: str, arg: Any) -> None:
                if event == "call":
                    count[0] += 1

            sys.setprofile(profile)
        await session.join(rank, procs, [("127.0.0.1", 20000 + rank)], "join-cost", 60)
        sys.setprofile(None)
        cpu_after, faults_after = _cpu_and_faults()
        results.put(
            ("done", (rank, began, time.monotonic(), cpu_after - cpu, faults_after - faults, count[0]))
        )
        await released
        await session.aclose()

    uvloop.run(main())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=64, help="processes that join (default 64)")
    parser.add_argument("--calls", action="store_true", help="count the Python calls of rank 0's join")
    args = parser.parse_args()
    token = secrets.token_hex(8)
    server = Server(_serve_aiocoll, token, False)
    port = server.port
    import aiocoll.client.control.session  # noqa: F401  (imported once, shared by every fork)

    fork = multiprocessing.get_context("fork")
    go, release, results = fork.Event(), fork.Event(), fork.Queue()
    job = f"join-cost-{secrets.token_hex(4)}"
    children = [
        fork.Process(
            target=_participant,
            args=(rank, args.procs, port, token, job, args.calls, go, release, results),
            daemon=True,
        )
        for rank in range(args.procs)
    ]
    for child_process in children:
        child_process.start()
    for _ in children:
        results.get(timeout=120)
    time.sleep(0.5)
    server_cpu = server.ask("cpu")
    begin = time.monotonic()
    go.set()
    rows = [results.get(timeout=120)[1] for _ in children]
    server_cpu_after = server.ask("cpu")
    release.set()
    for child_process in children:
        child_process.join(10)
    server.stop()
    last = max(row[2] for row in rows) - begin
    starts = [row[1] - begin for row in rows]
    print(f"# join_cost: {args.procs} warm processes, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"release to the last holding its table: {last * 1e3:.1f} ms")
    print(
        f"join started after the release: median {statistics.median(starts) * 1e3:.1f} ms, "
        f"last {max(starts) * 1e3:.1f} ms"
    )
    print(f"join wall time: median {statistics.median(row[2] - row[1] for row in rows) * 1e3:.1f} ms")
    print(
        f"per process: CPU median {statistics.median(row[3] for row in rows) * 1e3:.3f} ms, "
        f"minor faults median {statistics.median(row[4] for row in rows):.0f}"
        + (f", Python calls (rank 0) {next(row[5] for row in rows if row[0] == 0)}" if args.calls else "")
    )
    print(f"coordinator: CPU {(server_cpu_after - server_cpu) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
