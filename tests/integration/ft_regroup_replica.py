"""One replica of one rank, for tests/integration/test_ft_regroup.py: a process started by the
test (not a test module). Imports numpy and aiocoll only.

The model is a vector of float64; a step's gradient is the same on every replica and depends on
the step alone, of small integers, so that its mean over any quorum is that gradient exactly and
the model after each step is the same, bit for bit, as a run without faults. A step: the quorum
(``Manager.start_step``, which heals a replica that is behind); a pause (the forward and backward
pass); the gradient averaged over the quorum's replicas (``all_reduce_mean``); ``commit``. Every
committed step appends a line to ``--record`` (JSON: the step, the quorum's members, its group's
id, the model's digest after the step, the heal). It stops after the step named in
``--until-file`` once that file exists.

``--die-in-agreement``: this process kills itself (SIGKILL) as it enters the survivors'
agreement on their next group over the links they hold (``ProcessGroup._survivors_group``),
after writing an ``agreement`` record: the others' agreement then fails, with their group not
formed, and they must make their next group through the coordinator.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

import aiocoll
from aiocoll.ft import Manager

SIZE = 256


def initial() -> np.ndarray:
    return np.linspace(-1.0, 1.0, SIZE)


def gradient(step: int) -> np.ndarray:
    """Step ``step``'s gradient: small integers (their sum over a few replicas is exact)."""
    return np.random.default_rng(step).integers(-1000, 1000, SIZE).astype(np.float64)


def digest(w: np.ndarray) -> str:
    return hashlib.sha256(w.tobytes()).hexdigest()


def _stop_after(path: Path) -> int | None:
    """The step after which to stop: the number in ``path`` once it exists."""
    return int(path.read_text()) if path.exists() else None


async def main(args: argparse.Namespace, record: Any) -> int:
    def write(**entry: Any) -> None:
        record.write(json.dumps({"pid": os.getpid(), "t": time.time(), **entry}) + "\n")

    if args.die_in_agreement:
        agree = aiocoll.ProcessGroup._survivors_group

        async def die(self: aiocoll.ProcessGroup, ranks: Any, gid: str, timeout: float) -> Any:
            write(event="agreement", ranks=list(ranks), gid=gid)
            os.kill(os.getpid(), signal.SIGKILL)
            return await agree(self, ranks, gid, timeout)  # (not reached)

        aiocoll.ProcessGroup._survivors_group = die  # type: ignore[method-assign]

    w = initial()

    def load(state: dict[str, Any]) -> None:
        w[:] = state["w"]

    manager = Manager(
        args.coordinator,
        replica=args.replica,
        state_dict=lambda: {"w": w},
        load_state_dict=load,
        min_replicas=1,
        join_timeout=args.join_timeout,
        timeout=10.0,
        quorum_timeout=60.0,
    )
    until = Path(args.until_file)
    async with manager:
        while (stop := _stop_after(until)) is None or manager.step < stop:
            step = await manager.start_step()
            healed = manager.last_heal
            manager.last_heal = None
            await asyncio.sleep(args.step_time)  # the forward and backward pass: a kill lands here
            g = gradient(step)
            await manager.all_reduce_mean([g])
            if await manager.commit():
                w -= 0.1 * g
                assert manager.group is not None
                write(
                    event="step",
                    step=step,
                    members=manager.members,
                    quorum=manager.quorum_id,
                    group=manager.group.group_id,
                    digest=digest(w),
                    healed=healed,
                )
            else:
                write(event="failed", step=step, error=str(manager.last_error))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--replica", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--until-file", required=True)
    parser.add_argument("--join-timeout", type=float, default=1.0)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--die-in-agreement", action="store_true")
    cli = parser.parse_args()
    with open(cli.record, "a", buffering=1) as out:
        raise SystemExit(aiocoll.run(main(cli, out)))
