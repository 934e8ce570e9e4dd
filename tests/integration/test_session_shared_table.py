"""Many sessions of one process joining one round share one decoded member table, fetched at
most once per process, over real loopback sockets to an embedded coordinator."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiocoll.client.control.session import CoordinatorSession
from aiocoll.server import Coordinator

pytestmark = pytest.mark.integration

TOKEN = "shared-table-secret"


@pytest.mark.timeout(60)
async def test_sessions_of_one_process_share_one_member_table() -> None:
    n = 40
    async with Coordinator("127.0.0.1", 0, token=TOKEN) as coord:
        job = f"shared-{uuid.uuid4().hex}"
        sessions = await asyncio.gather(
            *(
                CoordinatorSession.connect("127.0.0.1", coord.port, token=TOKEN, job=job, timeout=30)
                for _ in range(n)
            )
        )
        try:
            tables = await asyncio.gather(
                *(
                    s.join(None, n, [("127.0.0.1", 30000 + i)], f"host-{i % 4}", timeout=30)
                    for i, s in enumerate(sessions)
                )
            )
            assert sorted(t.rank for t in tables) == list(range(n))
            first = tables[0].members
            assert [m.rank for m in first] == list(range(n))
            assert all(t.members is first for t in tables)  # one table object in this process
            # Every member's own entry carries what it sent.
            for i, t in enumerate(tables):
                assert first[t.rank].addrs == [("127.0.0.1", 30000 + i)]
                assert first[t.rank].host == f"host-{i % 4}"
            fetched = coord.metrics.registry.get_sample_value(
                "aiocoll_coordinator_operations_total", {"op": "table", "outcome": "ok"}
            )
            assert (fetched or 0) <= 1  # at most one table request for the whole process

            # A later lone join (a new job) still gets its table inline.
            other = f"shared-{uuid.uuid4().hex}"
            lone = await CoordinatorSession.connect(
                "127.0.0.1", coord.port, token=TOKEN, job=other, timeout=30
            )
            try:
                alone = await lone.join(0, 1, [("127.0.0.1", 1)], "solo", timeout=30)
                assert [(m.rank, m.addrs, m.host) for m in alone.members] == [(0, [("127.0.0.1", 1)], "solo")]
            finally:
                await lone.aclose()
        finally:
            await asyncio.gather(*(s.aclose() for s in sessions))
