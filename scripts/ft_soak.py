"""A chaos soak of per-step fault tolerance: replicas train while a random one is killed every T s.

A developer's tool (docs/FAULT_TOLERANCE.md, "A chaos soak", quotes it); run it under the bench
lock on a shared machine:

    flock /tmp/aiocoll-bench.lock python scripts/ft_soak.py --replicas 4 --kill-every 30 --minutes 10

Starts a coordinator (``--state-dir``, heartbeat timeout 5 s) and ``--replicas`` replica
processes of an ``aiocoll.ft.Manager`` job (a numpy model of ``--params`` floats, a gradient
that depends on the replica and the step, ``--compute-ms`` of pretend compute per step). A
supervisor kills a random replica with ``kill -9`` every ``--kill-every`` seconds and starts it
again under the same name at once; it heals from a live one. It never kills the only replica
that holds the job's state (the only one that committed a step since it started: the others
are starting or healing from it): another one goes instead, since that loss no fault tolerance
survives. The same run without faults, as long, comes first. Every replica records each
committed step with a hash of its parameters.
Reports:

- steps/s with faults against without (committed steps per second, the job's step counter);
- recovery: from each kill to the survivors' next commit, p50 and p99;
- heals: how many restarted replicas received the state;
- inconsistent commits: steps whose parameters' hash differs between two replicas (must be 0);
- hangs: stretches of more than 30 s with no commit anywhere, and replicas that did not stop
  within 60 s of the end (must be 0);
- replicas that failed: exited with an error, not killed (must be 0).

Exits 1 when there was an inconsistent commit, a hang or a failed replica.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HANG_S = 30.0


# ---------------------------------------------------------------------------------------------
# one replica


def _stopped(flag: Path) -> bool:
    return flag.exists()


async def _replica(args: argparse.Namespace) -> None:
    from aiocoll.ft import Manager, QuorumError

    params = np.linspace(-1.0, 1.0, args.params)
    # each replica's own gradient (distinct for r0..r15), so that steps committed by different
    # sets of replicas never hash the same
    offset = zlib.crc32(args.replica.encode()) % 1009 * 0.001

    def load(state: dict[str, np.ndarray]) -> None:
        params[...] = state["params"]

    out = await asyncio.to_thread(open, args.record, "a", buffering=1)  # a line per step, as they happen
    manager = Manager(
        args.coordinator,
        replica=args.replica,
        job="soak",
        state_dict=lambda: {"params": params},
        load_state_dict=load,
        min_replicas=1,
        join_timeout=2.0,
        timeout=10.0,
        quorum_timeout=120.0,
    )
    flag = Path(args.flag)
    async with manager:
        while not _stopped(flag):
            try:
                await manager.start_step()
            except QuorumError:
                if _stopped(flag):
                    # restarted late: the others stopped at the end instead of asking, and nobody
                    # holds the job's state to heal it from (the coordinator refuses the ask)
                    break
                raise
            if manager.last_heal is not None:
                out.write(json.dumps({"event": "heal", "t": time.monotonic(), **manager.last_heal}) + "\n")
                manager.last_heal = None
            step = manager.step
            grad = np.sin(params * 3.0 + offset + step * 0.001)
            await asyncio.sleep(args.compute_ms / 1000)  # the step's compute
            await manager.all_reduce_mean([grad])
            if await manager.commit():
                params -= 0.01 * grad
                digest = hashlib.sha256(params.tobytes()).hexdigest()[:16]
                line = {
                    "event": "step",
                    "step": step,
                    "t": time.monotonic(),
                    "hash": digest,
                    "n": manager.size,
                }
                out.write(json.dumps(line) + "\n")
    out.close()


# ---------------------------------------------------------------------------------------------
# the supervisor


def _run(args: argparse.Namespace, tmp: Path, faults: bool) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from aiocoll.testing.coordinator import CoordinatorProcess

    name = "faults" if faults else "clean"
    run_dir = tmp / name
    run_dir.mkdir()
    token = secrets.token_hex(16)
    coordinator = CoordinatorProcess(
        run_dir / "coordinator.log",
        "--state-dir",
        str(run_dir / "state"),
        "--heartbeat-timeout",
        "5",
        token=token,
    )
    env = {**os.environ, "AIOCOLL_TOKEN": token}
    flag = run_dir / "stop"
    names = [f"r{i}" for i in range(args.replicas)]
    started: dict[str, float] = {}

    def start(replica: str) -> subprocess.Popen[bytes]:
        started[replica] = time.monotonic()
        command = [
            sys.executable,
            __file__,
            "--replica",
            replica,
            "--coordinator",
            f"127.0.0.1:{coordinator.port}",
        ]
        command += ["--record", str(run_dir / f"{replica}.jsonl"), "--flag", str(flag)]
        command += ["--params", str(args.params), "--compute-ms", str(args.compute_ms)]
        log = open(run_dir / f"{replica}.log", "ab")  # the child holds it
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    procs = {r: start(r) for r in names}
    kills: list[tuple[float, str]] = []
    hangs: list[str] = []
    errors: list[str] = []

    def exited(replica: str, p: subprocess.Popen[bytes]) -> None:
        if p.returncode:
            errors.append(
                f"replica {replica} exited with code {p.returncode} (its log: {run_dir}/{replica}.log)"
            )

    rng = random.Random(args.seed)
    try:
        # the clock starts at the first commit (the processes' start-up and the first join window
        # are not the soak)
        deadline = time.monotonic() + 120
        while not any(_records(run_dir, r, "step") for r in names):
            if time.monotonic() > deadline:
                raise SystemExit(f"ft_soak: no replica committed a step within 120 s (logs in {run_dir})")
            time.sleep(0.2)
        begin = time.monotonic()
        end = begin + args.minutes * 60
        next_kill = begin + args.kill_every
        while time.monotonic() < end:
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))
            if faults and time.monotonic() >= next_kill:
                victim = rng.choice(names)
                holders = [r for r in names if _committed_since(run_dir, r, started[r])]
                if holders == [victim]:
                    # The only replica that holds the job's state (the others are starting, or
                    # healing from it): killed, the state would be lost, which no fault tolerance
                    # survives (the coordinator refuses to go on). Another one is killed.
                    victim = rng.choice([r for r in names if r != victim])
                if procs[victim].poll() is not None:
                    exited(victim, procs[victim])
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                kills.append((time.monotonic(), victim))
                procs[victim] = start(victim)  # the supervisor starts it again at once
                next_kill += args.kill_every
        flag.touch()
        stop = time.monotonic()
        for r, p in procs.items():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                hangs.append(f"replica {r} did not stop within 60 s of the end")
                p.kill()
                p.wait()
            else:
                exited(r, p)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        coordinator.stop()
    summary = _summary(run_dir, names, begin, stop, kills, hangs)
    summary["errors"] = errors
    return summary


def _committed_since(run_dir: Path, replica: str, since: float) -> bool:
    """Whether the replica's process started at ``since`` has committed a step: it holds the state."""
    return any(e["t"] > since for e in _records(run_dir, replica, "step"))


