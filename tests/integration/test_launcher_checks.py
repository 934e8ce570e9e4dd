"""What `aiocoll run` checks before it starts any worker, and what a worker never does instead.

`--coordinator HOST:PORT` means that coordinator: an explicit address where nothing answers
fails at once, in the launcher, naming the address and what to do; and a worker told
AIOCOLL_COORDINATOR never starts a coordinator of its own when that one does not answer (rank 0
used to, silently, so a job ran on a coordinator nobody asked for). A SCRIPT that does not exist
fails before anything starts. Real processes over loopback; nothing here forms a world.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_launcher import LAUNCHER, _clean_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


MARKING = r"""
import os
here = os.path.dirname(os.path.abspath(__file__))
open(os.path.join(here, "started-" + os.environ["RANK"]), "w").close()
"""


def _free_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_an_explicit_coordinator_that_does_not_answer_fails_before_any_worker_starts(tmp_path: Path) -> None:
    (tmp_path / "marking.py").write_text(MARKING)
    port = _free_port()
    started = time.monotonic()
    proc = subprocess.run(
        [
            *LAUNCHER,
            "--nproc-per-node",
            "2",
            "--coordinator",
            f"127.0.0.1:{port}",
            "--connect-timeout",
            "2",
            "marking.py",
        ],
        cwd=tmp_path,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=45,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    assert elapsed < 15, f"took {elapsed:.1f}s with --connect-timeout 2"
    err = proc.stderr
    assert f"error: no aiocoll coordinator answers at 127.0.0.1:{port}" in err, err
    assert f"aiocoll coordinator --host 127.0.0.1 --port {port}" in err  # how to start one there
    assert "leave out --coordinator" in err  # or let the launcher run one
    assert "--connect-timeout" in err
    assert not list(tmp_path.glob("started-*")), "no worker may start without its coordinator"
    assert "[rank" not in proc.stdout + err


WORKER = r"""
import aiocoll.sync as dist
dist.init_process_group(timeout=8)
print("joined", flush=True)
"""


def test_a_worker_never_starts_a_coordinator_in_place_of_the_one_aiocoll_coordinator_names(
    tmp_path: Path,
) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    port = _free_port()
    env = _clean_env(AIOCOLL_COORDINATOR=f"127.0.0.1:{port}", RANK="0", WORLD_SIZE="1", AIOCOLL_TOKEN="t")
    proc = subprocess.Popen(
        [sys.executable, "worker.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen_listening = False
        while proc.poll() is None:
            seen_listening = seen_listening or _listening(port)
            time.sleep(0.1)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0 and "joined" not in out, out + err
    assert not seen_listening, "rank 0 started a coordinator of its own at AIOCOLL_COORDINATOR's address"
    assert "RendezvousError" in err and f"127.0.0.1:{port}" in err
    assert "Rank 0 does not start one in its place" in err
    # Not a silent wait: after a few seconds the rank says once that it is still trying, and the
    # error says the cause once.
    assert err.count("event=coordinator_not_answering") == 1, err
    assert err.count(f"no aiocoll coordinator answered at 127.0.0.1:{port}") == 1, err


def test_a_missing_script_fails_at_once_and_starts_nothing(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = subprocess.run(
        [*LAUNCHER, "--nproc-per-node", "2", "nosuch.py"],
        cwd=tmp_path,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - started < 20
    assert proc.stderr.startswith("[aiocoll run] error: SCRIPT 'nosuch.py' does not exist")
    assert str(tmp_path.resolve() / "nosuch.py") in proc.stderr
    # Nothing was started: no embedded coordinator, no worker, no status command.
    assert "coordinator listening" not in proc.stderr and "[rank" not in proc.stdout + proc.stderr
    assert "aiocoll status" not in proc.stderr


def test_a_module_the_workers_would_not_find_fails_once_and_starts_nothing(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    marker = tmp_path / "imported"
    (tmp_path / "pkg" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "pkg" / "train.py").write_text("")
    for name, says in (
        ("nosuchmodule", "no module named 'nosuchmodule'"),
        ("pkg", "'pkg' is a package without a __main__ module"),
        ("pkg.nosuch", "no module named 'pkg.nosuch'"),
    ):
        proc = subprocess.run(
            [*LAUNCHER, "--nproc-per-node", "2", "--max-restarts", "2", "-m", name],
            cwd=tmp_path,
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"[aiocoll run] error: -m {name}: {says}"), proc.stderr
        assert str(tmp_path) in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr
        assert "coordinator listening" not in proc.stderr and "[rank" not in proc.stdout + proc.stderr
        if name == "pkg":  # found without running the package's __init__ (it may import torch)
            assert not marker.exists()


def test_a_coordinator_that_refuses_the_token_or_is_not_one_fails_once_before_any_worker_starts(
    tmp_path: Path,
) -> None:
    """The launcher's check is the workers' handshake: another token, or the coordinator's web
    port given as --coordinator, stop the launch once, saying what answered, and start nothing."""
    (tmp_path / "token").write_text("the-right-token")
    (tmp_path / "marking.py").write_text(MARKING)
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiocoll", "coordinator", "--host", "127.0.0.1", "--port", "0",
         "--http-port", "0", "--token-file", "token"],
        cwd=tmp_path, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        port = http_port = None
        log = []
        while port is None or http_port is None:
            line = proc.stdout.readline()
            assert line, f"the coordinator exited before listening: {log}"
            log.append(line)
            if m := re.search(r"http\S* .*on 127\.0\.0\.1:(\d+)", line):
                http_port = int(m.group(1))
            elif m := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained

        cases = {
            "wrong token": (port, "a-wrong-token", "token"),
            "web port": (http_port, "the-right-token", "an HTTP server answered"),
        }
        for case, (where, token, said) in cases.items():
            started = time.monotonic()
            launch = subprocess.run(
                [*LAUNCHER, "--nproc-per-node", "2", "--coordinator", f"127.0.0.1:{where}", "marking.py"],
                cwd=tmp_path, env=_clean_env(AIOCOLL_TOKEN=token), capture_output=True, text=True, timeout=45,
            )  # fmt: skip
            err = launch.stderr
            assert launch.returncode == 2, f"{case}: {err}"
            assert time.monotonic() - started < 20, case
            assert said in err and f"127.0.0.1:{where}" in err, f"{case}: {err}"
            assert "No worker was started" in err, f"{case}: {err}"
            assert err.count("error:") == 1 and "Traceback" not in err, f"{case}: said once: {err}"
            assert not list(tmp_path.glob("started-*")), f"{case}: no worker may start"
            assert "[rank" not in launch.stdout + err, case
    finally:
        proc.kill()
        proc.wait(10)
