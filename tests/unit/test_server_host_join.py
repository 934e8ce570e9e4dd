"""Joins that carry many members over one connection (a host's ranks, a node agent's), in the
coordinator's state machine without sockets: one reply per join with ranks and sessions only, the
table read in slices, members lost together with their connection and each loss told once per
connection, refusals and timeouts naming the ranks, and re-attaching after a restart."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from aiocoll.server import CoordinatorState

from aiocoll.protocol._coordinator import ERR_INVALID, ERR_RENDEZVOUS, EV_MEMBER_LOST, EV_RESTARTED

pytestmark = pytest.mark.timeout(20)


class Driver:
    def __init__(self) -> None:
        self.now = 1000.0
        self.state = CoordinatorState(clock=lambda: self.now)
        self.ids = 0

    def connect(self, session: Any = None) -> int:
        self.ids += 1
        self.state.connect(self.ids, "j", "worker", peer=f"10.0.0.{self.ids}:1", session=session)
        return self.ids

    def join(self, conn: int, ranks: list[int | None], world_size: int, **extra: Any) -> None:
        members = [[r, [["10.0.0.1", 7000 + i]], f"host{conn}"] for i, r in enumerate(ranks)]
        header = {"op": "join", "id": 50 + conn, "members": members, "world_size": world_size, **extra}
        self.state.request(conn, header, b"")

    def take(self, conn: int) -> list[tuple[dict[str, Any], bytes]]:
        outbox = self.state.outbox
        mine = [(h if isinstance(h, dict) else h.decode(), bytes(p)) for c, h, p in outbox if c == conn]
        outbox[:] = [f for f in outbox if f[0] != conn]
        return mine

    def call(self, conn: int, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        self.state.request(conn, header, b"")
        [reply] = self.take(conn)
        return reply


def test_many_members_join_over_one_connection_and_get_one_reply_with_ranks_and_sessions() -> None:
    d = Driver()
    a, b = d.connect(), d.connect()
    d.join(a, [None, None, 5, None], 8)
    assert d.take(a) == []
    d.join(b, [0, None, None, None], 8)
    [(reply_a, body_a)], [(reply_b, _)] = d.take(a), d.take(b)
    assert reply_a["ok"] and reply_b["ok"] and body_a == b""
    assert "members" not in reply_a and "table_digest" not in reply_a, "no table in a many-member reply"
    ranks = reply_a["ranks"] + reply_b["ranks"]
    assert sorted(ranks) == list(range(8)) and reply_a["ranks"][2] == 5 and reply_b["ranks"][0] == 0
    sessions = reply_a["sessions"] + reply_b["sessions"]
    assert len(set(sessions)) == 8
    assert reply_a["world_size"] == 8 and reply_a["round"] == reply_b["round"] == 0
    # The addresses a member's links need: a slice of the table, by rank.
    header, rows = d.call(a, {"op": "table", "id": 9, "round": 0, "ranks": [4, 7]})
    assert header["ok"] and [m["rank"] for m in msgpack.unpackb(rows)] == [4, 5, 6]
    assert msgpack.unpackb(rows)[1]["host"] == f"host{a}"  # rank 5 came with connection a
    for span in ([0, 9], [3, 2], ["0", 1], [1]):
        header, _ = d.call(a, {"op": "table", "id": 10, "round": 0, "ranks": span})
        assert header["err"] == ERR_INVALID, span
    status = d.state.status("j")[0]
    assert status["complete"] and [m["rank"] for m in status["members"]] == list(range(8))


def test_a_closed_connection_loses_all_its_members_and_the_loss_is_told_once_per_connection() -> None:
    d = Driver()
    a, b, c = d.connect(), d.connect(), d.connect()
    d.join(a, [0, 1, 2], 6)
    d.join(b, [3, 4], 6)
    d.join(c, [5], 6)
    for conn in (a, b, c):
        d.take(conn)
    d.state.disconnect(b, "cut")
    lost_told_a = [h for h, _ in d.take(a) if h.get("ev") == EV_MEMBER_LOST]
    lost_told_c = [h for h, _ in d.take(c) if h.get("ev") == EV_MEMBER_LOST]
    # One event per listening connection (not per listening member), naming both lost ranks.
    assert len(lost_told_a) == len(lost_told_c) == 1
    assert lost_told_a[0]["ranks"] == lost_told_c[0]["ranks"] == [3, 4] and lost_told_a[0]["count"] == 2
    states = {m["rank"]: m["state"] for m in d.state.status("j")[0]["members"]}
    assert states == {0: "alive", 1: "alive", 2: "alive", 3: "lost", 4: "lost", 5: "alive"}
    assert d.state.member_count() == 4
    # A leave takes every member of the connection with it.
    header, _ = d.call(a, {"op": "leave", "id": 77})
    assert header["ok"]
    states = {m["rank"]: m["state"] for m in d.state.status("j")[0]["members"]}
    assert [states[r] for r in (0, 1, 2)] == ["left"] * 3


def test_a_conflicting_member_fails_the_round_and_a_timeout_names_the_ranks() -> None:
    d = Driver()
    a, b = d.connect(), d.connect()
    d.join(a, [0, 1], 4)
    d.join(b, [2, 1], 4)  # rank 1 twice
    [(refused, _)] = d.take(b)
    [(failed, _)] = d.take(a)
    assert refused["err"] == ERR_RENDEZVOUS and "rank 1 already joined" in refused["msg"]
    assert failed["err"] == ERR_RENDEZVOUS and "ranks [0, 1]" in failed["msg"]
    assert d.state.jobs["j"].round.members == {}, "the round was emptied"
    # More members than the round has free ranks: refused, and so is the round.
    c = d.connect()
    d.join(c, [None, None, None], 4, timeout=5)
    d.join(d.connect(), [None, None], 4)
    [(crowded, _)] = d.take(c)
    assert crowded["err"] == ERR_RENDEZVOUS and "2 members joined a round with 1 free ranks" in crowded["msg"]
    # A join that times out names the ranks it brought, and the ranks missing.
    e = d.connect()
    d.join(e, [None, 3], 4, timeout=5)
    d.now += 6
    d.state.tick()
    [(late, _)] = d.take(e)
    assert (
        late["err"] == ERR_RENDEZVOUS
        and "for ranks [0, 3]" in late["msg"]
        and "missing ranks [1, 2]" in late["msg"]
    )


def test_many_members_resume_on_a_new_connection_after_a_restart() -> None:
    d = Driver()
    d.state.durable = True
    a, b = d.connect(), d.connect()
    d.join(a, [0, 1, 2], 4)
    d.join(b, [3], 4)
    [(reply, _)] = d.take(a)
    snapshot, records = d.state.snapshot(), d.state.take_journal()
    restored = Driver()
    restored.state.restore(snapshot, records)
    assert restored.state.member_count() == 4  # resuming
    again = restored.connect(session=reply["sessions"])
    assert [h.get("ev") for h, _ in restored.take(again)] == [EV_RESTARTED]
    restored.now += 31  # past the resume grace: only rank 3 did not come back
    restored.state.tick()
    states = {m["rank"]: m["state"] for m in restored.state.status("j")[0]["members"]}
    assert states == {0: "alive", 1: "alive", 2: "alive", 3: "lost"}
    lost = [h for h, _ in restored.take(again) if h.get("ev") == EV_MEMBER_LOST]
    assert [e["rank"] for e in lost] == [3]


def test_status_of_a_large_job_lists_the_members_that_matter_and_counts_them_all() -> None:
    from aiocoll.server._views import STATUS_MEMBERS

    d = Driver()
    size = STATUS_MEMBERS + 44
    conns = [d.connect() for _ in range(size // 4)]
    for i, conn in enumerate(conns):
        d.join(conn, [4 * i + k for k in range(4)], size)
    d.state.disconnect(conns[-1], "cut")  # the last four ranks are lost
    job = d.state.status("j")[0]
    assert job["members_total"] == size and job["members_alive"] == size - 4
    listed = [m["rank"] for m in job["members"]]
    assert len(listed) == STATUS_MEMBERS and listed == sorted(listed)
    assert set(range(size - 4, size)) <= set(listed), "the lost ones are listed, beyond the first ranks"


def test_losing_a_hundred_thousand_members_at_once_costs_the_size_of_the_round_not_its_square() -> None:
    import time

    d = Driver()
    size, per_conn = 100_000, 8
    conns = [d.connect() for _ in range(size // per_conn)]
    for i, conn in enumerate(conns):
        d.join(conn, [per_conn * i + k for k in range(per_conn)], size)
    d.state.outbox.clear()
    survivor = conns[0]
    began = time.process_time()
    for _ in range(11):  # past the heartbeat timeout: everyone but the survivor went silent
        d.now += 1
        d.state.conns[survivor].last_seen = d.now
        d.state.tick()
    elapsed = time.process_time() - began
    [event] = [h for h, _ in d.take(survivor) if h.get("ev") == EV_MEMBER_LOST]
    assert event["count"] == size - per_conn and len(event["ranks"]) == 1024
    assert d.state.member_count() == per_conn
    assert elapsed < 30, f"{elapsed:.1f} s of CPU: the losses are not announced per member"


def test_a_stall_is_credited_once_to_a_connection_carrying_many_members() -> None:
    # The coordinator's own 30 s stall is not counted as anyone's silence; the connection of a
    # host's four members then says nothing and is lost 10 s later, as a one-member one is.
    d = Driver()
    d.state = CoordinatorState(clock=lambda: d.now, heartbeat_timeout=10)
    a, b = d.connect(), d.connect()
    d.join(a, [0, 1, 2, 3], 5)
    d.join(b, [4], 5)
    d.take(a), d.take(b)
    d.now += 1
    d.state.tick()
    d.now += 30  # the coordinator's loop did not run meanwhile
    d.state.tick()
    assert d.state.closes == []
    lost_after = None
    for second in range(1, 30):
        d.now += 1
        d.state.request(b, {"op": "hb", "id": 1000 + second}, b"")
        d.state.tick()
        if d.state.closes:
            lost_after = second
            break
    assert [c for c, _ in d.state.closes] == [a]
    assert lost_after is not None and lost_after <= 11, lost_after
    lost = [h for h, _ in d.take(b) if h.get("ev") == EV_MEMBER_LOST]
    assert len(lost) == 1 and lost[0]["count"] == 4


def test_a_round_of_many_connections_asks_them_to_beat_less_often(monkeypatch: pytest.MonkeyPatch) -> None:
    # Past BEATS_PER_SECOND connections, the join replies name a longer heartbeat interval
    # (connections / BEATS_PER_SECOND, at most a third of the heartbeat timeout), which the
    # client keeps (up to half its own timeout); a small round's replies name none.
    from aiocoll.client.control._join import beat_interval
    from aiocoll.server import _rendezvous

    from aiocoll.protocol._coordinator import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT

    monkeypatch.setattr(_rendezvous, "BEATS_PER_SECOND", 4)
    for hosts, expected in ((4, None), (8, 2.0), (40, 10 / 3)):
        d = Driver()
        d.state = CoordinatorState(clock=lambda: 1000.0, heartbeat_timeout=10)
        conns = [d.connect() for _ in range(hosts)]
        for i, c in enumerate(conns):
            d.join(c, [2 * i, 2 * i + 1], 2 * hosts)
        replies = [reply for c in conns for reply, _ in d.take(c)]
        assert len(replies) == hosts and all(r["ok"] for r in replies)
        assert {r.get("beat") for r in replies} == {expected}, hosts
        assert beat_interval(replies[0]) == (expected or HEARTBEAT_INTERVAL)
    assert beat_interval({"beat": 60.0}) == HEARTBEAT_TIMEOUT / 2
    assert beat_interval({"beat": "soon"}) == beat_interval({"beat": 0.1}) == HEARTBEAT_INTERVAL
