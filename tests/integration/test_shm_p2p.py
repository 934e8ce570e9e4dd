"""Point-to-point payloads between ranks of one host travel through the shm links' rings, or for
large ones straight from the sender's memory (process_vm_readv), never over the Unix socket:
exact bytes for every size (one chunk, many chunks, odd sizes, both directions at once, early and
late receives), the operations the driver runs over links (reduce, gather, scatter, all_to_all)
against numpy; a receiver killed with SIGKILL while its sender waits on a full ring or for its
read, and a sender killed mid-message, while it fills a chunk, or before its receiver read it
(PeerLostError naming it, nothing under /dev/shm); one frame per payload up to the ring's size;
a waiting receive keeps the loop polling over these links (tcp links do
not: test_shm_api)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from aiocoll.client.data._waiting import SpinBudget
from aiocoll.client.data.transports import _in_place, _loop_polling, shm
from aiocoll.client.data.transports._link import LinkTransport
from aiocoll.client.data.transports.shm import ShmLink

from aiocoll._errors import MismatchError
from aiocoll.testing.world import outcome, run_world, unwrap

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# one piece, one chunk of many pieces, more than the 4 MiB ring (several chunks, or a read of
# the sender's memory), odd lengths
SIZES = (1, 4096, 100_003, 3 << 20, (16 << 20) + 7)
BOTH_WAYS = (80 << 20) + 4099


_PATHS = ("bytes_out", "bytes_in", "direct_bytes_out", "direct_bytes_in")
# the ring alone, where no rank may read another's memory
RING_ONLY = {"AIOCOLL_TRANSPORT": "shm", "AIOCOLL_SHM_DIRECT": "0"}


def _link_bytes(pg: Any) -> tuple[int, ...]:
    """Payload bytes this rank's links moved through rings (out, in), then read straight from
    the sender's memory (out, in)."""
    links = pg._rt.transport.debug_state()["links"]
    rings = [link["ring"] for link in links.values()]
    return tuple(sum(r[path] for r in rings) for path in _PATHS)


def _pattern(n: int, seed: int) -> np.ndarray:
    """Byte i is (131 i + seed) mod 251: one period of 251 bytes, repeated. Built from the period,
    not computed in int64 for every byte: at 80 MiB that took 2.7 s of CPU on the rank's loop,
    which also serves rank 0's coordinator, and under load stalled it past the heartbeat timeout
    (a rank then lost its session and the world failed)."""
    period = ((np.arange(251, dtype=np.int64) * 131 + seed) % 251).astype(np.uint8)
    return np.resize(period, n)


