"""Suite-wide set-up: the project's bytecode compiled once, one thread per process for torch and
numpy, and mypy in the background.

mypy, when the run includes test_mypy_finds_nothing, starts in the background as soon as the
tests are collected, at a low priority, so that its minute of CPU fills the time the other tests
spend waiting on processes and sockets instead of adding to the suite's wall time; that test then
only reads its verdict (tests/unit/test_static_checks.py). Under pytest-xdist the controller starts
it, once, and the worker that runs the test reads the verdict from the folder it writes to.

The suite starts a few thousand Python processes (ranks, launchers, coordinators), and each one
imports the project from source. Where PYTHONDONTWRITEBYTECODE is set (as in CI's environment),
no process writes the bytecode it compiled, so every one of them compiled every module again:
about 0.15 s of CPU per process. Compiling once, before the first test, lets them all load it.

torch's and numpy's thread pools (OpenMP, OpenBLAS) start a thread per core in every process that
computes, and their idle threads spin before they sleep. With the xdist workers and their ranks on
two cores, those spinning threads take the CPU from the processes doing the work: a small torch
training loop took 8 to 15 s of CPU with two threads on the loaded two-core machine and 0.5 s with
one. Every process of the run (the workers, and through the environment the processes the tests
start) computes on one thread, as ``aiocoll run`` and torchrun give each of several workers, unless
OMP_NUM_THREADS is set already."""

from __future__ import annotations

import compileall
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Set before any test module imports torch or numpy, which read it once, at their import.
os.environ.setdefault("OMP_NUM_THREADS", "1")
MYPY_TEST = "tests/unit/test_static_checks.py::test_mypy_finds_nothing"


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # an xdist worker: its controller compiled the bytecode and keeps mypy's folder
    # The packages every spawned process imports, and the helper modules the tests' worlds run.
    for folder in ("aiocoll", "client", "server", "tests"):
        compileall.compile_dir(ROOT / folder, quiet=2, workers=1)
    config.stash[BACKGROUND_MYPY] = BackgroundCheck(Path(tempfile.mkdtemp(prefix="aiocoll-mypy-")))


class BackgroundCheck(NamedTuple):
    """A static check running beside the tests, seen through its folder: its output in ``output``,
    and its exit code in ``code`` once it ended (written there by the shell that ran it). Any
    process of the run reads the verdict from the folder: the test that asks for it may run in
    a pytest-xdist worker, and the check was started by the controller."""

    folder: Path

    def started(self) -> bool:
        return (self.folder / "output").exists()

    def verdict(self, timeout: float) -> tuple[int, str]:
        """Its exit code and output, waiting up to ``timeout`` seconds for it to finish."""
        code, end = self.folder / "code", time.monotonic() + timeout
        while not code.exists():
            if time.monotonic() > end:
                raise TimeoutError(f"mypy did not finish within {timeout:g}s (started beside the tests)")
            time.sleep(0.2)
        return int(code.read_text()), (self.folder / "output").read_text(errors="replace")


def mypy_command() -> list[str] | None:
    """mypy of this interpreter's environment (or PATH's), run in the repository's root."""
    found = shutil.which("mypy", path=str(Path(sys.executable).parent)) or shutil.which("mypy")
    return [found] if found else None


def background_mypy(config: pytest.Config) -> BackgroundCheck | None:
    """The background mypy's folder: this process's own, or in an xdist worker the controller's."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        folder = workerinput.get(MYPY_FOLDER_KEY)
        return BackgroundCheck(Path(folder)) if folder else None
    return config.stash.get(BACKGROUND_MYPY, None)


def start_mypy(config: pytest.Config) -> None:
    """mypy in the background, once, writing into the folder ``background_mypy`` names."""
    check = config.stash.get(BACKGROUND_MYPY, None)
    command = mypy_command()
    if check is None or check.started() or command is None:
        return  # not this process's to start, started already, or the test itself says what is missing
    with open(check.folder / "output", "wb") as output:
        process = subprocess.Popen(
            [
                "sh",
                "-c",
                '"$@"; echo $? > "$0/code.tmp" && mv "$0/code.tmp" "$0/code"',
                check.folder,
                *command,
            ],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: os.nice(10),  # the tests' own processes go first
            start_new_session=True,  # its own process group, for pytest_unconfigure to end
        )
    config.stash[MYPY_PROCESS] = process


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(item.nodeid == MYPY_TEST for item in session.items):
        start_mypy(session.config)  # in an xdist worker, a no-op: the controller starts it


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    if MYPY_TEST in ids:
        start_mypy(node.config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    check = node.config.stash.get(BACKGROUND_MYPY, None)
    if check is not None:
        node.workerinput[MYPY_FOLDER_KEY] = str(check.folder)


def pytest_unconfigure(config: pytest.Config) -> None:
    process = config.stash.get(MYPY_PROCESS, None)
    if process is not None and process.poll() is None:  # the run ended before the test read it
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    check = config.stash.get(BACKGROUND_MYPY, None)
    if check is not None:
        shutil.rmtree(check.folder, ignore_errors=True)


BACKGROUND_MYPY = pytest.StashKey[BackgroundCheck]()
MYPY_PROCESS = pytest.StashKey["subprocess.Popen[bytes]"]()
MYPY_FOLDER_KEY = "aiocoll_background_mypy"
