"""CoordinatorProcess: `python -m aiocoll coordinator` as a child process, for tests.

Part of the testing surface; imports only the standard library (the coordinator runs in the
child, through the command line, exactly as an operator starts it). It exists so that tests of
the service, of sessions and of their recovery start, read and stop a real coordinator process
the same way: its output goes to a log file, never a pipe that could fill up and stall it; the
port it listens on is read from its log; and every wait is bounded.

    coordinator = CoordinatorProcess(tmp_path / "coordinator.log", "--state-dir", str(state), token=TOKEN)
    ...  # connect to 127.0.0.1:coordinator.port
    coordinator.stop(signal.SIGKILL)   # a crash; stop() (SIGTERM) drains
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

__all__ = ["CoordinatorProcess"]

_LISTENING = re.compile(r"listening on \S+:(\d+)")


class CoordinatorProcess:
    """A coordinator listening on 127.0.0.1, started and ready when the constructor returns.

    Args:
        log_path: the file its stdout and stderr go to (created or truncated).
        *args: more options of `aiocoll coordinator` (--state-dir, --http-port, ...).
        token: the AIOCOLL_TOKEN it runs with.
        port: the port to listen on; 0 lets the kernel pick one (read back as ``port``).
        start_timeout: seconds to wait for it to listen.
        descriptor_limit: the most file descriptors it may open (its RLIMIT_NOFILE, soft and
            hard); None: inherited.

    Attributes:
        proc: the child process. port: the port it listens on. log_path: its log file.

    Raises:
        RuntimeError: with its log, when it did not listen within ``start_timeout`` (it is killed).
    """

    def __init__(
        self,
        log_path: str | os.PathLike[str],
        *args: str,
        token: str,
        port: int = 0,
        start_timeout: float = 30.0,
        descriptor_limit: int | None = None,
    ) -> None:
        self.log_path = os.fspath(log_path)
        self._log = open(self.log_path, "wb")  # closed in stop()
        command = [sys.executable, "-m", "aiocoll", "coordinator", "--host", "127.0.0.1", "--port", str(port)]

        def limit_descriptors() -> None:
            if descriptor_limit is not None:
                import resource

                resource.setrlimit(resource.RLIMIT_NOFILE, (descriptor_limit, descriptor_limit))

        self.proc = subprocess.Popen(
            [*command, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "AIOCOLL_TOKEN": token},
            preexec_fn=limit_descriptors if descriptor_limit is not None else None,
        )
        self.port = self._wait_listening(start_timeout)

    def _wait_listening(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _LISTENING.search(self.log())
            if match:
                return int(match.group(1))
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"the coordinator did not start listening; its log:\n{self.log()}")

    def log(self) -> str:
        """Everything it has written so far."""
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Send ``sig`` (SIGTERM drains; SIGKILL is a crash) and wait, SIGKILL after ``timeout``.

        Returns:
            Its exit status (negative: the signal that ended it). Calling it again is fine.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._log.close()
        return self.proc.returncode
