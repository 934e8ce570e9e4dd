"""aiocoll.sync calls started on the caller's own thread (driven) and handed to the loop thread:
the same results and the same errors either way, in a real world of two processes.

One world runs every check: many calls (most driven, checked against numpy), large ones, threads
driving their own groups beside the main thread's, and a timeout, a mismatch and a lost peer each
met once on a driven call and once on a call handed over (the loop thread held busy, so the
caller cannot take its turn).
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiocoll.testing.world import free_ports, run_script_ranks

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        os.environ.get("AIOCOLL_LOOP", "").lower() == "uvloop",
        reason="AIOCOLL_LOOP=uvloop: the loop thread runs uvloop and no call is driven",
    ),
]


def _busy_loop() -> threading.Event:
    """Hold the loop thread in a callback (its turn taken) until the returned gate opens."""
    from aiocoll._sync_loop import get_loop_thread

    gate, entered = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait(30)

    get_loop_thread().loop.call_soon_threadsafe(hold)
    assert entered.wait(30)
    return gate


def _asleep() -> None:
    """Until the loop thread sleeps (its turn free), so that the next call is likely driven."""
    from aiocoll._sync_loop import get_loop_thread

    poller = get_loop_thread()._poller
    deadline = time.monotonic() + 5
    while poller is not None and poller.until == 0.0 and time.monotonic() < deadline:
        time.sleep(0.001)


def _failure(call: Any, busy: bool) -> dict[str, Any]:
    """Run ``call``, driven or (``busy``) handed over; the error it raised and the path it took."""
    from aiocoll._sync_loop import get_loop_thread

    loop_thread = get_loop_thread()
    gate = None
    if busy:
        gate = _busy_loop()
        threading.Timer(0.2, gate.set).start()
    else:
        _asleep()
    driven, handed = loop_thread.driven, loop_thread.handed
    try:
        call()
        error: tuple[str, str] | None = None
    except Exception as exc:
        error = (type(exc).__name__, str(exc))
    path = "driven" if loop_thread.driven > driven else "handed" if loop_thread.handed > handed else "?"
    return {"error": error, "path": path}


def worker(rank: int, port: int, result: Path) -> None:
    import aiocoll.sync as dist
    from aiocoll._sync_loop import get_loop_thread

    out: dict[str, Any] = {}
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    loop_thread = get_loop_thread()

    # Many small calls: right values, and most of them started on this thread.
    driven = loop_thread.driven
    wrong = []
    for i in range(300):
        a = np.full(3, float(rank + i))
        dist.all_reduce(a)
        if not np.array_equal(a, np.full(3, float(2 * i + 1))):
            wrong.append((i, a.tolist()))
    b = np.arange(5.0) * (rank + 1)
    dist.broadcast(b, src=1)
    out["wrong"], out["broadcast"] = wrong, b.tolist()
    out["driven_of_300"] = loop_thread.driven - driven

    # Large calls (16 MiB: many shared-memory steps each, run on this thread to their end while
    # the peer keeps pace): right values.
    big_wrong = []
    for i in range(3):
        c = np.full(4 << 20, float(rank + i), dtype=np.float32)
        dist.all_reduce(c)
        if not np.array_equal(c, np.full(4 << 20, float(2 * i + 1), dtype=np.float32)):
            big_wrong.append((i, c[:4].tolist()))
    out["big_wrong"] = big_wrong

    # Threads each driving their own group beside the main thread on the world group.
    groups = [dist.new_group([0, 1]) for _ in range(2)]
    thread_wrong: list[Any] = []

    def on_group(k: int) -> None:
        for i in range(200):
            x = np.array([float(rank * 10 + k + i)])
            dist.all_reduce(x, group=groups[k])
            if x[0] != float(10 + 2 * k + 2 * i):
                thread_wrong.append((k, i, x.tolist()))

    threads = [threading.Thread(target=on_group, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for i in range(200):
        y = np.array([float(rank + 1)])
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        if y[0] != 2.0:
            thread_wrong.append(("main", i, y.tolist()))
    for t in threads:
        t.join(60)
    out["thread_wrong"] = thread_wrong

    # A timeout, on a driven call and on one handed over: rank 1 never calls.
    for busy in (False, True):
        g = dist.new_group([0, 1])
        if rank == 0:
            # (the facade's groups take the world's timeout: torch's set_timeout, for this call)
            g.core._set_default_timeout(1.0)
            out[f"timeout/{busy}"] = _failure(lambda g=g: dist.all_reduce(np.ones(2), group=g), busy)
            g.core._set_default_timeout(60.0)
        dist.barrier()
    # A mismatch, both ranks on each path.
    for busy in (False, True):
        g = dist.new_group([0, 1])
        t = np.ones(2)
        if rank == 0:
            call = lambda g=g, t=t: dist.all_reduce(t, group=g)  # noqa: E731
        else:
            call = lambda g=g, t=t: dist.broadcast(t, src=0, group=g)  # noqa: E731
        out[f"mismatch/{busy}"] = _failure(call, busy)
        dist.barrier()
    # A lost peer: rank 1 leaves without a word; rank 0's next calls fail, on each path.
    result.write_bytes(pickle.dumps(out))
    if rank == 1:
        sys.stdout.flush()
        os._exit(0)
    for busy in (False, True):
        out[f"lost/{busy}"] = _failure(lambda: dist.all_reduce(np.ones(2)), busy)
    result.write_bytes(pickle.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # the world group's peer is gone: nothing left to leave in order


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("sync_driven")
    port = str(free_ports(1)[0])
    args = [["worker", str(r), port, str(tmp / f"rank{r}.pkl")] for r in range(2)]
    run_script_ranks(__file__, args, tmp, timeout=180, token="driven-test")
    return [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(2)]


def test_driven_calls_give_the_right_values_from_every_thread(world: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(world):
        assert out["wrong"] == [] and out["thread_wrong"] == [], (rank, out)
        assert out["big_wrong"] == [], (rank, out["big_wrong"])
        assert out["broadcast"] == [0.0, 2.0, 4.0, 6.0, 8.0]
        assert out["driven_of_300"] > 0, "no call was started on the caller's thread"


def test_a_timeout_a_mismatch_and_a_lost_peer_raise_the_same_way_on_both_paths(
    world: list[dict[str, Any]],
) -> None:
    paths = []
    for kind, ranks, error_type, words in (
        ("timeout", [0], "CollectiveTimeout", ["all_reduce", "1"]),
        ("mismatch", [0, 1], "MismatchError", ["all_reduce", "broadcast"]),
        ("lost", [0], "PeerLostError", ["1"]),
    ):
        for rank in ranks:
            got = {busy: world[rank][f"{kind}/{busy}"] for busy in (False, True)}
            assert got[True]["path"] == "handed", (kind, rank, got)
            paths.append(got[False]["path"])
            for busy, res in got.items():
                assert res["error"] is not None, (kind, rank, busy, res)
                name, message = res["error"]
                assert name == error_type, (kind, rank, busy, res)
                assert all(w in message for w in words), (kind, rank, busy, res)
    assert "driven" in paths, paths  # the loop slept before most of them: they were driven


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
