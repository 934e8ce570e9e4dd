"""Spawn N real worker processes on loopback that each run one async function, and collect what
every rank returned or raised. Public-surface testing helper: may import aiocoll.api.

Integration tests spend most of their time starting interpreters, so one world should run many
checks: write one async function that performs them all and returns a dict of outcomes, run it
once per test module (a module-scoped fixture), and let each test assert on its part.

    async def checks(pg):          # module level, so the workers can import it
        out = {}
        x = np.full(4, pg.rank, np.float32)
        await pg.all_reduce(x)
        out["sum"] = x
        return out

    results = run_world(checks, 3)             # list of RankResult, by rank
    values = unwrap(results)                   # raises with every rank's traceback on failure

Tests whose ranks are whole scripts (a torch.distributed script, a module's ``__main__``) use
``run_script_ranks`` instead: one process per argument list, every rank's log in the failure.

Workers start with ``python -c`` (no re-import of the test runner), rank 0 embeds the coordinator
on a free loopback port, and each worker's result or error comes back through a file. Errors are
carried as ``RemoteError`` records (type names, message, the attributes tests look at: rank,
ranks, missing_ranks, seq, group, op), since aiocoll's errors do not all survive pickling.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiocoll._env import env_text
from aiocoll._net import free_port

from .preload import TORCH, PreloadedProcess, start_python

__all__ = [
    "RankResult",
    "outcome",
    "RemoteError",
    "World",
    "free_port",
    "free_ports",
    "run_script_ranks",
    "run_world",
    "unwrap",
]

_ATTRS = ("rank", "ranks", "missing_ranks", "seq", "group", "op", "reason", "keys", "left")


@dataclass
class RemoteError:
    """An exception raised in a worker.

    Attributes:
        type: the class name. names: every class name in its MRO (for ``isinstance``-like checks).
        message: ``str(exc)``. attrs: the listed attributes it had. traceback: formatted.
        elapsed: seconds from the start of the worker's function until it was raised.
    """

    type: str
    names: list[str]
    message: str
    attrs: dict[str, Any] = field(default_factory=dict)
    traceback: str = ""
    elapsed: float = 0.0

    def is_a(self, name: str) -> bool:
        return name in self.names

    def __getattr__(self, name: str) -> Any:
        attrs = self.__dict__.get("attrs", {})
        if name in attrs:
            return attrs[name]
        raise AttributeError(name)

    @classmethod
    def capture(cls, exc: BaseException, elapsed: float = 0.0) -> RemoteError:
        attrs = {}
        for name in _ATTRS:
            value = getattr(exc, name, None)
            if value is not None:
                try:
                    pickle.dumps(value)
                except Exception:
                    value = repr(value)
                attrs[name] = value
        return cls(
            type=type(exc).__name__,
            names=[c.__name__ for c in type(exc).__mro__],
            message=str(exc),
            attrs=attrs,
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            elapsed=elapsed,
        )


@dataclass
class RankResult:
    """What one rank did. ``value`` is the function's return value when it succeeded."""

    rank: int
    value: Any = None
    error: RemoteError | None = None
    exitcode: int | None = None
    returned: bool = False

    @property
    def ok(self) -> bool:
        return self.returned and self.error is None


def unwrap(results: Sequence[RankResult]) -> list[Any]:
    """The ranks' values; raises AssertionError with every failure's traceback otherwise."""
    problems = []
    for r in results:
        if r.error is not None:
            problems.append(f"rank {r.rank} raised {r.error.type}: {r.error.message}\n{r.error.traceback}")
        elif not r.returned:
            problems.append(f"rank {r.rank} returned nothing (exit code {r.exitcode})")
    if problems:
        raise AssertionError("\n".join(problems))
    return [r.value for r in results]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free a moment ago (all bound at once, then closed)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


