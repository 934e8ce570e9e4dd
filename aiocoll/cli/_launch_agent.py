"""The process supervisor behind `aiocoll run`: spawn, prefix output, watch, stop, restart.

One asyncio loop in the launcher process does all of it: it reads every worker's stdout and
stderr without blocking (so no pipe can fill and stall a worker), notices exits, forwards the
launcher's signals, stops the survivors when one worker fails, and restarts the whole
generation while restarts remain. It may import the standard library, the launch config and the
embedded-coordinator seam; never the worker runtime, which the launcher does not need.

Each worker runs in its own session (its own process group): the terminal's Ctrl-C reaches only
the launcher, which forwards it exactly once to every worker's group, and SIGKILL after the
grace period reaches grandchildren (data loader processes, say) too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import dataclasses
import glob
import io
import logging
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, TextIO

from aiocoll._env import env_text

from .._net import free_port as pick_free_port
from ._launch_config import (
    LaunchConfig,
    LaunchConfigError,
    RankLayout,
    dump_directory,
    format_host_port,
    resolve_torch_store_address,
    worker_environment,
)
from ._launch_coordinator import (
    CoordinatorNotAnswering,
    CoordinatorRefused,
    EmbeddedCoordinatorUnavailable,
    start_embedded_coordinator,
    wait_for_coordinator,
)
from ._token_file import write_private_token_file

__all__ = ["Console", "exit_code_of", "describe_returncode", "pick_free_port", "run_agent"]

LOG_PREFIX = b"[aiocoll run] "
# A line longer than this is passed on in pieces: the pending partial line is a bounded buffer.
MAX_LINE_BYTES = 64 * 1024
READ_CHUNK = 64 * 1024
# The last lines of a worker's stderr kept to name the cause of its failure (its last non-blank
# line: a traceback's exception). Its output was shown as it came, so none is shown again.
STDERR_TAIL_LINES = 20
TAIL_LINE_CHARS = 400
# How long to wait, after a worker exits, for the rest of its output to arrive.
PIPE_DRAIN_SECONDS = 2.0
COORDINATOR_STOP_SECONDS = 10.0
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_SPAWN_FAILED = 127
EXIT_SETUP_FAILED = 2


def describe_returncode(returncode: int) -> str:
    """``exit code 3`` or ``killed by signal SIGKILL`` for a Popen returncode."""
    if returncode >= 0:
        return f"exit code {returncode}"
    return f"killed by signal {_signal_name(-returncode)}"


def exit_code_of(returncode: int) -> int:
    """The launcher's exit status for a failed worker: its code, or 128+N when signal N killed it."""
    return returncode if returncode > 0 else 128 - returncode


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Console:
    """Where the launcher writes: worker lines to stdout/stderr, its own log lines to stderr.

    Writes are whole prefixed lines followed by a flush, so lines of different workers never
    interleave mid-line. If the reader of our output goes away (``aiocoll run ... | head``), the
    stream is marked broken and further output to it is dropped; the workers keep running.
    """

    def __init__(self, stdout: IO[bytes] | TextIO, stderr: IO[bytes] | TextIO) -> None:
        self._streams: dict[int, Any] = {1: stdout, 2: stderr}
        self._broken: set[int] = set()
        # What starts each of the launcher's own lines; an elastic node adds its name and node
        # rank, so that the lines of several launchers read apart.
        self.prefix = LOG_PREFIX

    @classmethod
    def from_sys(cls) -> Console:
        return cls(getattr(sys.stdout, "buffer", sys.stdout), getattr(sys.stderr, "buffer", sys.stderr))

    def write(self, stream: int, data: bytes) -> None:
        if stream in self._broken or not data:
            return
        target = self._streams[stream]
        try:
            if isinstance(target, io.TextIOBase):
                target.write(data.decode("utf-8", errors="replace"))
            else:
                target.write(data)
            target.flush()
        except (BrokenPipeError, ValueError, OSError):
            self._broken.add(stream)

    def log(self, message: str) -> None:
        lines = message.splitlines() or [""]
        self.write(
            2, b"".join(self.prefix + line.encode("utf-8", errors="replace") + b"\n" for line in lines)
        )


