"""The session's numbering of mutations, without sockets: ``ack`` is the highest number below
which every reply arrived (in any order), and a session never has more than DEDUPE_WINDOW
mutations unanswered, so the coordinator never has to refuse one."""

from __future__ import annotations

import asyncio

import pytest
from aiocoll.client.session import CoordinatorSession

from aiocoll import StoreTimeout
from aiocoll._deadline import Deadline
from aiocoll.protocol._coordinator import CID_BYTES, DEDUPE_WINDOW, ROLE_STORE

pytestmark = pytest.mark.timeout(20)


def answered(session: CoordinatorSession, rid: int) -> None:
    """What _call does when a numbered mutation's reply arrives (or its caller gives up)."""
    session._unanswered.discard(rid)
    session._window_moved.set()


async def test_ack_is_the_number_below_which_every_reply_arrived() -> None:
    session = CoordinatorSession("127.0.0.1", 1, role=ROLE_STORE)
    assert len(session._cid) == CID_BYTES and session._handshake()._hello["cid"] == session._cid
    rids = [await session._next_rid(Deadline(5), "add", ["k"]) for _ in range(4)]
    assert rids == [1, 2, 3, 4] and session._ack() == 0
    answered(session, 2)
    answered(session, 3)
    assert session._ack() == 0  # 1 is still out
    answered(session, 1)
    assert session._ack() == 3
    answered(session, 4)
    assert session._ack() == 4
    assert await session._next_rid(Deadline(5), "add", ["k"]) == 5 and session._ack() == 4


async def test_a_mutation_beyond_the_window_waits_for_the_oldest_reply() -> None:
    session = CoordinatorSession("127.0.0.1", 1, role=ROLE_STORE)
    for _ in range(DEDUPE_WINDOW):
        await session._next_rid(Deadline(5), "add", ["k"])
    held = asyncio.ensure_future(session._next_rid(Deadline(5), "add", ["k"]))
    await asyncio.sleep(0.05)
    assert not held.done()
    answered(session, 2)  # not the oldest: the window does not move
    await asyncio.sleep(0.05)
    assert not held.done()
    answered(session, 1)
    assert await asyncio.wait_for(held, 5) == DEDUPE_WINDOW + 1
    # 1 and 2 are answered, so one more fits; then the window is full again.
    assert await session._next_rid(Deadline(5), "add", ["k"]) == DEDUPE_WINDOW + 2
    with pytest.raises(StoreTimeout, match="unanswered"):
        await session._next_rid(Deadline(0.05), "add", ["k"])
