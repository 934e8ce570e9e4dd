"""`aiocoll run` as a real process supervising real worker processes.

The workers here are plain Python scripts (print the environment, write a lot, fail, trap
signals), so these tests check the launcher alone: output prefixes, per-rank environment, a
failing worker stopping the rest, restarts, signal forwarding, and the embedded coordinator
answering on the advertised address. Each test spawns one launcher and checks many things
against it. The launcher is started as `python -m aiocoll.cli.run` (the same code the `aiocoll`
dispatcher calls), so these tests do not depend on the other sub-commands existing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

LAUNCHER = [sys.executable, "-m", "aiocoll.cli.run"]


# The token of the module's coordinator: a launcher checks, before any worker starts, that
# --coordinator completes the handshake with the job's token.
COORDINATOR_TOKEN = "launcher-secret"


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real coordinator for --coordinator, holding COORDINATOR_TOKEN; the workers of these
    tests never contact it unless a test says so."""
    token_file = tmp_path_factory.mktemp("coordinator") / "token"
    token_file.write_text(COORDINATOR_TOKEN)
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiocoll", "coordinator", "--host", "127.0.0.1", "--port", "0",
         "--token-file", str(token_file)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_clean_env(),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = []
        listening = re.compile(r"listening on 127\.0\.0\.1:(\d+)")
        while (line := proc.stdout.readline()) and not (found := listening.search(line)):
            lines.append(line)
        assert line, f"the coordinator exited before listening: {lines}"
        # keep its pipe drained
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield f"127.0.0.1:{found.group(1)}"
    finally:
        proc.kill()
        proc.wait(10)


PROBE = r"""
import json, os, sys
rank = int(os.environ["RANK"])
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "MASTER_ADDR", "MASTER_PORT", "AIOCOLL_COORDINATOR", "AIOCOLL_JOB", "AIOCOLL_TOKEN",
        "AIOCOLL_RESTART_COUNT", "OMP_NUM_THREADS"]
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys} | {"argv": sys.argv[1:]}))
lines = int(os.environ.get("PROBE_LINES", "0"))
pad = "x" * 40
for i in range(lines):
    # Far more than a pipe buffer on each stream: a launcher that reads one pipe at a time stalls.
    sys.stdout.write(f"out {rank} {i} {pad}\n")
    sys.stderr.write(f"err {rank} {i} {pad}\n")
sys.stderr.write(f"[rank{rank}]: prefixed by the worker, as torch does\n")
sys.stdout.write(f"partial-out-{rank}")
sys.stderr.write(f"partial-err-{rank}")
"""


def _launch(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 45
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LAUNCHER, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _token_env() -> dict[str, str]:
    """The environment of a launch against the module's coordinator."""
    return _clean_env(AIOCOLL_TOKEN=COORDINATOR_TOKEN)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "AIOCOLL_")) and k not in ("JOB_COMPLETION_INDEX", "OMP_NUM_THREADS")
    }
    env.update(extra)
    return env


def _rank_lines(text: str, rank: int) -> list[str]:
    prefix = f"[rank{rank}]: "
    return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


def _envs(stdout: str, ranks: range) -> dict[int, dict[str, object]]:
    found: dict[int, dict[str, object]] = {}
    for rank in ranks:
        for line in _rank_lines(stdout, rank):
            if line.startswith("ENV "):
                found[rank] = json.loads(line[4:])
    return found


def _logged_addresses(stderr: str) -> tuple[str, str]:
    """(coordinator, MASTER_ADDR:MASTER_PORT) from the launcher's job line."""
    line = next(line for line in stderr.splitlines() if "(AIOCOLL_COORDINATOR)" in line)
    coordinator = line.split(" coordinator ")[1].split()[0]
    store = line.split(" MASTER_ADDR:MASTER_PORT ")[1].split()[0]
    return coordinator, store