class _ConsoleLogHandler(logging.Handler):
    """Routes the embedded coordinator's warnings through the launcher's log, prefixed like it."""

    def __init__(self, console: Console) -> None:
        super().__init__(logging.WARNING)
        self._console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._console.log(f"coordinator: {self.format(record)}")
        except Exception:
            self.handleError(record)


class _OutputPump:
    """Reads one worker pipe without blocking and writes it out line by line, prefixed.

    Splits on b"\\n" only; a final line without a newline is flushed (with one added) at EOF.
    Keeps the last lines in ``tail`` (for the failure report) and copies raw bytes to ``tee``.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        pipe: IO[bytes],
        *,
        prefix: bytes,
        console: Console,
        stream: int,
        tail: collections.deque[bytes] | None = None,
        tee: IO[bytes] | None = None,
    ) -> None:
        self._loop = loop
        self._pipe = pipe
        self._fd = pipe.fileno()
        self._prefix = prefix
        # torch prefixes a worker's traceback with the same "[rankN]:" once its default group is
        # made: such a line is not prefixed twice.
        self._own_prefix = prefix.rstrip()
        self._console = console
        self._stream = stream
        self._tail = tail
        self._tee = tee
        self._partial = b""
        self._closed = False
        self.done: asyncio.Future[None] = loop.create_future()
        os.set_blocking(self._fd, False)
        loop.add_reader(self._fd, self._on_readable)

    def _on_readable(self) -> None:
        try:
            data = os.read(self._fd, READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            self._feed(data)
        else:
            self.close()

    def _feed(self, data: bytes) -> None:
        if self._tee is not None:
            with contextlib.suppress(OSError, ValueError):
                self._tee.write(data)
        *lines, partial = (self._partial + data).split(b"\n")
        while len(partial) > MAX_LINE_BYTES:
            lines.append(partial[:MAX_LINE_BYTES])
            partial = partial[MAX_LINE_BYTES:]
        self._partial = partial
        self._emit(lines)

    def _emit(self, lines: list[bytes]) -> None:
        if not lines:
            return
        prefix, own = self._prefix, self._own_prefix
        out = b"".join((line if line.startswith(own) else prefix + line) + b"\n" for line in lines)
        self._console.write(self._stream, out)
        if self._tail is not None:
            self._tail.extend(line.rstrip(b"\r") for line in lines[-STDERR_TAIL_LINES:])

    def close(self) -> None:
        """Stop reading; pass on a pending partial line. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        if self._partial:
            partial, self._partial = self._partial, b""
            self._emit([partial])
        with contextlib.suppress(OSError):
            self._pipe.close()
        if self._tee is not None:
            with contextlib.suppress(OSError, ValueError):
                self._tee.close()
        if not self.done.done():
            self.done.set_result(None)


def _death_signal_preexec() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGKILL the worker if the launcher dies without cleaning up.

    Without it, a launcher killed by the OOM killer or SIGKILL leaves its workers running (and
    possibly waiting on peers) forever. The libc function is looked up here, in the parent, so the
    child only makes one foreign call between fork and exec.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher_pid = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGKILL))
        # The launcher may have died between fork and prctl; then nobody would send the signal.
        if os.getppid() != launcher_pid:
            os._exit(1)

    return preexec


