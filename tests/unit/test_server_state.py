"""The coordinator's state machine without sockets or an event loop: every operation, waits on a
fake clock, rendezvous refusals, rounds, liveness, job expiry, limits and journal replay."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from aiocoll.server import CoordinatorState
from store_frames import StateDriver

from aiocoll.protocol._coordinator import (
    ERR_INVALID,
    ERR_RENDEZVOUS,
    ERR_TIMEOUT,
    ERR_TOO_LARGE,
    ERR_UNKNOWN_OP,
    EV_MEMBER_LOST,
    EV_RESTARTED,
    EV_SESSION_LOST,
    join_values,
)

pytestmark = pytest.mark.timeout(20)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float, state: CoordinatorState) -> None:
        self.now += seconds
        state.tick()


class Harness:
    """Drives a CoordinatorState the way the shell does and sorts its output per connection
    (store requests go in their compact form: store_frames.StateDriver)."""

    def __init__(self, **kwargs: Any) -> None:
        self.clock = Clock()
        self.state = CoordinatorState(clock=self.clock, **kwargs)
        self.driver = StateDriver(self.state)
        self.ids = 0

    def connect(self, job: str = "j", role: str = "worker", session: str | None = None) -> int:
        self.ids += 1
        self.state.connect(self.ids, job, role, peer="127.0.0.1:1", session=session)
        return self.ids

    def send(self, conn: int, op: str, payload: bytes = b"", **fields: Any) -> None:
        self.driver.send(conn, op, payload, **fields)

    def out(self, conn: int | None = None) -> list[tuple[dict[str, Any], bytes]]:
        """Take the frames sent (to ``conn`` only, when given) since they were last taken."""
        return self.driver.take(conn)

    def call(self, conn: int, op: str, payload: bytes = b"", **fields: Any) -> tuple[dict[str, Any], bytes]:
        self.send(conn, op, payload, **fields)
        frames = self.out(conn)
        assert len(frames) == 1, frames
        return frames[0]

    def tick(self, seconds: float) -> None:
        self.clock.advance(seconds, self.state)


def ok(reply: tuple[dict[str, Any], bytes]) -> tuple[dict[str, Any], bytes]:
    assert reply[0]["ok"] is True, reply
    return reply


def refused(reply: tuple[dict[str, Any], bytes], err: str) -> dict[str, Any]:
    header = reply[0]
    assert header["ok"] is False and header["err"] == err, header
    return header


# ---------------------------------------------------------------- store ops
def test_every_store_operation_round_trips() -> None:
    h = Harness()
    c = h.connect(role="store")
    ok(h.call(c, "set", b"v1", key="a"))
    assert ok(h.call(c, "get", key="a", timeout=1))[1] == b"v1"
    assert ok(h.call(c, "add", key="n", amount=5))[0]["value"] == 5
    assert ok(h.call(c, "add", key="n", amount=-7))[0]["value"] == -2
    assert ok(h.call(c, "get", key="n"))[1] == b"-2"
    assert ok(h.call(c, "check", keys=["a", "n"]))[0]["value"] is True
    assert ok(h.call(c, "check", keys=["a", "zz"]))[0]["value"] is False
    payload, sizes = join_values([b"x", b"", b"yyy"])
    ok(h.call(c, "mset", payload, keys=["m1", "m2", "m3"], sizes=sizes))
    header, body = ok(h.call(c, "mget", keys=["m3", "m1", "m2"], timeout=1))
    assert header["sizes"] == [3, 1, 0] and body == b"yyyx"
    ok(h.call(c, "append", b"12", key="log"))
    ok(h.call(c, "append", b"34", key="log"))
    assert ok(h.call(c, "get", key="log"))[1] == b"1234"
    assert ok(h.call(c, "nkeys"))[0]["value"] == 6
    assert ok(h.call(c, "del", key="a"))[0]["value"] is True
    assert ok(h.call(c, "del", key="a"))[0]["value"] is False
    assert ok(h.call(c, "nkeys"))[0]["value"] == 5
    ok(h.call(c, "wait", keys=["m1", "log"], timeout=0))
    ok(h.call(c, "hb"))


def test_compare_set_follows_torch_semantics() -> None:
    h = Harness()
    c = h.connect(role="store")

    def cas(key: str, expected: bytes, desired: bytes) -> bytes:
        payload, sizes = join_values([expected, desired])
        return ok(h.call(c, "cas", payload, key=key, sizes=sizes))[1]

    assert cas("k", b"", b"first") == b"first"  # missing + empty expected: set
    assert cas("k", b"wrong", b"second") == b"first"  # mismatch: current value back
    assert cas("k", b"first", b"second") == b"second"  # match: swapped
    assert cas("missing", b"x", b"y") == b"x"  # missing + non-empty expected: expected back, nothing set
    assert ok(h.call(c, "check", keys=["missing"]))[0]["value"] is False


def test_keys_are_isolated_per_job() -> None:
    h = Harness()
    a, b = h.connect("ja", "store"), h.connect("jb", "store")
    ok(h.call(a, "set", b"A", key="k"))
    assert ok(h.call(b, "check", keys=["k"]))[0]["value"] is False
    assert ok(h.call(b, "nkeys"))[0]["value"] == 0


def test_get_waits_until_another_connection_sets_the_key() -> None:
    h = Harness()
    waiter, setter = h.connect(role="store"), h.connect(role="store")
    h.send(waiter, "get", key="late", timeout=30, id=1)
    h.send(waiter, "mget", keys=["late", "later"], timeout=30, id=2)
    h.send(waiter, "wait", keys=["later"], timeout=None, id=3)
    assert h.out() == []
    h.tick(5)
    h.send(setter, "set", b"L", key="late", id=9)
    frames = h.out(waiter)
    assert frames == [({"id": 1, "ok": True}, b"L")]
    h.send(setter, "set", b"LL", key="later", id=10)
    frames = h.out(waiter)
    assert sorted(f[0]["id"] for f in frames) == [2, 3]
    mget = next(f for f in frames if f[0]["id"] == 2)
    assert mget[0]["sizes"] == [1, 2] and mget[1] == b"LLL"


def test_wait_times_out_on_the_fake_clock_naming_missing_keys() -> None:
    h = Harness()
    c = h.connect(role="store")
    ok(h.call(c, "set", b"1", key="have"))
    h.send(c, "wait", keys=["have", "gone1", "gone2"], timeout=2.0)
    h.tick(1.9)
    assert h.out() == []
    assert h.state.next_deadline() == pytest.approx(h.clock.now + 0.1)
    h.tick(0.2)
    [(header, _)] = h.out(c)
    refused((header, b""), ERR_TIMEOUT)
    assert header["keys"] == ["gone1", "gone2"]
    assert "gone1" in header["msg"] and "2s" in header["msg"]
    # A timed-out waiter is gone: setting the key later sends nothing to it.
    h.send(c, "set", b"x", key="gone1", id=8)
    h.send(c, "set", b"x", key="gone2", id=9)
    assert [f[0]["id"] for f in h.out(c)] == [8, 9]


def test_get_with_zero_timeout_answers_at_once() -> None:
    h = Harness()
    c = h.connect(role="store")
    refused(h.call(c, "get", key="nope", timeout=0), ERR_TIMEOUT)


def test_waiters_of_a_closed_connection_are_dropped() -> None:
    h = Harness()
    w, s = h.connect(role="store"), h.connect(role="store")
    h.send(w, "get", key="k", timeout=None)
    h.state.disconnect(w, "test")
    h.send(s, "set", b"v", key="k")
    assert h.out(w) == []
    assert h.state.jobs["j"].waiters == {}


def test_deleted_key_keeps_a_multi_key_waiter_waiting() -> None:
    h = Harness()
    w, s = h.connect(role="store"), h.connect(role="store")
    h.send(s, "set", b"1", key="a", id=1)
    h.send(w, "wait", keys=["a", "b"], timeout=None, id=2)
    h.send(s, "del", key="a", id=3)
    h.send(s, "set", b"2", key="b", id=4)
    assert h.out(w) == []
    h.send(s, "set", b"3", key="a", id=5)
    assert h.out(w) == [({"id": 2, "ok": True}, b"")]


# ---------------------------------------------------------------- bad input
def test_wrong_typed_keys_and_values_are_refused_naming_the_key() -> None:
    h = Harness(max_value_bytes=10)
    c = h.connect(role="store")
    refused(h.call(c, "set", b"v", key=123), ERR_INVALID)
    refused(h.call(c, "set", b"v", key=""), ERR_INVALID)
    header = refused(h.call(c, "set", b"x" * 11, key="big"), ERR_TOO_LARGE)
    assert "big" in header["msg"] and header["keys"] == ["big"] and "10 bytes" in header["msg"]
    refused(h.call(c, "set", b"v", key="k" * 5000), ERR_TOO_LARGE)
    refused(h.call(c, "add", key="n", amount="3"), ERR_INVALID)
    ok(h.call(c, "set", b"abc", key="text"))
    header = refused(h.call(c, "add", key="text", amount=1), ERR_INVALID)
    assert "text" in header["msg"]
    ok(h.call(c, "add", key="n", amount=(1 << 63) - 1))
    refused(h.call(c, "add", key="n", amount=1), ERR_INVALID)
    refused(h.call(c, "get", key="k", timeout="soon"), ERR_INVALID)
    refused(h.call(c, "get", key="k", timeout=-1), ERR_INVALID)
    refused(h.call(c, "wait", keys="notalist"), ERR_INVALID)
    refused(h.call(c, "mset", b"abc", keys=["a", "b"], sizes=[1, 1]), ERR_INVALID)
    refused(h.call(c, "mset", b"x" * 12, keys=["a", "b"], sizes=[1, 11]), ERR_TOO_LARGE)
    ok(h.call(c, "append", b"x" * 6, key="ap"))
    refused(h.call(c, "append", b"x" * 6, key="ap"), ERR_TOO_LARGE)
    refused(h.call(c, "cas", b"ab", key="c", sizes=[5, 5]), ERR_INVALID)
    refused(h.call(c, "frobnicate"), ERR_UNKNOWN_OP)
    refused(h.call(c, "status", job=5), ERR_INVALID)
    # Nothing refused changed the store.
    assert set(h.state.jobs["j"].kv) == {"text", "n", "ap"}


def test_request_without_an_id_is_fatal_for_the_connection() -> None:
    h = Harness()
    c = h.connect(role="store")
    with pytest.raises(ValueError, match="id"):
        h.state.request(c, {"op": "join", "rank": 0}, b"")
    with pytest.raises(ValueError, match="id"):
        h.state.request(c, [1], b"")  # a store request: [code, id, ...]


def test_keys_per_job_limit_is_enforced() -> None:
    h = Harness(max_keys_per_job=2)
    c = h.connect(role="store")
    ok(h.call(c, "set", b"", key="a"))
    ok(h.call(c, "set", b"", key="b"))
    ok(h.call(c, "set", b"again", key="b"))  # overwriting needs no room
    header = refused(h.call(c, "set", b"", key="c"), ERR_TOO_LARGE)
    assert "2" in header["msg"] and header["keys"] == ["c"]


def test_roles_limit_operations() -> None:
    h = Harness()
    admin, store = h.connect(role="admin"), h.connect(role="store")
    refused(h.call(admin, "set", b"v", key="k"), ERR_INVALID)
    ok(h.call(admin, "status", job=None))
    refused(h.call(store, "join", rank=0, world_size=1), ERR_INVALID)


# ---------------------------------------------------------------- rendezvous
def join(h: Harness, conn: int, rank: int | None, world_size: int, **extra: Any) -> None:
    h.send(
        conn,
        "join",
        rank=rank,
        world_size=world_size,
        addrs=[["127.0.0.1", 5000 + conn]],
        host=f"host{conn}",
        timeout=extra.pop("timeout", 60),
        id=100 + conn,
        **extra,
    )


def complete_round(
    h: Harness, world_size: int, job: str = "j"
) -> tuple[list[int], dict[int, dict[str, Any]]]:
    conns = [h.connect(job) for _ in range(world_size)]
    for i, c in enumerate(conns):
        join(h, c, i, world_size)
    replies = {c: hp[0] for c in conns for hp in h.out(c)}
    return conns, replies


def test_rendezvous_completes_with_membership_table_and_sessions() -> None:
    h = Harness()
    a, b, c = h.connect(), h.connect(), h.connect()
    join(h, a, 2, 3)
    join(h, b, None, 3)  # assigned: lowest free rank
    assert h.out() == []
    join(h, c, None, 3)
    replies = {conn: h.out(conn) for conn in (a, b, c)}
    ranks = {conn: r[0][0]["rank"] for conn, r in replies.items()}
    assert ranks == {a: 2, b: 0, c: 1}
    tables = [r[0][0]["members"] for r in replies.values()]
    assert tables[0] == tables[1] == tables[2]
    assert [m["rank"] for m in tables[0]] == [0, 1, 2]
    assert tables[0][2] == {"rank": 2, "addrs": [["127.0.0.1", 5000 + a]], "host": f"host{a}"}
    sessions = {r[0][0]["session"] for r in replies.values()}
    assert len(sessions) == 3 and all(len(s) >= 16 for s in sessions)
    assert all(r[0][0]["round"] == 0 and r[0][0]["world_size"] == 3 for r in replies.values())


def test_a_requested_rank_is_honoured_whatever_order_the_joins_arrive_in() -> None:
    # Ranks 3 and 1 asked for, two members rank-less: in every arrival order the two get what they
    # asked for (a rank-less member holding one moves before anyone sees the table), the rank-less
    # ones get 0 and 2, and one table goes to all.
    import itertools

    wanted: list[int | None] = [3, None, 1, None]
    for order in itertools.permutations(range(4)):
        h = Harness()
        conns = [h.connect() for _ in range(4)]
        for i in order:
            join(h, conns[i], wanted[i], 4)
        replies = [h.out(c) for c in conns]
        assert all(len(r) == 1 and r[0][0]["ok"] for r in replies), (order, replies)
        ranks = [r[0][0]["rank"] for r in replies]
        assert ranks[0] == 3 and ranks[2] == 1 and sorted(ranks) == [0, 1, 2, 3], (order, ranks)
        tables = [r[0][0]["members"] for r in replies]
        assert all(t == tables[0] for t in tables)
        assert [m["host"] for m in tables[0]] == [f"host{conns[ranks.index(k)]}" for k in range(4)]
    # Two members asking for the same rank are still refused, even after a rank-less one held it.
    h = Harness()
    a, b, c = h.connect(), h.connect(), h.connect()
    join(h, a, None, 3)  # holds 0 for now
    join(h, b, 0, 3)  # takes 0; a moves to 1
    join(h, c, 0, 3)
    header = h.out(c)[0][0]
    assert header["err"] == ERR_RENDEZVOUS and "rank 0" in header["msg"]


def test_rendezvous_refuses_duplicate_out_of_range_and_world_size_disagreement() -> None:
    h = Harness()
    a, b, c, d, e = (h.connect() for _ in range(5))
    join(h, c, 4, 4)  # out of range: refused alone, the round is not affected
    header = h.out(c)[0][0]
    assert header["err"] == ERR_RENDEZVOUS and "rank 4" in header["msg"] and "world size 4" in header["msg"]
    join(h, a, 1, 4)
    assert h.out(a) == []
    join(h, b, 1, 4)
    header = h.out(b)[0][0]
    assert header["err"] == ERR_RENDEZVOUS and "rank 1" in header["msg"] and "'j'" in header["msg"]
    # The member already waiting hears at once who was refused and why (issue 10).
    waiting = h.out(a)[0][0]
    assert waiting["err"] == ERR_RENDEZVOUS and "refused a join" in waiting["msg"]
    assert "two processes were given the same rank" in waiting["msg"]
    join(h, a, 3, 4)  # its failed join is gone: it may join again
    assert h.out(a) == []
    join(h, d, 2, 8)
    header = h.out(d)[0][0]
    assert header["err"] == ERR_RENDEZVOUS and "8" in header["msg"] and "4" in header["msg"]
    waiting = h.out(a)[0][0]
    assert waiting["err"] == ERR_RENDEZVOUS and "refused" in waiting["msg"]
    assert "world size 8" in waiting["msg"]
    join(h, e, 0, 4)
    join(h, e, 1, 4)
    assert h.out(e)[0][0]["err"] == ERR_RENDEZVOUS  # one join per connection


def test_rendezvous_times_out_naming_missing_ranks_and_frees_the_rank() -> None:
    h = Harness()
    a = h.connect()
    join(h, a, 0, 3, timeout=5)
    h.tick(6)
    header = h.out(a)[0][0]
    assert header["err"] == ERR_RENDEZVOUS and "timed out" in header["msg"] and "[1, 2]" in header["msg"]
    b = h.connect()
    join(h, b, 0, 3)  # rank 0 is free again
    assert h.out(b) == []


def test_join_of_a_closed_connection_frees_its_rank_before_completion() -> None:
    h = Harness()
    a, b, c = h.connect(), h.connect(), h.connect()
    join(h, a, 0, 2)
    h.state.disconnect(a, "test")
    join(h, b, 0, 2)
    join(h, c, 1, 2)
    assert h.out(b)[0][0]["ok"] and h.out(c)[0][0]["rank"] == 1


def test_lost_member_is_announced_to_every_other_member() -> None:
    h = Harness()
    conns, _ = complete_round(h, 3)
    h.state.disconnect(conns[1], "reset by peer")
    frames = [(c, hdr) for c, hdr, _ in h.state.outbox if isinstance(hdr, dict)]
    h.state.outbox.clear()
    assert sorted(c for c, _ in frames) == [conns[0], conns[2]]
    for _, header in frames:
        assert header["ev"] == EV_MEMBER_LOST and header["rank"] == 1 and "reset by peer" in header["reason"]


def test_silent_member_is_lost_after_heartbeat_timeout_and_closed() -> None:
    h = Harness(heartbeat_timeout=10)
    conns, _ = complete_round(h, 2)
    for _ in range(5):  # member 0 heartbeats, member 1 is silent
        h.tick(3)
        h.send(conns[0], "hb")
    frames = [f for f in h.out(conns[0]) if "ev" in f[0]]
    assert [f[0]["ev"] for f in frames] == [EV_MEMBER_LOST]
    assert frames[0][0]["rank"] == 1 and "silent" in frames[0][0]["reason"]
    assert [c for c, _ in h.state.closes] == [conns[1]]


def test_a_round_slower_to_form_than_the_heartbeat_timeout_loses_no_member_when_it_completes() -> None:
    # Rank 0 joins and then waits 15 s (past the 10 s timeout) for the others, saying nothing,
    # as a member waiting for the coordinator's answer does: its silence counts from the
    # completion, so it is not lost then, and lost only when silent 10 s after it.
    h = Harness(heartbeat_timeout=10)
    conns = [h.connect() for _ in range(3)]
    join(h, conns[0], 0, 3)
    for _ in range(15):
        h.tick(1)
    join(h, conns[1], 1, 3)
    join(h, conns[2], 2, 3)
    assert all(f[0]["ok"] for c in conns for f in h.out(c))
    for _ in range(9):  # ranks 1 and 2 beat once they have their answer, rank 0 stays silent
        h.tick(1)
        for c in conns[1:]:
            h.send(c, "hb")
    assert [f for c in conns for f in h.out(c) if "ev" in f[0]] == []
    assert h.state.closes == []
    for _ in range(2):
        h.tick(1)
        for c in conns[1:]:
            h.send(c, "hb")
    frames = [f for f in h.out(conns[1]) if "ev" in f[0]]
    assert [(f[0]["ev"], f[0]["rank"]) for f in frames] == [(EV_MEMBER_LOST, 0)]
    assert "silent" in frames[0][0]["reason"]
    assert [c for c, _ in h.state.closes] == [conns[0]]


def test_coordinator_stall_is_not_counted_as_member_silence_but_later_silence_is() -> None:
    h = Harness(heartbeat_timeout=10)
    conns, _ = complete_round(h, 2)
    h.tick(1)
    h.tick(30)  # the coordinator's own loop did not run for 30 s (heartbeats unread meanwhile)
    assert [f for c in conns for f in h.out(c) if "ev" in f[0]] == []
    assert h.state.closes == []
    for _ in range(4):  # after the stall, member 0 heartbeats and member 1 stays silent
        h.tick(3)
        h.send(conns[0], "hb")
    frames = [f for f in h.out(conns[0]) if "ev" in f[0]]
    assert [(f[0]["ev"], f[0]["rank"]) for f in frames] == [(EV_MEMBER_LOST, 1)]


def test_liveness_looks_at_each_member_when_its_silence_could_run_out_and_not_later() -> None:
    # Members are looked at when they are due, not every second: a member that goes silent at
    # any moment, after beating, is still lost within a pass (1 s) and a slot (0.25 s) of its
    # timeout; one that keeps beating never is; and a member that resumed after a restart has the
    # heartbeat's limit from then on, not what was left of the 30 s grace.
    h = Harness(heartbeat_timeout=10, durable=True, resume_grace=30)
    conns, replies = complete_round(h, 4)
    silent_from = {1: 3.0, 2: 7.5, 3: 12.25}  # ranks 1-3 beat until then, rank 0 throughout
    lost_at: dict[int, float] = {}
    t = 0.0
    while t < 30:
        h.tick(0.25)
        t += 0.25
        for rank, c in enumerate(conns):
            if t < silent_from.get(rank, 99):
                h.send(c, "hb")
        for f, _ in h.out(conns[0]):
            if f.get("ev") == EV_MEMBER_LOST:
                lost_at[f["rank"]] = t
    assert sorted(lost_at) == [1, 2, 3], lost_at
    for rank, last in silent_from.items():
        # heard last at ``last - 0.25``; lost once more than 10 s later, at the next pass
        assert 10 < lost_at[rank] - (last - 0.25) <= 10 + 1 + 0.25, (rank, lost_at)

    # After a restart: job k's rank 0 resumes and then says nothing; its rank 1 resumes and beats.
    h = Harness(heartbeat_timeout=10, durable=True, resume_grace=30)
    conns, replies = complete_round(h, 2, job="k")
    h2 = Harness(heartbeat_timeout=10, durable=True, resume_grace=30)
    h2.state.restore(None, h.state.take_journal())
    h2.tick(1.0)  # a pass while both are resuming (within the grace)
    resumed = [h2.connect("k", session=replies[c]["session"]) for c in conns]
    lost_at = {}
    t = 0.0
    while t < 20 and not lost_at:
        h2.tick(0.25)
        t += 0.25
        h2.send(resumed[1], "hb")
        for f, _ in h2.out(resumed[1]):
            if f.get("ev") == EV_MEMBER_LOST:
                lost_at[f["rank"]] = t
    assert list(lost_at) == [0] and 10 < lost_at[0] <= 11.25, lost_at


def test_leave_breaks_the_round_without_events_and_a_new_round_opens() -> None:
    h = Harness()
    conns, _ = complete_round(h, 2)
    # A healthy complete round refuses newcomers.
    x = h.connect()
    join(h, x, 0, 2)
    assert "complete" in h.out(x)[0][0]["msg"]
    ok(h.call(conns[0], "leave"))
    assert h.out() == []  # a clean leave is not a loss
    h.state.disconnect(conns[0], "bye")
    h.state.disconnect(conns[1], "killed")
    h.out()
    ok(h.call(h.connect(role="store"), "set", b"kept", key="k"))
    new = [h.connect() for _ in range(3)]
    for i, c in enumerate(new):
        join(h, c, i, 3)  # a new generation may even change the world size
    reply = h.out(new[0])[0][0]
    assert reply["ok"] and reply["round"] == 1 and reply["world_size"] == 3
    assert h.state.jobs["j"].kv["k"] == b"kept"  # keys persist across rounds


def test_events_go_only_to_the_round_the_lost_member_belonged_to() -> None:
    h = Harness()
    old, _ = complete_round(h, 2)
    h.state.disconnect(old[0], "crash")
    h.out()
    complete_round(h, 2)  # the next generation: it must hear nothing of the old one
    h.state.disconnect(old[1], "killed by launcher")
    assert [c for c, _, _ in h.state.outbox] == []


def test_abandoned_job_expires_after_ttl_but_not_while_connected() -> None:
    h = Harness(job_ttl=60)
    a = h.connect("keep", "store")
    b = h.connect("drop", "store")
    ok(h.call(a, "set", b"1", key="k"))
    ok(h.call(b, "set", b"1", key="k"))
    h.state.disconnect(b, "done")
    h.tick(30)
    assert "drop" in h.state.jobs
    h.tick(31)
    assert "drop" not in h.state.jobs and "keep" in h.state.jobs


def test_an_operator_watching_a_job_does_not_keep_it_from_expiring() -> None:
    h = Harness(job_ttl=60)
    worker = h.connect("done", "store")
    ok(h.call(worker, "set", b"1", key="k"))
    h.state.disconnect(worker, "finished")
    watcher = h.connect("done", "admin")
    for _ in range(5):  # `aiocoll status --watch` asking every 10 s
        h.tick(10)
        ok(h.call(watcher, "status", job="done"))
    h.tick(11)
    assert "done" not in h.state.jobs, "only workers' activity keeps a job"
    refused, _ = h.call(watcher, "status", job="done")
    assert refused["ok"] is False and "no such job 'done'" in refused["msg"]


def test_status_lists_jobs_members_and_liveness() -> None:
    h = Harness()
    conns, _ = complete_round(h, 2, job="train")
    h.tick(2)
    h.state.disconnect(conns[1], "gone")
    [job] = h.state.status("train")
    assert job["world_size"] == 2 and job["complete"] and job["round"] == 0
    alive = {m["rank"]: m["alive"] for m in job["members"]}
    assert alive == {0: True, 1: False}
    assert job["members"][0]["last_seen"] == pytest.approx(2.0)
    assert h.state.status("nope") == []


# ---------------------------------------------------------------- durability
def test_journal_replay_rebuilds_keys_rounds_and_resumable_sessions() -> None:
    h = Harness(durable=True)
    s = h.connect(role="store")
    ok(h.call(s, "set", b"v", key="a"))
    ok(h.call(s, "add", key="n", amount=3))
    ok(h.call(s, "append", b"x", key="log"))
    ok(h.call(s, "append", b"y", key="log"))
    ok(h.call(s, "set", b"gone", key="d"))
    ok(h.call(s, "del", key="d"))
    conns, replies = complete_round(h, 3)
    h.state.disconnect(conns[2], "crash")
    h.out()
    records = h.state.take_journal()

    # Half from a snapshot, half from records after it, like a real restart.
    h2 = Harness(durable=True, resume_grace=5)
    h2.state.restore(None, records)
    assert h2.state.jobs["j"].kv == {"a": b"v", "n": b"3", "log": b"xy"}
    assert h2.state.journal == []
    snap = h2.state.snapshot()
    h3 = Harness(durable=True, resume_grace=5)
    h3.state.restore(snap, [])
    assert h3.state.jobs["j"].kv == h2.state.jobs["j"].kv
    [job] = h3.state.status("j")
    assert {m["rank"]: m["state"] for m in job["members"]} == {0: "resuming", 1: "resuming", 2: "lost"}

    # Rank 0 resumes with its session: it is told the coordinator restarted.
    c0 = h3.connect(session=replies[conns[0]]["session"])
    assert h3.out(c0) == [({"ev": EV_RESTARTED}, b"")]
    # Rank 2 was lost before the restart: its session is refused.
    c2 = h3.connect(session=replies[conns[2]]["session"])
    [(event, _)] = h3.out(c2)
    assert event["ev"] == EV_SESSION_LOST
    # Rank 1 never returns: lost after the grace, and rank 0 hears of it.
    h3.tick(6)
    frames = h3.out(c0)
    assert [(f[0]["ev"], f[0]["rank"]) for f in frames] == [(EV_MEMBER_LOST, 1)]
    assert "reconnect" in frames[0][0]["reason"]


def test_rounds_move_only_as_their_table_allows_live_and_on_restore() -> None:
    from aiocoll.server._rounds import Round, RoundState, round_can_move

    forming, complete, broken = RoundState.FORMING, RoundState.COMPLETE, RoundState.BROKEN
    allowed = {(a, b) for a in RoundState for b in RoundState if round_can_move(a, b)}
    assert allowed == {(forming, complete), (complete, broken)}
    h = Harness(durable=True)
    rnd = Round(h.state.job("x", 0.0), 0, 1)
    with pytest.raises(AssertionError, match="forming -> "):
        rnd.move(broken)  # a round that never completed cannot break
    rnd.move(complete)
    with pytest.raises(AssertionError):
        rnd.move(forming)

    # Live: completed, then broken by a leave; a restore (snapshot or journal) gets there by
    # the same moves, its lost member too.
    conns, _ = complete_round(h, 2)
    assert h.state.jobs["j"].round.state is complete
    h.state.disconnect(conns[1], "crash")
    h.out()
    assert h.state.jobs["j"].round.state is broken
    records = h.state.take_journal()
    from_journal = Harness(durable=True)
    from_journal.state.restore(None, records)
    from_snapshot = Harness(durable=True)
    from_snapshot.state.restore(from_journal.state.snapshot(), [])
    for restored in (from_journal, from_snapshot):
        rnd = restored.state.jobs["j"].round
        assert rnd is not None and rnd.state is broken
        assert {m.rank: m.state.value for m in rnd.members.values()} == {0: "resuming", 1: "lost"}


def test_refused_requests_write_nothing_to_the_journal() -> None:
    h = Harness(durable=True, max_value_bytes=4)
    c = h.connect(role="store")
    refused(h.call(c, "set", b"toolong", key="k"), ERR_TOO_LARGE)
    h.send(c, "get", key="nope", timeout=None)
    assert h.state.take_journal() == []


def test_join_can_ask_for_the_membership_table_as_a_payload() -> None:
    h = Harness()
    a, b = h.connect(), h.connect()
    join(h, a, 0, 2, table_in_payload=True)
    join(h, b, 1, 2)
    [(header_a, payload_a)] = h.out(a)
    [(header_b, payload_b)] = h.out(b)
    assert "members" not in header_a and header_a["rank"] == 0 and header_a["session"]
    assert msgpack.unpackb(payload_a) == header_b["members"] and payload_b == b""
    assert [m["rank"] for m in header_b["members"]] == [0, 1]


def test_ten_thousand_members_rendezvous_without_quadratic_work() -> None:
    h = Harness()
    n = 10_000
    conns = [h.connect() for _ in range(n)]
    for c in conns:
        h.send(
            c,
            "join",
            rank=None,
            world_size=n,
            addrs=[["10.0.0.1", 1]],
            host="h",
            timeout=60,
            table_in_payload=True,
        )
    replies = h.state.outbox
    assert len(replies) == n
    # One shared encoding of the table, not one per member.
    assert len({id(p) for _, _, p in replies}) == 1
    assert sorted(hd.decode()["rank"] for _, hd, _ in replies) == list(range(n))  # type: ignore[union-attr]


def test_a_burst_of_handshakes_abandoned_after_the_challenge_is_told_once_per_burst() -> None:
    """Collecting the coordinator's proofs and hanging up is how an offline guess at a weak token
    starts: ABANDON_BURST of them within ABANDON_WINDOW seconds are said (once), a slow trickle
    never is."""
    from aiocoll.server._connection import ABANDON_BURST, ABANDON_WINDOW, AbandonedHandshakes

    trickle = AbandonedHandshakes()
    assert not any(trickle.note(i * ABANDON_WINDOW / 2) for i in range(5 * ABANDON_BURST))
    burst = AbandonedHandshakes()
    told = [burst.note(100.0 + i * 0.01) for i in range(2 * ABANDON_BURST)]
    assert told == ([0] * (ABANDON_BURST - 1) + [ABANDON_BURST]) * 2
