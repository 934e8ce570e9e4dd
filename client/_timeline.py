"""The timeline: with ``AIOCOLL_TIMELINE=DIR`` every process records each operation it finished
(kind, group, seq, bytes, algorithm, start, end, outcome) into a file of its own in DIR, which
``aiocoll timeline DIR -o FILE`` merges into one Chrome trace. Off, it costs one ``is None`` test
per operation (in client/_progress.py).

May import only the standard library, aiocoll._env and client/_clock. One Timeline per process,
shared by every
engine of the process (the torch backend runs an engine per torch group): its track is the
process's rank in the job (RANK, else the first engine's rank).

File format: JSON lines. The first line describes the process ``{"rank", "host", "pid",
"job"}``; each next line is one operation ``{"kind", "group", "label", "seq", "start", "end",
"outcome", "bytes", "algo", "group_rank"}`` with ``start`` and ``end`` in microseconds of wall
time (time.time) of this host. A line ``{"clock": OFFSET, "error": E}`` (seconds) says that from
there on this host's time plus OFFSET is the coordinator's, to within E (client/_clock.py, from
the heartbeats; operations before the first such line take the first), so that the files of
several hosts line up; a file without one (no coordinator) has only its host's clock.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from typing import Any

from aiocoll._env import env_int, env_text

from ._clock import estimate

__all__ = ["FLUSH_EVERY", "Timeline", "timeline_for_process"]

# Seconds between writes of the recorded operations (and at exit).
FLUSH_EVERY = 0.5
_ITEM_BYTES = {"bool": 1, "int8": 1, "uint8": 1, "float16": 2, "bfloat16": 2, "int16": 2, "float32": 4,
               "int32": 4, "uint32": 4, "float64": 8, "int64": 8, "uint64": 8, "complex64": 8,
               "complex128": 16}  # fmt: skip

_lock = threading.Lock()
_process_timeline: Timeline | None = None


class Timeline:
    """Operations of this process, buffered and appended to ``DIR/rank{R}-{pid}.jsonl``."""

    def __init__(self, directory: str, rank: int, job: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"rank{rank}-{os.getpid()}.jsonl")
        self.rank = rank
        # monotonic -> wall microseconds: operations are stamped with time.monotonic()
        self._offset = time.time() - time.monotonic()
        self._pending: list[tuple[Any, ...]] = []
        self._last_flush = time.monotonic()
        self._clock: tuple[float, float] | None = None  # the clock offset last written
        header = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "job": job}
        with open(self.path, "w") as f:
            f.write(json.dumps(header) + "\n")

    def add(
        self,
        kind: str,
        gid: str,
        label: str,
        seq: int,
        sig: dict[str, Any] | None,
        start: float,
        end: float,
        outcome: str,
        group_rank: int,
    ) -> None:
        """One finished operation (``start`` and ``end`` from time.monotonic()); kept as it
        came, turned into JSON when written."""
        self._pending.append((kind, gid, label, seq, sig, start, end, outcome, group_rank))
        if end - self._last_flush >= FLUSH_EVERY:
            self.flush()

    def _line(self, op: tuple[Any, ...]) -> str:
        kind, gid, label, seq, sig, start, end, outcome, group_rank = op
        meta = sig or {}
        count = meta.get("count")
        item = _ITEM_BYTES.get(str(meta.get("dtype")), 0)
        return json.dumps(
            {
                "kind": kind,
                "group": gid,
                "label": label,
                "seq": seq,
                "start": (start + self._offset) * 1e6,
                "end": (end + self._offset) * 1e6,
                "outcome": outcome,
                "bytes": count * item if isinstance(count, int) and item else None,
                "algo": meta.get("algo"),
                "group_rank": group_rank,
            }
        )

    def flush(self) -> None:
        """Append what was recorded since the last flush."""
        with _lock:
            ops, self._pending = self._pending, []
            self._last_flush = time.monotonic()
            if not ops:
                return
            lines = [self._line(op) + "\n" for op in ops]
            clock = estimate().current
            if clock is not None and clock != self._clock:
                self._clock = clock
                offset, error = clock
                lines.insert(0, json.dumps({"clock": round(offset, 6), "error": round(error, 6)}) + "\n")
            with open(self.path, "a") as f:
                f.write("".join(lines))


def timeline_for_process(engine_rank: int) -> Timeline | None:
    """The process's Timeline when AIOCOLL_TIMELINE names a directory, else None."""
    global _process_timeline
    directory = env_text("AIOCOLL_TIMELINE")
    if not directory:
        return None
    with _lock:
        if _process_timeline is None:
            rank = env_int("RANK")
            job = env_text("AIOCOLL_JOB") or "default"
            _process_timeline = Timeline(directory, engine_rank if rank is None else rank, job)
            atexit.register(_process_timeline.flush)
        return _process_timeline
