"""The coordinator's share of a loop turn, spent: requests then wait for later turns, large answers
are written over several turns, and connections closed together are forgotten together. With a
budget of zero nearly every request of a real coordinator waits its turn, so these checks run
the waiting paths over real sockets; what must hold is that nothing is lost, reordered or
answered twice, and that an operator's status request is not held behind the queue."""

from __future__ import annotations

import asyncio
import secrets

import pytest
from aiocoll.client.control.session import CoordinatorSession
from aiocoll.server import Coordinator
from aiocoll.server import _coordinator as coordinator_module

pytestmark = pytest.mark.timeout(60)

TOKEN = secrets.token_hex(16)


async def _session(port: int, job: str, **kw: object) -> CoordinatorSession:
    return await CoordinatorSession.connect("127.0.0.1", port, token=TOKEN, job=job, timeout=20, **kw)


async def test_a_spent_turn_defers_requests_and_writes_without_losing_or_reordering_any(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two connections' frames per look at the clock: answering a round of six hosts takes turns.
    monkeypatch.setattr(coordinator_module, "_WRITES_PER_CHECK", 2)
    async with Coordinator("127.0.0.1", 0, token=TOKEN) as c:
        c.turns.budget = 0.0
        waited = 0
        original_later = c.turns.later

        def counting_later(work: object) -> None:
            nonlocal waited
            waited += 1
            original_later(work)  # type: ignore[arg-type]

        c.turns.later = counting_later  # type: ignore[method-assign]

        # Store: eight clients, each a burst of pipelined sets, then adds and reads, concurrently.
        clients = [await _session(c.port, "kv") for _ in range(8)]

        async def store_work(i: int, s: CoordinatorSession) -> None:
            for n in range(50):
                await s.set(f"c{i}/k", f"{n}".encode())  # the same key: the last set must win
            assert await s.get(f"c{i}/k") == b"49"
            totals = [await s.add("shared", 1) for _ in range(25)]
            assert totals == sorted(totals) and len(set(totals)) == 25

        await asyncio.gather(*(store_work(i, s) for i, s in enumerate(clients)))
        assert await clients[0].add("shared", 0) == 8 * 25
        assert waited > 0, "a budget of zero must put requests off to later turns"

        # Rendezvous: six hosts of four ranks, answered over several turns; each reads its rows.
        hosts = [await _session(c.port, "rdv") for _ in range(6)]
        joined = await asyncio.gather(
            *(
                h.join_host(
                    list(range(4 * i, 4 * i + 4)), 24, [[("127.0.0.1", 9000 + r)] for r in range(4)], f"h{i}"
                )
                for i, h in enumerate(hosts)
            )
        )
        assert sorted(r for j in joined for r in j.ranks) == list(range(24))
        assert len({s for j in joined for s in j.sessions}) == 24
        rows = await hosts[2].table_rows(0, 24)
        assert [m.rank for m in rows] == list(range(24)) and rows[9].host == "h2"

        # An operator's status is answered while the queue is long.
        admin = await CoordinatorSession.connect("127.0.0.1", c.port, token=TOKEN, role="admin", timeout=20)
        flood = [asyncio.ensure_future(s.get(f"c{i}/k")) for i, s in enumerate(clients) for _ in range(20)]
        [view] = await admin.status("rdv")
        assert view["complete"] and view["world_size"] == 24
        assert await asyncio.gather(*flood) == [f"{49}".encode()] * len(flood)

        # Three hosts cut at once: each other host hears of all twelve ranks, each exactly once.
        heard: list[int] = []
        for h in hosts[3:]:
            h.on_member_lost(lambda rank, reason: heard.append(rank))
        for h in hosts[:3]:
            h.abort()
        for _ in range(200):
            if len(heard) >= 3 * 12:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # nothing more may come
        assert sorted(heard) == sorted(list(range(12)) * 3)

        for s in [*clients, *hosts[3:], admin]:
            await s.aclose()
