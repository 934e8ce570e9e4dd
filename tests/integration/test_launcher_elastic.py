"""Elastic `aiocoll run --nnodes MIN:MAX`: several launchers on this machine stand in for nodes.

One `aiocoll coordinator` per test; each launcher is `aiocoll run --nnodes 2:3 --nproc-per-node 1
--coordinator ...` of the same job. The workers record, per generation, what they saw (their
environment, the world size their rendezvous gave them, their launcher's pid) in files of the
test's tmp dir, so the test can say which generations ran and with which nodes. A job of MIN 2
starts with two launchers; a third one joins (one new generation with three nodes); one launcher
is killed (one new generation with the two left); the job then completes, exit 0 on both.
Membership changes do not use up --max-restarts (0 here); failures do, and one that finds no
restart left ends the job on every node with the failed worker's status and its cause named.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_launcher import _clean_env
from test_launcher_status import _Lines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

LAUNCHER = [sys.executable, "-m", "aiocoll.cli.run"]
TOKEN = "elastic-test-secret"

RECORD = r"""
import json, os, sys
from pathlib import Path

KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID", "AIOCOLL_RESTART_COUNT", "AIOCOLL_GENERATION", "AIOCOLL_JOB",
        "MASTER_ADDR", "MASTER_PORT"]


def record(here, **more):
    seen = {k: os.environ.get(k) for k in KEYS} | {"launcher": os.getppid()} | more
    name = f"gen{os.environ['AIOCOLL_GENERATION']}-rank{os.environ['RANK']}.json"
    (here / ("." + name)).write_text(json.dumps(seen))
    (here / ("." + name)).rename(here / name)   # whole, or not there
"""

# Joins the job's rendezvous, records, then all-reduces a flag until the test says finish; a
# peer that dies meanwhile makes the all-reduce fail (as a real job's would).
TRAINING = (
    RECORD
    + r"""
import time
import numpy as np
import aiocoll.sync as dist

