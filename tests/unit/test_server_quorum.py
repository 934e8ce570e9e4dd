"""The coordinator's quorum part (issue 20) without sockets: replicas asking at step boundaries on
a fake clock; when a quorum forms (the join window, the fast path, a replica whose connection
closed or went silent), its id (kept while the membership stays), who heals from whom, refusals,
timeouts, and a coordinator restart from the journal that loses nothing; replicas of several
ranks (counted when all their ranks asked, left out whole when one is gone, its other ranks told
which; ranks that disagree on the replica's size refused)."""

from __future__ import annotations

from typing import Any

import pytest
from aiocoll.server import CoordinatorState
from aiocoll.server._model import EncodedHeader
from aiocoll.server._quorum import QUORUM_KEY, heal_plan
from store_frames import StateDriver

from aiocoll.protocol._coordinator import ERR_INVALID, ERR_TIMEOUT, ERR_UNKNOWN_OP

pytestmark = pytest.mark.timeout(20)

JOIN = 5.0  # the join window every replica asks with here


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Replicas:
    """A CoordinatorState and the replicas that ask it for quorums, each on a connection."""

    def __init__(self, **kwargs: Any) -> None:
        self.clock = Clock()
        self.state = CoordinatorState(clock=self.clock, heartbeat_timeout=4.0, **kwargs)
        self.driver = StateDriver(self.state)
        self.conns: dict[str, int] = {}
        self.uids: dict[str, str] = {}
        self.asks: dict[str, int] = {}
        self.next_conn = 0
        self.next_id = 100
        self.quorum_ids: set[int] = set()
        self.cut: set[str] = set()  # replicas whose connection stays open but carries nothing

    def start(self, replica: str, *, uid: str | None = None) -> None:
        """A replica process starts: its own connection and incarnation id."""
        self.next_conn += 1
        self.conns[replica] = self.next_conn
        self.uids[replica] = uid or f"{replica}-{self.next_conn}"
        self.asks[replica] = 0
        self.state.connect(self.next_conn, "train", "store", peer=f"10.0.0.{self.next_conn}:5000")

    def ask(self, name: str, step: int, /, *, again: bool = False, **fields: Any) -> None:
        """Replica ``name`` asks for a quorum at ``step`` (``again``: re-sends its last ask, as
        after a reconnect); ``fields`` replace the request's."""
        if not again:
            self.asks[name] += 1
        self.next_id += 1
        self.quorum_ids.add(self.next_id)
        request = {
            "replica": name,
            "uid": self.uids[name],
            "step": step,
            "ask": self.asks[name],
            "host": f"host-{name}",
            "min_replicas": 2,
            "join_timeout": JOIN,
            "timeout": 60.0,
            "id": self.next_id,
            **fields,
        }
        self.driver.send(self.conns[name], "quorum", **request)

    def replies(self) -> dict[str, dict[str, Any]]:
        """The replies to quorum asks sent since last taken, by replica."""
        by_conn = {c: r for r, c in self.conns.items()}
        out = {}
        for conn, header, _ in self.state.outbox:
            if isinstance(header, EncodedHeader):
                header = header.decode()
            if conn in by_conn and isinstance(header, dict) and header.get("id") in self.quorum_ids:
                out[by_conn[conn]] = header
        self.state.outbox.clear()
        return out

    def tick(self, seconds: float) -> None:
        """Time passes; every replica not ``cut`` off beats each half second, as Managers do."""
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.now = min(end, self.clock.now + 0.5)
            for name, conn in self.conns.items():
                if name not in self.cut and conn in self.state.conns:
                    self.next_id += 1
                    self.driver.send(conn, "hb", id=self.next_id)
            self.state.tick()

    def close(self, replica: str) -> None:
        self.state.disconnect(self.conns[replica], "connection reset by peer")


def members(reply: dict[str, Any]) -> list[str]:
    return [m[0] for m in reply["members"]]


def formed(r: Replicas, *, step: int, names: list[str]) -> dict[str, dict[str, Any]]:
    """Everyone in ``names`` asks at ``step``; the quorum must form at once with all of them."""
    for name in names:
        r.ask(name, step)
    replies = r.replies()
    assert sorted(replies) == sorted(names), replies
    assert all(reply["ok"] for reply in replies.values()), replies
    return replies


def first_quorum(r: Replicas, names: list[str]) -> dict[str, dict[str, Any]]:
    for name in names:
        r.start(name)
        r.ask(name, 0)
    assert r.replies() == {}  # a job's first quorum waits for its join window
    r.tick(JOIN + 0.01)
    return r.replies()


def trained(names: list[str]) -> Replicas:
    """Replicas ``names`` past their first quorum and one more step."""
    r = Replicas()
    first_quorum(r, names)
    formed(r, step=1, names=names)
    return r


def test_first_quorum_waits_for_the_join_window_then_orders_members_and_syncs_them_from_the_first() -> None:
    r = Replicas()
    r.start("b")
    r.ask("b", 0)
    r.tick(2.0)
    r.start("a")
    r.ask("a", 0)
    r.tick(2.0)
    assert r.replies() == {}
    r.start("c")
    r.ask("c", 0)
    r.tick(1.01)  # the window counts from the first ask
    replies = r.replies()
    assert sorted(replies) == ["a", "b", "c"]
    for i, name in enumerate(["a", "b", "c"]):
        reply = replies[name]
        assert reply["ok"] is True and reply["quorum_id"] == 1
        assert reply["members"] == [["a", 0, "host-a"], ["b", 0, "host-b"], ["c", 0, "host-c"]]
        assert reply["uids"] == [r.uids["a"], r.uids["b"], r.uids["c"]]  # each one's incarnation
        assert reply["index"] == i and reply["max_step"] == 0
        assert reply["heal"] == {1: 0, 2: 0}  # a starting job: everyone takes the first one's model
        assert reply["left"] == []


