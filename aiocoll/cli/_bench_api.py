"""The blocking APIs as contenders of `aiocoll bench --api`: aiocoll.sync and the torch backend.

Runs in each spawned bench worker, beside the async group the worker already measures: joins a
group for each blocking API asked for and returns, per API, the object the bench's OpRunner calls
with torch.distributed's names (``all_reduce(t)``, ``broadcast(t, src=0)``, ...). Their calls run
on the worker's main thread, as a script's would, and are timed like gloo's. Imports aiocoll.sync
and torch only inside the worker, when asked for.

- ``sync``: ``aiocoll.sync`` over its own aiocoll world (a job of its own on the bench's
  coordinator), numpy or torch buffers as ``--tensor`` says.
- ``torch``: ``torch.distributed`` calls on a group of the ``"aiocoll"`` backend, torch tensors.
  When the worker already made torch's default group on gloo (``--vs gloo``), the aiocoll group is
  a ``new_group(backend="aiocoll")`` over it; when ``sync`` made torch's default group over its
  world (what aiocoll.sync does when torch is loaded), that default group is used; otherwise
  torch's default group is made on the "aiocoll" backend through the bench's TCPStore.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["API_CONTENDERS", "join_apis", "leave_apis"]

# The blocking APIs `--api` may add beside the async API (always measured: the ratios' base).
API_CONTENDERS = ("sync", "torch")


class _OnGroup:
    """torch.distributed's functions with ``group=`` bound (one partial per name, made once)."""

    def __init__(self, dist: Any, group: Any) -> None:
        self._dist = dist
        self._group = group

    def __getattr__(self, name: str) -> Any:
        bound = functools.partial(getattr(self._dist, name), group=self._group)
        setattr(self, name, bound)  # later lookups find the attribute without __getattr__
        return bound


async def join_apis(apis: Sequence[str], rank: int, cfg: dict[str, Any], torch_dist: Any) -> dict[str, Any]:
    """Join what each of ``apis`` needs; returns the object to call per API.

    Args:
        apis: names from API_CONTENDERS.
        rank: this worker's rank.
        cfg: the bench's worker configuration (port, gloo_port, token, job, timeout, world_size).
        torch_dist: torch.distributed with its default group made on gloo, or None.
    """
    # torch hands the backend no token: it reads the environment, as under `aiocoll run`
    os.environ["AIOCOLL_TOKEN"] = cfg["token"]
    n = cfg["world_size"]
    seconds = float(cfg["timeout"])
    found: dict[str, Any] = {}
    if "sync" in apis:
        import aiocoll.sync as sync

        await asyncio.to_thread(
            sync.init_process_group,
            init_method=f"tcp://127.0.0.1:{cfg['port']}",
            rank=rank,
            world_size=n,
            timeout=seconds,
            token=cfg["token"],
            job=f"{cfg['job']}-sync",
        )
        found["sync"] = sync
    if "torch" in apis:
        import torch.distributed as td

        import aiocoll.torch  # noqa: F401  (registers the backend)

        timeout = datetime.timedelta(seconds=seconds)
        if torch_dist is not None:
            group = await asyncio.to_thread(td.new_group, backend="aiocoll", timeout=timeout)
            found["torch"] = _OnGroup(td, group)
        elif td.is_initialized():  # aiocoll.sync made it over its own world
            found["torch"] = td
        else:
            store = td.TCPStore(
                "127.0.0.1", cfg["gloo_port"], is_master=False, wait_for_workers=False, timeout=timeout
            )
            await asyncio.to_thread(
                td.init_process_group, "aiocoll", store=store, rank=rank, world_size=n, timeout=timeout
            )
            found["torch"] = td
    return found


async def leave_apis(found: dict[str, Any], torch_dist: Any) -> None:
    """Leave what join_apis joined (torch's default group is left by whoever made it)."""
    if "torch" in found and torch_dist is None and "sync" not in found:
        await asyncio.to_thread(found["torch"].destroy_process_group)
    if "sync" in found:
        await asyncio.to_thread(found["sync"].destroy_process_group)
