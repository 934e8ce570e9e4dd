"""Issue 18: in a real world of three processes, each failure is said once, where it happened.

One world checks several things: a rank that never calls an operation (one rank times out and
names it, the other is told so at once, the record logged says nothing of an empty history, the
notice to the late rank does not nest the other rank's whole message), a rank that dies (the
survivor's error names its operation and says "lost rank 1" once), the world group named "world",
errors that print as aiocoll.X and survive pickling between processes, and the no-token warning at
the script's own line.

Run as a script, this module is one rank of that world.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from aiocoll._net import free_port

pytestmark = pytest.mark.integration

_WORLD = 3
_TIMEOUT = 6.0  # rank 0 gives up on rank 2 after this long
# Rank 1's own deadline is far later, so what it sees is rank 0's notice that it gave up: with
# equal deadlines, which of the two gave up first (and told the other) was the machine's choice.
_LONG_TIMEOUT = 60.0


async def _caught(work: Any) -> BaseException:
    try:
        await work
    except BaseException as exc:  # what the rank's user would see
        return exc
    raise AssertionError("the operation succeeded")


def _record(exc: BaseException, out: Path, name: str) -> dict[str, Any]:
    (out / f"{name}.pickle").write_bytes(pickle.dumps(exc))
    return {
        "type": "".join(traceback.format_exception_only(type(exc), exc)).split(":")[0],
        "message": str(exc),
    }


async def _rank(rank: int, port: int, out: Path) -> None:
    import numpy as np

    import aiocoll

    url = f"tcp://127.0.0.1:{port}"
    pg = await aiocoll.init_process_group(url, rank=rank, world_size=_WORLD, timeout=60)  # INIT
    x = np.ones(4, np.float32)
    await pg.all_reduce(x)  # world seq 0: a history for the record
    pair = await pg.new_group([0, 1])  # world seq 1
    seen: dict[str, Any] = {}
    if rank == 2:
        await asyncio.sleep(_TIMEOUT + 4)  # busy elsewhere while ranks 0 and 1 wait in seq 2
    else:
        timeout = _TIMEOUT if rank == 0 else _LONG_TIMEOUT
        seen["timeout"] = _record(await _caught(pg.all_reduce(x, timeout=timeout)), out, f"timeout{rank}")
        if rank == 1:
            (out / "rank1.json").write_text(json.dumps(seen))
            os._exit(3)  # dies while rank 0 waits for it in their pair
        assert pair is not None
        seen["lost"] = _record(await _caught(pair.all_reduce(x, timeout=60)), out, "lost0")
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    os._exit(0)  # the coordinator and links go with the process: what the others see is theirs


def _marker_line(marker: str) -> int:
    with open(__file__, encoding="utf-8") as source:
        return next(n for n, line in enumerate(source, 1) if line.rstrip().endswith(marker))


@pytest.mark.timeout(120)
def test_each_failure_is_said_once_where_it_happened(tmp_path: Path) -> None:
    from aiocoll import CollectiveTimeout, PeerLostError

    port = free_port()
    env = {
        k: v for k, v in os.environ.items() if k not in ("AIOCOLL_TOKEN", "RANK", "WORLD_SIZE", "MASTER_ADDR")
    }
    logs = [tmp_path / f"rank{r}.log" for r in range(_WORLD)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "wb") as fh:
            procs.append(
                subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), str(rank), str(port), str(tmp_path)],
                    env=env,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + 90
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = [log.read_text(errors="replace") for log in logs]
    everything = "\n".join(
        f"--- rank {r} exit {p.returncode}\n{t}" for r, (p, t) in enumerate(zip(procs, text, strict=True))
    )
    assert [p.returncode for p in procs] == [0, 3, 0], everything
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(_WORLD)]

    # The no-token warning names the script's line, once per job: from rank 0.
    site = f"{os.path.abspath(__file__)}:{_marker_line('# INIT')}: UserWarning: aiocoll: no token"
    assert site in text[0] and not any("no token" in t for t in text[1:]), everything

    # Rank 0 timed out naming rank 2, and the record says what came before, once; rank 1 was told
    # at once that rank 0 gave up, naming rank 2 too, in one sentence.
    for rank in (0, 1):
        timeout = results[rank]["timeout"]
        assert timeout["type"] == "aiocoll.CollectiveTimeout", timeout
        message = timeout["message"]
        assert message.startswith("all_reduce (group 'world', seq 2)") and "'w'" not in message, message
        assert "is at seq" not in message, message
        if "have not called" in message:  # the coordinator's verdict came before the deadline
            assert "rank(s) [2] have not called seq 2 of group 'world'" in message, message
        else:
            assert "waiting for rank(s) [2]" in message, message
        back = pickle.loads((tmp_path / f"timeout{rank}.pickle").read_bytes())
        assert type(back) is CollectiveTimeout and str(back) == message and back.missing_ranks == [2]
        if rank == 0:
            assert (
                f"rank 0: all_reduce (group 'world', seq 2) timed out after {_TIMEOUT}s waiting for "
                "rank(s) [2]; its last 2 operations, oldest first:" in text[0]
            ), text[0]
        else:
            told = (
                "all_reduce (group 'world', seq 2) failed: rank 0 gave up on it after its timeout of "
                f"{_TIMEOUT}s, waiting for rank(s) [2], and so does this rank"
            )
            assert message.startswith(told) and f"rank 1: {told}" in text[1], (message, text[1])
    assert not any("operation(s)" in t for t in text), everything
    # The coordinator's verdict (logged by the coordinator, in rank 0) is said in a rank's log at
    # most once, where its operation failed, not again when it arrives.
    for t in text:
        said = [line for line in t.splitlines() if "have not called" in line and "event=behind" not in line]
        assert len(said) <= 1 and all(" failed: " in line for line in said), everything

    # Rank 2 heard that the others gave up, in one sentence that does not nest theirs.
    notice = [line for line in text[2].splitlines() if "gave up on it" in line]
    assert notice and all(
        line.startswith("rank 2: all_reduce (group 'world', seq 2) failed: rank ") for line in notice
    ), text[2]
    assert all("said:" not in line and line.count("Timed out") == 0 for line in notice), notice

    # Rank 0's error for rank 1's death names its operation and says "lost rank 1" once.
    lost = results[0]["lost"]
    assert lost["type"] == "aiocoll.PeerLostError", lost
    assert lost["message"].startswith("all_reduce (group 'world.1', seq 0) "), lost
    assert lost["message"].count("rank 1") == 1 and "lost rank 1: lost" not in lost["message"], lost
    back = pickle.loads((tmp_path / "lost0.pickle").read_bytes())
    assert type(back) is PeerLostError and back.rank == 1 and str(back) == lost["message"]
    # In rank 0's log the loss is one line (the record), not the link's line beside it.
    assert text[0].count("lost rank 1") == 1 and "lost its link" not in text[0], text[0]


if __name__ == "__main__":
    asyncio.run(_rank(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])))