def test_next_quorum_forms_at_once_and_keeps_its_id_unless_membership_changes_or_a_replica_renews() -> None:
    r = Replicas()
    first_quorum(r, ["a", "b", "c"])
    for step in (1, 2):
        replies = formed(r, step=step, names=["c", "a", "b"])
        assert {reply["quorum_id"] for reply in replies.values()} == {1}
        assert all(reply["heal"] == {} for reply in replies.values())
    r.ask("a", 3)
    r.ask("b", 3, renew=True)  # its step failed: a fresh group, with the same members
    assert r.replies() == {}  # c has not asked and is there: wait for it
    r.ask("c", 3)
    replies = r.replies()
    assert {reply["quorum_id"] for reply in replies.values()} == {2}
    assert members(replies["a"]) == ["a", "b", "c"]


def test_a_replica_whose_connection_closes_leaves_at_once_and_the_waiting_ones_form_without_it() -> None:
    r = trained(["a", "b", "c"])
    r.ask("a", 2)
    r.ask("c", 2)
    assert r.replies() == {}
    r.close("b")  # kill -9: the kernel closes its sockets
    replies = r.replies()
    assert sorted(replies) == ["a", "c"]
    reply = replies["a"]
    assert reply["quorum_id"] == 2 and members(reply) == ["a", "c"] and reply["index"] == 0
    assert replies["c"]["index"] == 1
    [(name, host, why)] = reply["left"]
    assert name == "b" and host == "host-b" and "connection" in why and "closed" in why
    # the next step needs only the two
    assert {x["quorum_id"] for x in formed(r, step=3, names=["a", "c"]).values()} == {2}


def test_a_restarted_replica_joins_at_the_next_boundary_and_heals_from_a_live_one() -> None:
    r = trained(["a", "b", "c"])
    r.close("b")
    formed(r, step=2, names=["a", "c"])
    r.start("b")  # the same replica name, a new incarnation
    r.ask("b", 0)
    assert r.replies() == {}  # waits for the others' next step boundary
    r.ask("a", 3)
    r.ask("c", 3)
    replies = r.replies()
    assert sorted(replies) == ["a", "b", "c"]
    assert {x["quorum_id"] for x in replies.values()} == {3}
    assert replies["b"]["members"] == [["a", 3, "host-a"], ["b", 0, "host-b"], ["c", 3, "host-c"]]
    assert replies["b"]["max_step"] == 3 and replies["b"]["heal"] == {1: 0}


def test_the_same_name_restarted_before_anyone_noticed_still_changes_the_quorum_id() -> None:
    r = Replicas()
    first_quorum(r, ["a", "b"])
    r.start("b")  # a new process under the old name, on a new connection; the old one lingers
    replies = formed(r, step=1, names=["a", "b"])
    assert {x["quorum_id"] for x in replies.values()} == {2}  # another incarnation: a new group


def test_healing_replicas_are_spread_round_robin_over_the_up_to_date_ones() -> None:
    assert heal_plan([5, 0, 5, 3, 0, 5, 4]) == {1: 0, 3: 2, 4: 5, 6: 0}
    assert heal_plan([7, 7]) == {}
    assert heal_plan([0, 0, 0]) == {1: 0, 2: 0}
    assert heal_plan([0, 2]) == {0: 1}
    # -1: a torn state (a heal into the replica's own arrays failed midway), a source for no one
    assert heal_plan([0, -1, 0]) == {1: 0, 2: 0}  # all at 0: everyone takes the first one's state
    assert heal_plan([3, -1, 3]) == {1: 0}
    assert heal_plan([-1, 0]) == {0: 1}
    assert heal_plan([-1, -1]) == {}


def test_a_torn_replica_heals_even_from_a_replica_at_step_0_and_is_never_a_source() -> None:
    r = Replicas()
    first_quorum(r, ["a", "b"])
    r.close("a")  # a died while b healed from it: b's arrays hold part of a's state
    r.start("a")
    r.ask("a", 0)
    r.ask("b", 0, torn=True)
    r.tick(JOIN + 0.01)
    replies = r.replies()
    assert sorted(replies) == ["a", "b"]
    assert replies["b"]["members"] == [["a", 0, "host-a"], ["b", -1, "host-b"]]
    assert replies["b"]["heal"] == {1: 0} and replies["b"]["max_step"] == 0
    r.close("a")  # alone and torn: no one to heal from (the Manager raises QuorumError)
    r.ask("b", 0, torn=True)
    r.tick(JOIN + 0.01)
    assert r.replies() == {}  # min_replicas=2
    r.start("c")
    r.ask("c", 0, torn=True)
    replies = r.replies()
    assert replies["c"]["heal"] == {} and replies["c"]["max_step"] == -1


