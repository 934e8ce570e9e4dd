"""The flight recorder and `aiocoll analyze` on dumps of real failing jobs.

Six jobs run at once under `aiocoll run`, each a world of real processes with its own dump
directory: a rank that never reaches an operation (the others time out), ranks that call
different operations at one sequence number, a rank killed with SIGKILL mid-loop (its peer loses
it), a rank that leaves while its peer waits in one more operation, and a healthy job dumped on
SIGUSR1 with a small ring (AIOCOLL_FLIGHT_RECORDER), and one through the blocking facade, dumped
on SIGUSR1 too. Each job's dumps are then read by
`aiocoll analyze`, whose exit status and words are checked; so are the dumps themselves
(states, call sites at this file's lines, the ring's bound).

Run as a script (under `aiocoll run`), this module is one rank of such a job: ``SCENARIO`` is its
first argument.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

_HERE = os.path.abspath(__file__)


def _line(marker: str) -> int:
    for number, text in enumerate(Path(_HERE).read_text().splitlines(), 1):
        if text.rstrip().endswith(marker) and "_line(" not in text:
            return number
    raise AssertionError(marker)


async def _rank(scenario: str) -> None:
    import numpy as np

    import aiocoll

    if scenario == "killed":
        # The survivor reports its lost peer itself: the launcher's SIGTERM (a worker failed)
        # would otherwise race with it and could end it first.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    async with await aiocoll.init_process_group(timeout=60) as pg:
        x = np.ones(4, np.float32)
        for _ in range(3):
            await pg.all_reduce(x)  # LOOP
        if scenario == "behind":
            if pg.rank == 2:
                await asyncio.sleep(12)  # never in time for seq 3
                return
            await pg.all_reduce(x, timeout=4)  # WAITS
        elif scenario == "mismatch":
            if pg.rank == 0:
                await pg.all_reduce(x)  # ALL_REDUCE
            else:
                await pg.broadcast(x, src=0)  # BROADCAST
        elif scenario == "left":
            if pg.rank == 1:
                await asyncio.sleep(1.0)
                return  # leaves the group cleanly while rank 0 waits in one more
            await pg.all_reduce(x)  # ALONE
        elif scenario == "killed":
            if pg.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            await pg.all_reduce(x)  # SURVIVOR
        elif scenario == "healthy":
            for _ in range(40):
                await pg.all_reduce(x)  # HEALTHY
            if pg.rank == 0:
                await pg.send(x, 1)  # SEND
            else:
                await pg.recv(x, 0)  # RECV
            pids = await pg.all_gather_object(os.getpid())  # OBJECT
            await pg.barrier()
            if pg.rank == 0:
                for pid in pids:
                    os.kill(pid, signal.SIGUSR1)
            await asyncio.to_thread(_wait_for, _own_dump(pg.rank), 20.0)  # a thread of the rank's writes it
            await pg.barrier()


def _sync_rank() -> None:
    """A rank of the blocking facade (its operations run on a loop thread, where no user frame is:
    the facade passes the call site along)."""
    import numpy as np

    import aiocoll.sync as dist

    dist.init_process_group(timeout=60)
    x = np.ones(4, np.float32)
    for _ in range(3):
        dist.all_reduce(x)  # SYNC
    pids: list[Any] = [None, None]
    dist.all_gather_object(pids, os.getpid())  # SYNC_OBJECT
    dist.barrier()
    if dist.get_rank() == 0:
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
    _wait_for(_own_dump(dist.get_rank()), 20.0)
    dist.barrier()
    dist.destroy_process_group()


def _own_dump(rank: int) -> Path:
    return Path(os.environ["AIOCOLL_DUMP_DIR"]) / f"{os.environ['AIOCOLL_JOB']}-rank{rank}.json"


def _wait_for(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


_JOBS = {"behind": 3, "mismatch": 2, "killed": 2, "left": 2, "healthy": 2, "sync": 2}


def aiocoll_file(name: str) -> str:
    import importlib

    return os.path.abspath(str(importlib.import_module(name).__file__))


def _launch(tmp: Path, scenario: str) -> tuple[subprocess.Popen[str], Path]:
    dumps = tmp / scenario
    env = dict(os.environ, AIOCOLL_DUMP_DIR=str(dumps), AIOCOLL_TOKEN="recorder-test")
    if scenario == "healthy":
        env["AIOCOLL_FLIGHT_RECORDER"] = "16"
    if scenario == "left":
        # Over shared memory a peer's clean leave is not yet seen by a rank waiting for it (it
        # times out instead): a defect of the shared-memory links, not of the recorder.
        env["AIOCOLL_TRANSPORT"] = "tcp"
    size = str(_JOBS[scenario])
    cmd = [
        sys.executable,
        "-m",
        "aiocoll",
        "run",
        "--nproc-per-node",
        size,
        "--job",
        scenario,
        _HERE,
        scenario,
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, dumps


def _analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiocoll", "analyze", *args], capture_output=True, text=True, timeout=60
    )


def _dump(dumps: Path, job: str, rank: int) -> dict[str, Any]:
    return json.loads((dumps / f"{job}-rank{rank}.json").read_text())


def _sites(dump: dict[str, Any]) -> set[tuple[str, int]]:
    return {(op["site"]["file"], op["site"]["line"]) for op in dump["ops"] if op.get("site")}


def test_dumps_of_failing_jobs_name_the_rank_behind_the_mismatch_and_the_lost_rank(tmp_path: Path) -> None:
    launched = {name: _launch(tmp_path, name) for name in _JOBS}
    outputs: dict[str, str] = {}
    codes: dict[str, int] = {}
    for name, (proc, _) in launched.items():
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        outputs[name], codes[name] = out, proc.returncode
    everything = "\n".join(f"=== {n} exit {codes[n]}\n{outputs[n]}" for n in _JOBS)
    assert codes["healthy"] == codes["sync"] == 0 and all(
        codes[n] != 0 for n in ("behind", "mismatch", "killed")
    ), everything
    loop = (_HERE, _line("# LOOP"))

    # A rank behind: ranks 0 and 1 time out in seq 3; rank 2 never called it.
    dumps = launched["behind"][1]
    assert f"read them with aiocoll analyze {dumps}" in outputs["behind"], outputs["behind"]
    for rank in (0, 1):
        dump = _dump(dumps, "behind", rank)
        assert dump["rank"] == rank and dump["job"] == "behind"
        states = [(op["seq"], op["state"]) for op in dump["ops"] if op["group"] == "w" and op["seq"] >= 0]
        assert states[:3] == [(0, "completed"), (1, "completed"), (2, "completed")], dump["ops"]
        assert (3, "failed") in states, states
        assert {loop, (_HERE, _line("# WAITS"))} <= _sites(dump), dump["ops"]
    result = _analyze(str(dumps))
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "rank(s) [2] did not reach seq 3 (all_reduce(dtype=float32, count=4, op=sum)), "
        "which rank(s) [0, 1] wait in" in result.stdout
    ), result.stdout
    assert f"rank 2 last entered seq 2 at {_HERE}:{loop[1]} (_rank)" in result.stdout or (
        "rank 2: no dump" in result.stdout
    ), result.stdout

    # The same dumps make a timeline: one track per dump, the timed-out operation on it.
    trace_file = tmp_path / "behind-trace.json"
    converted = subprocess.run(
        [sys.executable, "-m", "aiocoll", "timeline", str(dumps), "-o", str(trace_file)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert converted.returncode == 0, converted.stderr
    events = json.loads(trace_file.read_text())["traceEvents"]
    timed_out = [e for e in events if e["ph"] == "X" and e["args"].get("seq") == 3]
    assert {e["pid"] for e in timed_out} == {0, 1}, timed_out
    assert all(e["name"] == "all_reduce" and e["args"]["outcome"] == "CollectiveTimeout" for e in timed_out)
    assert all(e["args"]["site"] == f"{_HERE}:{_line('# WAITS')}" for e in timed_out), timed_out

    # A mismatch: both ranks dump, and analyze names both calls with their lines.
    dumps = launched["mismatch"][1]
    result = _analyze(str(dumps))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "MISMATCH at seq 3" in result.stdout, result.stdout
    assert (
        f"rank 0 called all_reduce(dtype=float32, count=4, op=sum) at {_HERE}:{_line('# ALL_REDUCE')}"
        in result.stdout
    )
    assert (
        f"rank 1 called broadcast(root=0, dtype=float32, count=4) at {_HERE}:{_line('# BROADCAST')}"
        in result.stdout
    )

    # A rank killed mid-loop: the survivor dumps its lost peer; the dead rank left no dump.
    dumps = launched["killed"][1]
    dump = _dump(dumps, "killed", 0)
    assert "lost rank 1" in dump["reason"] or "PeerLostError" in dump["reason"], dump["reason"]
    assert not (dumps / "killed-rank1.json").exists()
    result = _analyze(str(dumps))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rank 1: no dump" in result.stdout and "rank(s) [1] did not reach seq 3" in result.stdout, (
        result.stdout
    )
    # One line per lost peer on the survivor, not a record of its operations.
    survivor = [line for line in outputs["killed"].splitlines() if line.startswith("[rank0]")]
    assert not any("oldest first" in line for line in survivor), outputs["killed"]
    # The one line, and the error's line.
    assert 1 <= sum("lost rank 1" in line for line in survivor) <= 2, survivor
    # A traceback shows the user's frames and ends at the public call: no frame of aiocoll's.
    packages = [
        os.path.dirname(aiocoll_file(name)) for name in ("aiocoll", "aiocoll.client", "aiocoll.server")
    ]
    assert not any(f'File "{p}/' in line for line in survivor for p in packages), survivor
    if any("Traceback" in line for line in survivor):
        assert any(f'File "{_HERE}", line {_line("# SURVIVOR")}' in line for line in survivor), survivor

    # A rank that left: the survivor's dump says so; analyze names it as not reaching seq 3.
    dumps = launched["left"][1]
    dump = _dump(dumps, "left", 0)
    assert "PeerLostError" in dump["reason"] and "rank 1 left" in dump["reason"], dump["reason"]
    (alone,) = [op for op in dump["ops"] if op["seq"] == 3]
    assert alone["state"] == "failed" and alone["outcome"] == "PeerLostError", alone
    assert alone["site"] == {"file": _HERE, "line": _line("# ALONE"), "function": "_rank"}, alone
    result = _analyze(str(dumps))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rank 1: no dump" in result.stdout and "rank(s) [1] did not reach seq 3" in result.stdout, (
        result.stdout
    )

    # A healthy job dumped on SIGUSR1: every rank, the ring bounded at 16, analyze exits 0. Each
    # kind of call names its line: collectives, point-to-point, object collectives.
    dumps = launched["healthy"][1]
    for rank in (0, 1):
        dump = _dump(dumps, "healthy", rank)
        assert dump["reason"] == "SIGUSR1" and len(dump["ops"]) <= 17, dump  # 16 finished + the barrier
        assert all(op["state"] in ("completed", "started", "queued") for op in dump["ops"])
        called = {op["op"].partition("(")[0]: op["site"] for op in dump["ops"]}
        p2p = ("send", "# SEND") if rank == 0 else ("recv", "# RECV")
        for kind, marker in (("all_reduce", "# HEALTHY"), p2p, ("all_gather_object", "# OBJECT")):
            assert called[kind] == {"file": _HERE, "line": _line(marker), "function": "_rank"}, (kind, dump)
    result = _analyze(str(dumps))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the dumps agree" in result.stdout

    # Through the blocking facade: the line that called it.
    dumps = launched["sync"][1]
    for rank in (0, 1):
        dump = _dump(dumps, "sync", rank)
        called = {op["op"].partition("(")[0]: op["site"] for op in dump["ops"]}
        for kind, marker in (("all_reduce", "# SYNC"), ("all_gather_object", "# SYNC_OBJECT")):
            assert called[kind] == {"file": _HERE, "line": _line(marker), "function": "_sync_rank"}, (
                kind,
                dump,
            )

    # Unreadable: no dumps, or a file that is not one.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _analyze(str(empty)).returncode == 2
    (empty / "x-rank0.json").write_text("{not json")
    bad = _analyze(str(empty))
    assert bad.returncode == 2 and "not a flight-recorder dump" in bad.stderr, bad.stderr


if __name__ == "__main__":
    if sys.argv[1] == "sync":
        _sync_rank()
    else:
        asyncio.run(_rank(sys.argv[1]))