async def ring_checks(pg: Any) -> dict[str, Any]:
    from shm_world import polled_ping_pongs

    import aiocoll

    r, n = pg.rank, pg.size
    out: dict[str, Any] = {"kinds": sorted(set(pg._rt.transport.link_kinds().values()))}
    before = _link_bytes(pg)
    await pg.barrier()  # (over the arenas) nobody sends before every rank has read its counters
    # both directions at once between 0 and 1, every size; 2 takes part in the collectives only
    ok = []
    if r in (0, 1):
        peer = 1 - r
        for size in SIZES:
            mine, got = _pattern(size, r), np.zeros(size, np.uint8)
            sending = pg.send(mine, dst=peer, tag=size % 1000)
            await pg.recv(got, src=peer, tag=size % 1000)
            await sending
            ok.append(bool(np.array_equal(got, _pattern(size, peer))))
        # an early message: sent long before its receive is posted, waits intact
        if r == 0:
            await pg.send(_pattern(8 << 20, 9), dst=1, tag=77)
        else:
            await asyncio.sleep(0.3)
            late = np.zeros(8 << 20, np.uint8)
            await pg.recv(late, src=0, tag=77)
            ok.append(bool(np.array_equal(late, _pattern(8 << 20, 9))))
        # a small message queued behind a large one leaves in its own frame, in order, and its
        # buffer is the sender's again once its send is done, though the large one is not
        if r == 0:
            large = pg.send(_pattern(6 << 20, 4), dst=1, tag=5)
            small = _pattern(100, 5)
            await pg.send(small, dst=1, tag=6)
            small[:] = 0
            await large
        else:
            await asyncio.sleep(0.2)
            got_small, got_large = np.zeros(100, np.uint8), np.zeros(6 << 20, np.uint8)
            await pg.recv(got_small, src=0, tag=6)
            await pg.recv(got_large, src=0, tag=5)
            ok.append(bool(np.array_equal(got_small, _pattern(100, 5))))
            ok.append(bool(np.array_equal(got_large, _pattern(6 << 20, 4))))
        # both ways at once, each more than a receiver keeps of unreceived messages (its reading
        # of the link pauses): each send completes once the peer has read it, which the peer
        # says in the ring's header, not over the paused socket; a read this large is split
        # between two threads (an odd length: the second part ends mid-page)
        both = _pattern(BOTH_WAYS, r)
        await pg.send(both, dst=peer, tag=8)
        both[:] = 0
        await pg.recv(both, src=peer, tag=8)
        ok.append(bool(np.array_equal(both, _pattern(BOTH_WAYS, peer))))
        # a float payload, reused by the sender at once after the send returned
        x = np.arange(1 << 20, dtype=np.float32) + r
        if r == 0:
            await pg.send(x, dst=1, tag=3)
            x[:] = -1.0
        else:
            y = np.zeros(1 << 20, np.float32)
            await pg.recv(y, src=0, tag=3)
            ok.append(bool(np.array_equal(y, np.arange(1 << 20, dtype=np.float32))))
    out["p2p"] = ok
    # a waiting receive keeps the loop polling for a moment over shm links (no sleep, no wake-up)
    out["polled"] = await polled_ping_pongs(pg, until_one_polled=True)
    # the collectives the driver runs over links, 3 MiB per rank (several chunks each)
    m = 3 << 18
    v = np.arange(m, dtype=np.float32) * (r + 1)
    await pg.reduce(v, dst=0, op=aiocoll.ReduceOp.SUM)
    if r == 0:
        out["reduce"] = bool(np.array_equal(v, np.arange(m, dtype=np.float32) * sum(range(1, n + 1))))
    mine = np.full(m, r, np.int32)
    gathered = [np.zeros(m, np.int32) for _ in range(n)] if r == 1 else None
    await pg.gather(mine, gathered, dst=1)
    if r == 1:
        assert gathered is not None
        out["gather"] = all(np.array_equal(g, np.full(m, j, np.int32)) for j, g in enumerate(gathered))
    part = np.zeros(m, np.float64)
    parts = [np.full(m, 10.0 * j + 0.5, np.float64) for j in range(n)] if r == 2 else None
    await pg.scatter(part, parts, src=2)
    out["scatter"] = bool(np.array_equal(part, np.full(m, 10.0 * r + 0.5)))
    ins = [np.full(m // n, 100 * r + j, np.int64) for j in range(n)]
    outs = [np.zeros(m // n, np.int64) for _ in range(n)]
    await pg.all_to_all(outs, ins)
    want = [np.full(m // n, 100 * j + r, np.int64) for j in range(n)]
    out["all_to_all"] = all(np.array_equal(o, w) for o, w in zip(outs, want, strict=True))
    after = _link_bytes(pg)
    out["ring_out"], out["ring_in"], out["direct_out"], out["direct_in"] = (
        a - b for a, b in zip(after, before, strict=True)
    )
    await pg.barrier()  # nobody leaves (closing its links, whose counters we read) before all read
    return out


def test_payloads_between_ranks_of_one_host_go_through_the_rings_and_arrive_exactly() -> None:
    from aiocoll.client.data._vm_read import vm_read_available

    results = unwrap(run_world(ring_checks, 3, env={"AIOCOLL_TRANSPORT": "shm"}))
    for r, res in enumerate(results):
        assert res["kinds"] == ["shm"], res
        assert res["scatter"] and res["all_to_all"], (r, res)
        if r in (0, 1):
            assert res["p2p"] == [True] * (len(SIZES) + 1 + (4 if r == 1 else 0)), (r, res["p2p"])
    assert results[0]["reduce"] and results[1]["gather"]
    # rank 0 posts each receive before its reply can exist, so it waits every round trip (rank 1
    # often finds the next message already there): hundreds of its receives came while polling
    assert results[0]["polled"] > 0, [res["polled"] for res in results]
    # every payload byte of more than 1 KiB between these ranks went through a ring or was read
    # from the sender's memory (smaller ones ride in their frame): the p2p traffic alone is more
    # than sum(SIZES) bytes each way
    for r in (0, 1):
        res = results[r]
        assert res["ring_out"] + res["direct_out"] >= sum(SIZES), res
        assert res["ring_in"] + res["direct_in"] >= sum(SIZES), res
    for path in ("ring", "direct"):
        assert sum(res[f"{path}_out"] for res in results) == sum(res[f"{path}_in"] for res in results)
    if vm_read_available():
        # past the 4 MiB ring the receiver reads the sender's buffer: the 16 MiB and 80 MiB ones
        # both ways, rank 0's early 8 MiB and queued 6 MiB ones, and rank 2's 6 MiB scatter parts
        # to 0 and 1; payloads up to the ring (the 4 MiB float one among them, and the other
        # collectives' 3 MiB and 2 MiB ones) all went through the rings
        both, mib = SIZES[-1] + BOTH_WAYS, 1 << 20
        assert (results[0]["direct_out"], results[0]["direct_in"]) == (both + 14 * mib, both + 6 * mib)
        assert (results[1]["direct_out"], results[1]["direct_in"]) == (both, both + 20 * mib)
        assert (results[2]["direct_out"], results[2]["direct_in"]) == (12 * mib, 0)


async def receiver_killed(pg: Any) -> dict[str, Any]:
    from shm_world import dev_shm_in_use

    inherited = set(dev_shm_in_use())
    pids = await pg.all_gather_object(os.getpid())
    if pg.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # stops reading: rank 0's ring to us fills up
        await asyncio.sleep(60)  # never reached: rank 0 kills us while we are stopped
    if pg.rank == 2:
        return {"error": None}
    big = np.ones(32 << 20, np.uint8)  # far more than the 4 MiB ring
    await asyncio.sleep(0.2)
    work = pg.send(big, dst=1)

    async def finish() -> None:
        await work

    sending = asyncio.ensure_future(finish())
    await asyncio.sleep(0.5)
    res: dict[str, Any] = {"waited": not sending.done()}
    ring = pg._rt.transport.debug_state()["links"][1]["ring"]
    res["asleep"], res["unread"] = ring["asleep"], ring["unread_by_peer"]
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(sending, 30)
        res["error"] = None
    except Exception as exc:
        res.update(error=type(exc).__name__, rank=getattr(exc, "rank", None))
    res["after"] = time.monotonic() - t0
    res["dev_shm"] = sorted(set(dev_shm_in_use()) - inherited)
    return res


@pytest.mark.parametrize("path", ["ring", "direct"])
def test_a_receiver_killed_while_its_sender_waits_fails_the_send_naming_it(path: str) -> None:
    """The sender waits on a full ring, or for its receiver to read its buffer."""
    from aiocoll.client.data._vm_read import vm_read_available

    if path == "direct" and not vm_read_available():
        pytest.skip("process_vm_readv is unavailable here: large messages go through the rings")
    env = RING_ONLY if path == "ring" else {"AIOCOLL_TRANSPORT": "shm"}
    results = run_world(receiver_killed, 3, timeout=120, env=env)
    assert results[1].exitcode == -signal.SIGKILL
    assert results[0].error is None, results[0].error
    res = results[0].value
    assert res["waited"], res
    if path == "ring":
        assert res["asleep"] and res["unread"] == 0, res  # the sender really waited on the full ring
    else:
        assert res["asleep"] and res["unread"] == 1, res  # it slept until the read
    assert res["error"] == "PeerLostError" and res["rank"] == 1, res
    assert res["after"] < 10.0 and res["dev_shm"] == [], res


async def sender_killed(pg: Any) -> dict[str, Any]:
    from shm_world import dev_shm_in_use

    inherited = set(dev_shm_in_use())
    big = 96 << 20  # many ring-fulls: the sender is killed with most of it still to come
    if pg.rank == 0:
        await pg.barrier()
        loop = asyncio.get_running_loop()
        link = pg._rt.transport.link(1)

        def kill_once_under_way() -> None:  # (a long send gives the loop a turn every 2 ms)
            if link.ring_bytes_out >= 8 << 20:
                os.kill(os.getpid(), signal.SIGKILL)
            loop.call_later(0.0005, kill_once_under_way)

        kill_once_under_way()
        await pg.send(np.ones(big, np.uint8), dst=1)
        await asyncio.sleep(60)  # never reached
    return await _receive_while_rank_0_dies(pg, big, inherited)


async def _receive_while_rank_0_dies(pg: Any, size: int, inherited: set[str]) -> dict[str, Any]:
    """Rank 1's receive of ``size`` bytes from rank 0, which dies sending them: what it failed
    with, how soon, and whether part of the payload had landed."""
    from shm_world import dev_shm_in_use

    into = np.zeros(size, np.uint8)
    receiving = pg.recv(into, src=0) if pg.rank == 1 else None
    # (a turn of the loop: the receive, which waits as a task, is posted before the barrier lets
    # rank 0 send; a barrier that completes inside its call would not give it one)
    await asyncio.sleep(0)
    await pg.barrier()
    t0 = time.monotonic()
    res: dict[str, Any] = {"error": None}
    if receiving is not None:
        try:
            await receiving
        except Exception as exc:
            res.update(error=type(exc).__name__, rank=getattr(exc, "rank", None))
        res["partial"] = bool(into.any()) and not bool(into.all())  # it died mid-message
    res["after"] = time.monotonic() - t0
    res["dev_shm"] = sorted(set(dev_shm_in_use()) - inherited)
    return res


async def sender_killed_mid_chunk(pg: Any) -> dict[str, Any]:
    """Rank 0 sends one chunk of several pieces and is killed after the first piece (its frame
    sent): rank 1's receive, copying the pieces out as they land, waits for the rest in place
    and must see the loss there."""
    from aiocoll.client.data import _shm_ring
    from shm_world import dev_shm_in_use

    inherited = set(dev_shm_in_use())
    size = 3 << 20  # less than the ring: one chunk, one frame, twelve pieces
    if pg.rank == 0:
        fill = _shm_ring.RingWriter.fill

        def fill_then_die(self: Any, end: int, n: int, at: int, src: memoryview) -> None:
            if n == size and at > 0:  # the first piece and the frame are out
                os.kill(os.getpid(), signal.SIGKILL)
            fill(self, end, n, at, src)

        _shm_ring.RingWriter.fill = fill_then_die  # (this process only)
        await pg.barrier()
        await pg.send(np.ones(size, np.uint8), dst=1)
        await asyncio.sleep(60)  # never reached
    return await _receive_while_rank_0_dies(pg, size, inherited)


@pytest.mark.parametrize("world", [sender_killed, sender_killed_mid_chunk])
def test_a_sender_killed_mid_message_fails_the_receive_naming_it(world: Any) -> None:
    """Killed with chunks still to send (rank 1 waits for their frames in the loop), or while it
    fills a chunk whose frame it sent (rank 1 waits for the pieces in place)."""
    results = run_world(world, 3, timeout=120, env=RING_ONLY)
    assert results[0].exitcode == -signal.SIGKILL
    assert results[1].error is None, results[1].error
    res = results[1].value
    assert res["error"] == "PeerLostError" and res["rank"] == 0 and res["partial"], res
    assert res["after"] < 10.0 and res["dev_shm"] == [], res


async def frames_per_message(pg: Any) -> dict[str, Any]:
    """Rank 0 sends messages up to the ring's capacity and larger ones, counting the frames each
    took; rank 1 checks the bytes."""
    out: dict[str, Any] = {"frames": [], "exact": []}
    if pg.rank in (0, 1):
        link = pg._rt.transport.link(1 - pg.rank)
        for size in (4 << 10, 300_001, 3 << 20, 4 << 20, 10 << 20):
            await pg.barrier()
            before = link.frames_out
            if pg.rank == 0:
                await pg.send(_pattern(size, 3), dst=1)
            else:
                got = np.zeros(size, np.uint8)
                await pg.recv(got, src=0)
                out["exact"].append(bool(np.array_equal(got, _pattern(size, 3))))
            await pg.barrier()
            out["frames"].append(link.frames_out - before)
    else:
        for _ in range(10):
            await pg.barrier()
    return out


def test_a_payload_up_to_the_ring_takes_one_frame_and_a_larger_one_a_frame_per_half_ring() -> None:
    results = unwrap(run_world(frames_per_message, 3, env=RING_ONLY))
    # (the barriers run over the arenas, not the links: every frame counted is the message's)
    assert results[1]["exact"] == [True] * 5, results[1]
    assert results[0]["frames"] == [1, 1, 1, 1, 5], results[0]


async def sender_killed_before_read(pg: Any) -> dict[str, Any]:
    """Rank 0 offers a large payload to read from its memory and is killed before rank 1 (stopped
    meanwhile) reads it; rank 2 lets rank 1 go on once it saw rank 0 die."""
    from shm_world import dev_shm_in_use

    inherited = set(dev_shm_in_use())
    pids = await pg.all_gather_object(os.getpid())
    big = 32 << 20
    res: dict[str, Any] = {"error": None}
    if pg.rank == 1:
        into = np.zeros(big, np.uint8)
        receiving = pg.recv(into, src=0)
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 2 sends SIGCONT once rank 0 is gone
        try:
            await asyncio.wait_for(receiving, 30)
        except Exception as exc:
            res.update(error=type(exc).__name__, rank=getattr(exc, "rank", None), why=str(exc))
        res["untouched"] = not into.any()
    elif pg.rank == 0:
        await _until_stopped(pids[1])  # nobody reads our offer then
        pg.send(np.ones(big, np.uint8), dst=1)
        assert pg._rt.transport.link(1).direct_bytes_out == big  # offered: the frame is on its way
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(pg.recv(np.zeros(1, np.uint8), src=0), 30)  # fails when 0 dies
        os.kill(pids[1], signal.SIGCONT)
    res["dev_shm"] = sorted(set(dev_shm_in_use()) - inherited)
    return res


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


async def _until_stopped(pid: int) -> None:
    """Wait until process ``pid`` is stopped (SIGSTOP), 30 s at most."""
    for _ in range(3000):
        if _state(pid) == "T":
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within 30 s")


def test_a_sender_killed_before_its_receiver_read_its_memory_fails_the_receive_naming_it() -> None:
    from aiocoll.client.data._vm_read import vm_read_available

    if not vm_read_available():
        pytest.skip("process_vm_readv is unavailable here: large messages go through the rings")
    results = run_world(sender_killed_before_read, 3, timeout=120, env={"AIOCOLL_TRANSPORT": "shm"})
    assert results[0].exitcode == -signal.SIGKILL
    assert results[1].error is None, results[1].error
    res = results[1].value
    assert res["error"] == "PeerLostError" and res["rank"] == 0, res
    assert "memory could not be read" in res["why"] and res["untouched"], res
    assert res["dev_shm"] == [], res


def _mail(pg: Any, peer: int) -> tuple[int, int]:
    """Messages this rank's link to ``peer`` took out of the peer's mailbox, and put in its own."""
    link = pg._rt.transport.link(peer)
    return link.mail_in, link.mail_out


async def mailbox_checks(pg: Any) -> dict[str, Any]:
    """Small messages through the rings' mailboxes (no frame on the socket), mixed with frames and
    ring messages on one tag, in both directions; any-source receives, tags taken out of order, a
    size mismatch."""
    r = pg.rank
    out: dict[str, Any] = {"bad": []}
    peer = 1 - r
    before = _mail(pg, peer)
    await pg.barrier()
    # 1. ping-pong, a fresh value each way every round trip, until both directions took the
    # mailbox (a receive that polls when its message is sent) or 30 s went by
    buf = np.zeros(1, np.int64)
    end = time.monotonic() + 30.0
    i = 0
    while True:
        if r == 0:
            both = all(now > was for now, was in zip(_mail(pg, 1), before, strict=True))
            buf[0] = -1 if (both and i >= 200) or time.monotonic() > end else i
            await pg.send(buf, dst=1, tag=1)
            stop = buf[0] == -1
            await pg.recv(buf, src=1, tag=1)
            if buf[0] != (-1 if stop else i + 1):
                out["bad"].append(("pong", i, int(buf[0])))
            if stop:
                break
        else:
            await pg.recv(buf, src=0, tag=1)
            stop = buf[0] == -1
            if not stop and buf[0] != i:
                out["bad"].append(("ping", i, int(buf[0])))
            buf[0] = -1 if stop else i + 1
            await pg.send(buf, dst=0, tag=1)
            if stop:
                break
        i += 1
    out["round_trips"] = i
    # 2. order on one tag: a small message, a ring message (its frame not yet read when the next
    # is sent), a small one, a multi-chunk one queued behind, a small one, an empty one, then a
    # reply; a small one may go through the mailbox only once everything before it was taken
    sizes = (4, 100_003, 8, 3 << 20, 1, 0, 2000, 1024)
    for k in range(40):
        if r == 0:
            works = [pg.send(_pattern(n, k + j), dst=1, tag=2) for j, n in enumerate(sizes)]
            for work in works:
                await work
            ack = np.zeros(1, np.int64)
            await pg.recv(ack, src=1, tag=3)
            if ack[0] != k:
                out["bad"].append(("ack", k, int(ack[0])))
        else:
            for j, n in enumerate(sizes):
                got = np.zeros(n, np.uint8)
                await pg.recv(got, src=0, tag=2)
                if not np.array_equal(got, _pattern(n, k + j)):
                    out["bad"].append(("order", k, j))
            await pg.send(np.full(1, k, np.int64), dst=0, tag=3)
    # 3. a receive from any source gets a mailed message and its sender; tags out of order
    if r == 0:
        await pg.recv(np.zeros(1, np.int64), src=1, tag=4)  # rank 1 waits (no polling) for ours
        await asyncio.sleep(0.05)
        await pg.send(np.full(2, 42, np.int32), dst=1, tag=6)
        await pg.send(np.full(2, 41, np.int32), dst=1, tag=5)
    else:
        got_any = np.zeros(2, np.int32)
        waiting = pg.recv(got_any, tag=5)  # any source
        await pg.send(np.zeros(1, np.int64), dst=0, tag=4)
        out["any_source"] = [await waiting, got_any.tolist()]
        six = np.zeros(2, np.int32)
        await pg.recv(six, src=0, tag=6)  # it came first, and waited
        out["tags"] = six.tolist()
    # 4. a size mismatch through the mailbox fails the receive; the stream goes on
    if r == 0:
        await pg.recv(np.zeros(1, np.int64), src=1, tag=7)
        await pg.send(np.full(2, 7, np.int32), dst=1, tag=8)
        await pg.send(np.full(1, 8, np.int32), dst=1, tag=8)
    else:
        await pg.send(np.zeros(1, np.int64), dst=0, tag=7)
        wrong = np.zeros(1, np.int32)
        try:
            await pg.recv(wrong, src=0, tag=8)
            out["mismatch"] = None
        except Exception as exc:
            out["mismatch"] = type(exc).__name__
        right = np.zeros(1, np.int32)
        await pg.recv(right, src=0, tag=8)
        out["after_mismatch"] = right.tolist()
    await pg.barrier()
    after = _mail(pg, peer)
    out["mail_in"], out["mail_out"] = after[0] - before[0], after[1] - before[1]
    await pg.barrier()  # nobody leaves (closing its links, whose counters we read) before all read
    return out


def test_small_messages_go_through_the_mailbox_in_order_with_frames_and_ring_messages() -> None:
    results = unwrap(run_world(mailbox_checks, 2, env={"AIOCOLL_TRANSPORT": "shm"}))
    for r in (0, 1):
        res = results[r]
        assert res["bad"] == [], (r, res)
        # the path was taken both ways (rank 0 goes on until it took one, up to 30 s)
        assert res["mail_in"] > 0 and res["mail_out"] > 0, (r, res)
    assert results[0]["mail_out"] == results[1]["mail_in"] and results[1]["mail_out"] == results[0]["mail_in"]
    res = results[1]
    assert res["any_source"] == [0, [41, 41]], res
    assert res["tags"] == [42, 42], res
    assert res["mismatch"] == "MismatchError" and res["after_mismatch"] == [8], res


async def test_a_mailed_message_not_yet_taken_when_its_link_closes_is_still_received() -> None:
    """The link's close takes what the peer put in its mailbox before it went (as its frames
    read before the end-of-file are delivered): a receive afterwards gets it, the next fails
    with PeerLostError. Real shared memory and sockets, one process (the close is made to come
    before the event loop's turn that would take the message)."""
    from aiocoll._errors import PeerLostError
    from aiocoll.testing.transport_conformance import close_world, shm_world

    world = await shm_world(2)
    try:
        sender, receiver = world
        await asyncio.sleep(0.1)  # the links' first frames (the probe) are read: nothing in flight
        assert sender.send_nowait(1, ("m", 1), memoryview(b"abcd"), {"n": 4}) is None
        assert sender.link(1).mail_out == 1  # in the mailbox, no frame
        receiver.mark_lost(0, "killed (as the heartbeat would say)")
        got = bytearray(4)
        assert await receiver.recv(0, ("m", 1), memoryview(got)) == (0, {"n": 4})
        assert got == b"abcd"
        with pytest.raises(PeerLostError):
            await receiver.recv(0, ("m", 1), memoryview(bytearray(4)))
    finally:
        await close_world(world)


async def test_a_mailed_payload_of_any_format_and_shape_arrives_as_its_bytes() -> None:
    """The mailbox packs a contiguous payload's bytes whatever the view's format and shape (a
    2-D int32 view, here), as the ring and frame paths send its flat byte view."""
    from aiocoll.testing.transport_conformance import close_world, shm_world

    world = await shm_world(2)
    try:
        sender, receiver = world
        await asyncio.sleep(0.1)  # the links' first frames (the probe) are read: nothing in flight
        data = np.arange(6, dtype=np.int32).reshape(2, 3)
        assert sender.send_nowait(1, ("f", 1), memoryview(data), {"n": 24}) is None
        assert sender.link(1).mail_out == 1  # in the mailbox, no frame
        got = bytearray(24)
        assert await receiver.recv(0, ("f", 1), memoryview(got)) == (0, {"n": 24})
        assert bytes(got) == data.tobytes()
    finally:
        await close_world(world)


async def test_a_frame_read_before_the_wake_up_for_an_earlier_mailed_message_comes_after_it() -> None:
    """A mailed message, then a frame on the same tag (the mailbox is full): when the event loop
    happens to read the socket before it runs the eventfd's callback, the mailed message is
    still taken first."""
    from aiocoll.testing.transport_conformance import close_world, shm_world

    world = await shm_world(2)
    try:
        sender, receiver = world
        await asyncio.sleep(0.1)  # the links' first frames (the probe) are read: nothing in flight
        assert sender.send_nowait(1, ("m", 1), memoryview(b"one!"), {}) is None
        assert sender.send_nowait(1, ("m", 1), memoryview(b"two!"), {}) is None
        assert sender.link(1).mail_out == 1  # the first in the mailbox, the second in a frame
        link = receiver.link(0)
        for _ in range(1000):  # the frame is in the socket once the peer says it wrote it
            if link._reader.frames_written() > link._frames_in:
                break
            await asyncio.sleep(0.001)
        link._on_readable()  # the socket's callback, as the loop would run it, before the eventfd's
        got = [bytearray(4), bytearray(4)]
        for into in got:
            await receiver.recv(0, ("m", 1), memoryview(into))
        assert got == [b"one!", b"two!"]
    finally:
        await close_world(world)


async def test_a_chunk_its_sender_is_slow_to_fill_is_copied_from_the_event_loop_and_later_frames_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sender that sent a chunk's frame and has not filled the chunk (stopped, or off its core)
    does not hold its receiver's event loop: the receiver waits in place only briefly, then its
    loop runs on (here the sender and the test share it, so a wait that held it would hang this
    test) and copies the rest once it lands; a message sent behind the chunk, whose frame came in
    the same read, is received after it, and the link reads on afterwards."""
    from aiocoll.client.data import _shm_ring

    from aiocoll.testing.transport_conformance import close_world, shm_world

    world = await shm_world(2)
    try:
        sender, receiver = world
        await asyncio.sleep(0.1)  # the links' first frames (the probe) are read: nothing in flight
        assert isinstance(sender, LinkTransport) and isinstance(receiver, LinkTransport)
        writer = sender.link(1)._writer
        fill = _shm_ring.RingWriter.fill
        deferred: list[tuple[int, int, int, bytes]] = []

        def stalled(self: Any, end: int, n: int, at: int, src: memoryview) -> None:
            if self is writer:
                deferred.append((end, n, at, bytes(src)))  # filled later, by the test
            else:
                fill(self, end, n, at, src)

        monkeypatch.setattr(_shm_ring.RingWriter, "fill", stalled)
        size = 3 << 20  # one chunk of twelve pieces: its frame goes before the first piece
        big = _pattern(size, 5)
        got_big, got_small = np.zeros(size, np.uint8), bytearray(8)
        first = asyncio.ensure_future(receiver.recv(0, ("m", 1), memoryview(got_big)))
        second = asyncio.ensure_future(receiver.recv(0, ("m", 1), memoryview(got_small)))
        await asyncio.sleep(0)
        sent = sender.send_nowait(1, ("m", 1), memoryview(big), {"n": 1})
        assert sender.send_nowait(1, ("m", 1), memoryview(b"behind!!"), {"n": 2}) is None
        link = receiver.link(0)
        for _ in range(200):  # the loop turns while the receiver waits for the pieces
            await asyncio.sleep(0.005)
            if link.debug_state()["ring"]["filling"] is not None:
                break
        assert link.debug_state()["ring"]["filling"] == [0, size], link.debug_state()
        assert deferred and not first.done() and not second.done()
        assert link.held, "the small message's frame waits behind the chunk"
        for end, n, at, data in deferred:
            fill(writer, end, n, at, memoryview(data))
        assert await asyncio.wait_for(first, 10) == (0, {"n": 1})
        assert await asyncio.wait_for(second, 10) == (0, {"n": 2})
        assert np.array_equal(got_big, big) and got_small == b"behind!!"
        if sent is not None:
            await asyncio.wait_for(sent, 10)
        state = link.debug_state()
        assert state["ring"]["filling"] is None and state["reading"] and link.held is None, state
        # and the link goes on: a message each way after it
        again = bytearray(4)
        task = asyncio.ensure_future(receiver.recv(0, ("m", 2), memoryview(again)))
        await asyncio.sleep(0)
        sender.send_nowait(1, ("m", 2), memoryview(b"next"), {})
        assert await asyncio.wait_for(task, 10) == (0, {}) and again == b"next"
    finally:
        await close_world(world)


async def test_a_receive_stops_spinning_for_a_peer_that_waits_in_place_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A receive that spins for its peer's message (recv_now) gives up once the peer waits in
    place for a message of ours: the peer sends nothing before its own wait ends. A peer that
    has our last message still to take does not wait for us. Real shared memory and sockets,
    one process (the peer's wait is its link's polling flag, raised as its spin would)."""
    from aiocoll.testing.transport_conformance import close_world, shm_world

    world = await shm_world(2)
    try:
        a, b = world
        await asyncio.sleep(0.1)  # the links' first frames (the probe) are read: nothing in flight
        assert isinstance(a, LinkTransport) and isinstance(b, LinkTransport)
        to_b, from_a = a.link(1), b.link(0)
        assert to_b is not None and from_a is not None
        assert not to_b.peer_waits()
        from_a.watch(True)  # b waits in place for a message from a
        try:
            assert to_b.peer_waits()
            # only the peer's wait may end this spin (not its budget, nor a late yield on a busy host)
            a._in_place.budget = SpinBudget(60.0)
            monkeypatch.setattr(_in_place, "LATE_YIELD_S", 60.0)
            assert a.recv_now(1, ("reply",), memoryview(bytearray(4))) is None
            assert a.mutual_waits == 1
            assert a._in_place.budget.now == 30.0  # spinning was no use: halved, not doubled
            assert a.send_nowait(1, ("m", 1), memoryview(b"abcd"), {}) is None
            assert to_b.mail_out == 1  # in the mailbox, which b has yet to take
            assert not to_b.peer_waits()
        finally:
            from_a.watch(False)  # takes the mailed message, as b's spin would as it stopped
        got = bytearray(4)
        assert await b.recv(0, ("m", 1), memoryview(got)) == (0, {})
        assert got == b"abcd"
        assert not to_b.peer_waits()
        a._in_place.budget = SpinBudget(1e-3)
        assert a.recv_now(1, ("reply",), memoryview(bytearray(4))) is None  # its spin ran out
        assert a.mutual_waits == 1
    finally:
        await close_world(world)


@contextlib.asynccontextmanager
async def _shm_pair() -> AsyncIterator[tuple[LinkTransport, LinkTransport]]:
    """Two transports of this process joined by a shm link, once the link's first frames (the
    probe) are read: nothing is in flight."""
    from aiocoll.testing.transport_conformance import close_world, shm_world

    world = await shm_world(2)
    try:
        a, b = world
        assert isinstance(a, LinkTransport) and isinstance(b, LinkTransport)
        await asyncio.sleep(0.1)
        yield a, b
    finally:
        await close_world(world)


async def test_a_message_mailed_during_a_receives_spin_is_taken_there_straight_or_through_the_matcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Messages that land while a receive spins for them (recv_now): its own goes straight into
    its buffer; one of another size fails it with MismatchError and is consumed; one of another
    tag goes to the matcher, after which the receive polls through the matcher and still gets
    its own. Real shared memory and sockets, one process: the peer's sends are made from inside
    the spin's yields."""
    monkeypatch.setattr(_in_place, "LATE_YIELD_S", 60.0)  # only a message ends the spin
    async with _shm_pair() as (a, b):
        b._in_place.budget = SpinBudget(60.0)
        sends: list[tuple[tuple[str], bytes]] = []
        yield_cpu = os.sched_yield

        def yield_then_send() -> None:
            yield_cpu()
            if sends:
                tag, data = sends.pop(0)
                assert a.send_nowait(1, tag, memoryview(data), {"n": len(data)}) is None

        monkeypatch.setattr(os, "sched_yield", yield_then_send)
        got = bytearray(4)
        sends[:] = [(("m",), b"abcd")]
        assert b.recv_now(0, ("m",), memoryview(got)) == (0, {"n": 4}) and got == b"abcd"
        sends[:] = [(("m",), b"12345678")]
        with pytest.raises(MismatchError) as info:
            b.recv_now(0, ("m",), memoryview(got))
        assert info.value.remote_meta == {"n": 8}  # type: ignore[attr-defined]
        sends[:] = [(("other",), b"xy"), (("m",), b"efgh")]
        assert b.recv_now(0, ("m",), memoryview(got)) == (0, {"n": 4}) and got == b"efgh"
        monkeypatch.undo()
        assert not sends and b.polled_arrivals == 3 and b.mutual_waits == b.late_yields == 0
        to_b, from_a = a.link(1), b.link(0)
        assert isinstance(to_b, ShmLink) and isinstance(from_a, ShmLink)
        assert (to_b.mail_out, to_b.mail_wakes, from_a.mail_in) == (4, 0, 4)  # all in the mailbox
        other = bytearray(2)
        assert await asyncio.wait_for(b.recv(0, ("other",), memoryview(other)), 10) == (0, {"n": 2})
        assert other == b"xy"


async def test_a_mailed_message_like_the_last_one_received_in_place_lands_without_its_meta_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A receive in place remembers the head (tag, meta, size) of the mailbox message it took
    and takes the next message with that head straight into its buffer, unpacking nothing: the
    payloads arrive as sent, and a message of the same tag and size with other meta (another
    dtype) is unpacked whole, its meta as sent."""
    unpacked: list[int] = []
    unpack = shm._unpack_mail
    monkeypatch.setattr(shm, "_unpack_mail", lambda view: unpacked.append(len(view)) or unpack(view))
    async with _shm_pair() as (a, b):
        from_a = b.link(0)
        assert isinstance(from_a, ShmLink)
        got = bytearray(4)
        sent = [(b"abcd", {"dtype": "float32", "count": 1}), (b"efgh", {"dtype": "float32", "count": 1})]
        sent += [(b"ijkl", {"dtype": "int32", "count": 1}), (b"mnop", {"dtype": "int32", "count": 1})]
        for data, meta in sent:
            assert a.send_nowait(1, ("p", "g", 3), memoryview(data), meta) is None
            here = b.recv_now(0, ("p", "g", 3), memoryview(got))
            assert here == (0, meta) and bytes(got) == data
            assert here is not None and here[1] is not meta  # (the caller's own dict)
        assert from_a.mail_in == 4  # every one through the mailbox
        assert len(unpacked) == 2  # the first of each head
        heads = from_a._taken_heads
        assert list(heads) == [(("p", "g", 3), 4)] and heads[(("p", "g", 3), 4)][1]["dtype"] == "int32"


async def test_a_receive_stops_spinning_once_other_work_held_its_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A receive spinning for its peer's message stops after a yield that came back late (other
    work held the core for a time slice: a sleeper gets it back sooner than a spinner); the
    clock is made to jump past the late-yield bound between two looks."""
    from aiocoll.client.data._waiting import LATE_YIELD_S

    from aiocoll.testing.transport_conformance import close_world, shm_world

    world = await shm_world(2)
    try:
        a = world[0]
        assert isinstance(a, LinkTransport)
        await asyncio.sleep(0.1)  # the links' first frames (the probe) are read: nothing in flight
        now = [time.perf_counter()]

        def slow_clock() -> float:
            now[0] += 2 * LATE_YIELD_S
            return now[0]

        monkeypatch.setattr(time, "perf_counter", slow_clock)
        assert a.recv_now(1, ("reply",), memoryview(bytearray(4))) is None
        monkeypatch.undo()
        assert (a.late_yields, a.mutual_waits) == (1, 0)
    finally:
        await close_world(world)


async def test_a_receive_waiting_in_the_loop_gets_a_mailed_message_without_a_wake_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While a posted receive keeps the event loop polling, the link says so in its ring (the
    loop's turns read the mailbox): the peer mails a small message without writing our eventfd,
    and the receive gets it. The flag goes down with the polling: the next message wakes us, and
    a receive finds it before it would be posted. Real shared memory and sockets, one process."""
    from aiocoll.testing.transport_conformance import close_world, shm_world

    monkeypatch.setattr(_loop_polling, "_POLL_S", 60.0)  # the polling outlasts any pause of a busy host
    world = await shm_world(2)
    try:
        a, b = world
        assert isinstance(a, LinkTransport) and isinstance(b, LinkTransport)
        to_b, from_a = a.link(1), b.link(0)
        assert isinstance(to_b, ShmLink) and isinstance(from_a, ShmLink)
        await asyncio.sleep(0.1)  # the links' first frames (the probe) are read: nothing in flight
        got = bytearray(4)
        task = asyncio.ensure_future(b.recv(0, ("m",), memoryview(got)))
        for _ in range(1000):
            await asyncio.sleep(0)
            if from_a._loop_watching:
                break
        assert from_a._loop_watching and not to_b.peer_waits()  # polled in the loop, not in place
        assert a.send_nowait(1, ("m",), memoryview(b"abcd"), {}) is None
        assert (to_b.mail_out, to_b.mail_wakes) == (1, 0)
        assert await asyncio.wait_for(task, 10) == (0, {}) and got == b"abcd"
        assert not from_a._loop_watching
        assert a.send_nowait(1, ("n",), memoryview(b"efgh"), {}) is None
        assert (to_b.mail_out, to_b.mail_wakes) == (2, 1)
        receive = b.recv(0, ("n",), memoryview(got))
        with pytest.raises(StopIteration) as done:  # taken in place, before it would be posted and wait
            receive.send(None)
        assert done.value.value == (0, {}) and got == b"efgh"
    finally:
        await close_world(world)


async def test_a_spin_that_ran_out_before_its_message_came_grows_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An in-place spin whose budget ran out (shrunk to its least by misses in a row) and whose
    receive then got its message while waiting in the loop grows its budget to twice that wait,
    within the most a spin may last: without it, a budget too short to take any reply would
    never grow back. Not when this rank sent meanwhile (the message may answer that)."""
    monkeypatch.setattr(_in_place, "LATE_YIELD_S", 60.0)  # only the budget ends the spin
    async with _shm_pair() as (a, b):
        budget = a._in_place.budget = SpinBudget(60.0)
        budget.now = 5e-6
        got = bytearray(4)
        assert a.recv_now(1, ("m",), memoryview(got)) is None  # ran out
        task = asyncio.ensure_future(a.recv(1, ("m",), memoryview(got)))
        await asyncio.sleep(0)  # posted
        assert b.send_nowait(0, ("m",), memoryview(b"abcd"), {}) is None
        assert await asyncio.wait_for(task, 10) == (1, {}) and got == b"abcd"
        assert budget.now > 5e-6
        # a message that may answer one of ours, sent after the spin ran out: no growing back
        budget.now = 5e-6
        assert a.recv_now(1, ("m",), memoryview(got)) is None
        task = asyncio.ensure_future(a.recv(1, ("m",), memoryview(got)))
        await asyncio.sleep(0)  # posted
        assert a.send_nowait(1, ("ask",), memoryview(b"ask?"), {}) is None
        assert b.send_nowait(0, ("m",), memoryview(b"efgh"), {}) is None
        assert await asyncio.wait_for(task, 10) == (1, {}) and got == b"efgh"
        assert budget.now == 5e-6
        # one sent during the spin (a posted receive's callback answering a message the spin
        # read): a longer spin would have taken a reply to it too, so the budget grows back
        answered = []

        def answer(result: Any, exc: BaseException | None) -> None:
            answered.append(result)
            assert a.send_nowait(1, ("answer",), memoryview(b"ans!"), {}) is None

        a.post_recv(1, ("ask",), memoryview(bytearray(4)), answer)
        pending = [("ask",)]
        yield_cpu = os.sched_yield

        def yield_then_ask() -> None:  # the peer's message lands while the spin goes on
            yield_cpu()
            if pending:
                assert b.send_nowait(0, pending.pop(), memoryview(b"ask?"), {}) is None

        budget.now = 2e-3
        monkeypatch.setattr(os, "sched_yield", yield_then_ask)
        assert a.recv_now(1, ("m",), memoryview(got)) is None  # ran out, after it answered
        monkeypatch.setattr(os, "sched_yield", yield_cpu)
        assert answered and not pending
        ran_out = budget.now
        task = asyncio.ensure_future(a.recv(1, ("m",), memoryview(got)))
        await asyncio.sleep(0)  # posted
        assert b.send_nowait(0, ("m",), memoryview(b"ijkl"), {}) is None
        assert await asyncio.wait_for(task, 10) == (1, {}) and got == b"ijkl"
        assert budget.now > ran_out


async def mailed_then_gone(pg: Any, how: str) -> dict[str, Any]:
    """Rank 0 puts a small message in its mailbox towards rank 1 while rank 1 is stopped
    (SIGSTOP: it cannot take it), then is killed (``how`` "killed") or closes its process group
    ("left"); rank 2 lets rank 1 go on once it saw rank 0 go. Rank 1 then receives the message,
    and its next receive from rank 0 fails with PeerLostError naming it (saying it left, when it
    did)."""
    pids = await pg.all_gather_object(os.getpid())
    res: dict[str, Any] = {}
    if pg.rank == 0:
        await _until_stopped(pids[1])  # nobody takes our message then
        link = pg._rt.transport.link(1)
        before = link.mail_out
        await pg.send(np.full(3, 5, np.int16), dst=1, tag=9)
        if link.mail_out != before + 1:
            raise AssertionError("the message did not go through the mailbox")
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        await pg.destroy()
        return res
    if pg.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 2 sends SIGCONT once rank 0 is gone
        got = np.zeros(3, np.int16)
        res["first"] = await outcome(lambda: pg.recv(got, src=0, tag=9, timeout=30))
        res["got"] = got.tolist()
        res["second"] = await outcome(lambda: pg.recv(np.zeros(3, np.int16), src=0, tag=9, timeout=30))
        return res
    with contextlib.suppress(Exception):
        await asyncio.wait_for(pg.recv(np.zeros(1, np.uint8), src=0), 30)  # fails when 0 goes
    os.kill(pids[1], signal.SIGCONT)
    return res


@pytest.mark.parametrize("how", ["killed", "left"])
def test_a_mailed_message_is_received_after_its_sender_went_and_the_next_receive_fails(how: str) -> None:
    results = run_world(mailed_then_gone, 3, timeout=120, env={"AIOCOLL_TRANSPORT": "shm"}, args=(how,))
    if how == "killed":
        assert results[0].exitcode == -signal.SIGKILL
    else:
        assert results[0].error is None, results[0].error
    assert results[1].error is None, results[1].error
    res = results[1].value
    assert res["first"]["error"] is None and res["got"] == [5, 5, 5], res
    second = res["second"]
    assert second["error"] == "PeerLostError" and second["rank"] == 0, res
    assert second["left"] is (how == "left"), res
    if how == "left":
        assert second["elapsed"] < 1.0, res