def _wait_for(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout}s")
        time.sleep(0.02)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_exited(pid: int, timeout: float = 20.0) -> None:
    """Until process ``pid`` has exited: gone, or a zombie its parent has not reaped yet (its
    exit status is settled then)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            return
        if state in ("Z", "X"):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} still runs (state {state}) after {timeout}s")
        time.sleep(0.02)


def test_every_worker_line_is_prefixed_and_each_rank_gets_its_environment(
    tmp_path: Path, coordinator: str
) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "token").write_text(COORDINATOR_TOKEN + "\n")
    lines = 3000
    proc = _launch(
        "--nproc-per-node",
        "3",
        "--coordinator",
        coordinator,
        "--job",
        "env-check",
        "--token-file",
        "token",
        "--log-dir",
        "logs",
        "probe.py",
        "--lr",
        "0.1",
        "--nproc-per-node",
        "9",
        cwd=tmp_path,
        env=_clean_env(PROBE_LINES=str(lines)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    for stream in (proc.stdout, proc.stderr):
        for line in stream.splitlines():
            assert line.startswith(("[rank0]: ", "[rank1]: ", "[rank2]: ", "[aiocoll run] ")), line
    assert not any(line.startswith("[aiocoll run] ") for line in proc.stdout.splitlines())

    envs = _envs(proc.stdout, range(3))
    assert sorted(envs) == [0, 1, 2]
    # MASTER_PORT is a free port for torch's rank-0 store, the same for every rank, and never the
    # coordinator's: the coordinator is named by AIOCOLL_COORDINATOR. The log line names both.
    logged, store = _logged_addresses(proc.stderr)
    assert logged == coordinator
    master_port = store.removeprefix("127.0.0.1:")
    assert master_port.isdigit() and master_port != coordinator.split(":")[1], store
    for rank, env in envs.items():
        assert env == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_WORLD_SIZE": "3",
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": master_port,
            "AIOCOLL_COORDINATOR": coordinator,
            "AIOCOLL_JOB": "env-check",
            "AIOCOLL_TOKEN": "launcher-secret",
            "AIOCOLL_RESTART_COUNT": "0",
            "OMP_NUM_THREADS": "1",
            "argv": ["--lr", "0.1", "--nproc-per-node", "9"],
        }

    for rank in range(3):
        out = _rank_lines(proc.stdout, rank)
        err = _rank_lines(proc.stderr, rank)
        # Every line arrives whole and in order, and the final partial line is flushed as its own line.
        assert [line for line in out if line.startswith("out ")] == [
            f"out {rank} {i} {'x' * 40}" for i in range(lines)
        ]
        assert [line for line in err if line.startswith("err ")] == [
            f"err {rank} {i} {'x' * 40}" for i in range(lines)
        ]
        assert out[-1] == f"partial-out-{rank}" and err[-1] == f"partial-err-{rank}"
        # A line the worker prefixed itself (torch does, with the same "[rankN]:") is not prefixed twice.
        assert f"[rank{rank}]: prefixed by the worker, as torch does" in proc.stderr.splitlines()
        # --log-dir keeps the raw output, unprefixed.
        raw = (tmp_path / "logs" / "restart_0" / f"rank{rank}.stdout").read_text()
        assert raw.startswith("ENV ") and raw.endswith(f"partial-out-{rank}")
        raw_err = (tmp_path / "logs" / "restart_0" / f"rank{rank}.stderr").read_text()
        assert raw_err.startswith(f"err {rank} 0 ")

    assert "[aiocoll run] all 3 rank(s) (0..2) exited 0" in proc.stderr
    # The status command for the job names --token-file's own file, never the secret itself.
    token_file = (tmp_path / "token").resolve()
    assert f"run: aiocoll status --coordinator {coordinator} --job env-check --token-file {token_file}\n" in (
        proc.stderr
    )
    launcher_lines = [line for line in proc.stderr.splitlines() if line.startswith("[aiocoll run] ")]
    assert not any("launcher-secret" in line for line in launcher_lines)


def test_node_rank_and_node_count_come_from_an_srun_task_and_number_global_ranks(
    tmp_path: Path, coordinator: str
) -> None:
    (tmp_path / "probe_module.py").write_text(PROBE)
    env = _clean_env(
        SLURM_PROCID="1",
        SLURM_NTASKS="2",
        SLURM_NNODES="2",
        SLURM_NODEID="1",
        SLURM_LOCALID="0",
        PYTHONPATH=str(tmp_path),
        AIOCOLL_TOKEN=COORDINATOR_TOKEN,
    )
    proc = _launch(
        "--nproc_per_node",
        "2",
        "--coordinator",
        coordinator,
        "-m",
        "probe_module",
        "a",
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "node rank 1 from SLURM_PROCID" in proc.stderr and "nnodes=2 from SLURM_NTASKS" in proc.stderr
    # Several nodes cannot agree on a free port: MASTER_PORT is torchrun's 29500 on the
    # coordinator's host, and the launcher says to pass --master-addr for torch-store scripts.
    assert "--master-addr NODE0_ADDR" in proc.stderr
    envs = _envs(proc.stdout, range(4))
    assert sorted(envs) == [2, 3]
    for local_rank, rank in enumerate((2, 3)):
        assert envs[rank]["LOCAL_RANK"] == str(local_rank)
        placed = (envs[rank]["WORLD_SIZE"], envs[rank]["GROUP_RANK"], envs[rank]["AIOCOLL_COORDINATOR"])
        assert placed == ("4", "1", coordinator)
        assert (envs[rank]["MASTER_ADDR"], envs[rank]["MASTER_PORT"]) == ("127.0.0.1", "29500")
        assert envs[rank]["AIOCOLL_TOKEN"] == COORDINATOR_TOKEN and envs[rank]["argv"] == ["a"]


FAILING = r"""
import os, signal, sys, time
rank = int(os.environ["RANK"])
here = os.path.dirname(os.path.abspath(__file__))
def mark(name, text=""):
    with open(os.path.join(here, name), "w") as f:
        f.write(text)
