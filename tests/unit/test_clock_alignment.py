"""Ranks on different hosts compare on the coordinator's clock: the heartbeat reply carries the
coordinator's wall clock, the beat thread turns each heartbeat into a sample of its host's clock
offset (the shortest round trip wins), and `aiocoll timeline` moves each rank's times by its
offset before it compares arrivals, for timeline files and flight-recorder dumps alike (and
`aiocoll analyze` says when each rank entered on that clock too)."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from aiocoll.client._clock import ClockEstimate
from aiocoll.client.control._beat import BeatThread
from test_server_progress import _world
from test_server_state import Harness, ok

from aiocoll.cli.analyze import analyze
from aiocoll.cli.timeline import merge
from aiocoll.protocol import FrameDecoder
from aiocoll.protocol._framing import encode_frame

pytestmark = pytest.mark.timeout(30)


def test_the_sample_with_the_shortest_round_trip_is_the_estimate() -> None:
    clock = ClockEstimate(window=4)
    assert clock.current is None
    clock.sample(100.0, 105.3, 100.4)  # 0.4 s round trip: offset 5.1 +- 0.2
    assert clock.current == pytest.approx((5.1, 0.2))
    clock.sample(101.0, 106.001, 101.002)  # 2 ms: 5.0 +- 0.001, better
    assert clock.current == pytest.approx((5.0, 0.001))
    clock.sample(102.0, 107.5, 102.9)  # worse: the estimate stays
    assert clock.current == pytest.approx((5.0, 0.001))
    clock.sample(103.0, 102.0, 102.5)  # this host's clock stepped back: no sample
    for second in range(4):  # the good sample leaves the window of 4
        clock.sample(110.0 + second, 115.0 + second + 0.01, 110.0 + second + 0.01)
    assert clock.current == pytest.approx((5.005, 0.005))


def test_a_beat_connection_hears_the_coordinators_wall_clock_and_a_store_connection_does_not() -> None:
    h = Harness()
    mains, beats = _world(h)
    h.tick(3.5)
    reply = ok(h.call(beats[0], "hb"))[0]
    assert reply["t"] == h.state.wall_clock()
    assert "t" not in ok(h.call(mains[0], "hb"))[0]


def _wire(header: dict[str, Any]) -> bytes:
    return b"".join(bytes(part) for part in encode_frame(header))


def test_a_heartbeat_measures_the_offset_to_a_coordinator_whose_clock_is_ahead() -> None:
    ahead = 5.0
    clock = ClockEstimate()
    beat = BeatThread(
        "127.0.0.1", 1, token=None, job="j", session="s", rank=0, report=lambda want: None, clock=clock
    )
    ours, coordinator = socket.socketpair()

    def answer() -> None:  # a coordinator whose clock runs 5 s ahead of this host's
        decoder = FrameDecoder(max_header=1 << 16, max_payload=0)
        for _ in range(3):
            (frame,) = decoder.feed(coordinator.recv(65536))
            time.sleep(0.01)  # between receipt and reply, as a busy coordinator would
            coordinator.sendall(_wire({"id": frame.header["id"], "ok": True, "t": time.time() + ahead}))

    with ours, coordinator:
        ours.settimeout(10)
        thread = threading.Thread(target=answer)
        thread.start()
        decoder = FrameDecoder(max_header=1 << 16, max_payload=0)
        for _ in range(3):
            assert beat._heartbeat(ours, decoder)["ok"] is True
        thread.join(10)
    assert clock.current is not None
    offset, error = clock.current
    assert error >= 0.005 and abs(offset - ahead) <= error  # the 10 ms reply delay is within it


def _timeline_file(directory: Path, rank: int, lines: list[dict[str, Any]]) -> None:
    header = {"rank": rank, "host": f"host{rank}", "pid": 100 + rank, "job": "j"}
    text = "".join(json.dumps(line) + "\n" for line in [header, *lines])
    (directory / f"rank{rank}-{100 + rank}.jsonl").write_text(text)


def _op(seq: int, start: float, end: float) -> dict[str, Any]:
    return {"kind": "all_reduce", "group": "w", "label": "world", "seq": seq, "start": start * 1e6,
            "end": end * 1e6, "outcome": "ok", "bytes": 16, "algo": None, "group_rank": 0}  # fmt: skip


def _arrival(trace: dict[str, Any], rank: int, seq: int) -> dict[str, Any]:
    (event,) = [
        e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == rank and e["args"]["seq"] == seq
    ]
    return event


def test_arrivals_compare_on_the_coordinators_clock_not_each_hosts(tmp_path: Path) -> None:
    # On the coordinator's clock: rank 0 enters seq 0 at 1000.0 and seq 1 at 1001.0, and waits for
    # rank 1, which enters them 0.2 s later each time. Rank 1's host runs 5 s ahead; its first
    # operation comes before its first clock line (which then applies to it too).
    _timeline_file(
        tmp_path, 0, [{"clock": 0.0001, "error": 0.0002}, _op(0, 1000.0, 1000.2), _op(1, 1001.0, 1001.2)]
    )
    _timeline_file(
        tmp_path, 1, [_op(0, 1005.2, 1005.2), {"clock": -5.0, "error": 0.0003}, _op(1, 1006.2, 1006.2)]
    )
    trace = merge(tmp_path)
    for seq in (0, 1):
        first, last = _arrival(trace, 0, seq), _arrival(trace, 1, seq)
        assert last["args"]["last_rank"] == 1 and first["args"]["last_rank"] == 1
        assert first["args"]["waited_for_last_us"] == pytest.approx(0.2e6 - 100, abs=1)
        assert last["args"]["entered_after_first_us"] == pytest.approx(0.2e6 - 100, abs=1)
        assert last["ts"] == pytest.approx((1000.2 + seq) * 1e6, abs=1)
    labels = {e["pid"]: e["args"]["labels"] for e in trace["traceEvents"] if e["name"] == "process_labels"}
    assert labels[1] == "times on the coordinator's clock: this host's -5000.000 ms (to within 0.300 ms)"


def _dump(rank: int, clock: dict[str, float] | None, enter: float) -> dict[str, Any]:
    op = {"group": "w", "label": "world", "seq": 3, "op": "all_reduce(dtype=float32, count=4, op=sum)",
          "sig": {"kind": "all_reduce"}, "state": "started", "outcome": None, "enter": enter, "end": None,
          "site": None}  # fmt: skip
    group = {"group": "w", "label": "world", "ranks": [0, 1], "next_seq": 4, "group_rank": rank}
    return {"version": 1, "job": "j", "rank": rank, "pid": 1, "host": f"host{rank}", "time": enter + 10,
            "reason": "SIGUSR1", "clock": clock, "ops": [op], "groups": [group]}  # fmt: skip


def test_dumps_are_moved_to_the_coordinators_clock_too(tmp_path: Path) -> None:
    dumps = {
        0: _dump(0, {"offset": 0.0, "error": 0.001}, 1000.0),
        1: _dump(1, {"offset": -5.0, "error": 0.001}, 1005.5),
    }
    for rank, dump in dumps.items():
        (tmp_path / f"j-rank{rank}.json").write_text(json.dumps(dump))
    trace = merge(tmp_path)
    assert _arrival(trace, 0, 3)["args"]["waited_for_last_us"] == pytest.approx(0.5e6, abs=1)
    assert _arrival(trace, 1, 3)["ts"] == pytest.approx(1000.5e6, abs=1)
    # `aiocoll analyze` says when each rank entered on the same clock: half a second apart, not 5.5 s.
    lines = analyze(dumps).lines
    since = [line.split(" since ")[1].split()[0] for line in lines if " since " in line]
    on_the_coordinators = [
        time.strftime("%H:%M:%S", time.localtime(1000)) + f".{ms}" for ms in ("000", "500")
    ]
    assert since == on_the_coordinators, lines
