"""The rendezvous table by reference: a ``table_ref`` join gets the table's digest instead of the
table, and the ``table`` operation hands out the current round's table (and only that round's)."""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack
import pytest
from aiocoll.server import CoordinatorState
from aiocoll.server._state import EncodedHeader

from aiocoll.protocol._coordinator import ERR_INVALID, ERR_RENDEZVOUS

pytestmark = pytest.mark.timeout(30)


class _Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def _state() -> CoordinatorState:
    return CoordinatorState(clock=_Clock())


def _frames(state: CoordinatorState, conn: int) -> list[tuple[dict[str, Any], bytes]]:
    out = [
        (h.decode() if isinstance(h, EncodedHeader) else h, bytes(p)) for c, h, p in state.outbox if c == conn
    ]
    state.outbox[:] = [f for f in state.outbox if f[0] != conn]
    return out


def _join(state: CoordinatorState, conn: int, rank: int | None, n: int, **extra: Any) -> None:
    header = {
        "op": "join",
        "id": 5,
        "rank": rank,
        "world_size": n,
        "addrs": [["10.0.0.1", 7000 + conn]],
        "host": f"h{conn % 3}",
        "timeout": 60,
        **extra,
    }
    state.request(conn, header, memoryview(b""))


def test_a_table_ref_join_gets_the_digest_of_the_table_the_others_get() -> None:
    state = _state()
    for conn in (1, 2, 3):
        state.connect(conn, "j", "worker", peer="127.0.0.1:1")
    _join(state, 1, 0, 3, table_in_payload=True)
    _join(state, 2, 1, 3, table_ref=True)
    _join(state, 3, 2, 3)
    [(inline, table)] = _frames(state, 1)
    [(ref, ref_payload)] = _frames(state, 2)
    [(plain, _)] = _frames(state, 3)
    assert msgpack.unpackb(table) == plain["members"]
    assert ref["ok"] is True and ref["rank"] == 1 and ref["session"] and ref["round"] == inline["round"]
    assert "members" not in ref and ref_payload == b""
    assert ref["table_digest"] == hashlib.blake2b(table, digest_size=16).digest()
    assert ref["table_size"] == len(table)
    # The inline table comes with its digest too (the client need not hash it to share it).
    assert inline["table_digest"] == ref["table_digest"] and "members" not in inline
    assert inline["ok"] is True and inline["rank"] == 0 and inline["session"] != ref["session"]

    state.request(2, {"op": "table", "id": 9, "round": ref["round"]}, memoryview(b""))
    [(head, fetched)] = _frames(state, 2)
    assert head["ok"] is True and head["id"] == 9 and fetched == table
    assert head["table_digest"] == ref["table_digest"]


def test_the_table_operation_refuses_a_round_that_is_not_the_current_completed_one() -> None:
    state = _state()
    for conn in (1, 2, 3):
        state.connect(conn, "j", "store" if conn == 3 else "worker", peer="127.0.0.1:1")
    state.request(3, {"op": "table", "id": 1, "round": 0}, memoryview(b""))
    [(head, _)] = _frames(state, 3)
    assert head["ok"] is False and head["err"] == ERR_RENDEZVOUS and "no completed round" in head["msg"]
    _join(state, 1, 0, 2, table_ref=True)
    state.request(3, {"op": "table", "id": 2, "round": 0}, memoryview(b""))
    [(head, _)] = _frames(state, 3)
    assert head["ok"] is False and head["err"] == ERR_RENDEZVOUS  # round 0 is still open
    _join(state, 2, 1, 2, table_ref=True)
    [(joined, _)] = _frames(state, 1)
    state.request(3, {"op": "table", "id": 3, "round": joined["round"] + 1}, memoryview(b""))
    [(head, _)] = _frames(state, 3)
    assert head["ok"] is False and head["err"] == ERR_RENDEZVOUS and "join again" in head["msg"]
    state.request(3, {"op": "table", "id": 4, "round": "0"}, memoryview(b""))
    [(head, _)] = _frames(state, 3)
    assert head["ok"] is False and head["err"] == ERR_INVALID
    state.request(3, {"op": "table", "id": 5, "round": joined["round"]}, memoryview(b""))
    [(head, table)] = _frames(state, 3)
    assert head["ok"] is True and [m["rank"] for m in msgpack.unpackb(table)] == [0, 1]


def test_ten_thousand_table_ref_replies_stay_small() -> None:
    state = _state()
    n = 10_000
    for conn in range(1, n + 1):
        state.connect(conn, "j", "worker", peer="127.0.0.1:1")
        _join(state, conn, None, n, table_ref=True)
    replies = state.outbox
    assert len(replies) == n
    assert all(isinstance(h, EncodedHeader) and h.size < 200 and len(p) == 0 for _, h, p in replies)
    assert sorted(h.decode()["rank"] for _, h, _ in replies) == list(range(n))  # type: ignore[union-attr]
