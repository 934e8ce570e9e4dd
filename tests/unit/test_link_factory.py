"""The one factory of link kinds: the AIOCOLL_TRANSPORT setting, the choice per peer from the
membership table, and a world whose peers are linked by different kinds."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest
from aiocoll.client.transports import _factory
from aiocoll.client.transports._factory import (
    LinkKind,
    PeerEntry,
    PeerRow,
    choose_link_kinds,
    connect_links,
    transport_choice,
)
from aiocoll.client.transports._link import LinkTransport
from aiocoll.client.transports.memory import MemoryLink
from aiocoll.client.transports.tcp import TcpTransport

import aiocoll
from aiocoll._deadline import Deadline

LIMIT = 10.0


def test_the_setting_defaults_to_auto_accepts_tcp_and_refuses_shm_and_nonsense_saying_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AIOCOLL_TRANSPORT", raising=False)
    assert transport_choice() == "auto"
    monkeypatch.setenv("AIOCOLL_TRANSPORT", " TCP ")
    assert transport_choice() == "tcp"
    with pytest.raises(ValueError, match=r"AIOCOLL_TRANSPORT=shm: .*shared-memory.*auto or tcp"):
        transport_choice("shm")
    with pytest.raises(ValueError, match=r"AIOCOLL_TRANSPORT='udp' is not one of auto, tcp, shm"):
        transport_choice("udp")


async def test_init_process_group_refuses_an_unusable_setting_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setenv("AIOCOLL_TRANSPORT", "shm")
    with pytest.raises(ValueError, match="AIOCOLL_TRANSPORT=shm"):
        await asyncio.wait_for(
            aiocoll.init_process_group(f"file://{tmp_path}/store", rank=0, world_size=1, token="t"), LIMIT
        )


def test_auto_and_tcp_choose_tcp_for_every_peer_today() -> None:
    table = {r: PeerRow(r, [("127.0.0.1", 1000 + r)], "hostA" if r < 2 else "hostB") for r in range(4)}
    for choice in ("auto", "tcp"):
        assert choose_link_kinds(1, table, choice) == {0: "tcp", 2: "tcp", 3: "tcp"}


class _SameProcessKind(LinkKind):
    """A same-host link kind for this test: memory links between transports of one process (what
    a shared-memory kind plugs in as)."""

    name = "same-process"
    same_host_only = True

    def __init__(self, transports: list[TcpTransport]) -> None:
        self.transports = transports

    async def connect(
        self,
        transport: LinkTransport,
        peers: Sequence[int],
        table: Mapping[int, PeerEntry],
        deadline: Deadline,
    ) -> None:
        for peer in peers:
            if peer > transport.rank:  # the lower rank makes the pair, as the higher one dials for tcp
                other = self.transports[peer]
                mine, theirs = MemoryLink(transport, peer), MemoryLink(other, transport.rank)
                mine.mirror, theirs.mirror = theirs, mine
                transport.attach(mine)
                other.attach(theirs)
        await transport.wait_links(peers, deadline)


@pytest.mark.timeout(60)
async def test_a_world_mixes_link_kinds_per_peer_by_host_and_every_pair_exchanges_messages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = 4
    ts = [TcpTransport(r, n, token="t", job="mixed") for r in range(n)]
    monkeypatch.setitem(_factory.KINDS, "same-process", _SameProcessKind(ts))
    monkeypatch.setattr(_factory, "AUTO_ORDER", ("same-process", "tcp"))
    try:
        table = [
            PeerRow(r, [await t.listen("127.0.0.1")], "hostA" if r < 2 else "hostB") for r, t in enumerate(ts)
        ]
        kinds = await asyncio.wait_for(
            asyncio.gather(*(connect_links(t, table, Deadline(LIMIT), "auto") for t in ts)), LIMIT
        )
        assert kinds[0] == {1: "same-process", 2: "tcp", 3: "tcp"}
        assert kinds[3] == {0: "tcp", 1: "tcp", 2: "same-process"}
        assert ts[0].link_kinds() == {1: "memory", 2: "tcp", 3: "tcp"}  # the kind's links
        for src in range(n):
            for dst in range(n):
                if src != dst:
                    await ts[src].send(dst, ("mix", src), memoryview(bytes([src, dst])), {"from": src})
        for dst in range(n):
            for src in range(n):
                if src != dst:
                    into = bytearray(2)
                    got = await asyncio.wait_for(ts[dst].recv(None, ("mix", src), memoryview(into)), LIMIT)
                    assert got == (src, {"from": src}) and into == bytes([src, dst])
        # a loss over either kind reaches the one matcher and the handlers the same way
        seen = {r: asyncio.Event() for r in (0, 2)}
        for r, event in seen.items():
            ts[r].on_peer_lost(lambda rank, exc, event=event: event.set() if rank == 1 else None)
        pending = asyncio.ensure_future(ts[0].recv(1, ("never",), memoryview(bytearray(1))))
        await asyncio.sleep(0.01)
        ts[1].abort()
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in seen.values())), LIMIT)
        with pytest.raises(aiocoll.PeerLostError):
            await asyncio.wait_for(pending, LIMIT)
    finally:
        await asyncio.gather(*(t.aclose() for t in ts))
