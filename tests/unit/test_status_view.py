"""What `aiocoll status` sees, without sockets: the coordinator's state machine answers an admin's
status request without changing anything (no job is made by looking, an unknown job is "no such
job"), a job whose members left says nothing holds it back any more, and the table names hosts by
their hostname while --json keeps the whole identity."""

from __future__ import annotations

from typing import Any

import pytest
from test_server_state import Harness, join, ok, refused

from aiocoll._host import host_identity, host_label
from aiocoll.cli.status import format_table
from aiocoll.protocol._coordinator import ERR_INVALID, EV_BEHIND

pytestmark = pytest.mark.timeout(20)

SIG = {"kind": "all_reduce", "dtype": "float32", "count": 4, "op": "sum"}


def test_looking_makes_no_job_and_an_unknown_job_is_named_as_missing() -> None:
    h = Harness()
    admin = h.connect(job="default", role="admin")  # what a plain `aiocoll status` connects as
    assert h.state.jobs == {}
    assert ok(h.call(admin, "status", job=None))[0]["jobs"] == []
    header = refused(h.call(admin, "status", job="nosuchjob"), ERR_INVALID)
    assert "no such job 'nosuchjob' (this coordinator holds no job)" in header["msg"]
    h.state.disconnect(admin, "closed by the client")
    assert h.state.jobs == {}

    worker = h.connect(job="train")
    join(h, worker, 0, 1)
    h.out(worker)  # its join's answer
    looker = h.connect(job="nosuchjob", role="admin")
    header = refused(h.call(looker, "status", job="nosuchjob"), ERR_INVALID)
    assert "no such job 'nosuchjob' (this coordinator holds 'train')" in header["msg"]
    assert [j["job"] for j in ok(h.call(looker, "status", job="train"))[0]["jobs"]] == ["train"]
    assert sorted(h.state.jobs) == ["train"]
    # An admin naming a job that exists sees its keys, as before.
    ok(h.call(worker, "set", b"v", key="k"))
    inside = h.connect(job="train", role="admin")
    assert ok(h.call(inside, "get", key="k"))[1] == b"v"


def _world(h: Harness, n: int = 3) -> tuple[list[int], list[int]]:
    mains = [h.connect() for _ in range(n)]
    for rank, conn in enumerate(mains):
        join(h, conn, rank, n)
    sessions = [h.out(conn)[0][0]["session"] for conn in mains]
    return mains, [h.connect(role="beat", session=s) for s in sessions]


def _report(h: Harness, beat: int, ops: list[dict[str, Any]], seqs: dict[str, int]) -> None:
    ok(h.call(beat, "progress", ops=ops, seqs=seqs, done=[], busy=None))


def _waiting(seq: int, waits: list[int]) -> dict[str, Any]:
    return {"g": "w", "n": [0, 1, 2], "s": seq, "sig": SIG, "st": "waiting", "w": waits, "age": 2.0}


def _held(h: Harness) -> tuple[list[int], str]:
    job = h.state.status("j")[0]
    return job["held_back_by"], job["summary"]


def _rank_2_behind(h: Harness, beats: list[int], mains: list[int]) -> None:
    _report(h, beats[0], [_waiting(3, [1])], {"w": 4})
    _report(h, beats[1], [_waiting(3, [2])], {"w": 4})
    _report(h, beats[2], [], {"w": 3})  # its next call on w will be seq 3: it is behind
    assert [e["ev"] for e, _ in h.out(mains[0]) if "ev" in e] == [EV_BEHIND]
    assert _held(h)[0] == [2]


def test_a_job_whose_members_all_left_is_held_back_by_nobody() -> None:
    h = Harness()
    mains, beats = _world(h)
    _rank_2_behind(h, beats, mains)
    for main in mains:  # a clean exit: every member says goodbye, with its last report unsent
        h.send(main, "leave")
        assert [reply["ok"] for reply, _ in h.out(main) if "ev" not in reply] == [True]
    assert _held(h) == ([], "")
    assert {m["state"] for m in h.state.status("j")[0]["members"]} == {"left"}
    # ... and the table does not call the ranks that left running
    table = format_table(h.state.status("j"))
    assert "no rank is alive (every member left or was lost)" in table, table
    assert "every rank is running" not in table, table


def test_a_behind_verdict_ends_when_the_ranks_waiting_for_it_are_done() -> None:
    h = Harness()
    mains, beats = _world(h)
    _rank_2_behind(h, beats, mains)
    _report(h, beats[0], [], {"w": 4})  # the waits completed: the ranks withdraw their reports
    assert _held(h)[0] == [2]  # rank 1 still waits at seq 3
    _report(h, beats[1], [], {"w": 4})
    assert _held(h) == ([], "")


def test_the_table_names_each_host_by_its_hostname_and_json_keeps_the_identity() -> None:
    identity = "vm/6edeaf24-5f1c-4c57-9a7e-3b5a9d3f0c21/4026531833"
    assert host_label(identity) == "vm"
    assert host_label(host_identity()).count("/") == 0
    for other in ("node-a", "rack1/node3", ""):  # AIOCOLL_HOST_ID, or a name written by hand
        assert host_label(other) == other
    jobs = [
        {
            "job": "j",
            "world_size": 2,
            "round": 0,
            "complete": True,
            "keys": 0,
            "members": [
                {"rank": 0, "host": identity, "alive": True, "last_seen": 0.1},
                {"rank": 1, "host": "rack1/node3", "alive": True, "last_seen": 0.1},
            ],
        }
    ]
    table = format_table(jobs)
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.startswith("  ")}
    assert rows["0"][1] == "vm" and rows["1"][1] == "rack1/node3"
    assert "6edeaf24" not in table