# Variables a torch.distributed script reads for its rendezvous: a script world sets its own.
_TORCH_RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_script_ranks(
    script: str | os.PathLike[str],
    args: Sequence[Sequence[str]],
    log_dir: os.PathLike[str],
    *,
    timeout: float,
    token: str,
    grace: float = 5.0,
    preload: Sequence[str] = (),
) -> None:
    """Run ``python script *args[r]`` once per rank r, for scripts that rendezvous by themselves.

    ``run_world`` starts a function; this starts a whole script (e.g. a test module
    with a ``__main__`` worker that uses torch.distributed or aiocoll.sync), with AIOCOLL_TOKEN set
    to ``token`` and torch's rendezvous variables removed. Each rank's output goes to
    ``log_dir/rank{r}.log``.

    Args:
        timeout: seconds before every rank still running is killed.
        grace: once one rank failed, seconds the others get before they are killed, so a failure
            never turns into a wait for the whole timeout.
        preload: modules the script imports before its rendezvous (e.g. ``preload.TORCH``): each
            rank is then forked from an interpreter that imported them once (``start_python``).

    Raises:
        AssertionError: when a rank did not exit 0, with the end of every rank's log.
    """
    env = {k: v for k, v in os.environ.items() if k not in _TORCH_RENDEZVOUS_ENV}
    env["AIOCOLL_TOKEN"] = token
    logs = [os.path.join(log_dir, f"rank{r}.log") for r in range(len(args))]
    procs: list[subprocess.Popen[bytes] | PreloadedProcess] = []
    for a, log in zip(args, logs, strict=True):
        with open(log, "wb") as fh:
            command = [sys.executable, os.fspath(script), *a]
            procs.append(start_python(command, preload=preload, env=env, stdout=fh, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + grace):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    report = []
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        with open(log, encoding="utf-8", errors="replace") as fh:
            report.append(f"--- rank {r} exit {p.returncode}\n{fh.read()[-3000:]}")
    assert all(p.returncode == 0 for p in procs), "\n".join(report)


_CHILD = "from aiocoll.testing.world import _child_main; _child_main()"


class World:
    """A running world of worker processes; ``run_world`` is the one-call form.

    Args:
        fn: ``async fn(pg, *args)`` at module level (with ``init=False``:
            ``async fn(rank, world_size, init_method, *args)``).
        world_size: number of workers. args: extra picklable arguments.
        init_method: default tcp://127.0.0.1:<free port> (rank 0 starts the coordinator).
        token, job: passed to init_process_group. init_timeout: rendezvous and op default timeout.
        env: extra environment variables for the workers.
        prefix: ``prefix(rank)`` is a command prefix to start that rank under (e.g. another
            host's namespaces: aiocoll.testing.netns.NamespaceHosts.prefix).

    When ``fn``'s module imported torch at its top level, every worker would import it again to
    load ``fn``: the workers are then forked from an interpreter that imported torch once
    (``start_python``), which saves each of them those seconds of CPU and nothing else.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *,
        args: Sequence[Any] = (),
        init_method: str | None = None,
        token: str | None = "aiocoll-test-token",
        job: str | None = None,
        init_timeout: float = 60.0,
        init: bool = True,
        env: dict[str, str] | None = None,
        prefix: Callable[[int], Sequence[str]] | None = None,
    ) -> None:
        self.world_size = world_size
        self.init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
        self._dir = tempfile.mkdtemp(prefix="aiocoll-world-")
        self.procs: list[subprocess.Popen[bytes] | PreloadedProcess] = []
        base_env = dict(os.environ)
        base_env.update(env or {})
        base_env.setdefault("PYTHONUNBUFFERED", "1")
        for rank in range(world_size):
            payload = {
                "fn": fn,
                "args": tuple(args),
                "rank": rank,
                "world_size": world_size,
                "init_method": self.init_method,
                "token": token,
                "job": job or "test",
                "timeout": init_timeout,
                "init": init,
                "out": os.path.join(self._dir, f"{rank}.pkl"),
            }
            spec_path = os.path.join(self._dir, f"{rank}.spec")
            with open(spec_path, "wb") as f:
                pickle.dump({"sys_path": list(sys.path), "payload": pickle.dumps(payload)}, f)
            with open(spec_path, "rb") as spec:  # the worker reads it as its standard input
                self.procs.append(
                    start_python(
                        [sys.executable, "-c", _CHILD],
                        preload=TORCH if "torch" in _top_level_imports(fn) else (),
                        prefix=prefix(rank) if prefix is not None else (),
                        env=base_env,
                        stdin=spec,
                    )
                )
            os.unlink(spec_path)

    def kill(self, rank: int) -> None:
        """SIGKILL one worker (fault injection from outside)."""
        self.procs[rank].kill()

    def join(self, timeout: float = 120.0) -> list[RankResult]:
        """Wait (bounded) for every worker; kill those still running at the deadline."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            left = max(0.0, deadline - time.monotonic())
            try:
                proc.wait(left)
            except subprocess.TimeoutExpired:
                pass
        results = []
        for rank, proc in enumerate(self.procs):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            res = RankResult(rank, exitcode=proc.returncode)
            path = os.path.join(self._dir, f"{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    kind, value = pickle.load(f)
                if kind == "ok":
                    res.value, res.returned = value, True
                else:
                    res.error, res.returned = value, True
                os.unlink(path)
            results.append(res)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)
        return results


def _top_level_imports(fn: Callable[..., Any]) -> set[str]:
    """The modules ``fn``'s module holds at its top level (a worker imports them anyway when it
    loads ``fn``)."""
    names = vars(sys.modules[fn.__module__]) if fn.__module__ in sys.modules else {}
    return {v.__name__ for v in names.values() if isinstance(v, type(sys))}


def run_world(
    fn: Callable[..., Any], world_size: int, *, timeout: float = 120.0, **kw: Any
) -> list[RankResult]:
    """Run ``fn`` on ``world_size`` fresh worker processes and return every rank's result.

    Args:
        fn, world_size, **kw: see World. timeout: seconds before stragglers are killed.
    Returns:
        RankResult per rank, in rank order.
    """
    return World(fn, world_size, **kw).join(timeout)


async def outcome(call: Callable[[], Any]) -> dict[str, Any]:
    """Run ``call()`` (which may raise at once, or when awaited) in a worker and describe what
    happened as plain data: the error's class name, message, the attributes tests look at, and
    the seconds it took."""
    t0 = time.monotonic()
    try:
        await call()
        return {"error": None, "elapsed": time.monotonic() - t0}
    except Exception as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "rank": getattr(exc, "rank", None),
            "ranks": getattr(exc, "ranks", None),
            "missing": getattr(exc, "missing_ranks", None),
            "seq": getattr(exc, "seq", None),
            "left": getattr(exc, "left", None),
            "elapsed": time.monotonic() - t0,
        }


