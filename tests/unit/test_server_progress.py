"""The coordinator's beats, progress reports and cross-check (issue 10), on the pure state machine
with a fake clock: no sockets, no processes."""

from __future__ import annotations

from typing import Any

from test_server_state import Harness, join, ok, refused

from aiocoll.protocol._coordinator import ERR_INVALID, EV_BEHIND, EV_MEMBER_LOST, EV_MISMATCH

SIG_AR = {"kind": "all_reduce", "dtype": "float32", "count": 4, "op": "sum"}
SIG_BC = {"kind": "broadcast", "root": 0, "dtype": "float32", "count": 4}


def _world(h: Harness, n: int = 3) -> tuple[list[int], list[int]]:
    """n joined members; returns their main and beat connection ids."""
    mains = [h.connect() for _ in range(n)]
    for rank, conn in enumerate(mains):
        join(h, conn, rank, n)
    sessions = [h.out(conn)[0][0]["session"] for conn in mains]
    beats = [h.connect(role="beat", session=s) for s in sessions]
    return mains, beats


def _op(seq: int, sig: dict[str, Any], waits: list[int], age: float = 2.0) -> dict[str, Any]:
    return {"g": "w", "n": [0, 1, 2], "s": seq, "sig": sig, "st": "waiting", "w": waits, "age": age}


def _report(h: Harness, beat: int, ops: list[dict[str, Any]], seqs: dict[str, int], **extra: Any) -> None:
    ok(h.call(beat, "progress", ops=ops, seqs=seqs, done=extra.pop("done", []), busy=extra.pop("busy", None)))


def _events(h: Harness, conn: int) -> list[dict[str, Any]]:
    return [frame for frame, _ in h.out(conn) if "ev" in frame]


def test_beats_keep_a_member_alive_while_its_main_connection_is_silent() -> None:
    h = Harness(heartbeat_timeout=3.0)
    mains, beats = _world(h)
    for _ in range(8):  # 8 s: the main connections say nothing, the beat connections beat
        h.tick(1.0)
        for beat in beats[:2]:
            ok(h.call(beat, "hb"))
    members = {m["rank"]: m for m in h.state.status("j")[0]["members"]}
    assert members[0]["alive"] and members[1]["alive"]
    assert not members[2]["alive"] and "silent" in members[2]["reason"]  # no beats: lost as before
    assert any(e["ev"] == EV_MEMBER_LOST and e["rank"] == 2 for e in _events(h, mains[0]))


def test_closing_a_beat_connection_declares_nothing_and_a_stranger_cannot_beat() -> None:
    h = Harness()
    mains, beats = _world(h)
    h.state.disconnect(beats[1], "gone")
    assert all(m["alive"] for m in h.state.status("j")[0]["members"])
    assert _events(h, mains[0]) == []
    stranger = h.connect(role="beat", session="not-a-session")
    assert any(c == stranger for c, _ in h.state.closes)
    refused(h.call(beats[0], "set", b"x", key="k"), ERR_INVALID)  # a beat connection only beats


def test_disagreeing_signatures_at_one_seq_become_a_mismatch_event_for_every_member() -> None:
    h = Harness()
    mains, beats = _world(h)
    _report(h, beats[0], [_op(5, SIG_AR, [1])], {"w": 6})
    assert all(_events(h, m) == [] for m in mains)  # the others have not reported yet
    # The stalled ranks' next beat is answered with "want": the coordinator asks for their view.
    assert h.call(beats[2], "hb")[0].get("want") is True
    _report(h, beats[1], [_op(5, SIG_AR, [2])], {"w": 6})
    _report(h, beats[2], [_op(5, SIG_BC, [0])], {"w": 6})
    for main in mains:
        (event,) = _events(h, main)
        assert event["ev"] == EV_MISMATCH and event["group"] == "w" and event["seq"] == 5
        assert "ranks 0, 1 called all_reduce(dtype=float32, count=4, op=sum)" in event["msg"]
        assert "rank 2 called broadcast(root=0, dtype=float32, count=4)" in event["msg"]
    _report(h, beats[0], [_op(5, SIG_AR, [1], age=3.0)], {"w": 6})
    assert all(_events(h, m) == [] for m in mains)  # announced once