def test_a_silent_replica_is_not_waited_for_after_the_heartbeat_timeout() -> None:
    r = trained(["a", "b", "c"])
    r.cut.add("c")  # c's host is cut off: its connection stays open but nothing arrives
    r.ask("a", 2)
    r.ask("b", 2)
    r.tick(3.5)
    assert r.replies() == {}
    r.tick(0.6)  # c silent for 4.1 s > heartbeat timeout 4 s
    replies = r.replies()
    assert sorted(replies) == ["a", "b"] and members(replies["a"]) == ["a", "b"]
    [(name, _, why)] = replies["a"]["left"]
    assert name == "c" and "silent" in why and "10.0.0.3" in why


def test_a_replica_there_but_not_asking_is_left_out_after_the_join_window() -> None:
    r = trained(["a", "b", "c"])
    r.ask("a", 2)
    r.ask("b", 2)
    r.tick(JOIN - 0.1)  # c beats (its process lives) but never asks
    assert r.replies() == {}
    r.tick(0.11)
    replies = r.replies()
    assert members(replies["b"]) == ["a", "b"]
    assert "join window" in replies["b"]["left"][0][2]


def test_new_replicas_never_form_a_quorum_apart_from_a_live_one_of_the_previous_quorum() -> None:
    """min_replicas=1: replicas none of which was in the previous quorum (restarted, or late for a
    job's first quorum) wait past the join window for its live replicas, which are in the middle
    of a step they may commit: a quorum of their own would commit the same step numbers with
    other parameters (the chaos soak's inconsistent step 0)."""
    r = Replicas()
    for name in ("a", "b", "c"):
        r.start(name)
        r.ask(name, 0, min_replicas=1)
    r.tick(JOIN + 0.01)
    assert sorted(r.replies()) == ["a", "b", "c"]
    r.close("c")  # kill -9 mid-step: a and b fail the step and ask again without it
    r.ask("a", 0, min_replicas=1, renew=True)
    r.ask("b", 0, min_replicas=1, renew=True)
    assert members(r.replies()["a"]) == ["a", "b"]
    r.start("c")  # restarted at once: it asks while a and b run their step (a slow one)
    r.ask("c", 0, min_replicas=1)
    r.tick(3 * JOIN)  # a and b beat all along
    assert r.replies() == {}  # not a quorum of c alone, training from its initial state
    r.ask("a", 1, min_replicas=1)
    r.ask("b", 1, min_replicas=1)
    replies = r.replies()
    assert sorted(replies) == ["a", "b", "c"]
    assert replies["c"]["members"] == [["a", 1, "host-a"], ["b", 1, "host-b"], ["c", 0, "host-c"]]
    assert replies["c"]["heal"] == {2: 0} and replies["c"]["left"] == []

    # a job's first quorum formed without d (late): d waits for it the same way
    r.start("d")
    r.ask("d", 0, min_replicas=1)
    r.tick(JOIN + 0.01)
    assert r.replies() == {}
    for name in ("a", "b", "c"):
        r.ask(name, 2, min_replicas=1)
    assert r.replies()["d"]["heal"] == {3: 0}

    # ... and once they are gone (closed, or silent), nobody holds the job's steps: refused
    r.start("e")
    r.ask("e", 0, min_replicas=1)
    r.tick(JOIN + 0.01)
    assert r.replies() == {}
    for name in ("a", "b"):
        r.close(name)
    r.cut.update({"c", "d"})
    r.tick(4.5)  # the heartbeat timeout
    reply = r.replies()["e"]
    assert reply["ok"] is False and reply["err"] == "rendezvous", reply
    msg = reply["msg"]
    assert "replica 'e' (host host-e, step 0)" in msg and "committed steps 0..1" in msg, msg
    assert "a (host host-a): its connection" in msg and "c (host host-c): its connection" in msg, msg
    assert "silent" in msg and "closed" in msg and "d (host" not in msg.split("asking")[0], msg


def refused(replies: dict[str, dict[str, Any]], names: list[str]) -> str:
    """Every replica in ``names`` was refused because the job's state is lost; the message."""
    assert sorted(replies) == sorted(names), replies
    for name, reply in replies.items():
        assert reply["ok"] is False and reply["err"] == "rendezvous", reply
        assert f"replica {name!r} (host host-{name}" in reply["msg"], reply
        assert "state is lost" in reply["msg"] and "new job name" in reply["msg"], reply
    return replies[names[0]]["msg"]


def test_replicas_behind_every_step_the_job_committed_are_refused_once_its_holders_are_gone() -> None:
    """The chaos soak under load: a started alone (b and c were slow to start) and committed
    step 0; b and c joined at its step 1, and a was killed before they healed from it. Trained
    on, b, c and a restarted would commit step 0 again with other parameters: refused, naming
    what was lost, who held it and what to do."""
    r = Replicas()
    r.start("a")
    r.ask("a", 0, min_replicas=1)
    r.tick(JOIN + 0.01)
    assert members(r.replies()["a"]) == ["a"]
    for name in ("b", "c"):
        r.start(name)
        r.ask(name, 0, min_replicas=1)
    r.ask("a", 1, min_replicas=1)
    assert r.replies()["b"]["heal"] == {1: 0, 2: 0}
    r.close("a")  # kill -9 while the group forms, and restarted at once
    r.start("a")
    r.ask("a", 0, min_replicas=1)
    assert r.replies() == {}  # b and c are still forming the group with the old a
    for name in ("b", "c"):  # their heal failed before it began
        r.ask(name, 0, min_replicas=1, renew=True)
    msg = refused(r.replies(), ["a", "b", "c"])
    assert "committed steps 0..0" in msg and "quorum 2: a (host host-a): restarted" in msg, msg
    assert "a (host host-a) at step 0, b (host host-b) at step 0, c (host host-c) at step 0" in msg, msg
    # A refused replica that stays connected and asks again is refused again at once, as is a
    # new one behind (test_a_holder_that_comes_back_after_a_refusal_is_answered: a holder is not).
    r.ask("b", 0, min_replicas=1)
    r.start("d")
    r.ask("d", 0, min_replicas=1)
    again = refused(r.replies(), ["b", "d"])
    assert "committed steps 0..0" in again and "quorum 2: a (host host-a): restarted" in again, again


