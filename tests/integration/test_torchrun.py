"""aiocoll under torchrun's own launcher: what its users see.

Real torchrun agents (``python -m torch.distributed.run``) on loopback start real workers that
run ``aiocoll.sync`` scripts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from aiocoll._net import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
pytest.importorskip("torch.distributed.run")

ALL_REDUCE = """
import os
import numpy as np
import aiocoll.sync as dist
dist.init_process_group("gloo")
t = np.ones(2)
dist.all_reduce(t)
os.write(1, f"SUM {int(t[0])}\\n".encode())  # one write: the ranks share torchrun's stdout
dist.destroy_process_group()
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIOCOLL_", "MASTER_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def test_without_a_token_only_rank_0_warns(tmp_path: Path) -> None:
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script),
    ]  # fmt: skip
    proc = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=150)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert proc.stdout.count("SUM 3") == 3, output[-3000:]
    # Every rank is equally open; the job says so once, in torchrun's one terminal.
    assert output.count("aiocoll: no token") == 1, output[-3000:]


# -- torchrun --rdzv-backend aiocoll -----------------------------------------------------------

# Rendezvous through aiocoll.sync, then all_reduce until the test says stop; the first line says
# which world this generation runs in.
ELASTIC_WORKER = """
import os, sys, time
from pathlib import Path
import numpy as np
import aiocoll.sync as dist
dist.init_process_group("gloo")
t = np.ones(1)
dist.all_reduce(t)
os.write(1, f"RESULT job={os.environ['AIOCOLL_JOB']} world={dist.get_world_size()} sum={t[0]:g}\\n".encode())
while not Path(sys.argv[1]).exists():
    dist.all_reduce(t)
    time.sleep(0.1)
dist.destroy_process_group()
"""


class _Agents:
    """torchrun agents (each in a session of its own, so that a kill takes its workers too)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, name: str, endpoint: str, job: str, nnodes: str, token: Path) -> subprocess.Popen[str]:
        conf = f"token_file={token},last_call_timeout=2,heartbeat_timeout=5,join_timeout=90"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "1",
            "--max-restarts", "2", "--monitor-interval", "0.2", "--rdzv-backend", "aiocoll",
            "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--rdzv-conf", conf,
            str(self.tmp_path / "worker.py"), str(self.tmp_path / f"stop-{job}"),
        ]  # fmt: skip
        log = open(self.tmp_path / f"{name}.log", "w")  # the child holds it
        proc = subprocess.Popen(
            command, env=_env(), cwd=self.tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text(errors="replace")

    def wait_for(self, name: str, text: str, count: int = 1, within: float = 120) -> None:
        deadline = time.monotonic() + within
        while self.log(name).count(text) < count:
            assert time.monotonic() < deadline, f"{text!r} not {count}x in {name}:\n{self.log(name)[-4000:]}"
            time.sleep(0.2)

    def kill(self, proc: subprocess.Popen[str]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.kill(proc)


def _coordinator(tmp_path: Path, port: int = 0) -> tuple[subprocess.Popen[str], str]:
    log = tmp_path / f"coordinator-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aiocoll", "coordinator", "--port", str(port), "--token-file", "token",
             "--state-dir", "state"],
            env=_env(), cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while "listening on 127.0.0.1:" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    endpoint = "127.0.0.1:" + log.read_text().split("listening on 127.0.0.1:")[1].split()[0]
    return proc, endpoint


def _status(endpoint: str, token_file: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "aiocoll", "status", "--coordinator", endpoint, "--token-file",
         str(token_file), "--json"],
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return {job["job"]: job for job in json.loads(done.stdout)}


def test_torchrun_agents_rendezvous_through_a_coordinator_and_go_on_without_a_killed_one(
    tmp_path: Path,
) -> None:
    from importlib.metadata import entry_points

    if "aiocoll" not in {ep.name for ep in entry_points(group="torchrun.handlers")}:
        pytest.fail("the torchrun.handlers entry point 'aiocoll' is not installed: pip install -e . again")
    (tmp_path / "worker.py").write_text(ELASTIC_WORKER)
    token_file = tmp_path / "token"
    token_file.write_text("torchrun-rdzv-token\n")
    (tmp_path / "wrong").write_text("not-the-token\n")
    coordinator, endpoint = _coordinator(tmp_path)
    agents = _Agents(tmp_path)
    try:
        # Two jobs on one coordinator: "elastic" with two agents (1:2), "solo" with one (1).
        first = agents.start("a0", endpoint, "elastic", "1:2", token_file)
        second = agents.start("a1", endpoint, "elastic", "1:2", token_file)
        solo = agents.start("solo", endpoint, "solo", "1", token_file)
        intruder = agents.start("intruder", endpoint, "elastic", "1:2", tmp_path / "wrong")
        for name in ("a0", "a1"):
            agents.wait_for(name, "RESULT job=elastic world=2 sum=2")
        # The node rendezvous speaks torchrun's option names (the join window is last_call_timeout).
        notes = agents.log("a0") + agents.log("a1")
        assert "--rdzv-join-window" not in notes and "aiocoll run" not in notes, notes
        agents.wait_for("solo", "RESULT job=solo world=1 sum=1")

        # A wrong token is refused before anything is parsed; the job never saw that agent.
        assert intruder.wait(60) != 0
        assert "refused" in agents.log("intruder"), agents.log("intruder")[-3000:]

        # Both jobs are on the coordinator (what its web page shows), the workers as members.
        jobs = _status(endpoint, token_file)
        assert {"elastic", "solo"} <= set(jobs), jobs
        assert sum(1 for m in jobs["elastic"]["members"] if m["alive"]) == 2, jobs["elastic"]
        assert jobs["elastic"]["world_size"] == 2 and jobs["solo"]["world_size"] == 1

        # One node dies with its workers: the other goes on at the smaller size.
        agents.kill(second)
        agents.wait_for("a0", "RESULT job=elastic world=1 sum=1", within=150)
        assert "lost" in agents.log("a0"), agents.log("a0")[-4000:]
        for job in ("elastic", "solo"):
            (tmp_path / f"stop-{job}").touch()
        assert first.wait(120) == 0, agents.log("a0")[-4000:]
        assert solo.wait(120) == 0, agents.log("solo")[-4000:]
    finally:
        agents.close()
        coordinator.send_signal(signal.SIGTERM)
        coordinator.wait(30)

    # Durable with --state-dir: a coordinator started again on it still holds both jobs' keys.
    again, endpoint = _coordinator(tmp_path)
    try:
        jobs = _status(endpoint, token_file)
        assert {"elastic", "solo"} <= set(jobs) and jobs["elastic"]["keys"] > 0, jobs
    finally:
        again.send_signal(signal.SIGTERM)
        again.wait(30)


def test_the_rendezvous_lines_name_torchruns_options() -> None:
    import io

    from aiocoll.torchrun import _TorchrunConsole

    err = io.BytesIO()
    console = _TorchrunConsole(io.BytesIO(), err)
    console.log("waiting up to 5s (--rdzv-join-window) for more; raise --rdzv-timeout, same --job")
    said = err.getvalue().decode()
    assert "(--rdzv-conf last_call_timeout)" in said and "raise --rdzv-conf join_timeout" in said, said
    assert "same --rdzv-id" in said, said