if rank == 0:
    def on_term(signum, frame):
        mark("rank0-got-sigterm")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    mark("ready0")
elif rank == 2:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # must be SIGKILLed after the grace period
    mark("pid2", str(os.getpid()))
    mark("ready2")
else:
    while not (os.path.exists(os.path.join(here, "ready0")) and os.path.exists(os.path.join(here, "ready2"))):
        time.sleep(0.01)
    print("Traceback (most recent call last):", file=sys.stderr)
    print('  File "train.py", line 12, in <module>', file=sys.stderr)
    print("ValueError: loss is nan at step 7", file=sys.stderr)
    sys.exit(3)
time.sleep(120)
"""


def test_a_failing_worker_stops_the_others_and_the_launcher_exits_with_its_code(
    tmp_path: Path, coordinator: str
) -> None:
    (tmp_path / "failing.py").write_text(FAILING)
    started = time.monotonic()
    proc = _launch(
        "--nproc-per-node",
        "3",
        "--grace-period",
        "1",
        "--coordinator",
        coordinator,
        "failing.py",
        cwd=tmp_path,
        env=_token_env(),
    )
    assert time.monotonic() - started < 40, "the launcher should stop the sleeping workers, not wait for them"
    assert proc.returncode == 3, proc.stderr
    err = proc.stderr
    assert "[aiocoll run] rank 1 (node 0, local rank 1, pid " in err
    assert ") failed: exit code 3" in err
    # Its traceback is shown once, as it came; the report names the cause in one line.
    assert err.count("Traceback (most recent call last):") == 1
    assert "[rank1]: Traceback (most recent call last):" in err
    cause = (
        "[aiocoll run] rank 1's last stderr line: ValueError: loss is nan at step 7 "
        "(its output is above, each line prefixed '[rank1]: ')"
    )
    assert cause in err
    assert err.count("ValueError: loss is nan at step 7") == 2  # its own line and the cause
    assert "stopping the other 2 worker(s) with SIGTERM" in err
    assert "rank(s) 2 still running 1s after the stop signal; sending SIGKILL" in err
    assert "job failed (no restarts allowed): rank 1 failed (exit code 3)" in err
    assert "rank 0: exit code 0; rank 1: exit code 3; rank 2: killed by signal SIGKILL" in err
    assert (tmp_path / "rank0-got-sigterm").exists()
    assert not _pid_alive(int((tmp_path / "pid2").read_text()))


SELF_KILLING = r"""
import os, signal, time
print("generation", os.environ["AIOCOLL_RESTART_COUNT"], flush=True)
if os.environ["RANK"] == "0":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


