"""The session's numbering of mutations, without sockets (client/control/_store_core.py): ``ack`` is the id
at and below which every mutation is settled, a reply settles everything sent before it (the
coordinator answers a connection in order), a refused set nobody awaited is kept for the next
call, and a session never has more than DEDUPE_WINDOW mutations unsettled, so the coordinator
never has to refuse one: the session asks for a SYNC and waits instead."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from aiocoll.client.control._store_core import SYNC_AFTER, StoreCore
from aiocoll.client.control.session import CoordinatorSession
from coordinator_link_fakes import handshaken_link

from aiocoll import ProtocolError, StoreError, StoreTimeout
from aiocoll._deadline import Deadline
from aiocoll.protocol import FrameDecoder
from aiocoll.protocol._coordinator import CID_BYTES, DEDUPE_WINDOW, ERR_TOO_LARGE, ROLE_STORE
from aiocoll.protocol._store import ADD, ERROR, GET, OK, SET, SYNC

pytestmark = pytest.mark.timeout(20)


def test_ack_is_the_id_below_which_every_mutation_is_settled() -> None:
    core = StoreCore("j", "127.0.0.1:1")
    ids = [core.mutation(ADD, ["k", 1], b"", ["k"], Deadline(5), True)[0] for _ in range(4)]
    assert ids == [1, 2, 3, 4] and core.ack() == 0
    read, _ = core.request([GET, "k", None])  # a read in between takes an id, never holds the window back
    core.settle([2, OK, 2], b"")  # replies come in order: 1 was answered before 2
    assert core.ack() == 2
    core.settle([4, OK, 4], b"")
    assert core.ack() == read  # nothing unsettled: everything issued so far
    frame_id, frame = core.mutation(ADD, ["k", 1], b"", ["k"], Deadline(5), True)
    header = FrameDecoder(lists=True).feed(frame)[0].header
    assert header == [ADD, frame_id, read, "k", 1], "each mutation carries its id and the ack"


def test_a_set_is_settled_by_any_later_reply_and_its_refusal_is_kept_for_the_next_call() -> None:
    core = StoreCore("j", "127.0.0.1:1")
    first, _ = core.mutation(SET, ["a"], b"v", ["a"], Deadline(5), False)
    refused, _ = core.mutation(SET, ["big"], b"v" * 10, ["big"], Deadline(5), False)
    third, _ = core.mutation(SET, ["c"], b"v", ["c"], Deadline(5), False)
    assert core.no_reply_unsettled == 3 and len(core.lost_frames()) == 3
    core.settle([refused, ERROR, ERR_TOO_LARGE, "set: value too large for key 'big'", ["big"]], b"")
    assert core.ack() == refused and core.no_reply_unsettled == 1
    exc = core.take_deferred()
    assert isinstance(exc, StoreError) and "big" in str(exc) and core.take_deferred() is None
    read, _ = core.request([GET, "k", None])
    core.settle([read, OK], b"")  # the reply to any request sent later
    assert core.ack() == read and core.no_reply_unsettled == 0 and core.lost_frames() == []
    assert first < refused < third < read


def test_enough_unanswered_sets_ask_for_a_sync_and_the_window_closes_at_dedupe_window() -> None:
    core = StoreCore("j", "127.0.0.1:1")
    for i in range(SYNC_AFTER - 1):
        core.mutation(SET, [f"k{i}"], b"v", ["k"], Deadline(5), False)
    assert not core.wants_sync()
    core.mutation(SET, ["one more"], b"v", ["k"], Deadline(5), False)
    assert core.wants_sync()
    core.sync_in_flight, _ = core.sync_frame()
    assert not core.wants_sync(), "one SYNC at a time"
    while core.window_open():
        core.mutation(SET, ["k"], b"v", ["k"], Deadline(5), False)
    assert core.last_id - core.ack() == DEDUPE_WINDOW  # the next would be one too many
    core.settle([core.sync_in_flight, OK], b"")
    assert core.window_open() and not core.sync_in_flight


async def test_a_mutation_beyond_the_window_sends_a_sync_and_waits_for_its_reply() -> None:
    session = CoordinatorSession("127.0.0.1", 1, role=ROLE_STORE)
    assert len(session._cid) == CID_BYTES and session._handshake()._hello["cid"] == session._cid
    link, transport = await handshaken_link(on_settle=session._on_settle)
    session._keeper.link = link
    while session._core.window_open():
        await session.set("k", b"v")
    held = asyncio.ensure_future(session.set("beyond", b"v"))
    await asyncio.sleep(0.05)
    assert not held.done(), "the window is full: the set waits"
    frames = FrameDecoder(lists=True).feed(transport.take())
    syncs = [f.header[1] for f in frames if f.header[0] == SYNC]
    assert syncs, "the session asked the coordinator to settle what it sent"
    head = msgpack.packb([syncs[-1], OK])
    link.data_received(len(head).to_bytes(4, "big") + (0).to_bytes(8, "big") + head)
    await asyncio.wait_for(held, 5)
    assert session._core.window_open()
    # With nobody answering, a full window is a timeout naming the key, not a hang.
    while session._core.window_open():
        await session.set("fill", b"v")
    with pytest.raises(StoreTimeout, match="not acknowledged"):
        await session.set("late", b"v", timeout=0.05)
    session.abort()


def test_after_a_reconnect_a_reply_settles_only_what_the_new_link_carried_before_it() -> None:
    # Requests go out again after a reconnect in whatever order their callers get to it, and a
    # read takes a new id: a reply must not settle a mutation that has not been sent again yet.
    core = StoreCore("j", "127.0.0.1:1")
    add, _ = core.mutation(ADD, ["n", 1], b"", ["n"], 5.0, True)  # awaited; its link drops
    queued, set_frame = core.mutation(SET, ["k"], b"v", ["k"], 5.0, False)
    assert core.reconnected() == [set_frame], "the sets nobody awaits go first on the new link"
    read, _ = core.request([GET, "k", None])  # another caller's read, before the add is re-sent
    core.settle([read, OK], b"v")
    assert add in core.unsettled and queued not in core.unsettled
    assert core.ack() == add - 1, "the add still holds the window back: its number is not forgotten"
    core.resent(add)
    core.settle([add, OK, 1], b"")
    assert not core.unsettled and core.ack() == core.last_id


def test_the_core_encodes_each_operation_and_reads_its_reply_without_any_io() -> None:
    """What both drivers send and what a reply means live in the core: a waiting request carries
    its remaining time and is given the coordinator's answer first; a mutation sent again keeps
    its number and frame; a refusal becomes the error naming its keys."""
    from aiocoll.client.control._store_core import MIN_REPLY_TIME, REPLY_GRACE, requests

    core = StoreCore("j", "127.0.0.1:1")
    decode = FrameDecoder(lists=True)
    with pytest.raises(TypeError, match="b'raw'"):
        requests.get(b"raw")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        requests.wait("abc")  # a lone str is not three keys
    get = requests.get("k")
    rid, frame, bound = core.encode(get, 0, 30.0, 12.5)
    assert decode.feed(frame)[0].header == [GET, rid, "k", 12.5] and bound == 12.5 + REPLY_GRACE
    add = requests.add("n", 2)
    first, frame, bound = core.encode(add, 0, 30.0, 0.2)
    assert bound == MIN_REPLY_TIME and decode.feed(frame)[0].header == [ADD, first, rid, "n", 2]
    core.reconnected()  # the link dropped before the reply: the add is sent again, same number
    again, frame_again, _ = core.encode(add, first, 30.0, 20.0)
    assert (again, frame_again) == (first, frame)
    assert core.outcome(add, [first, OK, 7], b"", 30.0) == 7
    mget = requests.multi_get(["a", "b"])
    assert core.outcome(mget, [9, OK, [1, 2]], b"xyz", 30.0) == [b"x", b"yz"]
    with pytest.raises(ProtocolError, match="mget of 2 keys with 1 values"):
        core.outcome(mget, [9, OK, [3]], b"xyz", 30.0)
    with pytest.raises(StoreTimeout) as missing:
        core.outcome(mget, [9, ERROR, "timeout", "timed out", ["b"]], b"", 30.0)
    assert missing.value.keys == ["b"]
