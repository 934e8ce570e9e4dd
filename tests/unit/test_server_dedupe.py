"""Exactly-once mutations in the coordinator's state machine, without sockets: a mutation re-sent
with the same client id (hello ``cid``) and request number (``rid``) gets its first reply and is not
applied again, on a new connection, after a snapshot and journal restore too; acknowledged replies
are forgotten, the window is bounded, and a gone client's memory expires."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from aiocoll.server import CoordinatorState
from aiocoll.server._journal import Journal
from aiocoll.server._state import CLIENT_SWEEP_INTERVAL
from store_frames import StateDriver

from aiocoll.protocol._coordinator import CID_BYTES, DEDUPE_WINDOW, ERR_INVALID, join_values

pytestmark = pytest.mark.timeout(20)


class Harness:
    def __init__(self, **kwargs: Any) -> None:
        self.now = 1000.0
        self.state = CoordinatorState(clock=lambda: self.now, **kwargs)
        self.driver = StateDriver(self.state)
        self.ids = 0

    def connect(self, cid: bytes | None, job: str = "j") -> int:
        self.ids += 1
        self.state.connect(self.ids, job, "store", peer="127.0.0.1:1", cid=cid)
        return self.ids

    def call(self, conn: int, op: str, payload: bytes = b"", **fields: Any) -> tuple[dict[str, Any], bytes]:
        self.driver.send(conn, op, payload, **fields)
        frames = self.driver.take(conn)
        self.state.outbox.clear()
        assert len(frames) == 1, frames
        return frames[0]

    def value(self, key: str, job: str = "j") -> bytes | None:
        v = self.state.jobs[job].kv.get(key)
        return None if v is None else bytes(v)


def ok(reply: tuple[dict[str, Any], bytes]) -> tuple[dict[str, Any], bytes]:
    assert reply[0]["ok"] is True, reply
    return reply


def test_a_resent_add_gets_its_first_reply_and_is_not_applied_again() -> None:
    h = Harness()
    cid = os.urandom(CID_BYTES)
    first = h.connect(cid)
    assert ok(h.call(first, "add", key="n", amount=5, rid=1, ack=0))[0]["value"] == 5
    # The link dropped before the reply arrived; the client re-sends on a new connection.
    h.state.disconnect(first, "cut")
    again = h.connect(cid)
    # A re-sent request keeps its id, which is its number (protocol._store).
    header, _ = ok(h.call(again, "add", key="n", amount=5, rid=1, ack=0))
    assert header == {"id": 1, "ok": True, "value": 5}
    assert h.value("n") == b"5"
    assert h.state.resends_answered == 1
    # The next number is a new add; another client with the same rid is another client.
    assert ok(h.call(again, "add", key="n", amount=5, rid=2, ack=1))[0]["value"] == 10
    other = h.connect(os.urandom(CID_BYTES))
    assert ok(h.call(other, "add", key="n", amount=1, rid=1, ack=0))[0]["value"] == 11


def test_every_mutation_kind_is_applied_once_per_request_number() -> None:
    h = Harness()
    cid = os.urandom(CID_BYTES)
    conn = h.connect(cid)
    cas_payload, cas_sizes = join_values([b"", b"first"])
    mset_payload, mset_sizes = join_values([b"A", b"B"])
    requests: list[tuple[str, bytes, dict[str, Any]]] = [
        ("append", b"x", {"key": "log"}),
        ("cas", cas_payload, {"key": "c", "sizes": cas_sizes}),
        ("set", b"v1", {"key": "s"}),
        ("mset", mset_payload, {"keys": ["ma", "mb"], "sizes": mset_sizes}),
        ("del", b"", {"key": "s"}),
    ]
    replies = []
    for rid, (op, payload, fields) in enumerate(requests, start=1):
        replies.append(ok(h.call(conn, op, payload, rid=rid, ack=0, **fields)))
    # Meanwhile another client changes what a second application would see.
    other = h.connect(None)
    ok(h.call(other, "set", b"v2", key="s"))
    ok(h.call(other, "set", b"changed", key="c"))
    for rid, (op, payload, fields) in enumerate(requests, start=1):
        assert h.call(conn, op, payload, rid=rid, ack=0, **fields) == replies[rid - 1], op
    assert h.value("log") == b"x"
    assert h.value("s") == b"v2"  # the re-sent set and del did not undo the later set
    assert h.value("c") == b"changed"
    assert replies[1][1] == b"first" and replies[4][0]["value"] is True


def test_acknowledged_replies_are_forgotten_and_their_numbers_refused() -> None:
    h = Harness()
    cid = os.urandom(CID_BYTES)
    conn = h.connect(cid)
    for rid in range(1, 11):
        ok(h.call(conn, "add", key="n", amount=1, rid=rid, ack=rid - 1))
    client = h.state.jobs["j"].clients[cid]
    assert sorted(client.replies) == [10]  # every earlier one was acknowledged by a later request
    header, _ = h.call(conn, "add", key="n", amount=1, rid=3, ack=2)
    assert header["ok"] is False and header["err"] == ERR_INVALID
    assert "already acknowledged" in header["msg"]
    assert h.value("n") == b"10"


def test_the_window_of_unacknowledged_mutations_is_bounded() -> None:
    h = Harness()
    conn = h.connect(os.urandom(CID_BYTES))
    ok(h.call(conn, "add", key="n", amount=1, rid=DEDUPE_WINDOW, ack=0))
    header, _ = h.call(conn, "add", key="n", amount=1, rid=DEDUPE_WINDOW + 1, ack=0)
    assert header["ok"] is False and header["err"] == ERR_INVALID
    assert f"at most {DEDUPE_WINDOW} mutations" in header["msg"]
    assert h.value("n") == b"1"


def test_numbered_requests_need_a_client_id_and_sane_numbers() -> None:
    h = Harness()
    # Without a client id nothing is numbered: a mutation sent twice is carried out twice.
    anonymous = h.connect(None)
    assert ok(h.call(anonymous, "add", key="n", amount=1, rid=1, ack=0))[0]["value"] == 1
    assert ok(h.call(anonymous, "add", key="n", amount=1, rid=1, ack=0))[0]["value"] == 2
    named = h.connect(os.urandom(CID_BYTES))
    for rid, ack in ((1, 1), (2, -1), (3, "0")):
        header, _ = h.call(named, "add", key="m", amount=1, rid=rid, ack=ack)
        assert header["ok"] is False and header["err"] == ERR_INVALID, (rid, ack)
    assert "m" not in h.state.jobs["j"].kv
    # A request number (the compact request's id) that is not an integer ends the connection.
    with pytest.raises(ValueError, match="id"):
        h.call(named, "add", key="m", amount=1, rid="1", ack=0)


def test_a_refused_mutation_is_not_remembered() -> None:
    h = Harness()
    conn = h.connect(os.urandom(CID_BYTES))
    ok(h.call(conn, "set", b"text", key="n", rid=1, ack=0))
    assert h.call(conn, "add", key="n", amount=1, rid=2, ack=1)[0]["ok"] is False
    ok(h.call(conn, "set", b"41", key="n", rid=3, ack=1))
    # rid 2 was never carried out, so sending it again carries it out now (once).
    assert ok(h.call(conn, "add", key="n", amount=1, rid=2, ack=1))[0]["value"] == 42
    assert ok(h.call(conn, "add", key="n", amount=1, rid=2, ack=1))[0]["value"] == 42


def test_a_gone_clients_memory_expires_after_its_ttl_but_not_while_connected() -> None:
    h = Harness(client_ttl=100.0, job_ttl=10_000.0)
    stays, leaves = os.urandom(CID_BYTES), os.urandom(CID_BYTES)
    keeper = h.connect(stays)
    ok(h.call(keeper, "add", key="n", amount=1, rid=1, ack=0))
    gone = h.connect(leaves)
    ok(h.call(gone, "add", key="n", amount=1, rid=1, ack=0))
    h.state.disconnect(gone, "done")
    h.now += 100.0 + CLIENT_SWEEP_INTERVAL
    h.state.tick()
    assert set(h.state.jobs["j"].clients) == {stays}


def test_memory_of_replies_survives_snapshot_and_journal_restore(tmp_path: Path) -> None:
    h = Harness(durable=True)
    journal = Journal(str(tmp_path))
    journal.load()
    cid = os.urandom(CID_BYTES)
    conn = h.connect(cid)

    def flush() -> None:
        journal.write(journal.encode(h.state.take_journal()))

    ok(h.call(conn, "add", key="n", amount=3, rid=1, ack=0))
    ok(h.call(conn, "append", b"a", key="log", rid=2, ack=0))
    # The mutation and the memory of its reply travel in one record: a torn write keeps both or neither.
    records = h.state.take_journal()
    assert [r[0] for r in records] == ["req", "req"]
    journal.write(journal.encode(records))
    journal.install_snapshot(journal.encode_snapshot(h.state.snapshot()))
    ok(h.call(conn, "add", key="n", amount=3, rid=3, ack=1))
    ok(h.call(conn, "append", b"b", key="log", rid=4, ack=1))
    flush()
    journal.close()

    again = Journal(str(tmp_path))
    snap, replay = again.load()
    again.close()
    assert snap is not None and len(replay) == 2
    restored = Harness()
    restored.state.restore(snap, replay)
    assert restored.value("n") == b"6" and restored.value("log") == b"ab"
    conn = restored.connect(cid)
    assert restored.call(conn, "add", key="n", amount=3, rid=3, ack=1)[0]["value"] == 6
    assert ok(restored.call(conn, "append", b"a", key="log", rid=2, ack=1))  # from the snapshot
    ok(restored.call(conn, "append", b"b", key="log", rid=4, ack=1))
    assert restored.value("n") == b"6" and restored.value("log") == b"ab"
    assert restored.state.resends_answered == 3
    assert ok(restored.call(conn, "add", key="n", amount=3, rid=5, ack=4))[0]["value"] == 9
