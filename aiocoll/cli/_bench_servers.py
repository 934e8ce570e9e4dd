"""Server processes for `aiocoll bench`: an aiocoll coordinator, and torch's TCPStore for comparison.

Each server runs in its own spawned process so that the benchmarked implementations share
nothing but the machine; the parent learns the port through a pipe and stops the server by
closing that pipe. The coordinator child imports only aiocoll.server (never torch); the TCPStore
child imports torch. May import aiocoll.server lazily (in the child), nothing else of aiocoll.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = [
    "ServerProcess",
    "cpu_hogs",
    "process_cpu_seconds",
    "process_cpu_times",
    "quiet_logs",
    "raise_fd_limit",
    "start_coordinator",
    "start_tcpstore",
]


def quiet_logs(verbose: bool) -> None:
    """Keep aiocoll's warnings (a member lost, a failed handshake) out of the tables unless --verbose.

    Warnings are what a benchmark under stress provokes by design; thousands of them would bury
    the results. Errors still show.
    """
    import logging

    logging.getLogger("aiocoll").setLevel(logging.WARNING if verbose else logging.ERROR)


def raise_fd_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit (thousands of sockets); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 16)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
    return soft


# A hog is plain Python arithmetic in a loop: CPU work like a data-loader worker's, no I/O, no
# sleeping, so the scheduler must share the cores between it and the ranks. Once per wrap of the
# counter (a few times a second) it checks that the bench that started it still lives: a bench
# killed with SIGKILL (a test's timeout, say) cannot end its hogs, and they must not spin on.
# The bench's pid comes as an argument: a hog that asked for its parent only once started could
# already be an orphan.
_HOG_PROGRAM = (
    "import os, sys\nparent = int(sys.argv[1])\nx = 0\nwhile True:\n    x = (x + 1) % 1000003\n"
    "    if x == 0 and os.getppid() != parent:\n        break\n"
)


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Run ``count`` busy processes for the duration of the block (nice 0, like the job), then end
    them, even when the block fails."""
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        command = [sys.executable, "-c", _HOG_PROGRAM, str(os.getpid())]
        for _ in range(count):
            hogs.append(subprocess.Popen(command, stdin=subprocess.DEVNULL))
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait(10)


def process_cpu_times(pid: int | None) -> tuple[float, float] | None:
    """The CPU time process ``pid`` has used so far, from /proc: user, system; None where /proc
    does not tell."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tick, int(fields[12]) / tick
    except (OSError, ValueError, IndexError):
        return None


def process_cpu_seconds(pid: int | None) -> float | None:
    """The CPU time (user and system together) process ``pid`` has used so far; None where /proc
    does not tell."""
    times = process_cpu_times(pid)
    return None if times is None else times[0] + times[1]


class ServerProcess:
    """A running server child: ``port``, and ``stop()`` which ends it (idempotent)."""

    def __init__(
        self,
        name: str,
        process: BaseProcess,
        conn: multiprocessing.connection.Connection,
        port: int,
        http_port: int | None = None,
    ):
        self.name = name
        self.process = process
        self.port = port
        self.http_port = http_port
        self._conn = conn

    def rss_bytes(self) -> int | None:
        """Its resident memory now (None where /proc does not tell)."""
        try:
            with open(f"/proc/{self.process.pid}/status", encoding="ascii") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError):
            pass
        return None

    def stop(self, timeout: float = 10.0) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("stop")
        with contextlib.suppress(OSError):
            self._conn.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _start(name: str, target: Any, args: tuple[Any, ...], timeout: float) -> ServerProcess:
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    process = ctx.Process(target=target, args=(child_conn, *args), name=name, daemon=True)
    process.start()
    child_conn.close()
    if not parent_conn.poll(timeout):
        process.kill()
        raise RuntimeError(f"the {name} did not report its port within {timeout:.0f} s")
    try:
        message = parent_conn.recv()
    except EOFError:
        process.join(5)
        raise RuntimeError(
            f"the {name} exited (code {process.exitcode}) before it reported its port"
        ) from None
    if isinstance(message, tuple) and message[0] == "error":
        process.join(5)
        raise RuntimeError(f"the {name} failed to start: {message[1]}")
    if isinstance(message, tuple):  # (port, HTTP port)
        return ServerProcess(name, process, parent_conn, int(message[0]), int(message[1]))
    return ServerProcess(name, process, parent_conn, int(message))


def start_coordinator(
    token: str | None,
    *,
    verbose: bool = False,
    timeout: float = 60.0,
    state_dir: str | None = None,
    http: bool = False,
) -> ServerProcess:
    """Start an aiocoll coordinator on 127.0.0.1 (a free port) in its own process, durable in
    ``state_dir`` when one is given, serving /healthz, /metrics and /jobs on a free port of its
    own with ``http`` (``http_port``).

    Raises:
        RuntimeError: when it does not come up within ``timeout`` seconds, with its error.
    """
    return _start("aiocoll coordinator", _coordinator_main, (token, verbose, state_dir, http), timeout)


def start_tcpstore(*, timeout: float = 60.0) -> ServerProcess:
    """Start torch's TCPStore server (is_master=True) on 127.0.0.1 in its own process.

    Raises:
        RuntimeError: when torch is missing or the server does not come up.
    """
    return _start("torch TCPStore server", _tcpstore_main, (), timeout)


def _wait_for_stop(conn: multiprocessing.connection.Connection) -> None:
    with contextlib.suppress(EOFError, OSError):
        conn.recv()


def _coordinator_main(
    conn: multiprocessing.connection.Connection,
    token: str | None,
    verbose: bool,
    state_dir: str | None = None,
    http: bool = False,
) -> None:
    import asyncio

    raise_fd_limit()
    quiet_logs(verbose)

    async def serve() -> None:
        from aiocoll.server import Coordinator

        coordinator = Coordinator(
            "127.0.0.1",
            0,
            token=token,
            state_dir=state_dir,
            http_port=0 if http else None,
            pace_collector=True,  # as `aiocoll coordinator` runs
        )
        await coordinator.start()
        conn.send((coordinator.port, coordinator.http_port) if http else coordinator.port)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, _wait_for_stop, conn)
        finally:
            await coordinator.stop()

    try:
        try:
            import uvloop

            uvloop.run(serve())
        except ImportError:
            asyncio.run(serve())
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _tcpstore_main(conn: multiprocessing.connection.Connection) -> None:
    raise_fd_limit()
    try:
        import datetime

        from torch.distributed import TCPStore

        store = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=600)
        )
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(store.port)
    _wait_for_stop(conn)
    del store
    time.sleep(0)
