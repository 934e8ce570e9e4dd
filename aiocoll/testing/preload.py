"""Python processes for tests, forked from an interpreter that has already imported torch.

Public testing helper; the server half runs by path (``runpy``), so it imports nothing of aiocoll
and a forked child starts with only the preloaded third-party modules in ``sys.modules``. The
client half may import only the standard library.

Importing torch costs a few seconds of CPU, and a test run starts dozens of processes whose first
act is that import. ``start_python`` gives such a process the same start a fresh ``python`` would
(its arguments, environment, working folder, standard streams and exit status) but forks it from
a server that imported torch once, so the import is paid once per test process instead of once per
child. It falls back to a plain ``subprocess.Popen`` when a fork could not behave like a fresh
interpreter: a command prefix, another interpreter, or environment variables that interpreters
and numeric libraries read only at start-up set otherwise than the server saw them.

The server listens on a Unix socket in a folder only its user can open. Each child is one
connection: the request (arguments, environment, folder, whether to start a new session) with the
child's three standard streams as passed descriptors, answered with the child's pid and, when it
has ended, its wait status.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import IO, Any

__all__ = ["TORCH", "PreloadedProcess", "start_python"]

# What a distributed torch script imports: torch itself, and the parts that take seconds more.
TORCH = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.device_mesh",
)

# Read by an interpreter, or by numpy and torch, once, when they start: a child whose value
# differs from the server's would not get what it asked for, so it starts fresh instead.
_START_UP_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "OPENBLAS_", "CUDA_", "TORCH_", "NCCL_", "KMP_")
_FOLLOWED = ("PYTHONUNBUFFERED",)  # set per child on its new standard streams
_START_S = 300.0  # for the server to import its modules (minutes on a loaded machine), or to fork


def _start_up_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_START_UP_PREFIXES) and k not in _FOLLOWED}


# -- the client half ---------------------------------------------------------------------------


class PreloadedProcess:
    """A child of the preload server, used like ``subprocess.Popen`` (pid, poll, wait, kill,
    terminate, send_signal, returncode, args). Its exit status comes over its own connection."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket) -> None:
        self.args, self.pid, self._conn = args, pid, conn
        self.returncode: int | None = None
        self.stdin = self.stdout = self.stderr = None

    def _read_status(self, timeout: float | None) -> bool:
        if self.returncode is not None:
            return True
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return False
        data = self._conn.recv(4096)
        self._conn.close()
        # No status (the server itself died): report the child as killed rather than hang.
        status = json.loads(data)["status"] if data else (signal.SIGKILL & 0x7F)
        self.returncode = os.waitstatus_to_exitcode(status)
        return True

    def poll(self) -> int | None:
        self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._read_status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> PreloadedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()


class _Server:
    """One preload server, started on first use by this process."""

    def __init__(self, modules: tuple[str, ...]) -> None:
        self.folder = tempfile.mkdtemp(prefix="aiocoll-preload-")  # mode 0700
        self.path = os.path.join(self.folder, "server.sock")
        self.env = _start_up_env(dict(os.environ))
        ready_r, ready_w = os.pipe()
        # The server ends when this pipe does, that is when this process does.
        self._keep_r, self._keep_w = os.pipe()
        code = (
            "import runpy, sys; runpy.run_path(sys.argv[1], run_name='aiocoll_preload_server')"
            "['serve'](sys.argv[2], sys.argv[3].split(','), int(sys.argv[4]), int(sys.argv[5]))"
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                __file__,
                self.path,
                ",".join(modules),
                str(ready_w),
                str(self._keep_r),
            ],
            pass_fds=(ready_w, self._keep_r),
            stdin=subprocess.DEVNULL,
        )
        os.close(ready_w)
        os.close(self._keep_r)
        with os.fdopen(ready_r, "rb") as ready:
            started = select.select([ready], [], [], _START_S)[0] and ready.read(1) == b"1"
        if not started:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(
                f"the preload server for {', '.join(modules)} did not start within {_START_S:g} s"
            )

    def spawn(
        self, args: list[str], env: dict[str, str], cwd: str, streams: list[int], new_session: bool
    ) -> PreloadedProcess:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(_START_S)
        try:
            conn.connect(self.path)
            request = {"argv": args[1:], "env": env, "cwd": cwd, "new_session": new_session}
            socket.send_fds(conn, [json.dumps(request).encode()], streams)
            reply = conn.recv(4096)
        except OSError as exc:
            conn.close()
            raise RuntimeError(f"the preload server did not start {args[1:]}: {exc}") from exc
        if not reply:
            conn.close()
            raise RuntimeError(f"the preload server did not start {args[1:]}")
        conn.settimeout(None)
        return PreloadedProcess(args, int(json.loads(reply)["pid"]), conn)


_servers: dict[tuple[str, ...], _Server] = {}
_servers_lock = threading.Lock()