def test_a_holder_that_comes_back_after_a_refusal_is_answered() -> None:
    """c held the job's last step and went silent (SIGSTOP); a and b were killed. d, new, is
    refused: nobody left holds the steps. c comes back (SIGCONT) and asks at its step: a
    quorum forms with it, and d, asking again, joins the next one and heals from c."""
    r = trained(["a", "b", "c"])
    r.cut.add("c")
    r.close("a")
    r.close("b")
    r.start("d")
    r.ask("d", 0, min_replicas=1)
    r.tick(4.1)  # c silent past the heartbeat timeout
    refused(r.replies(), ["d"])
    r.cut.discard("c")
    r.ask("c", 1, min_replicas=1)
    r.tick(JOIN + 0.01)
    assert members(r.replies()["c"]) == ["c"]
    r.ask("d", 0, min_replicas=1)
    r.ask("c", 2, min_replicas=1)
    replies = r.replies()
    assert members(replies["d"]) == ["c", "d"] and replies["d"]["heal"] == {1: 0}, replies


def test_replicas_restored_from_a_checkpoint_take_the_job_back_to_its_step() -> None:
    """The whole job stopped after committing steps 0..1 and restarts from a checkpoint of step 0
    under the same job name (Manager.restore): a quorum forms at step 0, and d, a new replica
    that was not restored, heals from them. Asked without restore they are refused; with a
    replica holding step 2 still there, a restored one heals from it instead."""
    r = trained(["a", "b", "c"])
    for name in ("a", "b", "c"):
        r.close(name)
    for name in ("a", "b"):
        r.start(name)
        r.ask(name, 0, restore=True, min_replicas=3)
    r.start("d")
    r.ask("d", 0, min_replicas=3)
    replies = r.replies()
    assert sorted(replies) == ["a", "b", "d"], replies
    assert members(replies["a"]) == ["a", "b", "d"] and replies["a"]["max_step"] == 0, replies
    for name in ("a", "b", "d"):  # the job goes on from there
        r.ask(name, 1, min_replicas=3)
    assert replies["a"]["quorum_id"] == r.replies()["d"]["quorum_id"]

    r = trained(["a", "b", "c"])
    for name in ("a", "b", "c"):
        r.close(name)
    r.start("a")
    r.ask("a", 0, min_replicas=1)
    assert "state is lost" in r.replies()["a"]["msg"]

    r = trained(["a", "b", "c"])
    r.close("a")
    r.start("a")
    r.ask("a", 0, restore=True)
    r.ask("b", 1)
    r.ask("c", 1)
    replies = r.replies()
    assert replies["a"]["max_step"] == 1 and replies["a"]["heal"], replies


def test_a_restarted_replica_left_alone_when_the_others_leave_is_refused() -> None:
    """The soak's end: c, restarted, waits for a and b, which stop instead of asking. Alone at
    step 0 it would commit step 0 again; it is refused at once."""
    r = trained(["a", "b", "c"])
    r.close("c")
    formed(r, step=2, names=["a", "b"])
    r.start("c")
    r.ask("c", 0, min_replicas=1)
    r.tick(JOIN + 0.01)
    assert r.replies() == {}  # a and b are in their step
    r.close("a")
    assert r.replies() == {}  # b may still ask
    r.close("b")
    msg = refused(r.replies(), ["c"])
    assert "committed steps 0..1" in msg and "a (host host-a): its connection" in msg, msg
    assert "b (host host-b): its connection" in msg and "commit steps 0..1 again" in msg, msg
    # ... and at once when it asks only after everyone had left (the job's quorum state was
    # forgotten, and read back from the key space: its replicas are known gone, not coming back)
    r.close("c")
    r.start("c")
    r.ask("c", 0, min_replicas=1)
    msg = refused(r.replies(), ["c"])
    assert "a (host host-a): it left, with every other replica of the job" in msg, msg