def test_restarts_run_out_and_a_signal_death_is_named_and_exits_128_plus_signal(
    tmp_path: Path, coordinator: str
) -> None:
    (tmp_path / "self_killing.py").write_text(SELF_KILLING)
    proc = _launch(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--grace-period",
        "5",
        "--coordinator",
        coordinator,
        "self_killing.py",
        cwd=tmp_path,
        env=_token_env(),
    )
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert _rank_lines(proc.stdout, 0) == ["generation 0", "generation 1"]
    err = proc.stderr
    assert err.count("failed: killed by signal SIGKILL") == 2
    assert "rank 0 failed (killed by signal SIGKILL): restarting all 2 local worker(s) (restart 1 of 1" in err
    assert "job failed (after 1 restart(s)): rank 0 failed (killed by signal SIGKILL)" in err
    assert "rank 1: killed by signal SIGTERM" in err


RESTARTING = r"""
import os, sys
here = os.path.dirname(os.path.abspath(__file__))
marker = os.path.join(here, "failed-once")
print("attempt", os.environ["AIOCOLL_RESTART_COUNT"], os.environ["AIOCOLL_JOB"], flush=True)
if os.environ["RANK"] == "1" and not os.path.exists(marker):
    open(marker, "w").close()
    print("first generation fails", file=sys.stderr)
    sys.exit(5)
"""


def test_max_restarts_restarts_the_whole_generation_with_the_same_job(
    tmp_path: Path, coordinator: str
) -> None:
    (tmp_path / "restarting.py").write_text(RESTARTING)
    proc = _launch(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--job",
        "elastic-7",
        "--coordinator",
        coordinator,
        "restarting.py",
        cwd=tmp_path,
        env=_token_env(),
    )
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        assert _rank_lines(proc.stdout, rank) == ["attempt 0 elastic-7", "attempt 1 elastic-7"]
    err = proc.stderr
    assert "rank 1 (node 0, local rank 1" in err and "failed: exit code 5" in err
    assert "[aiocoll run] rank 1's last stderr line: first generation fails" in err
    restarting = (
        "rank 1 failed (exit code 5): restarting all 2 local worker(s) (restart 1 of 1, job 'elastic-7')"
    )
    assert restarting in err
    assert "all 2 rank(s) (0..1) exited 0; restarts used 1 of 1" in err


TRAPPING = r"""
import os, signal, sys, time
rank = os.environ["RANK"]
here = os.path.dirname(os.path.abspath(__file__))
def on_signal(signum, frame):
    with open(os.path.join(here, f"rank{rank}-got"), "a") as f:
        f.write(signal.Signals(signum).name + "\n")
    if rank == "0":
        sys.exit(0)
    # rank 1 ignores the request: only a second signal to the launcher (SIGKILL) ends it.
signal.signal(signal.SIGTERM, on_signal)
with open(os.path.join(here, f"ready{rank}"), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def test_signals_to_the_launcher_reach_every_worker_and_a_second_one_kills(
    tmp_path: Path, coordinator: str
) -> None:
    (tmp_path / "trapping.py").write_text(TRAPPING)
    launcher = subprocess.Popen(
        [
            *LAUNCHER,
            "--nproc-per-node",
            "2",
            "--grace-period",
            "60",
            "--coordinator",
            coordinator,
            "trapping.py",
        ],
        cwd=tmp_path,
        env=_token_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(tmp_path / "ready0")
        _wait_for(tmp_path / "ready1")
        launcher.send_signal(signal.SIGTERM)
        _wait_for(tmp_path / "rank1-got")
        # rank 0 exits on the first signal: its exit code is settled before the second one comes
        _wait_exited(int((tmp_path / "ready0").read_text()))
        assert launcher.poll() is None, "rank 1 ignores SIGTERM, so the launcher must still be waiting"
        started = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        _out, err = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert time.monotonic() - started < 20, "the second signal must not wait for the 60 s grace period"
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert (tmp_path / "rank0-got").read_text() == "SIGTERM\n"
    assert (tmp_path / "rank1-got").read_text() == "SIGTERM\n"
    assert "received SIGTERM: forwarding it to the workers" in err
    assert "received SIGTERM again: killing the workers" in err
    assert "stopped by SIGTERM: rank 0: exit code 0; rank 1: killed by signal SIGKILL" in err
    assert not _pid_alive(int((tmp_path / "ready1").read_text()))


def test_a_program_that_cannot_start_is_reported_with_exit_127(tmp_path: Path, coordinator: str) -> None:
    proc = _launch(
        "--no-python",
        "--nproc-per-node",
        "2",
        "--coordinator",
        coordinator,
        str(tmp_path / "no-such-program"),
        cwd=tmp_path,
        env=_token_env(),
    )
    assert proc.returncode == 127
    assert f"cannot start rank 0 ({tmp_path / 'no-such-program'}): [Errno 2]" in proc.stderr


def _has_coordinator() -> bool:
    try:
        import aiocoll.server as server
    except ImportError:
        return False
    return hasattr(server, "Coordinator")


COORDINATOR_CLIENT = r"""
import asyncio, os, socket, sys
coordinator = os.environ["AIOCOLL_COORDINATOR"]
addr, port = coordinator.rsplit(":", 1)
master_addr, master_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
generation = os.environ["AIOCOLL_RESTART_COUNT"]
print("addresses", coordinator, f"{master_addr}:{master_port}", flush=True)
if rank == 0:
    # What torch's rank 0 does with env://: listen on MASTER_ADDR:MASTER_PORT. It must be free.
    listener = socket.create_server((master_addr, master_port))
    listener.close()
