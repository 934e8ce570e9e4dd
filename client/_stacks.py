"""This process's Python stack as it is now, for `aiocoll status --stacks` and the web page.

Taken on the beat thread (client/control/_beat.py) when the coordinator asks, so it answers while the
event loop is blocked in compute or I/O: the frames of the main thread, of the loop threads of
the engines (``watch_loop``), and of the asyncio tasks suspended on those loops (a coroutine
waiting in ``await pg.all_reduce(x)`` is on no thread's stack). The user's frames come first,
innermost first; aiocoll's, asyncio's and the standard library's after them.

May import only the standard library. Reading another thread's frames and a loop's tasks from
this thread is safe under the GIL: each container is copied in one call, retried if it changed.
"""

from __future__ import annotations

import asyncio
import os
import sys
import sysconfig
import threading
import weakref
from types import FrameType
from typing import Any

__all__ = ["MAX_FRAMES", "current_stack", "watch_loop"]

MAX_FRAMES = 48
_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = weakref.WeakKeyDictionary()


def watch_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Include ``loop``'s thread and its suspended tasks in the stacks (called on that loop)."""
    _loops[loop] = threading.get_ident()


def _library_dirs() -> tuple[str, ...]:
    dirs = set()
    for name in ("aiocoll", "aiocoll.client", "aiocoll.server", "torch", "numpy"):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            dirs.add(os.path.dirname(os.path.abspath(path)) + os.sep)
    for key in ("stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(os.path.abspath(path) + os.sep)
    return tuple(sorted(dirs))


def _is_library(filename: str, library: tuple[str, ...]) -> bool:
    # "<frozen genericpath>", "<string>" (python -c): the interpreter's, not the user's file
    return filename.startswith("<") or os.path.abspath(filename).startswith(library)


def _thread_frames(frame: FrameType | None) -> list[tuple[str, int, str]]:
    out = []
    while frame is not None:
        code = frame.f_code
        out.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return out  # innermost first


def _task_frames(task: asyncio.Task[Any]) -> list[tuple[str, int, str]]:
    """A suspended task's coroutine chain, innermost first."""
    out: list[tuple[str, int, str]] = []
    coro: Any = task.get_coro()
    for _ in range(64):
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        if coro is None:
            break
    out.reverse()
    return out


def _tasks(loop: asyncio.AbstractEventLoop) -> list[asyncio.Task[Any]]:
    for _ in range(3):
        try:
            return [t for t in asyncio.all_tasks(loop) if not t.done()]
        except RuntimeError:  # the set changed while it was copied: look again
            continue
    return []


def current_stack(limit: int = MAX_FRAMES) -> list[dict[str, Any]]:
    """``[{"file", "line", "function"}]``: the user's frames first (innermost first), then the
    library's, at most ``limit``."""
    library = _library_dirs()
    frames = sys._current_frames()
    stacks: list[list[tuple[str, int, str]]] = []
    threads = [threading.main_thread().ident]
    for loop, ident in list(_loops.items()):
        if ident not in threads:
            threads.append(ident)
        for task in _tasks(loop):
            coro: Any = task.get_coro()
            if getattr(coro, "cr_running", False):
                continue  # running: its frames are on its thread's stack
            chain = _task_frames(task)
            if any(not _is_library(f, library) for f, _, _ in chain):
                stacks.append(chain)  # a task of the user's (aiocoll's own say nothing of where it is)
    # The suspended tasks first: a coroutine waiting in an operation is deeper than the frames
    # of the thread that runs its loop (asyncio.run and the script's module).
    here = threading.get_ident()
    stacks += [_thread_frames(frames.get(ident)) for ident in threads if ident is not None and ident != here]
    seen: set[tuple[str, int, str]] = set()
    user: list[tuple[str, int, str]] = []
    rest: list[tuple[str, int, str]] = []
    for stack in stacks:
        for entry in stack:
            if entry in seen:
                continue
            seen.add(entry)
            (rest if _is_library(entry[0], library) else user).append(entry)
    return [{"file": f, "line": line, "function": fn} for f, line, fn in (user + rest)[:limit]]