def test_replicas_behind_wait_for_any_replica_that_may_hold_the_jobs_steps() -> None:
    """Not refused while a replica that may hold the job's state is there: one left out of the
    previous quorum but alive (it holds that quorum's step), or, after a coordinator restart,
    the previous quorum's replicas that have not come back yet."""
    r = trained(["a", "b", "c"])
    r.ask("a", 2, min_replicas=1)
    r.ask("b", 2, min_replicas=1)
    r.tick(JOIN + 0.01)  # c is slow: left out, alive at step 2
    assert members(r.replies()["a"]) == ["a", "b"]
    r.close("a")
    r.close("b")
    r.start("d")
    r.ask("d", 0, min_replicas=1)
    r.tick(3 * JOIN)  # c beats all along
    assert r.replies() == {}
    r.ask("c", 2, min_replicas=1)
    replies = r.replies()
    assert members(replies["d"]) == ["c", "d"] and replies["d"]["heal"] == {1: 0}

    r = Replicas(durable=True)
    first_quorum(r, ["a", "b"])
    formed(r, step=1, names=["a", "b"])
    again = Replicas(durable=True)
    again.state.restore(None, r.state.take_journal())
    again.start("c")
    again.ask("c", 0, min_replicas=1)
    again.tick(3 * JOIN)
    assert again.replies() == {}  # a and b may be reconnecting
    again.start("a")
    again.uids["a"], again.asks["a"] = r.uids["a"], r.asks["a"]
    again.ask("a", 2, min_replicas=1)
    again.tick(JOIN + 0.01)
    replies = again.replies()
    assert members(replies["c"]) == ["a", "c"] and replies["c"]["heal"] == {1: 0}


def test_a_replica_whose_heal_failed_does_not_form_a_quorum_apart_from_a_live_up_to_date_one() -> None:
    r = Replicas()
    for name in ("a", "b", "c"):
        r.start(name)
        r.ask(name, 0, min_replicas=1)
    r.tick(JOIN + 0.01)
    r.replies()
    r.close("b")
    r.ask("a", 0, min_replicas=1, renew=True)
    r.ask("c", 0, min_replicas=1, renew=True)
    r.replies()
    r.start("b")
    r.ask("b", 0, min_replicas=1)
    r.ask("a", 1, min_replicas=1)
    r.ask("c", 1, min_replicas=1)
    assert r.replies()["b"]["heal"] == {1: 0}  # b heals from a
    r.close("a")  # a dies while it sends: b's heal fails (before it overwrote anything)
    r.ask("b", 0, min_replicas=1, renew=True)  # b took part in that quorum, but at step 0
    r.tick(3 * JOIN)  # c is slow to notice and beats all along
    assert r.replies() == {}  # not b alone, from its initial state
    r.ask("c", 1, min_replicas=1, renew=True)
    replies = r.replies()
    assert members(replies["b"]) == ["b", "c"] and replies["b"]["heal"] == {0: 1}


def test_a_quorum_that_keeps_a_replica_of_the_previous_one_leaves_out_a_slow_one_after_the_window() -> None:
    r = Replicas()
    first_quorum(r, ["a", "b"])
    r.start("c")
    r.ask("c", 0)  # new, with a: a took part in the previous quorum's step, so that step is over
    r.ask("a", 1)
    r.tick(JOIN + 0.01)  # b beats but does not ask
    replies = r.replies()
    assert members(replies["a"]) == ["a", "c"] and replies["c"]["heal"] == {1: 0}
    assert replies["a"]["left"][0][0] == "b"


def test_an_ask_without_enough_replicas_times_out_naming_who_asked_and_who_was_waited_for() -> None:
    r = Replicas()
    first_quorum(r, ["a", "b"])
    r.close("b")
    r.ask("a", 1, timeout=3.0)
    r.tick(3.1)
    reply = r.replies()["a"]
    assert reply["ok"] is False and reply["err"] == ERR_TIMEOUT
    assert "'a'" in reply["msg"] and "1 of at least 2" in reply["msg"] and "min_replicas" in reply["msg"]
    # every replica it names comes with its host: the one that asked, the one it waited for
    assert "a (host host-a)" in reply["msg"] and "quorum 1: b (host host-b)" in reply["msg"]


def test_asks_that_disagree_or_are_malformed_are_refused_and_admin_connections_cannot_ask() -> None:
    r = Replicas()
    r.start("a")
    r.start("b")
    r.ask("a", 0)
    r.ask("b", 0, min_replicas=3)
    reply = r.replies()["b"]
    assert reply["err"] == ERR_INVALID and "min_replicas=3" in reply["msg"] and "'a'" in reply["msg"]
    for bad in ({"replica": ""}, {"step": -1}, {"uid": 5}, {"min_replicas": 0}, {"join_timeout": "x"}):
        r.ask("b", 0, **bad)
        reply = r.replies()["b"]
        assert reply["ok"] is False and reply["err"] == ERR_INVALID, (bad, reply)
    r.state.connect(99, "train", "admin", peer="10.0.0.99:1")
    r.driver.send(99, "quorum", replica="x", uid="x", step=0, ask=1, id=5)
    [(conn, header, _)] = r.state.outbox
    assert conn == 99 and header["err"] == ERR_INVALID and "may not use 'quorum'" in header["msg"]
    r.state.outbox.clear()
    r.driver.send(99, "quorom", id=6)
    assert r.state.outbox[0][1]["err"] == ERR_UNKNOWN_OP and "quorum" in r.state.outbox[0][1]["msg"]


