"""Suite-wide set-up: the project's bytecode compiled once, and mypy in the background.

mypy, when the run includes test_mypy_finds_nothing, starts in the background as soon as the
tests are collected, at a low priority, so that its minute of CPU fills the time the other tests
spend waiting on processes and sockets instead of adding to the suite's wall time; that test then
only reads its verdict (tests/unit/test_static_checks.py).

The suite starts a few thousand Python processes (ranks, launchers, coordinators), and each one
imports the project from source. Where PYTHONDONTWRITEBYTECODE is set (as in CI's environment),
no process writes the bytecode it compiled, so every one of them compiled every module again:
about 0.15 s of CPU per process. Compiling once, before the first test, lets them all load it."""

from __future__ import annotations

import compileall
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
MYPY_TEST = "tests/unit/test_static_checks.py::test_mypy_finds_nothing"


def pytest_configure(config: pytest.Config) -> None:
    # The packages every spawned process imports, and the helper modules the tests' worlds run.
    for folder in ("aiocoll", "client", "server", "tests"):
        compileall.compile_dir(ROOT / folder, quiet=2, workers=1)


class BackgroundCheck(NamedTuple):
    """A static check running beside the tests: its process and the file its output goes to."""

    process: subprocess.Popen[bytes]
    output: IO[bytes]

    def verdict(self, timeout: float) -> tuple[int, str]:
        """Its exit code and output, waiting up to ``timeout`` seconds for it to finish."""
        code = self.process.wait(timeout)
        self.output.seek(0)
        return code, self.output.read().decode(errors="replace")


def mypy_command() -> list[str] | None:
    """mypy of this interpreter's environment (or PATH's), run in the repository's root."""
    found = shutil.which("mypy", path=str(Path(sys.executable).parent)) or shutil.which("mypy")
    return [found] if found else None


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any(item.nodeid == MYPY_TEST for item in session.items):
        return
    command = mypy_command()
    if command is None:
        return  # the test itself says what is missing
    output = tempfile.TemporaryFile()
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: os.nice(10),  # the tests' own processes go first
    )
    session.config.stash[BACKGROUND_MYPY] = BackgroundCheck(process, output)


def pytest_unconfigure(config: pytest.Config) -> None:
    check = config.stash.get(BACKGROUND_MYPY, None)
    if check is not None:
        if check.process.poll() is None:  # the run ended before the test read it (-x, Ctrl-C)
            check.process.kill()
            check.process.wait()
        check.output.close()


BACKGROUND_MYPY = pytest.StashKey[BackgroundCheck]()
