"""The `aiocoll status` command `aiocoll run` prints works as printed, and only looks.

One real job (a launcher with its embedded coordinator and random token, two workers) is watched
from outside with the very command the launcher printed: it reaches the job through the token
file the launcher wrote (mode 0600; the secret itself is never printed), shows hostnames in the
table and the full host identity in --json, and once every member has left cleanly no longer says
that anything holds the job back. Asking for a job that does not exist, or for none, creates
nothing on the coordinator.
"""

from __future__ import annotations

import json
import shlex
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest
from test_launcher import LAUNCHER, _clean_env

from aiocoll._host import host_identity

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STATUS_PREFIX = "[aiocoll run] to see what each rank is doing, run: "

LAGGING = r"""
import os, time
from pathlib import Path
import aiocoll.sync as dist
here = Path(__file__).parent
dist.init_process_group(timeout=60)
rank = dist.get_rank()
if rank == 1:
    time.sleep(3)   # rank 0 waits in the barrier meanwhile: the coordinator finds rank 1 behind
dist.barrier()
dist.destroy_process_group()   # a clean exit: leave the job
(here / f"left-{rank}").touch()
while not (here / "release").exists():   # stay alive, so the launcher's coordinator does too
    time.sleep(0.05)
"""


class _Lines:
    """Collects a pipe's lines on a thread, so neither of the launcher's pipes can fill."""

    def __init__(self, pipe: IO[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe: IO[str]) -> None:
        for line in pipe:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(prefix):
                    return line
            time.sleep(0.05)
        raise AssertionError(f"no line starting {prefix!r} within {timeout}s: {self.lines[-20:]}")

    def text(self) -> str:
        self._thread.join(10)
        return "\n".join(self.lines)


def _run_status(words: list[str]) -> subprocess.CompletedProcess[str]:
    assert words[:2] == ["aiocoll", "status"], words
    return subprocess.run(
        [sys.executable, "-m", "aiocoll", *words[1:]],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout}s"
        time.sleep(0.05)


def _job(out: str) -> dict[str, Any]:
    (job,) = json.loads(out)
    assert isinstance(job, dict)
    return job


def test_the_printed_status_command_reaches_the_job_and_status_only_looks(tmp_path: Path) -> None:
    (tmp_path / "lagging.py").write_text(LAGGING)
    launcher = subprocess.Popen(
        [*LAUNCHER, "--nproc-per-node", "2", "--job", "lagjob", "--progress-after", "0.2", "lagging.py"],
        cwd=tmp_path,
        env=_clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert launcher.stdout is not None and launcher.stderr is not None
    out, err = _Lines(launcher.stdout), _Lines(launcher.stderr)
    try:
        printed = err.wait_for(STATUS_PREFIX, 30).removeprefix(STATUS_PREFIX)
        words = shlex.split(printed)
        coordinator = words[words.index("--coordinator") + 1]
        token_file = Path(words[words.index("--token-file") + 1])
        assert words[:2] == ["aiocoll", "status"] and words[words.index("--job") + 1] == "lagjob"
        assert coordinator.startswith("127.0.0.1:")
        # The random token lives in a file only this user can read, in a directory of its own.
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
        token = token_file.read_text().strip()
        assert len(token) >= 24

        for rank in (0, 1):
            _wait_for(tmp_path / f"left-{rank}", 60)

        # The printed command, as printed: the table names each host by its hostname.
        shown = _run_status(words)
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["RANK", "HOST"])
        members = [line.split()[:3] for line in lines[header + 1 : header + 3]]
        assert members == [["0", socket.gethostname(), "no"], ["1", socket.gethostname(), "no"]], shown.stdout
        assert "held back" not in shown.stdout

        # --json: the full identity, every member left, and nothing holds the job back any more.
        as_json = _run_status([*words, "--json"])
        assert as_json.returncode == 0, as_json.stderr
        job = _job(as_json.stdout)
        assert [(m["rank"], m["state"]) for m in job["members"]] == [(0, "left"), (1, "left")]
        assert {m["host"] for m in job["members"]} == {host_identity()}
        assert (job["held_back_by"], job["summary"]) == ([], ""), job

        # Asking about a job that does not exist says so, exits 1, and makes no job.
        base = ["aiocoll", "status", "--coordinator", coordinator, "--token-file", str(token_file)]
        missing = _run_status([*base, "--job", "nosuchjob"])
        assert missing.returncode == 1
        assert "no such job 'nosuchjob' (this coordinator holds 'lagjob')" in missing.stderr
        every = _run_status([*base, "--json"])  # no --job: it connects as job 'default'
        assert every.returncode == 0, every.stderr
        assert [j["job"] for j in json.loads(every.stdout)] == ["lagjob"]
    finally:
        (tmp_path / "release").touch()
        try:
            launcher.wait(timeout=60)
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
    stderr, stdout = err.text(), out.text()
    assert launcher.returncode == 0, stderr[-3000:]
    # The run did have a rank holding the job back (the verdict reached rank 0), now cleared.
    assert "rank(s) [1] have not called seq 0" in stderr
    assert stderr.count(STATUS_PREFIX) == 1
    assert token not in stderr and token not in stdout
    assert not token_file.exists() and not token_file.parent.exists()  # removed with the launcher
