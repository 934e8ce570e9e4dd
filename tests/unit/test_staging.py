"""The pinned staging pipeline against the thread-backed device: real threads, real events.

The device's streams are worker threads and its copies run later than the call that queued them,
so an ordering bug (a copy that does not wait for the caller's event, a buffer reused before its
copy ran, a result read before it landed) shows up as wrong values here, not just on a GPU.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aiocoll._errors import PeerLostError
from aiocoll.device._device import DeviceError
from aiocoll.device._device_threads import ThreadDevice, raise_device_error
from aiocoll.device._staging import DeviceSpan, Piece, Staging, chunk_bounds, ready_event, run_pipeline

pytestmark = pytest.mark.timeout(60)


def _spans(tensor: Any, chunk: int, *, read: bool = True, write: bool = True) -> list[list[Piece]]:
    whole = DeviceSpan(tensor, tensor.flat.dtype, 0, tensor.numel, read=read, write=write)
    return [[Piece(whole[a:b], read, write)] for a, b in chunk_bounds(tensor.numel, chunk)]


def pipe(staging: Staging, chunks: Any, transfer: Any, **kw: Any) -> Any:
    """run_pipeline with, unless given, the caller's event recorded now and a fresh lease."""
    kw.setdefault("ready", ready_event(staging.device))
    kw.setdefault("lease", staging.pool.lease())
    kw.setdefault("what", "test")
    return run_pipeline(staging, chunks, transfer, **kw)


async def _eventually(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.002)


async def _nothing(k: int, views: list[np.ndarray]) -> None:
    await asyncio.sleep(0)


@pytest.fixture
def device() -> Any:
    dev = ThreadDevice()
    yield dev
    dev.close()


async def test_copies_wait_for_the_event_recorded_on_the_callers_stream(device: ThreadDevice) -> None:
    # The caller's "kernel" writes the values 0.3 s after it was queued; the pipeline is started
    # right away. Without the side stream's wait for the caller's event it copies the zeros.
    staging = Staging(device, buffer_bytes=64, capacity=2)
    tensor = device.tensor(np.zeros(40, np.float32))
    caller = device.new_stream()
    device.set_current_stream(caller)
    try:

        def kernel() -> None:
            time.sleep(0.3)
            tensor.flat[:] = np.arange(40, dtype=np.float32)

        device.launch(caller, kernel)
        ready = ready_event(device)
    finally:
        device.set_current_stream(None)
    seen: list[np.ndarray] = []

    async def transfer(k: int, views: list[np.ndarray]) -> None:
        seen.append(views[0].copy())

    await pipe(staging, _spans(tensor, 16), transfer, ready=ready)
    np.testing.assert_array_equal(np.concatenate(seen), np.arange(40, dtype=np.float32))


async def test_chunks_overlap_copies_with_transfers_and_results_land_on_the_device(
    device: ThreadDevice,
) -> None:
    device.copy_delay = 0.01
    staging = Staging(device, buffer_bytes=16 * 4, capacity=3)
    values = np.arange(100, dtype=np.float32)
    tensor = device.tensor(values)
    chunks = _spans(tensor, 16)
    sizes: list[int] = []

    def count(direction: str) -> int:
        return sum(1 for d, _ in list(device.copies) if d == direction)

    async def transfer(k: int, views: list[np.ndarray]) -> None:
        sizes.append(views[0].size)
        if k + 1 < len(chunks):
            # chunk k+1's device-to-host copy runs while chunk k is "on the network"
            await _eventually(lambda: count("to_host") >= k + 2, f"copy of chunk {k + 1} during chunk {k}")
        if k >= 1:
            # and chunk k-1's results go back to the device meanwhile
            await _eventually(lambda: count("to_device") >= k, f"copy back of chunk {k - 1} during chunk {k}")
        views[0] *= 2

    done = await pipe(staging, chunks, transfer)
    assert done.query()
    assert sizes == [16] * 6 + [4]
    np.testing.assert_array_equal(tensor.flat, values * 2)  # on the device once it returned
    assert device.pinned_allocations <= 3


async def test_concurrent_operations_share_a_bounded_pool_without_deadlock(device: ThreadDevice) -> None:
    device.copy_delay = 0.001
    staging = Staging(device, buffer_bytes=8 * 8, capacity=2)
    tensors = [device.tensor(np.full(50, i, np.float64)) for i in range(6)]
    peak = 0

    async def op(i: int) -> None:
        async def transfer(k: int, views: list[np.ndarray]) -> None:
            nonlocal peak
            peak = max(peak, staging.pool.in_use)
            await asyncio.sleep(0.001)
            views[0] += 1

        await pipe(staging, _spans(tensors[i], 8), transfer, what=f"op {i}")

    await asyncio.wait_for(asyncio.gather(*(op(i) for i in range(6))), 30)
    for i, t in enumerate(tensors):
        np.testing.assert_array_equal(t.flat, np.full(50, i + 1, np.float64))
    assert device.pinned_allocations == 2  # reused, never more than the capacity
    assert peak <= 2 and staging.pool.in_use == 0


