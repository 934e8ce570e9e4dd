"""monitored_barrier: a barrier through rank 0 that names the ranks that did not arrive.

One mechanism for both front ends that offer it (aiocoll.sync.monitored_barrier and the torch
backend's ``ProcessGroup.monitored_barrier``). It composes point-to-point operations of an
``aiocoll.ProcessGroup`` passed in (duck-typed), so it imports only the error types and numpy,
nothing above the foundations. Messages use torch's wording ("Rank 1 failed to pass
monitoredBarrier in 2000 ms", "timed out in monitoredBarrier"): torch's tests and users' code
match it.

As in torch, every other rank sends rank 0 a token and waits for its answer; rank 0 waits for all
tokens within one deadline, then answers everyone. A rank that arrives after rank 0 gave up
leaves its token queued on rank 0 (torch's gloo backend behaves the same).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from ._errors import CollectiveTimeout

__all__ = ["MONITORED_BARRIER_TAG", "monitored_barrier"]

MONITORED_BARRIER_TAG = 0x7FFF_0001  # a p2p tag user code is unlikely to pick


def _ms(timeout: float | None) -> str:
    return "no limit" if timeout is None else f"{round(timeout * 1000)} ms"


async def monitored_barrier(
    core: Any,
    timeout: float | None,
    wait_all_ranks: bool,
    *,
    group: str,
    rank_name: Callable[[int], int],
) -> None:
    """Run one monitored barrier on the aiocoll ProcessGroup ``core``.

    Args:
        timeout: seconds for the whole barrier (None: no limit; 0 or less fails at once).
        wait_all_ranks: rank 0 waits the whole timeout and names every missing rank instead of
            failing on the first (lowest) missing one.
        group: the group's name, for messages. rank_name: the rank messages name for a group rank.

    Raises:
        CollectiveTimeout: on rank 0, naming the ranks that did not arrive; on the others, when
            rank 0 did not answer in time.
    """
    me, size = int(core.rank), int(core.size)
    where = f"monitored_barrier of group {group!r}"
    if timeout is not None and timeout <= 0:
        raise CollectiveTimeout(
            "monitored_barrier",
            group,
            -1,
            [],
            timeout,
            f"Rank {rank_name(me)} timed out in monitoredBarrier after {_ms(timeout)} ({where}: the "
            f"timeout was not positive)",
        )
    tag = MONITORED_BARRIER_TAG
    token = np.zeros(1, np.uint8)
    if me != 0:
        await core.send(token, 0, tag=tag, timeout=timeout)
        try:
            await core.recv(np.zeros(1, np.uint8), 0, tag=tag, timeout=timeout)
        except CollectiveTimeout as exc:
            raise CollectiveTimeout(
                "monitored_barrier",
                group,
                exc.seq,
                [rank_name(0)],
                timeout,
                f"Rank {rank_name(me)} successfully reached monitoredBarrier, but received errors while "
                f"waiting for send/recv from rank {rank_name(0)}: Timed out after {_ms(timeout)} ({where}; "
                f"a rank failed to arrive, rank {rank_name(0)}'s error names it)",
            ) from exc
        return
    others = list(range(1, size))
    arrivals = {
        r: asyncio.ensure_future(_await(core.recv(np.zeros(1, np.uint8), r, tag=tag, timeout=timeout)))
        for r in others
    }
    missing: list[int] = []
    try:
        for r in others:
            try:
                await arrivals[r]
            except CollectiveTimeout:
                missing.append(r)
                if not wait_all_ranks:
                    break
    finally:
        for arrival in arrivals.values():
            arrival.cancel()
    if missing:
        names = [rank_name(r) for r in missing]
        who = f"Rank {names[0]}" if len(names) == 1 else "Ranks " + ", ".join(map(str, names))
        raise CollectiveTimeout(
            "monitored_barrier",
            group,
            -1,
            names,
            timeout,
            f"{who} failed to pass monitoredBarrier in {_ms(timeout)} ({where}: Timed out waiting for "
            f"{'them' if len(names) > 1 else 'it'}; check that every rank reaches this barrier)",
        )
    await asyncio.gather(*(_await(core.send(token, r, tag=tag, timeout=timeout)) for r in others))


async def _await(work: Any) -> Any:
    return await work