if os.environ["USE_STORE"] == "1":
    from aiocoll import connect_store
    async def main():
        store = await connect_store(f"tcp://{coordinator}", timeout=30)
        await store.set(f"hello/{generation}/{rank}", f"{generation}:{rank * 10}")
        values = [await store.get(f"hello/{generation}/{r}") for r in range(world)]
        print("store", b",".join(values).decode(), flush=True)
        await store.aclose()
    asyncio.run(main())
else:
    # No store client yet: at least the embedded coordinator must accept a connection there.
    socket.create_connection((addr, int(port)), timeout=10).close()
    print("connected", addr, port, flush=True)
if generation == "0" and rank == 1:
    sys.exit(7)   # the second generation must find the same coordinator still serving the job
"""


@pytest.mark.skipif(not _has_coordinator(), reason="aiocoll.server.Coordinator has not landed yet")
def test_embedded_coordinator_answers_at_aiocoll_coordinator_and_outlives_a_restart(tmp_path: Path) -> None:
    use_store = importlib.util.find_spec("aiocoll._connect") is not None
    (tmp_path / "client.py").write_text(COORDINATOR_CLIENT)
    proc = _launch(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "client.py",
        cwd=tmp_path,
        env=_clean_env(AIOCOLL_TOKEN="t0k", USE_STORE="1" if use_store else "0"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("embedded coordinator listening on 127.0.0.1:") == 1
    port = proc.stderr.split("embedded coordinator listening on 127.0.0.1:")[1].split()[0]
    coordinator, store = _logged_addresses(proc.stderr)
    assert coordinator == f"127.0.0.1:{port}"
    assert store.startswith("127.0.0.1:") and store != coordinator
    for rank in (0, 1):
        lines = _rank_lines(proc.stdout, rank)
        # Both generations are told the same two (different) addresses the launcher logged.
        told = [line for line in lines if line.startswith("addresses ")]
        assert told == [f"addresses {coordinator} {store}"] * 2
        answers = [line for line in lines if not line.startswith("addresses ")]
        if use_store:
            assert answers == ["store 0:0,0:10", "store 1:0,1:10"]
        else:
            assert answers == [f"connected 127.0.0.1 {port}"] * 2
    assert "restart 1 of 1" in proc.stderr
    # The embedded coordinator's own log lines come through the launcher's prefix too.
    for line in proc.stderr.splitlines():
        assert line.startswith(("[rank0]: ", "[rank1]: ", "[aiocoll run] ")), line


def _has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


GLOO = r"""
import os, time
import torch
import torch.distributed as dist
generation = int(os.environ["AIOCOLL_RESTART_COUNT"])
dist.init_process_group("gloo")   # env://: rank 0 listens on MASTER_ADDR:MASTER_PORT
rank, world = dist.get_rank(), dist.get_world_size()
assert (rank, world) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
tensor = torch.arange(4, dtype=torch.float32) + 10 * rank
dist.all_reduce(tensor)
expected = torch.arange(4, dtype=torch.float32) * world + 10 * sum(range(world))
assert torch.equal(tensor, expected), (tensor, expected)
print("all_reduce", generation, tensor.tolist(), os.environ["MASTER_PORT"], flush=True)
if generation == 0:
    if rank == 1:
        # os._exit: interpreter teardown with a live gloo group would abort (SIGABRT) instead.
        os._exit(3)   # the restarted rank 0 must bind the same MASTER_PORT again
    time.sleep(60)    # rank 0 waits to be stopped, so rank 1's is the failure reported
