"""The event loop aiocoll runs on: uvloop when installed, and ``aiocoll.run(main())`` for scripts.

A script's ``asyncio.run(main())`` gets the standard event loop. uvloop's loop turns and socket
wake-ups cost less, and side by side (docs/PERFORMANCE.md, "The event loop") small operations
took markedly longer on the standard loop. ``run`` (an addition to the contract, exported as
``aiocoll.run``) gives scripts uvloop in one call; ``AIOCOLL_LOOP=asyncio`` opts out of uvloop.
aiocoll.sync's loop thread runs the standard loop (its selector lets callers drive their own
calls, aiocoll/_sync_loop.py) unless ``AIOCOLL_LOOP=uvloop`` names uvloop: ``new_event_loop``.
Foundation module: standard library, and uvloop when present.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from aiocoll._env import env_text

__all__ = ["new_event_loop", "run"]

_T = TypeVar("_T")


def _wants_uvloop() -> bool:
    return (env_text("AIOCOLL_LOOP") or "uvloop").lower() == "uvloop"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop: uvloop's when installed and not opted out of (AIOCOLL_LOOP=asyncio), else asyncio's."""
    if _wants_uvloop():
        try:
            import uvloop
        except ImportError:
            return asyncio.new_event_loop()
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, _T], *, debug: bool | None = None) -> _T:
    """Run ``main`` to completion on a fresh event loop and return its result, like ``asyncio.run``.

    The loop is uvloop's when uvloop is installed (a dependency of aiocoll on Linux and macOS)
    and AIOCOLL_LOOP is not "asyncio"; else asyncio's default. ``debug`` is asyncio.run's.
    """
    if _wants_uvloop():
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main, debug=debug)
    return asyncio.run(main, debug=debug)
