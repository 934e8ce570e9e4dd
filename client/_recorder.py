"""The flight recorder's other half: where an operation was called from, and the dump.

The ring itself is the progress tracker's record of finished operations (client/_progress.py,
``ProgressTracker.history``), sized by AIOCOLL_FLIGHT_RECORDER (default 2000; 0 keeps only the
HISTORY operations progress reports need, and takes no call sites). This module says where an
operation was called (``CallSites``: the engine takes the user's frame's code object and offset
at the call, at a depth found once per kind of call; the blocking facade passes its caller's
site instead; ``site_of`` turns either into file:line only when a dump is written), writes the
dump (``write_dump``: ``DIR/<job>-rank<R>.json`` when AIOCOLL_DUMP_DIR is set), and holds the
SIGUSR1 handler that dumps every live tracker of the process.

May import the standard library, aiocoll._env, aiocoll._errors and client/_clock only; never the
engine (it hands its trackers here) nor the public surface.

Dump format (JSON, one object): ``{"version": 1, "job", "rank", "pid", "host", "time",
"reason", "clock", "groups": [{"group", "label", "ranks", "next_seq", "group_rank"}], "ops":
[{"group", "label", "seq", "op", "sig", "state", "outcome", "enter", "end", "site"}]}``:
``state`` is queued, started, completed or failed; ``enter`` and ``end`` are seconds of this
host's wall time (time.time); ``site`` is ``{"file", "line", "function"}`` or null; ``ops`` is
oldest first (finished ones, then pending); ``clock`` is ``{"offset", "error"}``: this host's
time plus ``offset`` seconds is the coordinator's, to within ``error`` (client/_clock.py), or
null when no coordinator's clock was heard.
"""

from __future__ import annotations

import inspect
import json
import logging
import operator
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from types import CodeType, FrameType
from typing import Any

from aiocoll._env import env_int, env_text
from aiocoll._errors import CALLER_SITE, internal_dirs

from ._clock import estimate

__all__ = [
    "DEFAULT_CAPACITY",
    "DUMP_VERSION",
    "CallSites",
    "aiocoll_frames",
    "Site",
    "call_sites",
    "caller_site",
    "capacity",
    "code_at",
    "dump_dir",
    "dump_path",
    "register",
    "site_of",
    "write_dump",
]

log = logging.getLogger("aiocoll.client.recorder")

DEFAULT_CAPACITY = 2000
DUMP_VERSION = 1
# A call site as the engine stores it: (code, offset) of the user's frame (``code_at``), or what
# the blocking facade passed along with the call (aiocoll._errors.Site: filename, line, module
# globals, function) when it came through the facade's loop thread.
Site = tuple[Any, ...]
# One C call that reads a frame's code and offset: the frame itself is not kept.
code_at = operator.attrgetter("f_code", "f_lasti")
# The site the blocking facade passed along with a call.
caller_site = CALLER_SITE.get


def capacity() -> int:
    """Operations each rank keeps (AIOCOLL_FLIGHT_RECORDER; 0: the recorder is off)."""
    value = env_int("AIOCOLL_FLIGHT_RECORDER")
    if value is None:
        return DEFAULT_CAPACITY
    if value < 0:
        raise ValueError(f"environment variable AIOCOLL_FLIGHT_RECORDER={value} must be 0 (off) or more")
    return value


def dump_dir() -> str | None:
    """Where dumps go (AIOCOLL_DUMP_DIR), or None: no dumps."""
    return env_text("AIOCOLL_DUMP_DIR") or None


class CallSites:
    """Where one engine's operations are called from: how many frames above ``Engine.site`` the
    user's frame is (``depth``: every call the user makes to aiocoll's API reaches it through
    the same number of frames: the API's method, its group's provider table, and the engine's
    ``submit_op`` or a row's straight path).

    ``Engine.site`` takes ``code_at(sys._getframe(depth))`` per operation (the user's frame is read,
    never made, and not kept), unless that frame's code is one a walk passed as aiocoll's
    (``passed``; ``code``: the last code found not to be, which a loop's calls need not look up
    again); then, and until the depth is known, it calls ``first``, which walks the stack.
    A walk keeps its depth only for a call the user made to aiocoll's API itself (the outermost
    of aiocoll's frames is in aiocoll/api.py, a ProcessGroup method): a call of aiocoll's own
    on the user's behalf (``aiocoll.ft`` calling a group's collectives) is deeper, and is walked
    each time, so that neither way of calling ever takes the other's depth.
    """

    __slots__ = ("code", "depth", "passed")

    def __init__(self) -> None:
        self.depth = _NO_DEPTH
        self.passed: set[int] = set()  # ids of codes: aiocoll's own stay loaded, never reused
        self.code: CodeType | None = None

    def first(self) -> Site | None:
        """The site of the operation being opened (called from ``Engine.site``); its depth
        is kept for the next ones when the user called aiocoll's API directly."""
        opening = sys._getframe(1)
        ours = aiocoll_frames(opening)
        for f in ours:
            self.passed.add(id(f.f_code))  # (by identity: a code object's hash is slow)
        outermost = ours[-1] if ours else opening
        user = outermost.f_back if ours else opening
        if user is None:  # no frame of the user's on this stack: the engine's own frame
            return code_at(opening)  # (site_of reads it as unknown)
        api = getattr(sys.modules.get("aiocoll.api"), "__file__", None)
        if api is not None and outermost.f_code.co_filename == api:
            self.depth = len(ours)
        return code_at(user)