def _records(run_dir: Path, replica: str, event: str) -> list[dict[str, Any]]:
    path = run_dir / f"{replica}.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # the last line of a process killed while writing it
        if entry["event"] == event:
            out.append(entry)
    return out


def _summary(
    run_dir: Path,
    names: list[str],
    begin: float,
    stop: float,
    kills: list[tuple[float, str]],
    hangs: list[str],
) -> dict[str, Any]:
    steps = {r: _records(run_dir, r, "step") for r in names}
    by_step: dict[int, set[str]] = {}
    for entries in steps.values():
        for e in entries:
            by_step.setdefault(e["step"], set()).add(e["hash"])
    inconsistent = sorted(s for s, hashes in by_step.items() if len(hashes) > 1)
    # who committed what at the first few of those steps, for the report (replica, hash,
    # quorum size, seconds since the start): the evidence of how two quorums diverged
    divergent = {
        s: sorted(
            (r, e["hash"][:8], e["n"], round(e["t"] - begin, 3))
            for r in names
            for e in steps[r]
            if e["step"] == s
        )
        for s in inconsistent[:3]
    }
    times = sorted(e["t"] for entries in steps.values() for e in entries)
    in_window = [e for entries in steps.values() for e in entries if begin <= e["t"] <= stop]
    done = {e["step"] for e in in_window}
    rate = len(done) / (stop - begin)
    gaps = [b - a for a, b in itertools.pairwise(times) if b - a > HANG_S]
    hangs = hangs + [f"no commit anywhere for {g:.1f} s" for g in gaps]
    recovery = []
    for at, victim in kills:
        after = [e["t"] for r, entries in steps.items() if r != victim for e in entries if e["t"] > at]
        if after:
            recovery.append(min(after) - at)
    heals = sum(1 for r in names for e in _records(run_dir, r, "heal") if e["t"] > begin)  # restarted ones
    return {
        "steps_per_s": rate,
        "steps": len(done),
        "seconds": stop - begin,
        "kills": len(kills),
        "recovery_s": recovery,
        "heals": heals,
        "inconsistent": inconsistent,
        "divergent": divergent,
        "hangs": hangs,
        "dir": str(run_dir),
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--kill-every", type=float, default=30.0, help="seconds between two kills")
    parser.add_argument(
        "--minutes", type=float, default=10.0, help="each run's length (with and without faults)"
    )
    parser.add_argument("--params", type=int, default=100_000, help="the model's floats (default 100000)")
    parser.add_argument(
        "--compute-ms", type=float, default=50.0, help="pretend compute per step (default 50)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the summaries here")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the run without faults (a check, no ratio)"
    )
    parser.add_argument("--replica", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--flag", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica:
        asyncio.run(_replica(args))
        return
    tmp = tempfile.mkdtemp(prefix="ft-soak-")  # kept when something went wrong, as evidence
    clean = None if args.no_baseline else _run(args, Path(tmp), faults=False)
    chaos = _run(args, Path(tmp), faults=True)
    load = os.getloadavg()[0]
    rec = chaos["recovery_s"]
    print(
        f"ft_soak: {args.replicas} replicas, a kill -9 every {args.kill_every:g} s for "
        f"{args.minutes:g} min "
        f"({chaos['kills']} kills), {args.params} params, {args.compute_ms:g} ms compute per step; "
        f"load {load:.1f} on {os.cpu_count()} CPUs"
    )
    if clean is None:
        print(f"  steps/s: {chaos['steps_per_s']:.2f} with faults (no run without)")
        clean = {"inconsistent": [], "hangs": [], "errors": []}
    else:
        ratio = chaos["steps_per_s"] / clean["steps_per_s"]
        print(
            f"  steps/s: {chaos['steps_per_s']:.2f} with faults, {clean['steps_per_s']:.2f} without: "
            f"{ratio:.3f}x"
        )
    if rec:
        print(
            f"  recovery (kill -> survivors' next commit): p50 {statistics.median(rec):.3f} s, "
            f"p99 {_quantile(rec, 0.99):.3f} s, worst {max(rec):.3f} s"
        )
    print(f"  heals: {chaos['heals']}")
    bad = chaos["inconsistent"] + clean["inconsistent"]
    print(f"  inconsistent commits: {len(bad)}{' (steps ' + str(bad[:10]) + ')' if bad else ''}")
    hangs = chaos["hangs"] + clean["hangs"]
    print(f"  hangs: {len(hangs)}{': ' + '; '.join(hangs[:5]) if hangs else ''}")
    errors = chaos["errors"] + clean["errors"]
    print(f"  replicas that failed: {len(errors)}{': ' + '; '.join(errors[:5]) if errors else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps({"clean": clean, "faults": chaos, "load": load}, indent=2))
    if bad or hangs or errors:
        for step, who in chaos["divergent"].items():
            print(f"  step {step} committed as (replica, hash, quorum size, s): {who}")
        print(f"  the replicas' records and logs are kept in {tmp}")
        raise SystemExit(1)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