def test_a_coordinator_restart_during_a_quorum_loses_nothing() -> None:
    r = Replicas(durable=True)
    first_quorum(r, ["a", "b", "c"])
    formed(r, step=1, names=["a", "b", "c"])
    # step 2: the quorum forms, but the coordinator dies before b's and c's replies leave it
    r.ask("a", 2)
    r.ask("b", 2)
    r.ask("c", 2)
    answered = r.replies()
    assert {x["quorum_id"] for x in answered.values()} == {1}
    records = r.state.take_journal()
    assert any(rec[0] == "set" and rec[2] == QUORUM_KEY for rec in records)

    again = Replicas(durable=True)
    again.state.restore(None, records)
    for name in ("a", "b", "c"):
        again.conns[name] = again.next_conn = again.next_conn + 1
        again.state.connect(again.next_conn, "train", "store", peer="10.0.0.9:1")
        again.uids[name], again.asks[name] = r.uids[name], r.asks[name]
    # b and c send their ask again: the same answer, at once
    again.ask("b", 2, again=True)
    again.ask("c", 2, again=True)
    replies = again.replies()
    assert replies == {name: {**answered[name], "id": replies[name]["id"]} for name in ("b", "c")}
    # a went on to step 3 and asks there; b and c too: the same members, so the same id
    again.ask("a", 3)
    again.ask("b", 3)
    assert again.replies() == {}  # c was in the previous quorum and is there: waited for
    again.ask("c", 3)
    replies = again.replies()
    assert {x["quorum_id"] for x in replies.values()} == {1}
    assert all(x["heal"] == {} and x["max_step"] == 3 for x in replies.values())
    # a change of membership after the restart takes the next id, not one already used
    again.close("c")
    replies = formed(again, step=4, names=["a", "b"])
    assert {x["quorum_id"] for x in replies.values()} == {2}


def test_after_a_restart_the_previous_members_not_yet_back_are_waited_for_until_the_join_window() -> None:
    r = Replicas(durable=True)
    first_quorum(r, ["a", "b"])
    again = Replicas(durable=True)
    again.state.restore(None, r.state.take_journal())
    again.start("a")
    again.uids["a"], again.asks["a"] = r.uids["a"], r.asks["a"]
    again.ask("a", 1, min_replicas=1)
    assert again.replies() == {}  # b may be reconnecting
    again.tick(JOIN + 0.01)
    reply = again.replies()["a"]
    assert members(reply) == ["a"] and reply["quorum_id"] == 2


# ---------------------------------------------------------------------------------------------
# replicas of several ranks: "a0", "a1" are ranks 0 and 1 of replica "a" (their own processes)


def shard_ask(r: Replicas, rank_name: str, step: int, /, **fields: Any) -> None:
    """Rank ``rank_name`` ("b1": rank 1 of replica "b", of 2) asks at ``step``."""
    r.ask(rank_name, step, replica=rank_name[:-1], replica_rank=int(rank_name[-1]), replica_size=2, **fields)


def sharded(names: list[str]) -> Replicas:
    """Replicas of two ranks each (``names``: their ranks) past their first quorum and one more step."""
    r = Replicas()
    for name in names:
        r.start(name)
        shard_ask(r, name, 0)
    r.tick(JOIN + 0.01)
    assert sorted(r.replies()) == sorted(names)
    for name in names:
        shard_ask(r, name, 1)
    assert sorted(r.replies()) == sorted(names)
    return r


def test_a_replica_of_several_ranks_counts_only_when_all_its_ranks_asked_and_all_get_one_reply() -> None:
    r = Replicas()
    for name in ("a0", "a1", "b0", "b1"):
        r.start(name)
    shard_ask(r, "a0", 0)
    shard_ask(r, "a1", 0)
    shard_ask(r, "b0", 0)
    r.tick(JOIN + 0.01)
    assert r.replies() == {}  # min_replicas=2: b is not complete without its rank 1
    shard_ask(r, "b1", 0)
    replies = r.replies()
    assert sorted(replies) == ["a0", "a1", "b0", "b1"]
    for name, reply in replies.items():
        assert reply["ok"] is True and members(reply) == ["a", "b"]
        assert reply["index"] == ("ab".index(name[0]))
        assert reply["hosts"] == [["host-a0", "host-a1"], ["host-b0", "host-b1"]]
        assert reply["heal"] == {1: 0}  # both shards of b start from a's
    # the next step: all four ask, the same quorum id; three of them are not enough
    for name in ("a0", "a1", "b0"):
        shard_ask(r, name, 1)
    assert r.replies() == {}
    shard_ask(r, "b1", 1)
    assert {x["quorum_id"] for x in r.replies().values()} == {1}


def test_a_replica_that_lost_one_rank_is_left_out_whole_and_its_other_rank_is_told_which() -> None:
    r = sharded(["a0", "a1", "b0", "b1"])
    shard_ask(r, "a0", 2, min_replicas=1)
    shard_ask(r, "b0", 2, min_replicas=1)
    assert r.replies() == {}
    r.close("b1")  # kill -9 of b's rank 1
    replies = r.replies()
    # b0 may not train on alone: its ask fails, naming the lost rank, its replica and host
    assert replies["b0"]["ok"] is False and replies["b0"]["err"] == "rendezvous"
    msg = replies["b0"]["msg"]
    assert "replica 'b'" in msg and "rank 1 of 2 (host host-b1)" in msg and "closed" in msg, msg
    assert "a0" not in replies  # a1 is there and has not asked: waited for
    shard_ask(r, "a1", 2, min_replicas=1)
    replies = r.replies()
    assert sorted(replies) == ["a0", "a1"] and members(replies["a1"]) == ["a"]
    [(name, host, why)] = replies["a1"]["left"]
    assert name == "b" and host == "host-b1" and "rank 1 of 2" in why and "closed" in why
    # b restarts whole (new processes): it joins at the next boundary, each shard healing from a's
    r.close("b0")
    r.start("b0")
    r.start("b1")
    shard_ask(r, "b0", 0, min_replicas=1)
    for name in ("a0", "a1"):
        shard_ask(r, name, 3, min_replicas=1)
    replies = r.replies()
    assert sorted(replies) == ["a0", "a1"]  # b0 alone is not a replica yet: it waits for b1
    shard_ask(r, "b1", 0, min_replicas=1)
    for name in ("a0", "a1"):
        shard_ask(r, name, 4, min_replicas=1)
    replies = r.replies()
    assert sorted(replies) == ["a0", "a1", "b0", "b1"]
    assert all(x["heal"] == {1: 0} and x["max_step"] == 4 for x in replies.values())


