"""aiocoll.run: asyncio.run on uvloop when uvloop is installed, the standard loop otherwise."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import pytest

import aiocoll


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed")
def test_run_returns_the_result_and_runs_on_uvloop_when_installed() -> None:
    assert aiocoll.run(_loop_module()) == "uvloop"


def test_run_falls_back_to_the_standard_loop_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` now raises ImportError
    assert aiocoll.run(_loop_module()) == "asyncio"
