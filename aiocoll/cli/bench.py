"""Measure aiocoll's collectives, store and rendezvous, side by side with torch gloo and TCPStore.

`aiocoll bench --op all_reduce --sizes 4:64M --world-size 4 --vs gloo --plot busbw.png` spawns
local ranks that rendezvous through a coordinator on loopback, sweeps the sizes and prints time,
algbw and busbw (nccl-tests' definitions) per size, with the ratio to gloo measured in the same
worker processes. `--op store` and `--op rendezvous` measure the coordinator against torch's
TCPStore. This module only parses arguments: the work lives in the _bench_* modules, imported
when the command runs, so `aiocoll --help` never imports numpy, torch or matplotlib.
"""

from __future__ import annotations

import argparse
import sys

from ._bench_common import BUSBW_FACTORS, COLLECTIVE_OPS, DTYPE_SIZES

__all__ = ["add_arguments", "main"]

_EPILOG = """\
examples:
  aiocoll bench --op all_reduce --sizes 4:64M --world-size 4 --vs gloo --plot allreduce.png
  aiocoll bench --op all_reduce --sizes 4,1M,16M --world-size 2 --vs gloo,mpi --hog 4
  aiocoll bench --op all_reduce --sizes 4,1M,16M --api async,sync,torch --vs gloo --tensor torch
  aiocoll bench --op all --sizes 4,64K,16M --world-size 2 --json out.json
  aiocoll bench --op all_reduce --sizes 4K:256M --tensor torch-cuda --vs nccl
  aiocoll bench --op store --clients 1,8 --vs tcpstore
  aiocoll bench --op rendezvous --procs 64,256 --vs tcpstore --simulated 10000
  aiocoll bench --op rendezvous --procs '' --simulated 100000 --ranks-per-host 8

sizes: MIN:MAX is a doubling sweep (MIN:MAX:F multiplies by F), a,b,c a list; K, M, G are
powers of 1024. all_gather/reduce_scatter/all_to_all sizes are the whole buffer (n parts),
rounded down to a multiple of n elements, as nccl-tests does. busbw = algbw * factor:
""" + "\n".join(f"  {op:15s}{factor}" for op, factor in BUSBW_FACTORS.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = _EPILOG
    parser.add_argument(
        "--op",
        default="all_reduce",
        choices=[*COLLECTIVE_OPS, "all", "store", "rendezvous"],
        help="what to measure: a collective, 'all' collectives, 'store' throughput or 'rendezvous' time "
        "(default all_reduce)",
    )
    parser.add_argument("--sizes", default="4:64M", help="message sizes in bytes (default 4:64M)")
    parser.add_argument("--world-size", type=int, default=2, help="number of local ranks (default 2)")
    parser.add_argument(
        "--vs",
        default=None,
        metavar="gloo,mpi|tcpstore",
        help="also measure others in the same invocation, with ratios side by side: gloo (torch) and/or "
        "mpi (mpi4py + the MPI its mpiexec belongs to: pip install 'aiocoll[mpi]') for collectives, "
        "or nccl (torch, with --tensor torch-cuda) instead of gloo; tcpstore (torch) for --op "
        "store/rendezvous",
    )
    parser.add_argument(
        "--api",
        default="async",
        metavar="async,sync,torch",
        help="which of aiocoll's APIs to measure, side by side: async (the async API, always measured: "
        "the other APIs' ratios are to it), sync (aiocoll.sync, the blocking drop-in) and torch "
        '(torch.distributed on the "aiocoll" backend); collectives only (default async)',
    )
    parser.add_argument(
        "--transport",
        default=None,
        choices=["auto", "tcp", "shm"],
        help="links between aiocoll's ranks, passed to them as AIOCOLL_TRANSPORT (default: the "
        "environment's, else auto: shared memory on one host, TCP across hosts)",
    )
    parser.add_argument(
        "--hog",
        type=int,
        default=0,
        metavar="N",
        help="run N busy processes (pure-Python spin loops) beside the whole run, the same for every "
        "contender, to measure how each holds up when it must share the CPU (default 0)",
    )
    parser.add_argument("--plot", metavar="FILE", help="write a PNG of busbw (and time) against size")
    parser.add_argument("--json", metavar="FILE", help="write every result as JSON")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per size (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations before them (default 5)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_SIZES), help="element type")
    parser.add_argument(
        "--tensor",
        default="numpy",
        choices=["numpy", "torch", "torch-cuda"],
        help="what aiocoll's buffers are: numpy arrays (default), torch CPU tensors, or torch CUDA "
        "tensors (rank r on GPU r %% count; the algo column names the device path; fails without "
        "CUDA). gloo and nccl always use torch tensors on the same device",
    )
    parser.add_argument(
        "--algorithm",
        default=None,
        choices=["ring", "rhd", "tree", "direct"],
        help="force aiocoll's algorithm over the links instead of choosing by size (ring, rhd = recursive "
        "halving-doubling, tree, direct); ranks of one host read each other's memory instead (algo shm) "
        "unless --transport tcp",
    )
    parser.add_argument(
        "--loop",
        default="auto",
        choices=["auto", "asyncio", "uvloop"],
        help="event loop (auto: uvloop if present)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds any single step may take before the run stops with an error (default 300)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--verbose", action="store_true", help="show aiocoll's warnings from the coordinator and ranks"
    )
    store = parser.add_argument_group("--op store / --op rendezvous")
    store.add_argument("--clients", default="1,8", help="client processes for --op store (default 1,8)")
    store.add_argument(
        "--store-ops", type=int, default=2000, help="operations per client per round (default 2000)"
    )
    store.add_argument("--value-size", type=int, default=32, help="bytes per stored value (default 32)")
    store.add_argument(
        "--acked-sets",
        action="store_true",
        help="aiocoll's async set returns once the coordinator acknowledged it (pipeline_sets=False), "
        "instead of once queued; by default sets are not answered, as TCPStore's are not, and each "
        "timed set loop of aiocoll's ends with a flush that waits for the acknowledgement of all",
    )
    store.add_argument(
        "--state-dir",
        action="store_true",
        help="run aiocoll's coordinator with a state directory (every mutation on disk before it is "
        "acknowledged or seen, group commit) in a temporary folder",
    )
    store.add_argument(
        "--rounds", type=int, default=3, help="rounds per measurement; the median is kept (default 3)"
    )
    store.add_argument(
        "--procs", default="64,256", help="processes that rendezvous (default 64,256; '' for none)"
    )
    store.add_argument(
        "--simulated",
        type=int,
        default=10000,
        help="simulated ranks (asyncio sessions, many per process) that rendezvous as one job; 0 skips "
        "(default 10000)",
    )
    store.add_argument(
        "--sim-procs", type=int, default=8, help="processes hosting the simulated clients (default 8)"
    )
    store.add_argument(
        "--ranks-per-host",
        type=int,
        default=8,
        help="simulated ranks carried by one connection, as a host's ranks are by one process "
        "(CoordinatorSession.join_host); 1: a connection per rank (default 8)",
    )


