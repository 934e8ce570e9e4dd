"""Pacing of the cyclic garbage collector (server/_collector.py): no automatic full collection
while any coordinator paces it, the process's setting back after the last one stops, a due
collection postponed while busy (but not for ever) and run when quiet, a disabled collector left
alone."""

from __future__ import annotations

import asyncio
import gc

import pytest
from aiocoll.server import _collector
from aiocoll.server._collector import CollectorPacing

pytestmark = pytest.mark.timeout(10)


async def test_pacing_holds_off_full_collections_and_restores_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()
    before = gc.get_threshold()
    first, second = CollectorPacing(loop, lambda: False), CollectorPacing(loop, lambda: False)
    first.start()
    assert gc.get_threshold()[:2] == before[:2] and gc.get_threshold()[2] >= 1 << 30
    second.start()
    first.stop()
    assert gc.get_threshold()[2] >= 1 << 30, "another coordinator still paces it"
    second.stop()
    assert gc.get_threshold() == before


async def test_a_due_collection_waits_for_a_quiet_moment_but_not_for_ever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_collector, "FULL_EVERY", 0.01)
    monkeypatch.setattr(_collector, "_RETRY", 0.01)
    monkeypatch.setattr(_collector, "QUIET_WAIT_MAX", 0.2)
    loop = asyncio.get_running_loop()
    busy = [True]
    pacing = CollectorPacing(loop, lambda: busy[0])
    pacing.start()
    try:
        await asyncio.sleep(0.08)
        assert pacing.full_collections == 0, "busy: postponed"
        busy[0] = False
        await asyncio.sleep(0.05)
        assert pacing.full_collections >= 1
        busy[0] = True
        done = pacing.full_collections
        await asyncio.sleep(0.4)
        assert pacing.full_collections > done, "busy for longer than QUIET_WAIT_MAX: collected anyway"
    finally:
        pacing.stop()


async def test_a_disabled_collector_is_left_alone() -> None:
    before = gc.get_threshold()
    gc.disable()
    try:
        pacing = CollectorPacing(asyncio.get_running_loop(), lambda: False)
        pacing.start()
        assert gc.get_threshold() == before and not gc.isenabled()
        pacing.stop()
    finally:
        gc.enable()
