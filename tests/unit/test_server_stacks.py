"""The coordinator's stacks part on the pure state machine with a fake clock: a ``stacks``
request pushes a stack request to each member's beat connection and is answered once every
rank answered, or after 1 s naming the silent ones; the status view shows the stack of a rank
holding the job back; a "behind" verdict is told again with where the ranks behind are."""

from __future__ import annotations

from typing import Any

from test_server_progress import SIG_AR, _events, _op, _report, _world
from test_server_state import Harness, ok, refused

from aiocoll.protocol._coordinator import ERR_INVALID, EV_BEHIND, EV_STACK


def _frames(line: int, function: str = "step") -> list[dict[str, Any]]:
    return [
        {"file": "/job/train.py", "line": line, "function": function},
        {"file": "/lib/x.py", "line": 1, "function": "f"},
    ]


def _asked(h: Harness, beat: int) -> list[int]:
    return [frame["q"] for frame, _ in h.out(beat) if frame.get("ev") == EV_STACK]


def test_a_stacks_request_is_answered_when_every_rank_answered_or_after_one_second() -> None:
    h = Harness()
    _, beats = _world(h)
    admin = h.connect(role="admin")
    h.send(admin, "stacks", job="j", id=7)
    queries = [_asked(h, beat) for beat in beats]
    assert all(len(q) == 1 for q in queries) and len({q[0] for q in queries}) == 1
    (qid,) = queries[0]
    for rank, beat in enumerate(beats):
        assert h.out(admin) == []  # not until every rank answered
        ok(h.call(beat, "stack", q=qid, frames=_frames(10 + rank)))
    ((reply, _),) = h.out(admin)
    assert reply["id"] == 7 and reply["ok"] and reply["missing"] == []
    assert reply["stacks"] == {str(r): _frames(10 + r) for r in range(3)}

    # Rank 1 is silent: after 1 s the others' stacks come back, rank 1 named as missing.
    h.send(admin, "stacks", job="j", ranks=[0, 1], id=8)
    (qid,) = _asked(h, beats[0])
    assert _asked(h, beats[1]) == [qid] and _asked(h, beats[2]) == []  # not asked
    ok(h.call(beats[0], "stack", q=qid, frames=_frames(20)))
    h.tick(0.5)
    assert h.out(admin) == []
    h.tick(0.6)
    ((reply, _),) = h.out(admin)
    assert reply["id"] == 8 and reply["missing"] == [1] and list(reply["stacks"]) == ["0"]
    ok(h.call(beats[1], "stack", q=qid, frames=_frames(30)))  # late: taken, nobody waits for it
    assert h.out(admin) == []


def test_only_a_member_s_beat_connection_answers_and_only_known_jobs_are_asked() -> None:
    h = Harness()
    mains, beats = _world(h)
    refused(h.call(mains[0], "stack", q=1, frames=[]), ERR_INVALID)
    refused(h.call(beats[0], "stacks", job="j"), ERR_INVALID)  # a beat connection may not ask
    refused(h.call(h.connect(role="admin"), "stacks", job="nope"), ERR_INVALID)
    refused(h.call(beats[0], "stack", q=1, frames="not a list"), ERR_INVALID)


def test_the_rank_holding_a_job_back_shows_its_stack_and_the_verdict_says_where_it_is() -> None:
    h = Harness()
    mains, beats = _world(h)
    _report(h, beats[0], [_op(3, SIG_AR, [1])], {"w": 4})
    _report(h, beats[1], [_op(3, SIG_AR, [2])], {"w": 4})
    _report(h, beats[2], [], {"w": 3})  # behind: the verdict goes out, and rank 2 is asked
    (verdict,) = _events(h, mains[0])
    assert verdict["ev"] == EV_BEHIND and "where they are" not in verdict["msg"]
    for main in mains[1:]:
        assert _events(h, main) == [verdict]
    h.tick(0.01)  # the next turn asks rank 2 where it is
    (qid,) = _asked(h, beats[2])
    assert _asked(h, beats[0]) == [] and _asked(h, beats[1]) == []
    ok(h.call(beats[2], "stack", q=qid, frames=_frames(41, "augment")))
    for main in mains:
        (again,) = _events(h, main)
        assert again["ev"] == EV_BEHIND and again["ranks"] == [2] and again["seq"] == 3
        assert again["msg"] == verdict["msg"] + "; where they are now: rank 2 at /job/train.py:41 in augment"
    members = {m["rank"]: m for m in h.state.status("j")[0]["members"]}
    assert members[2]["stack"] == _frames(41, "augment") and members[2]["stack_age"] == 0
    assert "stack" not in members[0] and "stack" not in members[1]
    # Stale after FRESH seconds: the view asks rank 2 again (and still shows what it has).
    h.tick(3.5)
    members = {m["rank"]: m for m in h.state.status("j")[0]["members"]}
    assert members[2]["stack"] == _frames(41, "augment") and members[2]["stack_age"] >= 3.5
    assert len(_asked(h, beats[2])) == 1
