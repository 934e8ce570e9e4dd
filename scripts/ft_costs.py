"""What per-step fault tolerance costs (issue 20); docs/FAULT_TOLERANCE.md, "What it costs",
quotes it. A developer's tool: run it under the heavy lock on a shared machine.

    flock /tmp/aiocoll-heavy.lock python scripts/ft_costs.py                  # 5 runs of each
    python scripts/ft_costs.py --runs 3 --ballast-mib 256 --transports tcp --json costs.json

Two parts, each a number of runs of examples/fault_tolerant_training.py --demo (a coordinator,
three replicas on this machine, one killed with kill -9 after its step 20 and restarted when the
others reach step 25), read from the demo's own summary.json:

- recovery and quorum: the time from the kill to the survivors' next committed step; the time
  each step spends asking for its quorum (``zero_grad``: one coordinator round trip when the
  membership did not change, plus waiting for the last replica to ask) against the whole step
  (the example's 50 ms of pretend compute, the all_reduce of the gradients and the commit); medians
  over the steps that healed nothing.
- heal per GiB: the same with --ballast-mib B (B MiB more state, which travels in every heal),
  for each of --transports (AIOCOLL_TRANSPORT: ``tcp`` is the path between hosts, ``auto`` shared
  memory on one host); the restarted replica's heal (receive buffers, the transfer, and
  load_state_dict). Against it, in the same run: torch.distributed's gloo sending the same number
  of bytes from one process to another on this machine (send/recv of one uint8 tensor into a
  buffer made beforehand, the second of two transfers).

- transfer probe: aiocoll's own send/recv of the same bytes between two processes, for each of
  --transports: into a buffer written before (the second of two transfers, as gloo's), and into
  a fresh one (np.empty: its pages are touched first by the receive), which is what a heal
  receives into. It says how much of a heal is the transport and how much the new memory.

--parts picks among plain, heal, gloo, probe (default: all). Prints a table (median and range
of each) and, with --json, writes every run's numbers with the date, the commit and the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fault_tolerant_training.py"
GIB = 1 << 30


def demo(out: Path, *, ballast_mib: int, transport: str | None, deadline: float) -> dict[str, Any]:
    """One --demo run; its summary (recovery_s, quorum_ms, step_ms, heal)."""
    env = dict(os.environ)
    if transport:
        env["AIOCOLL_TRANSPORT"] = transport
    command = [sys.executable, str(EXAMPLE), "--demo", "--out", str(out), "--deadline", str(deadline)]
    command += ["--ballast-mib", str(ballast_mib)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=deadline + 60)
    if run.returncode != 0:
        raise SystemExit(f"ft_costs: the demo failed (logs in {out}):\n{run.stdout}\n{run.stderr}")
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def gloo_seconds(nbytes: int) -> float:
    """Seconds gloo takes to move ``nbytes`` from one process to another here (the receiver's
    clock, the second of two transfers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, __file__, "--gloo-worker", str(port), str(nbytes)]
    procs = [subprocess.Popen([*command, str(rank)], stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"ft_costs: the gloo transfer failed: {outs}")
    return float(outs[1].strip().splitlines()[-1])


def gloo_worker(port: int, nbytes: int, rank: int) -> None:
    import torch
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffer = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
    seconds = 0.0
    for _ in range(2):
        tdist.barrier()
        started = time.perf_counter()
        if rank == 0:
            tdist.send(buffer, 1)
        else:
            tdist.recv(buffer, 0)
        seconds = time.perf_counter() - started
    tdist.destroy_process_group()
    print(seconds, flush=True)


async def transfer_probe(pg: Any, nbytes: int) -> dict[str, float]:
    """Rank 0 sends ``nbytes`` to rank 1 three times: into a buffer twice (times the second),
    then into a fresh one; rank 1's clock."""
    import numpy as np

    seconds: dict[str, float] = {}
    buffer = np.ones(nbytes, np.uint8) if pg.rank == 0 else np.empty(nbytes, np.uint8)
    for name in ("first", "touched", "fresh"):
        target = np.empty(nbytes, np.uint8) if name == "fresh" and pg.rank == 1 else buffer
        await pg.barrier()
        started = time.perf_counter()
        if pg.rank == 0:
            await pg.send(buffer, 1, 7, timeout=600)
        else:
            await pg.recv(target, 0, 7, timeout=600)
        seconds[name] = time.perf_counter() - started
    return seconds


def probe_seconds(nbytes: int, transport: str) -> dict[str, float]:
    """``transfer_probe`` in a world of two processes; rank 1's times."""
    from aiocoll.testing.world import run_world, unwrap

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    os.environ["AIOCOLL_TRANSPORT"] = transport
    try:
        from ft_costs import transfer_probe as probe  # by module name, for the worker processes

        results: list[dict[str, float]] = unwrap(run_world(probe, 2, timeout=900, args=(nbytes,)))
    finally:
        del os.environ["AIOCOLL_TRANSPORT"]
    return results[1]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(s: dict[str, float], unit: str, scale: float = 1.0, digits: int = 2) -> str:
    return (
        f"{s['median'] * scale:.{digits}f} {unit} "
        f"({s['min'] * scale:.{digits}f}..{s['max'] * scale:.{digits}f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="runs of each measurement (default 5)")
    parser.add_argument("--ballast-mib", type=int, default=1024, help="extra state for the heal runs (MiB)")
    parser.add_argument("--transports", default="tcp,auto", help="AIOCOLL_TRANSPORT values for the heal runs")
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds one demo run may take")
    parser.add_argument("--parts", default="plain,heal,gloo,probe", help="which parts to run (default all)")
    parser.add_argument("--json", help="write every run's numbers here")
    parser.add_argument("--gloo-worker", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gloo_worker:
        gloo_worker(*args.gloo_worker)
        return
    parts = set(args.parts.split(","))
    transports = [t for t in args.transports.split(",") if t]
    started = datetime.datetime.now(datetime.timezone.utc)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"),
        "commit": commit,
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "plain": [],
        "heal": {},
        "gloo_s": [],
        "probe": {},
    }
    nbytes = args.ballast_mib << 20
    with tempfile.TemporaryDirectory(prefix="aiocoll-ft-costs-") as tmp:
        for k in range(args.runs if "plain" in parts else 0):
            summary = demo(Path(tmp) / f"plain{k}", ballast_mib=0, transport=None, deadline=args.deadline)
            report["plain"].append(summary)
            print(
                f"run {k}: kill -> next step {summary['recovery_s']:.3f}s, "
                f"quorum {summary['quorum_ms']:.2f} ms of a {summary['step_ms']:.1f} ms step",
                flush=True,
            )
        for transport in transports if "heal" in parts else []:
            runs = report["heal"][transport] = []
            for k in range(args.runs):
                out = Path(tmp) / f"heal-{transport}{k}"
                summary = demo(out, ballast_mib=args.ballast_mib, transport=transport, deadline=args.deadline)
                runs.append(summary["heal"])
                heal = summary["heal"]
                nbytes = heal["bytes"]
                print(
                    f"run {k}: heal over {transport}: "
                    f"{heal['bytes'] / GIB:.3f} GiB in {heal['seconds']:.2f}s",
                    flush=True,
                )
    for k in range(args.runs if "gloo" in parts else 0):
        report["gloo_s"].append(gloo_seconds(nbytes))
        print(f"run {k}: gloo send/recv of {nbytes / GIB:.3f} GiB: {report['gloo_s'][-1]:.2f}s", flush=True)
    for transport in transports if "probe" in parts else []:
        runs = report["probe"][transport] = []
        for k in range(args.runs):
            runs.append(probe_seconds(nbytes, transport))
            print(f"run {k}: aiocoll send/recv over {transport}: {runs[-1]}", flush=True)
    gib = nbytes / GIB
    lines = [f"{report['date']}, commit {commit}, {report['machine']}: {report['command']}"]
    plain = report["plain"]
    if plain:
        lines += [
            "kill -9 -> survivors' next committed step: "
            f"{fmt(spread([s['recovery_s'] for s in plain]), 's', 1, 3)}",
            f"quorum per step: {fmt(spread([s['quorum_ms'] for s in plain]), 'ms')}; "
            f"step: {fmt(spread([s['step_ms'] for s in plain]), 'ms', 1, 1)}; "
            f"quorum / step: {fmt(spread([s['quorum_ms'] / s['step_ms'] for s in plain]), '%', 100, 1)}",
        ]
    for transport, heals in report["heal"].items():
        per_gib = spread([h["seconds"] / (h["bytes"] / GIB) for h in heals])
        lines.append(f"heal over {transport}: {fmt(per_gib, 's/GiB')}")
    if report["gloo_s"]:
        lines.append(
            f"gloo send/recv, same bytes: {fmt(spread([s / gib for s in report['gloo_s']]), 's/GiB')}"
        )
    for transport, probes in report["probe"].items():
        touched = spread([p["touched"] / gib for p in probes])
        fresh = spread([p["fresh"] / gib for p in probes])
        lines.append(
            f"aiocoll send/recv over {transport}: into a buffer used before {fmt(touched, 's/GiB')}; "
            f"into a fresh one {fmt(fresh, 's/GiB')}"
        )
    print("\n".join(lines), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
