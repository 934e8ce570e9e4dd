"""What the fault-tolerance tests share (test_fault_tolerance.py, test_ft_sharded.py,
test_ft_diloco.py): the processes a test starts as ranks of replicas, and reading their records.
A helper module of the tests, not a test module; imports the standard library and aiocoll.testing only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from aiocoll.testing.preload import PreloadedProcess, start_python

ROOT = Path(__file__).resolve().parents[2]
RECOVERY_BOUND = 10.0  # seconds from the kill to the survivors' next committed step (measured: ~0.1 s)


def load_script(path: Path) -> Any:
    """The module of the script at ``path`` (a replica script or an example), loaded as is, for
    a test's reference run of what it does."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def records_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def written(path: Path) -> list[dict[str, Any]]:
    """``records_of`` of a file still being written: its last line only once it is whole."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def stop_after(until: Path, step: int) -> None:
    """Tell the ranks that read ``until`` to stop after ``step`` (written whole, at once)."""
    (until.parent / f"{until.name}.tmp").write_text(str(step))
    (until.parent / f"{until.name}.tmp").replace(until)


class Ranks:
    """The processes a test starts as ranks of replicas: each ``NAME`` logs to ``NAME.log`` and
    records its events in ``NAME.jsonl`` in ``tmp``; every wait is bounded and shows the logs."""

    def __init__(self, tmp: Path, script: Path, token: str, preload: tuple[str, ...] = ()) -> None:
        """``preload``: the modules ``script`` imports at its top (start_python forks its ranks
        from an interpreter that imported them once)."""
        self.tmp, self.script, self.token, self.preload = tmp, script, token, preload
        self.procs: dict[str, subprocess.Popen[bytes] | PreloadedProcess] = {}

    def start(self, name: str, args: list[str], job: str = "default", files: str = "") -> None:
        """Start ``NAME``; ``files``: another name's log and record to append to (a process
        started ahead to take that one's place)."""
        files = files or name
        command = [sys.executable, str(self.script), *args, "--record", str(self.tmp / f"{files}.jsonl")]
        env = {**os.environ, "AIOCOLL_TOKEN": self.token, "AIOCOLL_JOB": job}
        log = open(self.tmp / f"{files}.log", "ab")  # the child holds it
        self.procs[name] = start_python(
            command, preload=self.preload, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )

    def all(self, name: str) -> list[dict[str, Any]]:
        return records_of(self.tmp / f"{name}.jsonl")

    def records(self, name: str, event: str = "step") -> list[dict[str, Any]]:
        return [e for e in self.all(name) if e["event"] == event]

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()[-3000:]

    def wait_for(self, what: str, check: Any, seconds: float = 60.0) -> None:
        import time

        end = time.monotonic() + seconds
        while not check():
            if time.monotonic() >= end:  # the logs read only then: each poll would read them all
                logs = "\n".join(
                    f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.tmp.glob("*.log"))
                )
                raise AssertionError(f"not within {seconds:g}s: {what}\n{logs}")
            time.sleep(0.02)

    def finish(self, names: list[str], seconds: float = 60.0) -> None:
        """Wait for ``names`` to exit; each must exit 0."""
        for name in names:
            self.procs[name].wait(seconds)
            assert self.procs[name].returncode == 0, (name, self.log(name))

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