# A depth no stack reaches (sys._getframe raises ValueError): the first call walks.
_NO_DEPTH = 1 << 30


def call_sites(capacity: int) -> tuple[CallSites | None, bool]:
    """What an engine made now takes per operation: its CallSites; or, when it is made by the
    blocking facade (on the facade's loop thread, where no user frame is), True: the site the
    facade passes along with each call. (None, False) when the recorder is off."""
    if capacity <= 0:
        return None, False
    if caller_site() is not None:
        return None, True
    return CallSites(), False


def aiocoll_frames(frame: FrameType | None) -> list[FrameType]:
    """``frame`` and the frames above it up to the first one outside aiocoll (and asyncio),
    innermost first. aiocoll's command-line tools (aiocoll/cli: the bench's ranks) call the API
    as a user does, and count as the user's: their calls then keep their depth (CallSites)
    instead of a walk each."""
    skip = _package_dirs()
    package = getattr(sys.modules.get("aiocoll"), "__file__", None) or ""
    tools = os.path.join(os.path.dirname(os.path.abspath(package)), "cli") + os.sep
    ours: list[FrameType] = []
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(skip) or path.startswith(tools):
            break
        ours.append(frame)
        frame = frame.f_back
    return ours


def _package_dirs() -> tuple[str, ...]:
    """Where frames are not the user's: aiocoll's, and those of torch and asyncio between the
    user's call and aiocoll's."""
    dirs = list(internal_dirs())
    for name in ("torch", "asyncio"):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def _line_of(code: CodeType, offset: int) -> int:
    for start, end, line in code.co_lines():
        if start <= offset < end and line is not None:
            return line
    return code.co_firstlineno


def site_of(site: Site | None, not_user: tuple[str, ...] | None = None) -> dict[str, Any] | None:
    """The user's frame of a stored site, as ``{"file", "line", "function"}`` (None: unknown)."""
    if site is None:
        return None
    code = site[0]
    if type(code) is CodeType:
        skip = not_user if not_user is not None else _package_dirs()
        if os.path.abspath(code.co_filename).startswith(skip):
            return None  # aiocoll's own frame: no user's frame was on the stack
        return {"file": code.co_filename, "line": _line_of(code, site[1]), "function": code.co_name}
    filename, line, _, function = site  # passed by the blocking facade
    return {"file": filename, "line": int(line), "function": str(function)}


# -- the dump -----------------------------------------------------------------------------------
def dump_path(directory: str, job: str, rank: int) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in job) or "default"
    return os.path.join(directory, f"{safe}-rank{rank}.json")


def _task_started(op: Any) -> bool:
    """False for an operation that runs as a task (its runner has one) not started yet: queued."""
    task = getattr(getattr(op, "lane", None), "task", None)
    if task is None:
        return True  # driven by message callbacks from its call on (an eager operation)
    try:
        return inspect.getcoroutinestate(task.get_coro()) != inspect.CORO_CREATED
    except (TypeError, AttributeError):
        return True