def test_a_silent_rank_leaves_its_replica_out_after_the_heartbeat_timeout() -> None:
    r = sharded(["a0", "a1", "b0", "b1"])
    r.cut.add("b0")
    for name in ("a0", "a1", "b1"):
        shard_ask(r, name, 2, min_replicas=1)
    r.tick(3.5)
    assert r.replies() == {}
    r.tick(0.6)
    replies = r.replies()
    assert sorted(replies) == ["a0", "a1", "b1"]
    assert replies["b1"]["ok"] is False and "rank 0 of 2 (host host-b0)" in replies["b1"]["msg"]
    assert members(replies["a0"]) == ["a"] and "silent" in replies["a0"]["left"][0][2]


def test_ranks_of_one_replica_that_disagree_on_its_size_or_rank_are_refused() -> None:
    r = Replicas()
    for name in ("a0", "a1"):
        r.start(name)
    shard_ask(r, "a0", 0)
    r.ask("a1", 0, replica="a", replica_rank=1, replica_size=3)
    reply = r.replies()["a1"]
    assert reply["ok"] is False and reply["err"] == ERR_INVALID
    assert "replica_size=3" in reply["msg"] and "replica_size=2" in reply["msg"] and "'a'" in reply["msg"]
    assert "host-a0" in reply["msg"] and "host-a1" in reply["msg"]
    r.start("b0")
    r.ask("b0", 0, replica="b", replica_rank=0, replica_size=3)  # replicas of other sizes: refused
    reply = r.replies()["b0"]
    assert reply["ok"] is False and "replica_size=3" in reply["msg"] and "replica_size=2" in reply["msg"]
    for bad in ({"replica_rank": 2}, {"replica_size": 0}, {"replica_rank": -1}):
        r.ask("a1", 0, **{"replica": "a", "replica_rank": 1, "replica_size": 2, **bad})
        reply = r.replies()["a1"]
        assert reply["ok"] is False and reply["err"] == ERR_INVALID, (bad, reply)


def test_a_coordinator_restart_replays_the_reply_to_each_rank_of_a_replica_of_several() -> None:
    r = Replicas(durable=True)
    for name in ("a0", "a1", "b0", "b1"):
        r.start(name)
        shard_ask(r, name, 0)
    r.tick(JOIN + 0.01)
    answered = r.replies()
    again = Replicas(durable=True)
    again.state.restore(None, r.state.take_journal())
    for name in ("a1", "b0"):
        again.start(name)
        again.uids[name], again.asks[name] = r.uids[name], r.asks[name]
        shard_ask(again, name, 0, again=True)
    replies = again.replies()
    assert replies == {name: {**answered[name], "id": replies[name]["id"]} for name in ("a1", "b0")}


def test_a_rank_that_asks_after_its_replica_was_left_out_is_told_too() -> None:
    r = sharded(["a0", "a1", "b0", "b1"])
    r.close("b1")
    for name in ("a0", "a1"):
        shard_ask(r, name, 2, min_replicas=1)
    assert members(r.replies()["a0"]) == ["a"]
    shard_ask(r, "b0", 2, min_replicas=1)  # it was slower: the quorum without b formed already
    reply = r.replies()["b0"]
    assert reply["ok"] is False and "rank 1 of 2 (host host-b1)" in reply["msg"] and "restart" in reply["msg"]


# ---------------------------------------------------------------------------------------------
# one rank of a replica replaced: its other ranks wait (replace_timeout) and the replica rejoins