def main(args: argparse.Namespace) -> int:
    """Run the benchmark ``args`` describe; returns the exit code (2 for a usage problem)."""
    collective = args.op not in ("store", "rendezvous")
    contenders = [c.strip() for c in (args.vs or "").split(",") if c.strip()]
    unknown = [c for c in contenders if c not in ("gloo", "nccl", "mpi", "tcpstore")]
    if unknown or len(set(contenders)) != len(contenders) or {"gloo", "nccl"} <= set(contenders):
        print(
            f"aiocoll bench: --vs {args.vs!r}: name gloo (or nccl), mpi or tcpstore, each once",
            file=sys.stderr,
        )
        return 2
    if collective and "tcpstore" in contenders:
        print(
            "aiocoll bench: --vs tcpstore goes with --op store or --op rendezvous; use --vs gloo and/or "
            "mpi here (--vs gloo,mpi)",
            file=sys.stderr,
        )
        return 2
    if not collective and contenders not in ([], ["tcpstore"]):
        print(f"aiocoll bench: --op {args.op} compares with --vs tcpstore only", file=sys.stderr)
        return 2
    apis = [a.strip() for a in args.api.split(",") if a.strip()]
    if not apis or any(a not in ("async", "sync", "torch") for a in apis) or len(set(apis)) != len(apis):
        print(f"aiocoll bench: --api {args.api!r}: name async, sync and/or torch, each once", file=sys.stderr)
        return 2
    if not collective and apis != ["async"]:
        print(f"aiocoll bench: --api goes with the collectives, not --op {args.op}", file=sys.stderr)
        return 2
    args.apis = apis
    if args.hog < 0:
        print("aiocoll bench: --hog must be 0 or more", file=sys.stderr)
        return 2
    args.contenders = contenders
    args.vs = "tcpstore" if contenders == ["tcpstore"] else None if not contenders else args.vs
    if args.op == "store" and (args.store_ops < 1 or args.rounds < 1 or args.value_size < 0):
        print(
            "aiocoll bench: --store-ops and --rounds must be at least 1, --value-size at least 0",
            file=sys.stderr,
        )
        return 2
    if args.op == "rendezvous" and (
        args.rounds < 1 or args.sim_procs < 1 or args.simulated < 0 or args.ranks_per_host < 1
    ):
        print(
            "aiocoll bench: --rounds, --sim-procs and --ranks-per-host must be at least 1, "
            "--simulated at least 0",
            file=sys.stderr,
        )
        return 2
    from ._bench_servers import cpu_hogs

    try:
        with cpu_hogs(args.hog) as hogs:
            args.hog_pids = [hog.pid for hog in hogs]  # in --json, so one can check they are gone
            return _run(args, collective)
    except RuntimeError as exc:  # a server that would not start, matplotlib missing
        print(f"aiocoll bench: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, collective: bool) -> int:
    """The measurement itself; its own errors become exit code 1 with the reason on stderr."""
    if collective:
        from ._bench_coll import BenchError, run_collectives

        try:
            return run_collectives(args)
        except BenchError as exc:
            print(f"aiocoll bench: {exc}", file=sys.stderr)
            return 1
    from ._bench_rendezvous import run_rendezvous
    from ._bench_store import StoreBenchError, run_store

    try:
        return run_store(args) if args.op == "store" else run_rendezvous(args)
    except (StoreBenchError, ValueError) as exc:
        print(f"aiocoll bench: {exc}", file=sys.stderr)
        return 1