def test_a_rank_that_completed_its_part_is_compared_by_what_it_recently_did() -> None:
    h = Harness()
    mains, beats = _world(h)
    _report(h, beats[2], [_op(0, {"kind": "reduce", "root": 2}, [0, 1])], {"w": 1})
    _report(h, beats[0], [], {"w": 1}, done=[["w", 0, {"kind": "reduce", "root": 0}]])
    _report(h, beats[1], [], {"w": 1}, done=[["w", 0, {"kind": "reduce", "root": 0}]])
    (event,) = _events(h, mains[1])
    assert event["ev"] == EV_MISMATCH and "root=2" in event["msg"] and "root=0" in event["msg"]


def test_a_rank_that_has_not_reached_the_seq_is_named_behind_in_events_and_status() -> None:
    h = Harness()
    mains, beats = _world(h)
    _report(h, beats[0], [_op(3, SIG_AR, [1])], {"w": 4})
    _report(h, beats[1], [_op(3, SIG_AR, [2])], {"w": 4})
    _report(h, beats[2], [], {"w": 3})  # its next call on w will be seq 3: it is behind
    (event,) = _events(h, mains[0])
    assert event["ev"] == EV_BEHIND and event["ranks"] == [2]
    assert event["msg"] == (
        "rank(s) [2] have not called seq 3 of group 'world' (all_reduce(dtype=float32, count=4, op=sum)), "
        "which rank(s) [0, 1] wait in: they are busy elsewhere or stuck before it"
    ), event["msg"]
    job = h.state.status("j")[0]
    assert job["held_back_by"] == [2] and "held back by rank 2" in job["summary"]
    members = {m["rank"]: m for m in job["members"]}
    (entry,) = members[0]["progress"]
    assert entry["group"] == "w" and entry["seq"] == 3 and entry["state"] == "waiting"
    assert entry["op"] == "all_reduce(dtype=float32, count=4, op=sum)" and entry["waiting_for"] == [1]
    assert members[2]["progress"] == [] and job["progress_reports"] == 3


def test_a_busy_event_loop_shows_as_slow_and_holds_the_job_back() -> None:
    h = Harness()
    _, beats = _world(h)
    _report(h, beats[1], [], {"w": 2}, busy=4.5)
    job = h.state.status("j")[0]
    (entry,) = {m["rank"]: m for m in job["members"]}[1]["progress"]
    assert entry["state"] == "slow" and entry["age"] >= 4.5
    assert job["held_back_by"] == [1] and "event loop is busy" in job["summary"]


def test_a_malformed_report_is_refused_and_nothing_is_kept() -> None:
    h = Harness()
    _, beats = _world(h)
    bad = _op(1, SIG_AR, [1])
    bad["age"] = -1
    refused(h.call(beats[0], "progress", ops=[bad], seqs={}), ERR_INVALID)
    refused(h.call(beats[0], "progress", ops=[_op(1, SIG_AR, [1])] * 65, seqs={}), ERR_INVALID)
    store = h.connect(role="store")
    refused(h.call(store, "progress", ops=[], seqs={}), ERR_INVALID)
    assert h.state.status("j")[0]["progress_reports"] == 0


def test_a_wrong_token_join_is_reported_to_the_members_waiting_in_a_forming_round_only() -> None:
    h = Harness()
    waiting = h.connect()
    join(h, waiting, 0, 2)
    h.state.refused_connection("j", "worker", "10.0.0.9:4242", "it failed authentication (a wrong token)")
    (event,) = _events(h, waiting)
    assert event["ev"] == "refused" and event["peer"] == "10.0.0.9:4242" and "wrong token" in event["reason"]
    h.state.refused_connection("j", "admin", "10.0.0.9:4242", "wrong token")  # not a would-be member
    h.state.refused_connection("other-job", "worker", "10.0.0.9:4242", "wrong token")
    assert _events(h, waiting) == []
    late = h.connect()
    join(h, late, 1, 2)  # the round completes: nobody waits any more
    h.out()
    h.state.refused_connection("j", "worker", "10.0.0.9:4242", "wrong token")
    assert h.out() == []
    assert all(m["alive"] for m in h.state.status("j")[0]["members"])  # a notice, never a failure