dist.barrier()
dist.destroy_process_group()
print("done", generation, flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _has_torch(), reason="torch is not installed")
def test_plain_torch_gloo_script_runs_unchanged_and_restarts_on_the_same_master_port(tmp_path: Path) -> None:
    (tmp_path / "gloo_script.py").write_text(GLOO)
    # No --coordinator: the embedded coordinator holds its own port, and MASTER_PORT must be free.
    proc = _launch(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--grace-period",
        "5",
        "gloo_script.py",
        cwd=tmp_path,
        env=_clean_env(),
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    coordinator, store = _logged_addresses(proc.stderr)
    master_port = store.removeprefix("127.0.0.1:")
    assert coordinator.startswith("127.0.0.1:") and coordinator != store
    summed = [0.0 + 10.0, 2.0 + 10.0, 4.0 + 10.0, 6.0 + 10.0]
    assert _rank_lines(proc.stdout, 0) == [
        f"all_reduce 0 {summed} {master_port}",
        f"all_reduce 1 {summed} {master_port}",
        "done 1",
    ]
    assert _rank_lines(proc.stdout, 1) == [
        f"all_reduce 0 {summed} {master_port}",
        f"all_reduce 1 {summed} {master_port}",
        "done 1",
    ]
    assert "rank 1 failed (exit code 3): restarting all 2 local worker(s)" in proc.stderr
    assert "EADDRINUSE" not in proc.stderr and "address already in use" not in proc.stderr.lower()


def _dispatcher_complete() -> bool:
    return all(
        importlib.util.find_spec(f"aiocoll.cli.{name}") is not None
        for name in ("coordinator", "run", "bench", "status")
    )


@pytest.mark.skipif(not _dispatcher_complete(), reason="not every `aiocoll` sub-command module exists yet")
def test_aiocoll_run_help_through_the_dispatcher_shows_examples(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "aiocoll", "run", "--help"], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    for fragment in ("examples:", "--nproc-per-node", "--max_restarts", "exit status:"):
        assert fragment in proc.stdout, fragment


TOKEN_CLIENT = r"""
import asyncio, os
import aiocoll
async def main():
    store = await aiocoll.connect_store("tcp://" + os.environ["AIOCOLL_COORDINATOR"], timeout=20)
    await store.set("rank" + os.environ["RANK"], "here")
    await store.wait(["rank0", "rank1"])
    await store.aclose()
    print("TOKEN", os.environ["AIOCOLL_TOKEN"], flush=True)
asyncio.run(main())
"""


@pytest.mark.skipif(not _has_coordinator(), reason="aiocoll.server.Coordinator has not landed yet")
def test_without_a_token_each_launch_uses_a_random_secret_its_coordinator_requires(tmp_path: Path) -> None:
    (tmp_path / "client.py").write_text(TOKEN_CLIENT)
    tokens = []
    for _ in range(2):
        proc = _launch("--nproc-per-node", "2", "client.py", cwd=tmp_path, env=_clean_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "random token of its own" in proc.stderr
        assert "no token" not in proc.stderr  # no worker had to warn about an open job
        seen = {
            line.split()[-1]
            for rank in (0, 1)
            for line in _rank_lines(proc.stdout, rank)
            if line.startswith("TOKEN ")
        }
        assert len(seen) == 1 and len(next(iter(seen))) >= 24  # one shared secret per launch
        tokens.append(seen.pop())
    assert tokens[0] != tokens[1]