@dataclass
class _Worker:
    local_rank: int
    rank: int
    popen: subprocess.Popen[bytes]
    pumps: list[_OutputPump]
    stderr_tail: collections.deque[bytes]
    returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.popen.poll()
        return self.returncode

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the worker's whole process group (it leads its own session)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    async def drain(self, timeout: float) -> None:
        """Wait (bounded) until its pipes reach EOF, then stop reading them either way."""
        pending = [pump.done for pump in self.pumps if not pump.done.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        for pump in self.pumps:
            pump.close()


@dataclass
class GenerationResult:
    """How one generation of workers ended.

    Attributes:
        returncodes: rank -> Popen returncode (negative: killed by that signal).
        failed: the first worker seen failing (not counting those we stopped), or None.
        spawn_error: why a worker could not be started, or None.
    """

    returncodes: dict[int, int] = field(default_factory=dict)
    failed: _Worker | None = None
    spawn_error: str | None = None

    @property
    def ok(self) -> bool:
        clean = all(code == 0 for code in self.returncodes.values())
        return self.failed is None and self.spawn_error is None and clean


class _Generation:
    """One set of nproc_per_node workers, from spawn until the last one has exited.

    ``layout`` places them (default: the fixed one of the launch); ``generation`` numbers them
    (default: ``restart_count``; an elastic job also starts generations on changes of membership).
    """

    def __init__(
        self,
        config: LaunchConfig,
        console: Console,
        *,
        restart_count: int,
        coordinator: tuple[str, int],
        master_addr: str,
        master_port: int,
        layout: RankLayout | None = None,
        generation: int | None = None,
        max_restarts: int | None = None,
    ) -> None:
        self._config = config
        self._console = console
        self._restart_count = restart_count
        self.layout = config.layout() if layout is None else layout
        self._generation = restart_count if generation is None else generation
        self._max_restarts = max_restarts
        self._coordinator = coordinator
        self._master_addr = master_addr
        self._master_port = master_port
        self._workers: list[_Worker] = []
        self._wake = asyncio.Event()
        self._stopping = False
        self._kill_deadline = 0.0
        self._killed = False
        self._result = GenerationResult()

    # -- stopping, callable from signal handlers -------------------------------------------------

    def request_stop(self, signum: int) -> None:
        """Send ``signum`` to every live worker; SIGKILL follows after the grace period."""
        if self._stopping:
            return
        self._stopping = True
        self._kill_deadline = time.monotonic() + self._config.grace_period
        for worker in self._live():
            worker.signal_group(signum)
        self._wake.set()

    def kill_now(self) -> None:
        """SIGKILL every live worker at once (a second signal to the launcher asks for this)."""
        self._stopping = True
        self._killed = True
        for worker in self._live():
            worker.signal_group(signal.SIGKILL)
        self._wake.set()

    def _live(self) -> list[_Worker]:
        return [w for w in self._workers if w.poll() is None]

    # -- the generation's life -------------------------------------------------------------------

    async def run(self) -> GenerationResult:
        loop = asyncio.get_running_loop()
        preexec = _death_signal_preexec()
        for local_rank in range(self._config.nproc_per_node):
            if self._stopping:
                break
            try:
                self._workers.append(self._spawn(loop, local_rank, preexec))
            except OSError as exc:
                rank = self.layout.global_rank(local_rank)
                self._result.spawn_error = (
                    f"cannot start rank {rank} ({' '.join(self._config.command)}): {exc}"
                )
                self._console.log(self._result.spawn_error)
                self.request_stop(signal.SIGTERM)
                break
        await self._supervise()
        return self._result

    def _spawn(
        self, loop: asyncio.AbstractEventLoop, local_rank: int, preexec: Callable[[], None] | None
    ) -> _Worker:
        config = self._config
        rank = self.layout.global_rank(local_rank)
        env = worker_environment(
            config,
            os.environ,
            local_rank=local_rank,
            restart_count=self._restart_count,
            coordinator=self._coordinator,
            master_addr=self._master_addr,
            master_port=self._master_port,
            layout=self.layout,
            generation=self._generation,
            max_restarts=self._max_restarts,
        )
        tees: list[IO[bytes] | None] = [None, None]
        if config.log_dir is not None:
            folder = os.path.join(config.log_dir, f"restart_{self._generation}")
            os.makedirs(folder, exist_ok=True)
            tees = [open(os.path.join(folder, f"rank{rank}.{name}"), "wb") for name in ("stdout", "stderr")]
        try:
            popen = subprocess.Popen(
                list(config.command),
                env=env,
                # Like mpirun: only the first local worker reads the launcher's stdin.
                stdin=None if local_rank == 0 else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=preexec,
                close_fds=True,
            )
        except BaseException:
            for tee in tees:
                if tee is not None:
                    tee.close()
            raise
        assert popen.stdout is not None and popen.stderr is not None
        prefix = f"[rank{rank}]: ".encode()
        tail: collections.deque[bytes] = collections.deque(maxlen=STDERR_TAIL_LINES)
        pumps = [
            _OutputPump(loop, popen.stdout, prefix=prefix, console=self._console, stream=1, tee=tees[0]),
            _OutputPump(
                loop, popen.stderr, prefix=prefix, console=self._console, stream=2, tail=tail, tee=tees[1]
            ),
        ]
        return _Worker(local_rank=local_rank, rank=rank, popen=popen, pumps=pumps, stderr_tail=tail)

    async def _supervise(self) -> None:
        interval = self._config.monitor_interval
        while True:
            for worker in self._workers:
                if worker.rank not in self._result.returncodes:
                    returncode = worker.poll()
                    if returncode is not None:
                        self._result.returncodes[worker.rank] = returncode
                        if returncode != 0 and not self._stopping:
                            await self._on_failure(worker)
            live = self._live()
            if not live:
                break
            if self._stopping and not self._killed and time.monotonic() >= self._kill_deadline:
                ranks = ", ".join(str(w.rank) for w in live)
                self._console.log(
                    f"rank(s) {ranks} still running {self._config.grace_period:g}s after the stop "
                    "signal; sending SIGKILL"
                )
                self.kill_now()
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=interval)
        # A worker's children may outlive it and hold its pipes open: the job's processes end
        # with the job, and no launcher waits on an orphan's pipe.
        for worker in self._workers:
            worker.signal_group(signal.SIGKILL)
        await asyncio.gather(*(worker.drain(PIPE_DRAIN_SECONDS) for worker in self._workers))

    async def _on_failure(self, worker: _Worker) -> None:
        self._result.failed = worker
        assert worker.returncode is not None
        # The exit can be seen before the last of its stderr is read: wait for EOF (bounded).
        await worker.drain(PIPE_DRAIN_SECONDS)
        self._console.log(
            f"rank {worker.rank} (node {self.layout.node_rank}, local rank {worker.local_rank}, "
            f"pid {worker.pid}) failed: {describe_returncode(worker.returncode)}"
        )
        self._console.log(self._cause(worker))
        others = [w for w in self._live() if w is not worker]
        if others:
            self._console.log(
                f"stopping the other {len(others)} worker(s) with SIGTERM "
                f"(SIGKILL after {self._config.grace_period:g}s)"
            )
        self.request_stop(signal.SIGTERM)

    def _cause(self, worker: _Worker) -> str:
        """One line naming why ``worker`` failed: its last non-blank stderr line (a traceback's
        exception), pointing at its whole output above rather than printing it a second time."""
        text = last_stderr_line(worker)
        if text is None:
            return f"rank {worker.rank} wrote nothing to stderr"
        where = f"its output is above, each line prefixed '[rank{worker.rank}]: '"
        if self._config.log_dir is not None:
            folder = os.path.join(self._config.log_dir, f"restart_{self._generation}")
            where += f", and in {os.path.join(folder, f'rank{worker.rank}.stderr')}"
        return f"rank {worker.rank}'s last stderr line: {text} ({where})"


