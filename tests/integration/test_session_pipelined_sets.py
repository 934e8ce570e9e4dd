"""Pipelined sets (``pipeline_sets=True``, the default): set returns once queued, later operations
see it, a refused set is reported by a later operation (at the latest by flush and aclose), and
sets not yet acknowledged when the link is cut are re-sent in order before later requests —
against an embedded coordinator over real loopback sockets (through a fault proxy for the cut)."""

from __future__ import annotations

import uuid

import pytest
from aiocoll.client.control.session import CoordinatorSession
from aiocoll.server import Coordinator

from aiocoll import StoreError
from aiocoll.testing.fault_proxy import FaultProxy

pytestmark = pytest.mark.integration

TOKEN = "pipelined-secret"


async def _session(port: int, job: str) -> CoordinatorSession:
    return await CoordinatorSession.connect(
        "127.0.0.1", port, token=TOKEN, job=job, role="store", timeout=20, pipeline_sets=True
    )


@pytest.mark.timeout(60)
async def test_pipelined_sets_are_seen_by_later_operations_and_failures_come_next() -> None:
    async with Coordinator("127.0.0.1", 0, token=TOKEN, max_value_bytes=64) as coord:
        job = f"pipe-{uuid.uuid4().hex}"
        store = await _session(coord.port, job)
        try:
            for i in range(3000):
                await store.set(f"k{i % 50}", f"v{i}")
            assert store._core.no_reply_unsettled, "pipelined sets return before they are acknowledged"
            # Replies come in request order: a later get sees the last value of its key.
            assert await store.get("k49") == b"v2999"
            assert await store.num_keys() == 50
            await store.flush()
            assert not store._core.no_reply_unsettled and not store._core.unsettled

            await store.set("big", b"x" * 65)  # above the coordinator's limit: returns anyway
            # The get below was written before the refusal arrived: it succeeds; the refusal is
            # raised by the first operation started after it arrived.
            assert await store.get("k0") == b"v2950"
            with pytest.raises(StoreError, match="'big'"):
                await store.get("k0")
            assert await store.get("k0") == b"v2950"  # reported once; the session goes on
            assert not await store.check(["big"])

            await store.set("big", b"y" * 100)
            with pytest.raises(StoreError, match="'big'"):
                await store.flush()
            await store.set("late", b"z" * 100)
        finally:
            with pytest.raises(StoreError, match="'late'"):
                await store.aclose()  # the last refusal is not swallowed
        assert store.closed


@pytest.mark.timeout(60)
async def test_pipelined_sets_cut_in_flight_are_resent_once_and_in_order() -> None:
    async with Coordinator("127.0.0.1", 0, token=TOKEN) as coord:
        async with FaultProxy("127.0.0.1", coord.port) as proxy:
            job = f"pipe-{uuid.uuid4().hex}"
            store = await _session(proxy.port, job)
            try:
                await store.set("ctr", b"0")
                await store.flush()
                proxy.pause()  # the next sets are written but held by the proxy
                for i in range(1, 201):
                    await store.set("ctr", str(i))
                    await store.set(f"k{i}", str(i))
                assert store._core.no_reply_unsettled == 400
                proxy.cut()
                proxy.resume()
                # The reconnect re-sends the cut sets, in order, before this get.
                assert await store.get("ctr") == b"200"
                assert await store.num_keys() == 201
                assert await store.multi_get(["k1", "k200"]) == [b"1", b"200"]
                await store.flush()
                assert not store._core.lost_frames() and not store._core.unsettled
            finally:
                await store.aclose()


@pytest.mark.timeout(30)
async def test_connect_store_passes_pipeline_sets_through_and_defaults_to_pipelined_sets() -> None:
    from aiocoll import connect_store

    async with Coordinator("127.0.0.1", 0, token=TOKEN, max_value_bytes=64) as coord:
        url = f"tcp://127.0.0.1:{coord.port}"
        pipelined = await connect_store(url, token=TOKEN, job="pipe-url")
        acknowledged = await connect_store(url, token=TOKEN, job="pipe-url", pipeline_sets=False)
        try:
            assert pipelined.pipeline_sets and not acknowledged.pipeline_sets
            await pipelined.set("a", "1")
            await pipelined.flush()
            assert await acknowledged.get("a") == b"1"
            # An acknowledged set returns once the coordinator has it, and raises its own refusal.
            await acknowledged.set("b", "2")
            assert not acknowledged._core.unsettled
            with pytest.raises(StoreError, match="'big'"):
                await acknowledged.set("big", b"x" * 65)
        finally:
            await pipelined.aclose()
            await acknowledged.aclose()