here = Path(sys.argv[1])
dist.init_process_group(timeout=60)
record(here, joined_world_size=dist.get_world_size(), joined_rank=dist.get_rank())
while True:
    flag = np.array([1.0 if (here / "finish").exists() else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag[0] > 0:
        break
    time.sleep(0.2)
dist.destroy_process_group()
"""
)

# Rank 1 fails at once, every generation; rank 0 waits to be stopped.
FAILING = (
    RECORD
    + r"""
import time
here = Path(sys.argv[1])
record(here)
if os.environ["RANK"] == "1":
    raise ValueError("loss is nan at step 7")
while True:
    time.sleep(0.1)
"""
)


class _Process:
    def __init__(self, argv: list[str], cwd: Path) -> None:
        env = _clean_env()
        self.popen = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.popen.stdout is not None and self.popen.stderr is not None
        self.out = _Lines(self.popen.stdout)
        self.err = _Lines(self.popen.stderr)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"pid {self.pid} still running after {timeout}s:\n{self.err.text()[-4000:]}"
            ) from None

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(30)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[str]:
    """An `aiocoll coordinator` on a free port, with the test's token."""
    (tmp_path / "token").write_text(TOKEN + "\n")
    proc = _Process(
        [sys.executable, "-m", "aiocoll", "coordinator", "--port", "0", "--token-file", "token"], tmp_path
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            found = [line for line in list(proc.err.lines) if "listening on 127.0.0.1:" in line]
            if found:
                yield "127.0.0.1:" + found[0].split("listening on 127.0.0.1:")[1].split()[0]
                break
            assert proc.popen.poll() is None, f"the coordinator exited: {proc.err.text()}"
            assert time.monotonic() < deadline, f"the coordinator did not listen within 30s: {proc.err.lines}"
            time.sleep(0.05)
    finally:
        proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(15)
        except subprocess.TimeoutExpired:
            proc.stop()


def _launcher(tmp_path: Path, coordinator: str, script: str, *extra: str) -> _Process:
    return _Process(
        [
            *LAUNCHER,
            "--nnodes",
            "2:3",
            "--nproc-per-node",
            "1",
            "--coordinator",
            coordinator,
            "--job",
            "elastic",
            "--token-file",
            "token",
            "--rdzv-join-window",
            "1",
            "--heartbeat-timeout",
            "3",
            "--grace-period",
            "3",
            "--rdzv-timeout",
            "90",
            *extra,
            script,
            str(tmp_path / "seen"),
        ],
        tmp_path,
    )


def _generation(
    seen: Path, gen: int, ranks: int, launchers: list[_Process], timeout: float = 90
) -> list[dict[str, object]]:
    """The records of generation ``gen``'s ranks 0..ranks-1, once they are all there."""
    paths = [seen / f"gen{gen}-rank{rank}.json" for rank in range(ranks)]
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            logs = "\n\n".join(f"launcher {p.pid}:\n{p.err.text()[-3000:]}" for p in launchers)
            raise AssertionError(
                f"generation {gen} did not record ranks 0..{ranks - 1} within {timeout}s; "
                f"recorded: {sorted(p.name for p in seen.glob('gen*'))}\n{logs}"
            )
        time.sleep(0.1)
    return [json.loads(path.read_text()) for path in paths]


def _job(tmp_path: Path, name: str, text: str) -> Path:
    """Write the workers' script; the folder where they record what they saw."""
    (tmp_path / name).write_text(text)
    seen = tmp_path / "seen"
    seen.mkdir()
    return seen


def _recorded(seen: Path) -> list[str]:
    return sorted(path.stem for path in seen.glob("gen*.json"))


def test_nodes_join_and_leave_in_new_generations_and_the_survivors_complete_the_job(
    tmp_path: Path, coordinator: str
) -> None:
    seen = _job(tmp_path, "training.py", TRAINING)
    host = socket.gethostname()
    first = [_launcher(tmp_path, coordinator, "training.py", "--max-restarts", "0") for _ in range(2)]
    launchers = list(first)
    try:
        # MIN=2: two launchers start the job, generation 0, with two nodes.
        gen0 = _generation(seen, 0, 2, launchers)
        assert {r["launcher"] for r in gen0} == {p.pid for p in first}
        for rank, record in enumerate(gen0):
            assert record["RANK"] == record["ROLE_RANK"] == record["GROUP_RANK"] == str(rank)
            assert record["WORLD_SIZE"] == record["GROUP_WORLD_SIZE"] == record["ROLE_WORLD_SIZE"] == "2"
            assert record["joined_world_size"] == 2 and record["joined_rank"] == rank
            assert record["TORCHELASTIC_RESTART_COUNT"] == record["AIOCOLL_RESTART_COUNT"] == "0"
            assert record["AIOCOLL_GENERATION"] == "0" and record["TORCHELASTIC_MAX_RESTARTS"] == "0"
            assert record["TORCHELASTIC_RUN_ID"] == record["AIOCOLL_JOB"] == "elastic"
        # Rank 0's torch store is on node rank 0, at a port it found free; the same for everyone.
        assert gen0[0]["MASTER_ADDR"] == gen0[1]["MASTER_ADDR"] == "127.0.0.1"
        assert gen0[0]["MASTER_PORT"] == gen0[1]["MASTER_PORT"] != coordinator.split(":")[1]

        # A third launcher arrives while generation 0 runs: it is admitted by one new
        # generation with three nodes; the nodes that were there keep their node ranks.
        third = _launcher(tmp_path, coordinator, "training.py", "--max-restarts", "0")
        launchers.append(third)
        gen1 = _generation(seen, 1, 3, launchers)
        assert [r["launcher"] for r in gen1] == [gen0[0]["launcher"], gen0[1]["launcher"], third.pid]
        for rank, record in enumerate(gen1):
            assert record["RANK"] == record["GROUP_RANK"] == str(rank)
            assert (
                record["WORLD_SIZE"] == record["GROUP_WORLD_SIZE"] == "3" and record["joined_world_size"] == 3
            )
            assert record["AIOCOLL_GENERATION"] == "1"
            # A change of membership is not a restart after a failure (torchrun's meaning).
            assert record["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert _recorded(seen) == ["gen0-rank0", "gen0-rank1", "gen1-rank0", "gen1-rank1", "gen1-rank2"]

        # The launcher of node rank 0 dies (SIGKILL: no goodbye; its worker dies with it): one
        # new generation with the two nodes left, which renumber from 0.
        victim = next(p for p in launchers if p.pid == gen1[0]["launcher"])
        victim.popen.send_signal(signal.SIGKILL)
        victim.wait(30)
        survivors = [p for p in launchers if p is not victim]
        gen2 = _generation(seen, 2, 2, survivors)
        assert [r["launcher"] for r in gen2] == [gen1[1]["launcher"], gen1[2]["launcher"]]
        for rank, record in enumerate(gen2):
            assert record["RANK"] == record["GROUP_RANK"] == str(rank)
            assert record["WORLD_SIZE"] == "2" and record["joined_world_size"] == 2
            assert record["AIOCOLL_GENERATION"] == "2" and record["TORCHELASTIC_RESTART_COUNT"] == "0"

        # The job completes: every worker exits 0, both launchers exit 0 (--max-restarts 0: had
        # the survivors' failed all-reduce counted as a failure, they would have exited 1).
        (seen / "finish").touch()
        codes = {p.pid: p.wait(60) for p in survivors}
        assert set(codes.values()) == {0}, {p.pid: p.err.text()[-3000:] for p in survivors}
        assert _recorded(seen) == [
            "gen0-rank0",
            "gen0-rank1",
            "gen1-rank0",
            "gen1-rank1",
            "gen1-rank2",
            "gen2-rank0",
            "gen2-rank1",
        ]
        for proc in survivors:
            err = proc.err.text()
            name = f"{host}:{proc.pid}"
            if proc is not third:
                assert f"generation 0 ended: node(s) {host}:{third.pid} asked to join" in err
            assert f"generation 1 ended: node(s) {host}:{victim.pid} lost" in err
            assert "it does not use up --max-restarts" in err
            assert "job 'elastic' completed at generation 2" in err and "restarts used 0 of 0" in err
            # Every line of the node agent names its node.
            agent_lines = [line for line in err.splitlines() if line.startswith("[aiocoll run ")]
            assert agent_lines and all(f" {name}" in line for line in agent_lines[2:]), agent_lines
    finally:
        for proc in launchers:
            proc.stop()


def test_a_failure_beyond_max_restarts_ends_the_job_on_every_node_with_the_cause_named(
    tmp_path: Path, coordinator: str
) -> None:
    seen = _job(tmp_path, "failing.py", FAILING)
    launchers = [_launcher(tmp_path, coordinator, "failing.py", "--max-restarts", "1") for _ in range(2)]
    try:
        codes = [p.wait(90) for p in launchers]
        # Both nodes end with the failed worker's own exit status (a Python exception: 1).
        assert codes == [1, 1], [p.err.text()[-3000:] for p in launchers]
        # Generation 0 failed and was restarted once (TORCHELASTIC_RESTART_COUNT 1), then no more.
        assert _recorded(seen) == ["gen0-rank0", "gen0-rank1", "gen1-rank0", "gen1-rank1"]
        gen1 = [json.loads((seen / f"gen1-rank{rank}.json").read_text()) for rank in (0, 1)]
        assert {r["TORCHELASTIC_RESTART_COUNT"] for r in gen1} == {"1"}
        assert {r["TORCHELASTIC_MAX_RESTARTS"] for r in gen1} == {"1"}
        failing = next(p for p in launchers if p.pid == gen1[1]["launcher"])
        other = next(p for p in launchers if p is not failing)
        for proc in launchers:
            err = proc.err.text()
            assert "generation 0 ended: rank 1 (node 1 " in err and "restart 1 of 1" in err
            assert "job 'elastic' failed (after 1 restart(s)): rank 1 (node 1 " in err
            assert "failed (exit code 1)" in err
        # The cause is named once per failure: on the failing node by the worker's own output
        # and the launcher's line about it; on the other node by one line each time.
        assert other.err.text().count("ValueError: loss is nan at step 7") == 2
        cause = "rank 1's last stderr line: ValueError: loss is nan at step 7"
        assert failing.err.text().count(cause) == 2
    finally:
        for proc in launchers:
            proc.stop()