async def test_a_buffer_given_back_is_not_overwritten_before_its_copy_back_ran(device: ThreadDevice) -> None:
    # One buffer, slow copies back: op B takes the buffer op A just gave back while A's copy
    # back is still queued; A must still land its own results.
    device.copy_delay = 0.05
    staging = Staging(device, buffer_bytes=32, capacity=1)
    a = device.tensor(np.zeros(8, np.float32))
    b = device.tensor(np.zeros(8, np.float32))

    def filler(value: float) -> Any:
        async def transfer(k: int, views: list[np.ndarray]) -> None:
            views[0][:] = value

        return transfer

    first = asyncio.ensure_future(pipe(staging, _spans(a, 8), filler(1.0), host_wait=False))
    second = asyncio.ensure_future(pipe(staging, _spans(b, 8), filler(2.0)))
    await asyncio.gather(first, second)
    device.synchronize()
    np.testing.assert_array_equal(a.flat, np.ones(8, np.float32))
    np.testing.assert_array_equal(b.flat, np.full(8, 2.0, np.float32))
    assert device.pinned_allocations == 1


async def test_completion_event_lets_the_callers_stream_wait_not_the_host(device: ThreadDevice) -> None:
    device.copy_delay = 0.05
    staging = Staging(device, buffer_bytes=64, capacity=2)
    tensor = device.tensor(np.zeros(16, np.float32))

    async def transfer(k: int, views: list[np.ndarray]) -> None:
        views[0][:] = 7.0

    done = await pipe(staging, _spans(tensor, 16, read=False), transfer, host_wait=False)
    caller = device.new_stream()
    caller.wait_event(done)
    seen: list[np.ndarray] = []
    device.launch(caller, lambda: seen.append(tensor.flat.copy()))
    device.synchronize()
    np.testing.assert_array_equal(seen[0], np.full(16, 7.0, np.float32))
    assert not [c for c in device.copies if c[0] == "to_host"]  # write-only: nothing copied to the host


async def test_failed_copy_raises_naming_the_chunk_and_returns_buffers(device: ThreadDevice) -> None:
    staging = Staging(device, buffer_bytes=32, capacity=2)
    tensor = device.tensor(np.arange(24, dtype=np.float32))
    calls = []

    def fail_third(direction: str, nbytes: int) -> None:
        calls.append(direction)
        if len(calls) == 3:
            raise_device_error("injected")(direction, nbytes)

    device.fail_copy = fail_third
    with pytest.raises(DeviceError, match=r"all_reduce \(test\): .*chunk [0-9] of 3.*injected"):
        await pipe(staging, _spans(tensor, 8, write=False), _nothing, what="all_reduce (test)")
    assert staging.pool.in_use == 0
    # the device and the pool stay usable
    device.fail_copy = None
    got: list[np.ndarray] = []

    async def keep(k: int, views: list[np.ndarray]) -> None:
        got.append(views[0].copy())

    await pipe(staging, _spans(tensor, 8), keep)
    np.testing.assert_array_equal(np.concatenate(got), np.arange(24, dtype=np.float32))


async def test_failed_copy_back_raises(device: ThreadDevice) -> None:
    staging = Staging(device, buffer_bytes=32, capacity=2)
    tensor = device.tensor(np.arange(8, dtype=np.float32))

    def fail_back(direction: str, nbytes: int) -> None:
        if direction == "to_device":
            raise DeviceError("injected copy-back failure")

    device.fail_copy = fail_back
    with pytest.raises(DeviceError, match=r"copying results back to threads:.*injected"):
        await pipe(staging, _spans(tensor, 8), _nothing)
    assert staging.pool.in_use == 0


async def test_peer_lost_mid_pipeline_fails_the_operation_and_returns_buffers(device: ThreadDevice) -> None:
    device.copy_delay = 0.005
    staging = Staging(device, buffer_bytes=32, capacity=3)
    tensor = device.tensor(np.arange(64, dtype=np.float32))

    async def transfer(k: int, views: list[np.ndarray]) -> None:
        if k == 2:
            raise PeerLostError(1, "connection reset")

    with pytest.raises(PeerLostError):
        await pipe(staging, _spans(tensor, 8), transfer)
    assert staging.pool.in_use == 0 and staging.pool.allocated <= 3


async def test_cancellation_mid_pipeline_returns_buffers_to_the_pool(device: ThreadDevice) -> None:
    device.copy_delay = 0.005
    staging = Staging(device, buffer_bytes=32, capacity=2)
    tensor = device.tensor(np.arange(64, dtype=np.float32))
    started = asyncio.Event()

    async def stuck(k: int, views: list[np.ndarray]) -> None:
        if k == 1:
            started.set()
            await asyncio.sleep(3600)

    task = asyncio.ensure_future(pipe(staging, _spans(tensor, 8), stuck))
    await asyncio.wait_for(started.wait(), 10)
    assert staging.pool.in_use == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert staging.pool.in_use == 0


async def test_a_waiting_first_buffer_is_granted_when_a_lease_closes(device: ThreadDevice) -> None:
    staging = Staging(device, buffer_bytes=32, capacity=2)
    hold = staging.pool.lease()
    await hold.take()
    assert hold.try_take() is not None and staging.pool.in_use == 2
    waiting = asyncio.ensure_future(staging.pool.lease().take())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    hold.close()
    assert (await asyncio.wait_for(waiting, 5)) is not None
    assert staging.pool.allocated == 2


def test_chunk_bounds_cover_every_element_once() -> None:
    assert chunk_bounds(0, 8) == [(0, 0)]
    assert chunk_bounds(17, 8) == [(0, 8), (8, 16), (16, 17)]
    assert chunk_bounds(8, 8) == [(0, 8)]