def test_a_lost_rank_replaced_in_time_brings_its_replica_back_with_a_new_generation_healing_per_shard() -> (
    None
):
    r = sharded(["a0", "a1", "b0", "b1"])
    for name in ("a0", "a1", "b0", "b1"):
        shard_ask(r, name, 2, replace_timeout=30.0, generation=1)
    first = r.replies()
    assert {x["generation"] for x in first.values()} == {1}  # the same processes: the same generation
    # b1 is killed mid-step: b0 waits for a new process of its rank 1 instead of failing
    r.close("b1")
    for name in ("a0", "a1", "b0"):
        shard_ask(r, name, 3, min_replicas=1, replace_timeout=30.0, generation=1, renew=True)
    replies = r.replies()
    assert sorted(replies) == ["a0", "a1"] and members(replies["a0"]) == ["a"]
    assert "rank 1 of 2 (host host-b1)" in replies["a0"]["left"][0][2]
    for name in ("a0", "a1"):  # a trains on; b0 still waits, across quorums
        shard_ask(r, name, 4, min_replicas=1, replace_timeout=30.0, generation=1)
    assert sorted(r.replies()) == ["a0", "a1"]
    r.tick(10.0)
    assert r.replies() == {}
    # the new process of b's rank 1 asks (step 0, a new incarnation): b counts again at a's next ask
    r.start("b1")
    shard_ask(r, "b1", 0, min_replicas=1, replace_timeout=30.0)
    assert r.replies() == {}  # a is there and has not asked: waited for
    for name in ("a0", "a1"):
        shard_ask(r, name, 5, min_replicas=1, replace_timeout=30.0, generation=1)
    replies = r.replies()
    assert sorted(replies) == ["a0", "a1", "b0", "b1"]
    for reply in replies.values():
        assert members(reply) == ["a", "b"] and reply["max_step"] == 5
        assert reply["members"][1][1] == -1  # b's ranks hold steps 3 and 0: torn, never a source
        assert reply["heal"] == {1: 0}  # each of b's ranks heals its shard from a's
    assert replies["a0"]["generation"] == replies["a1"]["generation"] == 1
    assert replies["b0"]["generation"] == replies["b1"]["generation"] == 2  # b's own group anew
    # the next step: the same processes, the same quorum and generation
    for name in ("a0", "a1", "b0", "b1"):
        shard_ask(r, name, 6, min_replicas=1, replace_timeout=30.0, generation=2 if name[0] == "b" else 1)
    replies = r.replies()
    assert {x["quorum_id"] for x in replies.values()} == {first["a0"]["quorum_id"] + 2}
    assert {replies[n]["generation"] for n in ("b0", "b1")} == {2}
    assert all(x["heal"] == {} for x in replies.values())


def test_a_rank_not_replaced_within_replace_timeout_fails_naming_the_lost_rank_and_the_wait() -> None:
    r = sharded(["a0", "a1", "b0", "b1"])
    r.close("b1")
    shard_ask(r, "b0", 2, min_replicas=1, replace_timeout=8.0)
    r.tick(7.5)
    assert "b0" not in r.replies()
    r.tick(1.0)
    reply = r.replies()["b0"]
    assert reply["ok"] is False and reply["err"] == "rendezvous"
    msg = reply["msg"]
    assert "rank 1 of 2 (host host-b1) is gone" in msg and "replace_timeout (8s)" in msg, msg


def test_a_failure_inside_a_replica_gives_it_a_new_generation_and_the_others_keep_theirs() -> None:
    r = sharded(["a0", "a1", "b0", "b1"])
    for name in ("a0", "a1", "b0", "b1"):
        shard_ask(r, name, 2, generation=1)
    assert {x["generation"] for x in r.replies().values()} == {1}
    for name in ("a0", "a1", "b0"):
        shard_ask(r, name, 2, generation=1, renew=True)
    shard_ask(r, "b1", 2, generation=1, renew=True, inside=True)  # b's own group failed on b1
    replies = r.replies()
    assert {replies[n]["generation"] for n in ("a0", "a1")} == {1}
    assert {replies[n]["generation"] for n in ("b0", "b1")} == {2}
    assert replies["b0"]["members"][1][1] == 2  # the same step on both: a whole state


def test_a_coordinator_restart_in_the_middle_of_a_replacement_loses_nothing() -> None:
    r = Replicas(durable=True)
    names = ["a0", "a1", "b0", "b1"]
    for name in names:
        r.start(name)
        shard_ask(r, name, 0, min_replicas=1)
    r.tick(JOIN + 0.01)
    assert {x["generation"] for x in r.replies().values()} == {1}
    r.close("b1")
    for name in ("a0", "a1", "b0"):
        shard_ask(r, name, 1, min_replicas=1, replace_timeout=60.0, generation=1, renew=True)
    assert sorted(r.replies()) == ["a0", "a1"]  # a without b; b0 waits for b's rank 1
    again = Replicas(durable=True)
    again.state.restore(None, r.state.take_journal())
    for name in ("a0", "a1", "b0"):  # the live ranks reconnect; b0 sends its waiting ask again
        again.start(name)
        again.uids[name], again.asks[name] = r.uids[name], r.asks[name]
    shard_ask(again, "b0", 1, again=True, min_replicas=1, replace_timeout=60.0, generation=1, renew=True)
    again.start("b1")  # the new process of b's rank 1
    shard_ask(again, "b1", 0, min_replicas=1, replace_timeout=60.0)
    for name in ("a0", "a1"):
        shard_ask(again, name, 2, min_replicas=1, replace_timeout=60.0, generation=1)
    replies = again.replies()
    assert sorted(replies) == names
    assert all(members(x) == ["a", "b"] and x["heal"] == {1: 0} for x in replies.values())
    assert {replies[n]["generation"] for n in ("a0", "a1")} == {1}  # a kept its processes and group
    # b's generation moves past the one its ranks' group had, though b0 alone said which that was
    assert {replies[n]["generation"] for n in ("b0", "b1")} == {2}
    # and a restart of everything b was: its ranks of the last quorum are known (persisted), so a
    # whole new b gets a generation no process of it used before
    records = again.state.take_journal()
    third = Replicas(durable=True)
    third.state.restore(None, records)
    for name in names:
        third.start(name, uid=f"{name}-third")
        shard_ask(
            third, name, 0 if name[0] == "b" else 3, min_replicas=1, generation=1 if name[0] == "a" else 0
        )
    third.tick(JOIN + 0.01)
    replies = third.replies()
    assert {replies[n]["generation"] for n in ("b0", "b1")} == {3}
