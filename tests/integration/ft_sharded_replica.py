"""One rank of a replica of two ranks, for tests/integration/test_ft_sharded.py: a process
started by the test (not a test module). Imports numpy and aiocoll only.

Each rank holds its shard of a tiny numpy model (a vector of float64). A step: the quorum
(``Manager.start_step``, which heals the shard from the same shard of a live replica when behind);
a pause (the forward and backward pass); the replica's loss, summed over its two ranks on the
replica's own group (the intra-replica group of a sharded model: an ordinary aiocoll job per
replica and generation, made again whenever ``Manager.replica_generation`` changes; a failure
there is reported with ``report_error(inside_replica=True)``); the shard's gradient, averaged over
the replicas of the quorum on the shard's group (``all_reduce_mean``); ``commit``.
Every committed step appends a line to ``--record`` (JSON: the step, the quorum's members, the
shard's digest after the step, the heal, the generation); a ``QuorumError`` is recorded and the
process exits 3. It stops after the step named in ``--until-file`` once that file exists.

``--replace-timeout`` is the Manager's (0: a rank whose fellow rank is lost stops; above 0: it
waits that long for a new process of the lost rank). ``--shared-data``: every replica's data is the
same (each shard's gradient depends on the shard and the step only), so that the mean over any
quorum of one or two replicas is that gradient exactly and the model is the same, bit for bit, as
a run without faults; ``--seed`` seeds this process's initial shard (otherwise its own pid).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
    """The shard's gradient at ``step``: its own data (by replica; "" for data shared by all) and
    the replica's loss."""
    seed = int.from_bytes(hashlib.sha256(f"{replica}/{shard}/{step}".encode()).digest()[:4], "little")
    data = np.random.default_rng(seed).standard_normal(SIZE)
    return 0.5 * w + 0.1 * np.tanh(loss) + data


def _stop_after(path: Path) -> int | None:
    """The step after which to stop: the number in ``path`` once it exists."""
    return int(path.read_text()) if path.exists() else None


async def main(args: argparse.Namespace, record: Any) -> int:

    def write(**entry: Any) -> None:
        record.write(json.dumps({"pid": os.getpid(), "t": time.time(), **entry}) + "\n")

    # this process's own model: a restarted rank starts from another one until it heals
    seed = args.seed if args.seed is not None else hash((args.replica, args.rank, os.getpid())) & 0xFFFF
    w = initial(seed)

    def load(state: dict[str, Any]) -> None:
        w[:] = state["w"]

    intra: aiocoll.ProcessGroup | None = None  # the replica's own group, of its current generation
    generation = 0
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
        quorum_timeout=max(60.0, args.replace_timeout + 30.0),
        replace_timeout=args.replace_timeout,
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
            loss = np.array([float(w @ w)])
            try:
                if manager.replica_generation != generation:
                    # new processes in the replica, or its group failed: its own group anew
                    intra = await _regroup(intra, args, manager.replica_generation)
                    generation = manager.replica_generation
                    write(event="generation", step=step, generation=generation)
                assert intra is not None
                await asyncio.sleep(args.step_time)  # the forward and backward pass: a kill lands here
                await intra.all_reduce(loss, timeout=10.0)  # the replica's loss, over its ranks
            except aiocoll.DistError as exc:
                manager.report_error(exc, inside_replica=True)  # the next quorum: a new generation
            data = "" if args.shared_data else args.replica
            g = gradient(w, float(loss[0]), data, args.rank, step)
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
                    generation=generation,
                )
            else:
                write(event="failed", step=step, error=str(manager.last_error))
        return 0
    finally:
        await manager.close()
        if intra is not None:
            await asyncio.wait_for(intra.destroy(), 5.0)


def initial(seed: int) -> np.ndarray:
    """A shard's initial values."""
    return np.random.default_rng(seed).standard_normal(SIZE)


async def _regroup(
    old: aiocoll.ProcessGroup | None, args: argparse.Namespace, generation: int
) -> aiocoll.ProcessGroup:
    """The replica's own group of ``generation``: a job of its own, so that a replaced rank never
    meets its predecessor's group; the old one destroyed first (its lost peer is not waited for)."""
    if old is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(old.destroy(), 5.0)
    return await aiocoll.init_process_group(
        f"tcp://{args.coordinator}",
        rank=args.rank,
        world_size=2,
        job=f"{os.environ.get('AIOCOLL_JOB', 'default')}/intra-{args.replica}-g{generation}",
        timeout=30.0,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--replica", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--replace-timeout", type=float, default=0.0)
    parser.add_argument("--shared-data", action="store_true")
    parser.add_argument("--record", required=True)
    parser.add_argument("--until-file", required=True)
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--join-timeout", type=float, default=5.0)
    parsed = parser.parse_args()
    with open(parsed.record, "a", buffering=1) as out:
        raise SystemExit(asyncio.run(main(parsed, out)))
