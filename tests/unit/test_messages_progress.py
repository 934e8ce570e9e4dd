"""Issue 18: the progress cross-check and the record logged on a failure say what is true, once:
no seq that contradicts "has not called", nothing about an empty history, the world named."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest
from aiocoll.client._progress import ProgressTracker

from aiocoll._progress_check import JobProgress

pytestmark = pytest.mark.timeout(10)

SIG = {"kind": "all_reduce", "dtype": "float32", "count": 4, "op": "sum"}


def _waiting(seq: int, waits: list[int]) -> dict[str, Any]:
    return {"g": "w", "n": [0, 1, 2, 3], "s": seq, "sig": SIG, "st": "waiting", "w": waits, "age": 1.0}


def test_a_behind_rank_is_named_at_an_earlier_seq_only_when_it_is_at_one() -> None:
    job = JobProgress()
    job.update(2, {"seqs": {"w": 3}}, 10.0, 10.0)  # its next call is seq 3: right before it
    job.update(3, {"seqs": {"w": 1}}, 10.0, 10.0)  # two calls further back
    job.update(1, {"ops": [_waiting(3, [2])], "seqs": {"w": 4}}, 10.0, 10.0)
    (verdict,) = job.update(0, {"ops": [_waiting(3, [1])], "seqs": {"w": 4}}, 10.0, 10.0)
    assert verdict.kind == "behind" and verdict.ranks == (2, 3)
    assert verdict.message == (
        "rank(s) [2, 3] have not called seq 3 of group 'world' (all_reduce(dtype=float32, count=4, op=sum)), "
        "which rank(s) [0, 1] wait in: they are busy elsewhere or stuck before it; rank 3 is further back: "
        "its next call is seq 1"
    )


def test_the_record_says_nothing_of_an_empty_history(caplog: pytest.LogCaptureFixture) -> None:
    group = SimpleNamespace(gid="w", label="world", index=0, ranks=(0, 1), next_seq=0, pending=set())
    tracker = ProgressTracker(0, lambda: [group], threshold=60.0)
    caplog.set_level(logging.WARNING, logger="aiocoll.client.progress")
    tracker.log_record("lost rank 1 (closed the connection)")
    tracker.record("barrier", group, 0, None, time.monotonic(), "ok")  # type: ignore[arg-type]
    tracker.log_record("lost rank 2 (closed the connection)")
    first, second = (r.getMessage() for r in caplog.records)
    assert first == "rank 0: lost rank 1 (closed the connection)"
    assert second.startswith(
        "rank 0: lost rank 2 (closed the connection); its last operation:\n  barrier group='world' seq=0"
    )
    assert "operation(s)" not in first + second
