"""The parent side of `aiocoll bench` for collectives: spawn ranks, collect times, print the table.

Starts a coordinator in its own process, spawns ``--world-size`` workers (multiprocessing spawn:
each child imports only what it needs), gathers their per-iteration times from a queue and
prints one row per size as soon as every rank has reported it. Imports only the standard library
and the bench helpers at module level; numpy, torch and matplotlib are the children's or the
plot's business. A worker that fails or goes silent ends the run with its error, never a hang.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import multiprocessing
import os
import queue as queue_module
import secrets
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from aiocoll._env import env_text

from ._bench_api import API_CONTENDERS
from ._bench_common import (
    BUSBW_FACTORS,
    DTYPE_SIZES,
    Progress,
    bench_meta,
    contender_gap,
    format_bytes,
    resolve_loop,
    summarize,
    unmeasured,
    utc_now,
    write_json,
)
from ._bench_mpi import MPI_DTYPES, MpiUnavailable, run_mpi_phase
from ._bench_servers import start_coordinator, start_tcpstore

__all__ = ["run_collectives"]


class BenchError(RuntimeError):
    """A benchmark run that could not complete; the message says why and what to do."""


def _columns(contenders: Sequence[str]) -> list[tuple[str, int]]:
    """aiocoll's columns, each contender's, then the ratios to every contender side by side."""
    cols = [
        ("size(B)", 9),
        ("count", 8),
        ("algo", 6),
        ("time(us)", 9),
        ("avg(us)", 9),
        ("min(us)", 9),
        ("algbw", 7),
        ("busbw", 7),
    ]
    for c in contenders:
        cols += [(f"{c}(us)", 9), (f"{c}_avg", 9), (f"{c}_min", 9), (f"{c}_busbw", max(10, len(c) + 7))]
    for what in ("time", "avg", "busbw"):
        cols += [(_ratio_name(what, c), max(9, len(_ratio_name(what, c)))) for c in contenders]
    return cols


def _ratio_name(what: str, contender: str) -> str:
    # a blocking API (--api) is compared the other way round: its X over the async API's
    return f"{what}:{contender}/async" if contender in API_CONTENDERS else f"{what}/{contender}"


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return "-"
        if abs(value) >= 1000:
            return f"{value:.0f}"
        if abs(value) >= 100:
            return f"{value:.1f}"
        if abs(value) >= 10:
            return f"{value:.2f}"
        return f"{value:.3f}"
    return str(value)


def _ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs > 0 else math.nan


def _ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    """aiocoll/contender: time and avg (lower is better for aiocoll), busbw (higher is better)."""
    return {
        "time": _ratio(ours["time_us"], theirs["time_us"]),
        "avg": _ratio(ours["avg_us"], theirs["avg_us"]),
        "busbw": _ratio(ours["busbw"], theirs["busbw"]),
    }


def _row_cells(row: dict[str, Any], contenders: Sequence[str]) -> list[object]:
    ours = row["aiocoll"]
    cells: list[object] = [
        row["size"],
        row["count"],
        row.get("algorithm", "-"),
        ours["time_us"],
        ours["avg_us"],
        ours["min_us"],
        ours["algbw"],
        ours["busbw"],
    ]
    for c in contenders:
        theirs = row[c]
        cells += [theirs["time_us"], theirs["avg_us"], theirs["min_us"], theirs["busbw"]]
    for what in ("time", "avg", "busbw"):
        cells += [row["ratios"][c][what] for c in contenders]
    return cells


def _print_header(op: str, n: int, args: argparse.Namespace, contenders: Sequence[str]) -> None:
    factor = BUSBW_FACTORS[op]
    bandwidth = (
        "barrier moves no data: only time"
        if op == "barrier"
        else f"algbw = size/time, busbw = algbw*{factor} (GB/s)"
    )
    print(
        f"# aiocoll bench: {op}, world size {n}, {args.dtype} ({args.tensor}), "
        f"{args.iters} iters after {args.warmup} warmup, algorithm {args.algorithm or 'auto'}, "
        f"transport {args.transport or env_text('AIOCOLL_TRANSPORT') or 'auto'}, loop {args.loop}, "
        f"{args.hog} CPU hog(s), load {_loadavg()}, {utc_now()}"
    )
    print(
        "# time = median over iterations of the slowest rank; avg = slowest rank's mean (nccl-tests' "
        "time, outliers included; it may be below min, since each rank times only its own part of an "
        "iteration while time and min take the slowest rank of each); min = fastest iteration; "
        f"{bandwidth}; algo = what aiocoll ran"
        + (
            "; X/c = aiocoll's X over contender c's (time: lower is better, busbw: higher is better)"
            if contenders
            else ""
        )
    )
    if set(API_CONTENDERS) & set(contenders):
        print(
            '# sync = aiocoll.sync, torch = torch.distributed on the "aiocoll" backend: blocking calls '
            "from the rank's main thread, as a script makes them; X:c/async = c's X over the async API's"
        )
    if "mpi" in contenders:
        print("# mpi = mpi4py over the MPI its mpiexec belongs to, run as its own job in the same invocation")
    if op == "sendrecv":
        print("# sendrecv: ping-pong between ranks 0 and 1; time is half the round trip")
    for c in contenders:
        gap = contender_gap(c, op, args.tensor)
        if gap is not None:
            print(f"# {c} columns show '-': {gap}")
    cols = _columns(contenders)
    print("  ".join(name.rjust(width) for name, width in cols))
    sys.stdout.flush()


def _print_row(row: dict[str, Any], contenders: Sequence[str]) -> None:
    cols = _columns(contenders)
    cells = _row_cells(row, contenders)
    print("  ".join(_fmt(c).rjust(w) for c, (_, w) in zip(cells, cols, strict=True)))
    sys.stdout.flush()


def _loadavg() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def _check_args(args: argparse.Namespace, ops: list[str]) -> None:
    n = args.world_size
    if n < 1:
        raise BenchError("--world-size must be at least 1")
    if "sendrecv" in ops and n < 2:
        raise BenchError("sendrecv needs --world-size 2 or more")
    if args.iters < 1 or args.warmup < 0:
        raise BenchError("--iters must be at least 1 and --warmup at least 0")
    if args.dtype not in DTYPE_SIZES:
        raise BenchError(f"--dtype {args.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
    if args.dtype == "bfloat16" and args.tensor == "numpy":
        raise BenchError("numpy has no bfloat16: add --tensor torch to measure bfloat16")
    if "mpi" in args.contenders and args.dtype not in MPI_DTYPES:
        raise BenchError(f"--vs mpi: MPI has no {args.dtype} reduction; use one of {', '.join(MPI_DTYPES)}")
    needs_torch = (
        bool({"gloo", "nccl"} & set(args.contenders)) or args.tensor != "numpy" or "torch" in args.apis
    )
    if needs_torch and importlib.util.find_spec("torch") is None:
        raise BenchError(
            "torch is not installed, so there is nothing to compare with: install it "
            "(pip install 'aiocoll[torch]') or drop --vs gloo / --tensor torch / --api torch"
        )
    if args.transport is not None:
        from aiocoll.client.data.transports import transport_choice

        try:  # the link factory's own check, here before any process starts
            transport_choice(args.transport)
        except ValueError as exc:
            raise BenchError(f"--transport {args.transport}: {exc}") from None
    _check_cuda_args(args)


def _check_cuda_args(args: argparse.Namespace) -> None:
    if "nccl" in args.contenders and args.tensor != "torch-cuda":
        raise BenchError("--vs nccl measures CUDA tensors: add --tensor torch-cuda")
    if args.tensor == "torch-cuda":
        from aiocoll.device._cuda import cuda_unavailable

        why = cuda_unavailable()
        if why is not None:
            raise BenchError(
                f"--tensor torch-cuda needs a CUDA device, and {why}; run it on a machine with a GPU, "
                "or measure CPU tensors with --tensor torch"
            )
    if "nccl" in args.contenders:
        import torch.distributed

        if not torch.distributed.is_nccl_available():
            raise BenchError("--vs nccl: this torch has no NCCL; use --vs gloo")
        from aiocoll.device._cuda import device_count

        # NCCL refuses two ranks on one device ("Duplicate GPU detected") at its first call;
        # say so before any process starts. aiocoll itself shares a device between ranks.
        if device_count() < args.world_size:
            raise BenchError(
                f"--vs nccl needs a GPU per rank: NCCL refuses two ranks on one device, and this "
                f"machine has {device_count()} CUDA device(s) for {args.world_size} ranks; "
                f"use --world-size {device_count()} or fewer, or compare with --vs gloo"
            )
    if args.loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise BenchError(
            "--loop uvloop: uvloop is not installed (pip install uvloop) — or use --loop asyncio"
        )


def _terminate(procs: Sequence[multiprocessing.process.BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 5
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(2)


def run_collectives(args: argparse.Namespace) -> int:
    """Run the collective sweep described by ``args`` and print/save the results.

    ``args.contenders`` lists what to compare with ("gloo", "mpi"). gloo runs inside the aiocoll
    worker processes, alternating with aiocoll size by size; MPI runs first as a job of its own
    (mpiexec), and its rows wait for aiocoll's. ``args.hog`` busy processes run beside the whole
    invocation (bench.main starts them).

    Returns:
        The exit code: 0 on success.

    Raises:
        BenchError: for bad arguments, a missing torch or MPI, or a worker that failed or went silent.
    """
    from ._bench_common import COLLECTIVE_OPS, parse_sizes

    ops = list(COLLECTIVE_OPS) if args.op == "all" else [args.op]
    _check_args(args, ops)
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    n = args.world_size
    contenders: list[str] = list(args.contenders)
    apis: list[str] = [a for a in args.apis if a != "async"]  # the async API is always measured
    columns = [*apis, *contenders]
    # torch.distributed in the workers; its TCPStore also serves the torch backend's rendezvous
    with_torch = bool({"gloo", "nccl"} & set(contenders)) or "torch" in apis
    args.loop = resolve_loop(args.loop)
    cfg = {
        "world_size": n,
        "port": 0,
        "gloo_port": 0,
        "token": secrets.token_hex(16),
        "job": f"bench-{secrets.token_hex(4)}",
        "timeout": args.timeout,
        "vs": contenders,
        "apis": apis,
        "transport": args.transport,
        "ops": ops,
        "sizes": sizes,
        "dtype": args.dtype,
        "itemsize": DTYPE_SIZES[args.dtype],
        "tensor": args.tensor,
        "algorithm": args.algorithm,
        "iters": args.iters,
        "warmup": args.warmup,
        "loop": args.loop,
        "verbose": args.verbose,
    }
    impls = ["aiocoll", *columns]
    total_steps = sum(1 if op == "barrier" else len(sizes) for op in ops) * len(impls)
    progress = Progress(total_steps, f"bench {args.op} n={n}", enabled=not args.quiet)
    pending: dict[tuple[str, int, str], dict[int, tuple[list[float], dict[str, float]]]] = defaultdict(dict)
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    printed_header: set[str] = set()
    all_rows: list[dict[str, Any]] = []
    started = time.monotonic()

    def record(
        op: str,
        size: int,
        impl: str,
        per_rank: list[list[float]],
        usage: list[dict[str, float]],
        algorithm: str,
    ) -> None:
        """One implementation finished one op and size on every rank: print the row once all did."""
        row = rows.setdefault((op, size), {"op": op, "size": size, "count": size // cfg["itemsize"]})
        gap = contender_gap(impl, op, args.tensor)
        row[impl] = unmeasured() if gap is not None else summarize(op, size, n, per_rank)
        # per operation, averaged over the ranks (JSON only): CPU µs, voluntary/involuntary switches
        reported = [u for u in usage if u]  # a contender that could not run reports none
        row[impl]["usage"] = (
            {key: sum(u[key] for u in reported) / len(reported) for key in reported[0]} if reported else {}
        )
        if impl == "aiocoll":
            row["algorithm"] = algorithm
        progress.step(f"{impl} {op} {format_bytes(size)}")
        if not all(i in row for i in impls):
            return
        row["ratios"] = {
            c: _ratios(row[c], row["aiocoll"]) if c in API_CONTENDERS else _ratios(row["aiocoll"], row[c])
            for c in columns
        }
        if op not in printed_header:
            if printed_header:
                print()
            _print_header(op, n, args, columns)
            printed_header.add(op)
        _print_row(row, columns)
        all_rows.append(row)

    if "mpi" in contenders:
        try:
            run_mpi_phase(
                cfg, lambda op, size, times, usage: record(op, size, "mpi", times, usage, ""), args.timeout
            )
        except (MpiUnavailable, RuntimeError) as exc:
            raise BenchError(str(exc)) from None

    coordinator = start_coordinator(cfg["token"], verbose=args.verbose)
    cfg["port"] = coordinator.port
    # torch's rendezvous goes through a TCPStore server of its own (port 0: no race for a port)
    try:
        gloo_store = start_tcpstore() if with_torch else None
    except BaseException:
        coordinator.stop()
        raise
    cfg["gloo_port"] = gloo_store.port if gloo_store is not None else 0
    ctx = multiprocessing.get_context("spawn")
    results: Any = ctx.Queue()
    from ._bench_worker import worker_main

    procs = [
        ctx.Process(target=worker_main, args=(rank, cfg, results), name=f"bench-rank-{rank}", daemon=True)
        for rank in range(n)
    ]
    done_ranks: set[int] = set()
    try:
        for proc in procs:
            proc.start()
        last_message = time.monotonic()
        while len(done_ranks) < n:
            try:
                message = results.get(timeout=1.0)
            except queue_module.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise BenchError(
                        f"rank {procs.index(dead[0])} exited with code {dead[0].exitcode} before finishing"
                    ) from None
                if time.monotonic() - last_message > args.timeout:
                    raise BenchError(
                        f"no progress from the workers for {args.timeout:.0f} s (raise --timeout for very "
                        "large sizes, or look for a hung rank)"
                    ) from None
                continue
            last_message = time.monotonic()
            kind = message[0]
            if kind == "error":
                _, rank, text, trace = message
                sys.stderr.write(trace)
                raise BenchError(f"rank {rank} failed: {text}")
            if kind == "done":
                done_ranks.add(message[1])
                continue
            if kind != "times":
                continue
            _, rank, op, size, impl, times, algorithm, usage = message
            key = (op, size, impl)
            pending[key][rank] = (times, usage)
            if len(pending[key]) == n:
                reports = list(pending.pop(key).values())
                record(op, size, impl, [t for t, _ in reports], [u for _, u in reports], algorithm)
        for proc in procs:
            proc.join(10)
    finally:
        _terminate(procs)
        coordinator.stop()
        if gloo_store is not None:
            gloo_store.stop()
        with contextlib.suppress(Exception):
            results.close()
    meta = bench_meta(
        "collectives",
        started,
        ops=ops,
        world_size=n,
        dtype=args.dtype,
        tensor=args.tensor,
        iters=args.iters,
        warmup=args.warmup,
        algorithm=args.algorithm or "auto",
        loop=args.loop,
        vs=contenders,
        api=["async", *apis],
        transport=args.transport or env_text("AIOCOLL_TRANSPORT") or "auto",
        hog=args.hog,
        hog_pids=args.hog_pids,
        load=_loadavg(),
    )
    meta["units"] = {"time_us": "microseconds", "algbw": "GB/s (1e9 B/s)", "busbw": "GB/s (1e9 B/s)"}
    if args.json:
        write_json(args.json, {"meta": meta, "results": all_rows})
    if args.plot:
        from ._bench_plot import plot_collectives

        plot_collectives(args.plot, meta, all_rows)
    return 0
