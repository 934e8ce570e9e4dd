"""The one factory of link kinds: the AIOCOLL_TRANSPORT setting, the choice per peer from the
membership table, and a world whose peers are linked by different kinds."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest
from aiocoll.client.data.transports import _factory
from aiocoll.client.data.transports._factory import (
    LinkKind,
    PeerEntry,
    PeerRow,
    choose_link_kinds,
    connect_links,
    listen_addresses,
    transport_choice,
)
from aiocoll.client.data.transports._link import LinkTransport
from aiocoll.client.data.transports.memory import MemoryLink
from aiocoll.client.data.transports.tcp import TcpTransport

import aiocoll
from aiocoll._deadline import Deadline

LIMIT = 10.0


def _shm_unusable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_factory.KINDS["shm"], "unavailable", lambda: "shared memory needs Linux")


def test_the_setting_defaults_to_auto_accepts_tcp_and_shm_and_refuses_nonsense_saying_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AIOCOLL_TRANSPORT", raising=False)
    assert transport_choice() == "auto"
    monkeypatch.setenv("AIOCOLL_TRANSPORT", " TCP ")
    assert transport_choice() == "tcp"
    assert transport_choice("shm") == "shm"
    with pytest.raises(ValueError, match=r"AIOCOLL_TRANSPORT='udp' is not one of auto, tcp, shm"):
        transport_choice("udp")
    _shm_unusable(monkeypatch)
    with pytest.raises(ValueError, match=r"AIOCOLL_TRANSPORT=shm: .*needs Linux.*auto or tcp"):
        transport_choice("shm")


async def test_init_process_group_refuses_an_unusable_setting_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    _shm_unusable(monkeypatch)
    monkeypatch.setenv("AIOCOLL_TRANSPORT", "shm")
    with pytest.raises(ValueError, match="AIOCOLL_TRANSPORT=shm"):
        await asyncio.wait_for(
            aiocoll.init_process_group(f"file://{tmp_path}/store", rank=0, world_size=1, token="t"), LIMIT
        )


def test_auto_and_shm_choose_shm_on_the_same_host_and_tcp_across_hosts_tcp_chooses_tcp_everywhere() -> None:
    table = {r: PeerRow(r, [("127.0.0.1", 1000 + r)], "hostA" if r < 2 else "hostB") for r in range(4)}
    for choice in ("auto", "shm"):
        assert choose_link_kinds(1, table, choice) == {0: "shm", 2: "tcp", 3: "tcp"}
    assert choose_link_kinds(1, table, "tcp") == {0: "tcp", 2: "tcp", 3: "tcp"}


async def _linked(n: int, hosts: list[str], choice: str, *, hide_shm: bool = False) -> list[TcpTransport]:
    ts = [TcpTransport(r, n, token="t", job="shm-choice") for r in range(n)]
    addrs = [await listen_addresses(t, "127.0.0.1", token="t", job="shm-choice", choice=choice) for t in ts]
    if hide_shm:  # what a peer in another network namespace looks like: its address is not reachable
        addrs = [
            [a if not str(a[0]).startswith("@") else ["@aiocoll-not-reachable", 0] for a in row]
            for row in addrs
        ]
    table = [PeerRow(r, addrs[r], hosts[r]) for r in range(n)]
    try:
        await asyncio.wait_for(
            asyncio.gather(*(connect_links(t, table, Deadline(3.0), choice) for t in ts)), LIMIT
        )
    except BaseException:
        await asyncio.gather(*(t.aclose() for t in ts))
        raise
    return ts


@pytest.mark.timeout(60)
async def test_a_real_world_uses_shm_within_each_host_and_tcp_between_hosts() -> None:
    ts = await _linked(4, ["hostA", "hostA", "hostB", "hostB"], "auto")
    try:
        assert ts[0].link_kinds() == {1: "shm", 2: "tcp", 3: "tcp"}
        assert ts[3].link_kinds() == {0: "tcp", 1: "tcp", 2: "shm"}
        await ts[1].send(0, ("x",), memoryview(b"hi"), {"m": 1})
        into = bytearray(2)
        assert await asyncio.wait_for(ts[0].recv(1, ("x",), memoryview(into)), LIMIT) == (1, {"m": 1})
        assert into == b"hi"
    finally:
        await asyncio.gather(*(t.aclose() for t in ts))


@pytest.mark.timeout(60)
async def test_same_host_peers_that_cannot_share_memory_fall_back_to_tcp_unless_shm_is_forced() -> None:
    ts = await _linked(2, ["hostA", "hostA"], "auto", hide_shm=True)
    try:
        assert ts[1].link_kinds() == {0: "tcp"}
    finally:
        await asyncio.gather(*(t.aclose() for t in ts))
    with pytest.raises(
        aiocoll.RendezvousError, match=r"AIOCOLL_TRANSPORT=shm: rank 1 cannot share memory with rank 0"
    ):
        await _linked(2, ["hostA", "hostA"], "shm", hide_shm=True)


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