def write_dump(
    directory: str,
    *,
    job: str,
    rank: int,
    reason: str,
    history: Iterable[tuple[Any, ...]],
    groups: Iterable[Any],
    describe: Callable[[Mapping[str, Any]], str],
) -> str:
    """Write this rank's records to ``DIR/<job>-rank<R>.json`` (replacing an earlier dump) and
    return the path. ``history``: the tracker's finished operations; ``groups``: the engine's
    groups, whose pending operations are written after them."""
    now_mono, now_wall = time.monotonic(), time.time()
    offset = now_wall - now_mono
    clock = estimate().current
    skip = _package_dirs()
    said: dict[Any, dict[str, Any] | None] = {}  # site -> its file:line (a loop calls from a few)

    def where(site: Site | None) -> dict[str, Any] | None:
        if site is None or type(site[0]) is not CodeType:  # (the facade's: nothing to look up)
            return site_of(site, skip)
        if site not in said:
            said[site] = site_of(site, skip)
        return said[site]

    labels: dict[str, str] = {}
    group_rows = []
    pending_rows = []
    for group in list(groups):
        labels[group.gid] = group.label
        group_rows.append(
            {
                "group": group.gid,
                "label": group.label,
                "ranks": list(group.ranks),
                "next_seq": group.next_seq,
                "group_rank": group.index,
            }
        )
        for op in sorted(list(group.pending), key=lambda o: (o.seq, o.started)):
            sig = op.sig or {"kind": op.kind}
            pending_rows.append(
                {
                    "group": group.gid,
                    "label": group.label,
                    "seq": op.seq,
                    "op": describe(sig),
                    "sig": _plain(sig),
                    "state": "started" if _task_started(op) else "queued",
                    "outcome": None,
                    "enter": round(op.started + offset, 6),
                    "end": None,
                    "site": where(getattr(op, "site", None)),
                }
            )
    rows = []
    for item in list(history):
        kind, gid, seq, sig, start, end, outcome = item[:7]
        site = item[7] if len(item) > 7 else None
        sig = sig or {"kind": kind}
        rows.append(
            {
                "group": gid,
                "label": labels.get(gid, gid),
                "seq": seq,
                "op": describe(sig),
                "sig": _plain(sig),
                "state": "completed" if outcome == "ok" else "failed",
                "outcome": outcome,
                "enter": round(start + offset, 6),
                "end": round(end + offset, 6),
                "site": where(site),
            }
        )
    body = {
        "version": DUMP_VERSION,
        "job": job,
        "rank": rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "time": round(now_wall, 6),
        "reason": reason,
        "clock": None if clock is None else {"offset": round(clock[0], 6), "error": round(clock[1], 6)},
        "groups": group_rows,
        "ops": rows + pending_rows,
    }
    os.makedirs(directory, exist_ok=True)
    path = dump_path(directory, job, rank)
    part = f"{path}.{os.getpid()}.part"
    with open(part, "w") as f:
        f.write(json.dumps(body, default=str))  # (one C call; json.dump encodes in Python)
    os.replace(part, path)  # a reader never sees half a dump
    return path


def _plain(sig: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in sig.items():
        if isinstance(value, (list, tuple)):
            value = [v if isinstance(v, (int, float, str, bool)) or v is None else str(v) for v in value]
        elif value is not None and not isinstance(value, (int, float, str, bool)):
            value = str(value)
        out[str(key)] = value
    return out


# -- SIGUSR1 ------------------------------------------------------------------------------------
# The trackers of this process that can dump (one per engine); weak, so a closed engine goes.
_live: weakref.WeakSet[Any] = weakref.WeakSet()
_installed = False
_install_lock = threading.Lock()


def register(tracker: Any) -> None:
    """``tracker.dump(reason)`` runs on SIGUSR1 from now on (when AIOCOLL_DUMP_DIR is set)."""
    _live.add(tracker)
    _install()


def _install() -> None:
    """Install the SIGUSR1 handler once, from the main thread, and only where nothing else
    handles the signal (its default action would end the process: with a dump directory the
    user asked for dumps instead)."""
    global _installed
    if _installed or dump_dir() is None:
        return
    with _install_lock:
        if _installed:
            return
        try:
            if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
                _installed = True  # the program handles it itself
                return
            signal.signal(signal.SIGUSR1, _on_sigusr1)
            _installed = True
        except (ValueError, AttributeError, OSError):
            # Not the main thread (the blocking facade makes its engine on the loop thread): the
            # import of aiocoll, which runs on the main thread, installs it (see install_at_import).
            return


def install_at_import() -> None:
    """Install the SIGUSR1 handler now if this is the main thread and dumps are asked for."""
    if threading.current_thread() is threading.main_thread():
        _install()


def _on_sigusr1(signum: int, frame: Any) -> None:
    # Written from a thread of its own: a signal handler runs between two bytecodes of the main
    # thread, which may hold the engine's state half-changed (the writer copies each container
    # in one C call, as the beat thread does).
    threading.Thread(target=_dump_all, args=("SIGUSR1",), name="aiocoll-dump", daemon=True).start()


def _dump_all(reason: str) -> None:
    for tracker in list(_live):
        try:
            path = tracker.dump(reason)
        except Exception:
            log.exception("writing the flight recorder's dump failed")
            continue
        if path:
            print(
                f"aiocoll: rank {tracker.rank}: wrote its flight record to {path}",
                file=sys.stderr,
                flush=True,
            )


install_at_import()
