"""One rank of a replica of two ranks, for tests/integration/test_fault_tolerance.py: a process
started by the test (not a test module). Imports numpy and aiocoll only.

Each rank holds its shard of a tiny numpy model (a vector of float64). A step: the quorum
(``Manager.start_step``, which heals the shard from the same shard of a live replica when behind);
a pause (the forward and backward pass); the replica's loss, summed over its two ranks on the
replica's own group (the intra-replica group of a sharded model: an ordinary aiocoll job per
replica and incarnation; a failure there is reported with ``report_error(inside_replica=True)``);
the shard's gradient, averaged over the replicas of the quorum on the shard's group
(``all_reduce_mean``); ``commit``.
Every committed step appends a line to ``--record`` (JSON: the step, the quorum's members, the
shard's digest after the step, the heal); a ``QuorumError`` is recorded and the process exits 3.
It stops after the step named in ``--until-file`` once that file exists.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

import aiocoll
from aiocoll.ft import Manager, QuorumError

SIZE = 64


def gradient(w: np.ndarray, loss: float, replica: str, shard: int, step: int) -> np.ndarray:
    """The shard's gradient at ``step``: its own data (by replica) and the replica's loss."""
    seed = int.from_bytes(hashlib.sha256(f"{replica}/{shard}/{step}".encode()).digest()[:4], "little")
    data = np.random.default_rng(seed).standard_normal(SIZE)
    return 0.5 * w + 0.1 * np.tanh(loss) + data


def _stop_after(path: Path) -> int | None:
    """The step after which to stop: the number in ``path`` once it exists."""
    return int(path.read_text()) if path.exists() else None


async def main(args: argparse.Namespace, record: Any) -> int:

    def write(**entry: Any) -> None:
        record.write(json.dumps({"pid": os.getpid(), "t": time.time(), **entry}) + "\n")

    # this incarnation's own model: a restarted replica starts from another one until it heals
    w = np.random.default_rng(hash((args.replica, args.rank, os.getpid())) & 0xFFFF).standard_normal(SIZE)

    def load(state: dict[str, Any]) -> None:
        w[:] = state["w"]

    intra = await aiocoll.init_process_group(
        f"tcp://{args.coordinator}",
        rank=args.rank,
        world_size=2,
        job=f"intra-{args.replica}-{args.incarnation}",
        timeout=30.0,
    )
    manager = Manager(
        args.coordinator,
        replica=args.replica,
        replica_rank=args.rank,
        replica_size=2,
        state_dict=lambda: {"w": w.copy()},
        load_state_dict=load,
        min_replicas=1,
        join_timeout=args.join_timeout,
        timeout=10.0,
        quorum_timeout=60.0,
    )
    until = Path(args.until_file)
    try:
        while (stop := _stop_after(until)) is None or manager.step < stop:
            try:
                step = await manager.start_step()
            except QuorumError as exc:
                write(event="error", error=str(exc))
                return 3
            healed = manager.last_heal
            manager.last_heal = None
            await asyncio.sleep(args.step_time)  # the forward and backward pass: a kill lands here
            loss = np.array([float(w @ w)])
            try:
                await intra.all_reduce(loss, timeout=10.0)  # the replica's loss, over its ranks
            except aiocoll.DistError as exc:
                manager.report_error(exc, inside_replica=True)
            g = gradient(w, float(loss[0]), args.replica, args.rank, step)
            await manager.all_reduce_mean([g])
            if await manager.commit():
                w -= 0.1 * g
                write(
                    event="step",
                    step=step,
                    members=manager.members,
                    quorum_id=manager.quorum_id,
                    digest=hashlib.sha256(w.tobytes()).hexdigest(),
                    healed=healed,
                )
            else:
                write(event="failed", step=step, error=str(manager.last_error))
        return 0
    finally:
        await manager.close()
        await asyncio.wait_for(intra.destroy(), 5.0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--replica", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--incarnation", type=int, default=0)
    parser.add_argument("--record", required=True)
    parser.add_argument("--until-file", required=True)
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--join-timeout", type=float, default=5.0)
    parsed = parser.parse_args()
    with open(parsed.record, "a", buffering=1) as out:
        raise SystemExit(asyncio.run(main(parsed, out)))
