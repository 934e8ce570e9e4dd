"""Each job's recent events (server/_events.py), as the coordinator's page and /jobs show them: the
state machine with a fake clock, no sockets."""

from __future__ import annotations

from typing import Any

import pytest
from aiocoll.server._events import EVENTS_PER_JOB, RANKS_PER_EVENT, JobEvents
from test_server_progress import SIG_AR, SIG_BC, _op, _report, _world
from test_server_state import Harness, join, refused

from aiocoll.protocol._coordinator import ERR_RENDEZVOUS

pytestmark = pytest.mark.timeout(30)


def _events(h: Harness, job: str = "j") -> list[dict[str, Any]]:
    (entry,) = h.state.status(job)
    events: list[dict[str, Any]] = entry["events"]
    return events


def test_joins_fold_into_one_event_and_a_completed_round_is_noted() -> None:
    h = Harness()
    _world(h, 3)
    events = _events(h)
    assert [e["kind"] for e in events] == ["join", "round_complete"]
    assert events[0]["ranks"] == [0, 1, 2] and events[0]["count"] == 3
    assert events[0]["text"] == "ranks 0, 1, 2 joined round 0 (3 of 3 ranks in)"
    assert events[1]["text"] == "round 0 complete: 3 ranks"
    assert all(e["round"] == 0 and e["time"] == h.state.wall_clock() for e in events)


def test_a_lost_member_is_noted_with_its_reason_and_a_clean_leave_as_left() -> None:
    h = Harness()
    mains, _ = _world(h, 3)
    h.state.disconnect(mains[2], "peer reset")
    h.send(mains[1], "leave", id=7)
    lost, left = _events(h)[-2:]
    assert lost["kind"] == "lost" and lost["ranks"] == [2]
    assert lost["text"] == "rank 2 lost from round 0: connection closed without leave (peer reset)"
    assert left["kind"] == "left" and left["text"] == "rank 1 left round 0"


def test_refused_joins_and_a_rendezvous_timeout_are_noted() -> None:
    h = Harness()
    a, b, c = h.connect(), h.connect(), h.connect()
    join(h, a, 0, 3)
    join(h, b, 0, 3)  # the same rank again: the round fails
    refused(h.out(b)[0], ERR_RENDEZVOUS)
    assert _events(h)[-1]["kind"] == "join_refused"
    assert "rank 0 already joined round 0" in _events(h)[-1]["text"]
    join(h, c, 1, 3, timeout=2)
    h.tick(3.0)
    timeout = _events(h)[-1]
    assert timeout["kind"] == "join_timeout" and timeout["ranks"] == [1]
    assert "1 of 3 ranks had joined; missing [0, 2]" in timeout["text"]


def test_connections_refused_for_their_token_fold_so_they_cannot_flush_the_history() -> None:
    h = Harness()
    _world(h, 2)
    for port in range(3 * EVENTS_PER_JOB):
        h.state.refused_connection(
            "j", "worker", f"10.0.0.9:{port}", "it failed authentication (a wrong token)"
        )
    events = _events(h)
    assert [e["kind"] for e in events] == ["join", "round_complete", "connection_refused"]
    assert events[-1]["count"] == 3 * EVENTS_PER_JOB
    assert f"last from 10.0.0.9:{3 * EVENTS_PER_JOB - 1}" in events[-1]["text"]
    # A job nobody joined gets no history from strangers naming it.
    h.state.refused_connection("nosuchjob", "worker", "10.0.0.9:1", "wrong token")
    assert h.state.status("nosuchjob") == []


def test_mismatches_are_noted_with_what_each_rank_called() -> None:
    h = Harness()
    _, beats = _world(h)
    _report(h, beats[0], [_op(5, SIG_AR, [1])], {"w": 6})
    _report(h, beats[1], [_op(5, SIG_AR, [2])], {"w": 6})
    _report(h, beats[2], [_op(5, SIG_BC, [0])], {"w": 6})
    last = _events(h)[-1]
    assert last["kind"] == "mismatch" and last["ranks"] == [0, 1, 2]
    assert "rank 2 called broadcast(root=0" in last["text"]


def test_the_ring_keeps_the_last_events_and_goes_with_the_job() -> None:
    h = Harness(job_ttl=5.0)
    for _ in range(EVENTS_PER_JOB + 10):
        mains, beats = _world(h, 1)  # a round of one, completed and left: three events each
        h.send(mains[0], "leave", id=9)
        h.state.disconnect_many([(mains[0], "closed"), (beats[0], "closed")])
    events = _events(h)
    assert len(events) == EVENTS_PER_JOB
    assert events[-1]["kind"] == "left" and events[-1]["round"] == EVENTS_PER_JOB + 9
    for _ in range(7):  # no connection, no activity: the job expires, and its events with it
        h.tick(1.0)
    assert h.state.status("j") == []
    _world(h, 1)  # a new job of the same name starts a history of its own
    assert [(e["kind"], e["round"]) for e in _events(h)] == [("join", 0), ("round_complete", 0)]


def test_an_event_lists_a_bounded_number_of_ranks_and_counts_them_all() -> None:
    ring = JobEvents(lambda: 1000.0)
    ring.record("j", "lost", rnd=3, ranks=range(100), count=100, detail="silent for 10s")
    (event,) = ring.of("j")
    assert event["ranks"] == list(range(RANKS_PER_EVENT)) and event["count"] == 100
    assert event["text"].startswith("100 ranks (0, 1, 2,") and event["text"].endswith("silent for 10s")


def test_ranks_that_timed_out_together_are_counted_as_joined_not_missing() -> None:
    """Two ranks of three joined and time out in the same instant: neither's error calls the other
    missing, although the first to expire is gone when the second is answered."""
    h = Harness()
    a, b = h.connect(), h.connect()
    join(h, a, 0, 3, timeout=2)
    join(h, b, 1, 3, timeout=2)
    h.tick(3.0)
    first, second = refused(h.out(a)[0], ERR_RENDEZVOUS), refused(h.out(b)[0], ERR_RENDEZVOUS)
    assert "2 of 3 ranks had joined; missing ranks [2]" in first["msg"], first
    said = "2 of 3 ranks had joined (rank(s) [0] of them timed out already); missing ranks [2]"
    assert said in second["msg"], second
    assert [e["text"] for e in _events(h) if e["kind"] == "join_timeout"][-1].endswith("missing [2]")