# -- the worker side ---------------------------------------------------------------------------


def _child_main() -> None:
    spec = pickle.loads(sys.stdin.buffer.read())
    for entry in reversed(spec["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    payload = pickle.loads(spec["payload"])
    import logging

    level = env_text("AIOCOLL_TEST_LOG_LEVEL") or "WARNING"
    logging.basicConfig(
        level=getattr(logging, level), format=f"[rank {payload['rank']}] %(levelname)s %(name)s: %(message)s"
    )
    # AIOCOLL_TEST_UVLOOP=1 runs the worker on uvloop, when it is installed.
    if env_text("AIOCOLL_TEST_UVLOOP") == "1" and importlib.util.find_spec("uvloop") is not None:
        import uvloop

        outcome = uvloop.run(_child(payload))
    else:
        outcome = asyncio.run(_child(payload))
    tmp = payload["out"] + ".tmp"
    with open(tmp, "wb") as f:
        try:
            pickle.dump(outcome, f)
        except Exception as exc:
            f.seek(0)
            f.truncate()
            pickle.dump(("err", RemoteError.capture(exc)), f)
    os.replace(tmp, payload["out"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: faster, and no stray thread can hang the exit


async def _child(payload: dict[str, Any]) -> tuple[str, Any]:
    import warnings

    warnings.simplefilter("ignore")
    fn = payload["fn"]
    t0 = time.monotonic()
    try:
        if not payload["init"]:
            value = await fn(payload["rank"], payload["world_size"], payload["init_method"], *payload["args"])
            return ("ok", value)
        from aiocoll.api import init_process_group

        pg = await init_process_group(
            payload["init_method"],
            rank=payload["rank"],
            world_size=payload["world_size"],
            token=payload["token"],
            job=payload["job"],
            timeout=payload["timeout"],
        )
        t0 = time.monotonic()
        try:
            value = await fn(pg, *payload["args"])
        finally:
            try:
                await asyncio.wait_for(pg.destroy(), 15)
            except Exception:
                pass
        return ("ok", value)
    except BaseException as exc:  # report everything, including SystemExit from the function
        return ("err", RemoteError.capture(exc, time.monotonic() - t0))