def _server(modules: tuple[str, ...]) -> _Server:
    with _servers_lock:
        server = _servers.get(modules)
        if server is None or server.proc.poll() is not None:
            server = _servers[modules] = _Server(modules)
        return server


def _stream_fd(value: Any, default: int) -> tuple[int, bool]:
    """The descriptor a Popen-style stream argument names, and whether we opened it."""
    if value is None:
        return default, False
    if value == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), True
    if isinstance(value, int):
        return value, False
    return value.fileno(), False


def start_python(
    args: Sequence[str],
    *,
    preload: Sequence[str] = TORCH,
    prefix: Sequence[str] = (),
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdin: IO[Any] | int | None = None,
    stdout: IO[Any] | int | None = None,
    stderr: IO[Any] | int | None = None,
    start_new_session: bool = False,
) -> PreloadedProcess | subprocess.Popen[bytes]:
    """Start ``args`` (``[sys.executable, script or -c code or -m module, *rest]``) as a child
    forked from a server that imported ``preload``, or as a plain Popen when nothing is to be
    preloaded or a fork could not behave like a fresh interpreter. Streams take a file, a
    descriptor, None or ``subprocess.DEVNULL`` (``stderr`` also ``subprocess.STDOUT``); pipes are
    not offered."""
    args = [os.fspath(a) for a in args]
    env = dict(os.environ if env is None else env)
    interpreter_options = len(args) < 2 or args[1] in ("-u", "-X", "-W", "-O", "-I", "-E", "-S")
    plain = not preload or bool(prefix) or args[0] != sys.executable or interpreter_options
    if not plain:
        server = _server(tuple(preload))
        plain = _start_up_env(env) != server.env
    if plain:
        return subprocess.Popen(
            [*prefix, *args],
            env=env,
            cwd=cwd,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            start_new_session=start_new_session,
        )
    opened: list[int] = []
    fds: list[int] = []
    for value, default in ((stdin, 0), (stdout, 1), (stderr, 2)):
        if value == subprocess.STDOUT:
            fds.append(fds[1])
            continue
        fd, ours = _stream_fd(value, default)
        fds.append(fd)
        opened += [fd] if ours else []
    try:
        return server.spawn(
            args, env, os.fspath(cwd) if cwd is not None else os.getcwd(), fds, start_new_session
        )
    finally:
        for fd in opened:
            os.close(fd)


# -- the server half (run by path in its own interpreter) ----------------------------------------


def serve(path: str, modules: list[str], ready_fd: int, keep_fd: int) -> None:
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the children import it themselves, and fail as a fresh interpreter would
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    os.write(ready_fd, b"1")
    os.close(ready_fd)
    children: dict[int, socket.socket] = {}
    own = [listener.fileno(), wake_r, wake_w, keep_fd]
    while True:
        try:
            ready, _, _ = select.select([listener.fileno(), wake_r, keep_fd], [], [])
        except InterruptedError:
            ready = []
        if keep_fd in ready:
            os._exit(0)  # the process that started us has ended; children run on, as Popen's would
        if wake_r in ready:
            os.read(wake_r, 4096)
        if listener.fileno() in ready:
            conn, _ = listener.accept()
            fds: list[int] = []
            try:
                data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(data)
                pid = os.fork()
                if pid == 0:
                    _child(request, fds, [*own, conn.fileno()])
                conn.send(json.dumps({"pid": pid}).encode())
                children[pid] = conn
            except OSError:
                conn.close()
            finally:
                for fd in fds:
                    os.close(fd)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            waiting = children.pop(pid, None)
            if waiting is not None:
                try:
                    waiting.send(json.dumps({"status": status}).encode())
                except OSError:
                    pass
                waiting.close()


def _child(request: dict[str, Any], fds: list[int], server_fds: list[int]) -> None:
    """Become the requested program, as a fresh interpreter would run it; never returns."""
    import io
    import runpy
    import types

    signal.set_wakeup_fd(-1)
    for sig, handler in (
        (signal.SIGCHLD, signal.SIG_DFL),
        (signal.SIGINT, signal.default_int_handler),
        (signal.SIGTERM, signal.SIG_DFL),
    ):
        signal.signal(sig, handler)
    for fd in server_fds:
        os.close(fd)
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target, inheritable=True)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))

    def text(fd: int, mode: str, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        if mode == "r":
            return io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8", errors=errors)
        binary: Any = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(binary, encoding="utf-8", errors=errors, write_through=unbuffered)

    sys.stdin = text(0, "r", "strict")
    sys.stdout = text(1, "w", "strict")
    sys.stderr = text(2, "w", "backslashreplace")
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # a fresh interpreter's global generator: not the server's state
    argv: list[str] = request["argv"]
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish(code)


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _finish(code: int) -> None:
    """The end of a fresh interpreter: wait for its threads, run its exit handlers, flush."""
    import atexit

    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if code == -signal.SIGINT:  # as an interpreter stopped by Ctrl-C: dead by the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)