def dumps_line(job: str) -> str:
    """Where the ranks' flight-recorder dumps are, and how to read them (said when a job fails)."""
    directory = dump_directory(job)
    written = sorted(glob.glob(os.path.join(directory, "*.json"))) if os.path.isdir(directory) else []
    if not written:
        return f"no rank wrote a flight-recorder dump (AIOCOLL_DUMP_DIR={directory})"
    return (
        f"{len(written)} rank(s) wrote a flight-recorder dump in {directory}: read them with "
        f"aiocoll analyze {directory}"
    )


def last_stderr_line(worker: _Worker) -> str | None:
    """A worker's last non-blank stderr line (a traceback's exception), shortened; None if none."""
    last = next((line for line in reversed(worker.stderr_tail) if line.strip()), None)
    if last is None:
        return None
    text = last.decode("utf-8", errors="replace").strip()
    return text[:TAIL_LINE_CHARS] + "..." if len(text) > TAIL_LINE_CHARS else text


class _Agent:
    """Runs generations until one succeeds, restarts run out, or the launcher is signalled.

    With --nnodes MIN:MAX the generations are the job's, decided with the other nodes; an
    ElasticNode (_launch_elastic) runs them, through ``received``, ``begin`` and ``finish``.
    """

    def __init__(
        self, config: LaunchConfig, console: Console, elastic: Callable[..., Any] | None = None
    ) -> None:
        self._config = config
        self._console = console
        self._elastic = elastic  # ElasticNode (_launch_elastic), handed in: it builds on this module
        self._received: int | None = None
        self._current: _Generation | None = None
        self._signalled = asyncio.Event()
        self._status_command = ""
        self._remove_token_file: Callable[[], None] | None = None

    @property
    def config(self) -> LaunchConfig:
        return self._config

    @property
    def console(self) -> Console:
        return self._console

    @property
    def received(self) -> int | None:
        """The first signal the launcher got, or None."""
        return self._received

    @property
    def signalled(self) -> asyncio.Event:
        return self._signalled

    def begin(self, generation: _Generation) -> None:
        """``generation`` is the one signals go to from now on (stopped at once if one came)."""
        self._current = generation
        if self._received is not None:
            generation.request_stop(self._received)

    def finish(self) -> None:
        self._current = None

    def _on_signal(self, signum: int) -> None:
        name = _signal_name(signum)
        if self._received is None:
            self._received = signum
            self._signalled.set()
            if self._current is None:
                self._console.log(f"received {name}: stopping before the workers start")
                return
            self._console.log(f"received {name}: forwarding it to the workers (send it again to kill them)")
            self._current.request_stop(signum)
        else:
            self._console.log(f"received {name} again: killing the workers")
            if self._current is not None:
                self._current.kill_now()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        for signum in FORWARDED_SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(signum, self._on_signal, signum)
                installed.append(signum)
        coordinator: Any = None
        coordinator_logger = logging.getLogger("aiocoll.server")
        log_handler = _ConsoleLogHandler(self._console)
        try:
            config = self._config
            token = config.token if config.token is not None else env_text("AIOCOLL_TOKEN", strip=False)
            if config.coordinator is None:
                coordinator_logger.addHandler(log_handler)
                if not token:
                    # Secure by default: the embedded coordinator and the workers' peer links are
                    # only for this launch, so a fresh random secret costs the user nothing.
                    token = secrets.token_urlsafe(24)
                    config = self._config = dataclasses.replace(config, token=token)
                    self._console.log("no AIOCOLL_TOKEN given: this job uses a random token of its own")
                try:
                    coordinator, host, port = await start_embedded_coordinator(token, config.embedded_port)
                except EmbeddedCoordinatorUnavailable as exc:
                    self._console.log(f"error: {exc}")
                    return EXIT_SETUP_FAILED
                except Exception as exc:  # a port in use, or a bug below: either way, say it and stop
                    self._console.log(f"error: cannot start the embedded coordinator: {exc!r}")
                    return EXIT_SETUP_FAILED
                self._console.log(f"embedded coordinator listening on {host}:{port}")
            else:
                host, port = config.coordinator
                refused = await self._wait_for_coordinator(host, port, token)
                if refused is not None:
                    return refused
            self._status_command = self._make_status_command(host, port, token)
            if config.elastic is not None:
                if self._elastic is None:
                    raise RuntimeError("an elastic job needs the elastic node runner (run_agent's elastic=)")
                self._console.log(f"to see what each rank is doing, run: {self._status_command}")
                return int(await self._elastic(self, (host, port), token).run())
            return await self._run_generations(host, port)
        finally:
            for signum in installed:
                loop.remove_signal_handler(signum)
            if self._remove_token_file is not None:
                self._remove_token_file()
            if coordinator is not None:
                try:
                    await asyncio.wait_for(coordinator.stop(), COORDINATOR_STOP_SECONDS)
                except Exception as exc:  # the job's outcome is already decided; say why and go on
                    self._console.log(f"the embedded coordinator did not stop cleanly: {exc!r}")
            coordinator_logger.removeHandler(log_handler)

    async def _wait_for_coordinator(self, host: str, port: int, token: str | None) -> int | None:
        """Wait until --coordinator completes the handshake with the job's token; None then, else
        the exit status (it did not answer within --connect-timeout, something else answered, or
        the launcher was signalled meanwhile)."""
        where = format_host_port(host, port)
        timeout = self._config.connect_timeout

        def waiting(reason: str) -> None:
            self._console.log(f"waiting up to {timeout:g}s for the coordinator at {where} ({reason})")

        probe = asyncio.ensure_future(
            wait_for_coordinator(host, port, timeout, token=token, job=self._config.job, on_wait=waiting)
        )
        signalled = asyncio.ensure_future(self._signalled.wait())
        try:
            await asyncio.wait({probe, signalled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            signalled.cancel()
            if not probe.done():
                probe.cancel()
                await asyncio.gather(probe, return_exceptions=True)
        if self._received is not None:
            return 128 + self._received
        try:
            probe.result()
        except CoordinatorNotAnswering as exc:
            start = f"aiocoll coordinator --host {host} --port {port}"
            if self._config.token_file is not None:
                start += f" --token-file {shlex.quote(self._config.token_file)}"
            self._console.log(
                f"error: no aiocoll coordinator answers at {where} ({exc.reason}; tried for {timeout:g}s, "
                f"--connect-timeout). Start one there first ({start}, on that machine), or check the "
                "address; or leave out --coordinator to let the launcher run one for this job (one node "
                "only). No worker was started"
            )
            return EXIT_SETUP_FAILED
        except CoordinatorRefused as exc:
            self._console.log(f"error: {exc}. No worker was started")
            return EXIT_SETUP_FAILED
        return None

    def _make_status_command(self, host: str, port: int, token: str | None) -> str:
        """The `aiocoll status` command for this job, its token in a file (mode 0600), never on
        the command line: --token-file's own file, else one written for this launch (removed
        when the launcher exits)."""
        config = self._config
        words = ["aiocoll", "status", "--coordinator", format_host_port(host, port), "--job", config.job]
        token_file = config.token_file if config.token is not None else None
        if token and token_file is None:
            try:
                token_file, self._remove_token_file = write_private_token_file(token)
            except OSError as exc:
                self._console.log(
                    f"warning: cannot write the token to a file for aiocoll status ({exc}); give that "
                    "command AIOCOLL_TOKEN in its environment"
                )
        if token_file is not None:
            words += ["--token-file", token_file]
        return " ".join(shlex.quote(word) for word in words)

    async def _run_generations(self, host: str, port: int) -> int:
        config = self._config
        placement = config.placement
        first, last = config.global_rank(0), config.global_rank(config.nproc_per_node - 1)
        # One MASTER_PORT for the whole launch, not one per restart: torch's store listens with
        # SO_REUSEADDR, so the TIME_WAIT connections a killed rank 0 leaves behind do not stop the
        # next generation's rank 0 from binding the port again, and every process of the previous
        # generation is SIGKILLed (by process group) before the next one starts. A stable port
        # also keeps the address logged below true for the whole job. It is picked after the
        # embedded coordinator is listening, so the kernel cannot hand out the coordinator's port.
        try:
            store = resolve_torch_store_address(config, (host, port), pick_free_port)
        except LaunchConfigError as exc:
            self._console.log(f"error: {exc}")
            return EXIT_SETUP_FAILED
        except OSError as exc:
            self._console.log(f"error: cannot find a free port for MASTER_PORT on 127.0.0.1: {exc}")
            return EXIT_SETUP_FAILED
        for warning in store.warnings:
            self._console.log(f"warning: {warning}")
        self._console.log(
            f"job {config.job!r}: node {placement.node_rank} of {placement.nnodes}, "
            f"ranks {first}..{last} of world size {config.world_size}, "
            f"coordinator {format_host_port(host, port)} (AIOCOLL_COORDINATOR), "
            f"MASTER_ADDR:MASTER_PORT {format_host_port(store.addr, store.port)} "
            f"(rank 0's torch store; {store.source})"
        )
        self._console.log(f"to see what each rank is doing, run: {self._status_command}")
        restart_count = 0
        while True:
            if self._received is not None:
                return 128 + self._received
            generation = _Generation(
                config,
                self._console,
                restart_count=restart_count,
                coordinator=(host, port),
                master_addr=store.addr,
                master_port=store.port,
            )
            self._current = generation
            try:
                result = await generation.run()
            finally:
                self._current = None
            if self._received is not None:
                self._console.log(
                    f"stopped by {_signal_name(self._received)}: {self._summarise(result.returncodes)}"
                )
                return 128 + self._received
            if result.spawn_error is not None:
                return EXIT_SPAWN_FAILED
            if result.ok:
                which = "all" if placement.nnodes == 1 else "all local"
                self._console.log(
                    f"{which} {config.nproc_per_node} rank(s) ({first}..{last}) exited 0; "
                    f"restarts used {restart_count} of {config.max_restarts}"
                )
                return 0
            failed = result.failed
            assert failed is not None and failed.returncode is not None
            reason = f"rank {failed.rank} failed ({describe_returncode(failed.returncode)})"
            if restart_count < config.max_restarts:
                restart_count += 1
                self._console.log(
                    f"{reason}: restarting all {config.nproc_per_node} local worker(s) "
                    f"(restart {restart_count} of {config.max_restarts}, job {config.job!r})"
                )
                continue
            budget = f"after {restart_count} restart(s)" if config.max_restarts else "no restarts allowed"
            self._console.log(f"job failed ({budget}): {reason}")
            self._console.log(f"final status: {self._summarise(result.returncodes)}")
            self._console.log(dumps_line(config.job))
            return exit_code_of(failed.returncode)

    @staticmethod
    def _summarise(returncodes: dict[int, int]) -> str:
        if not returncodes:
            return "no worker was running"
        parts = [f"rank {rank}: {describe_returncode(code)}" for rank, code in sorted(returncodes.items())]
        return "; ".join(parts)


async def run_agent(config: LaunchConfig, console: Console, elastic: Callable[..., Any] | None = None) -> int:
    """Run the job described by ``config`` on this node and return the launcher's exit status.

    Returns:
        0 when every worker of a generation exited 0; the first failed worker's exit code (128+N
        if signal N killed it) when restarts ran out; 128+N when the launcher got signal N;
        127 when a worker could not be started; 2 when the embedded coordinator could not start or
        MASTER_ADDR:MASTER_PORT could not be chosen.

    ``elastic`` runs a job with an elastic node range (``_launch_elastic.ElasticNode``: it builds
    on this module, so it is handed in rather than imported here).
    """
    return await _Agent(config, console, elastic).run()
