"""Pinned staging of device tensors: the bounded buffer pool, the event waiter and the pipeline.

Foundation layer: imports aiocoll.device._device (the interface), aiocoll._errors and numpy; never
torch, never a concrete device. The public layer hands ``run_pipeline`` an operation cut into
chunks (each chunk: pieces of device tensors to read and/or write, plus host arrays that need
no staging) and a ``transfer(k, views)`` coroutine that moves chunk ``k`` over the network
between host views; this module does the rest:

- One side stream per device (``Staging``). Before an operation's first copy, the side stream
  waits for an event recorded on the caller's stream when the operation was called, so the data
  the caller just computed is what is sent.
- Chunk ``k``'s device-to-host copies are queued on the side stream ahead of time (up to the
  buffers the operation holds), so while chunk ``k`` crosses the network the copy of chunk
  ``k+1`` runs, and the host-to-device copy of chunk ``k``'s results runs while chunk ``k+1``
  crosses the network.
- Buffers come from a bounded pool of reused pinned buffers. Reuse is safe by stream order:
  every copy into or out of a staging buffer is queued on the one side stream, and the host
  touches a buffer only after waiting for an event recorded on that stream after the buffer
  was taken; so a buffer given back right after its host-to-device copy was queued is never
  overwritten before that copy ran.
- The operation completes when an event recorded after the last copy back is reached: on the
  host (``host_wait``), or, for torch users, by handing the event back so that the caller's
  stream waits for it instead of the host.

When an operation fails from outside (a lost peer, a deadline), the engine fails its Work at
once and cancels its body; the pipeline gives its buffers back in its ``finally`` as that
cancellation unwinds the body, one or more loop turns after the Work failed (while the body
waits for a copy event, say). Nothing is leaked; whoever checks the pool right after the failure
must allow for those turns.

Deadlock freedom of the shared pool: an operation's body starts in call order and asks for its
first buffer at once; first buffers are granted strictly in arrival order, an operation keeps
at least one buffer until it ends, and a second one is granted only while no lease waits for
its first. So the oldest operation on every rank always holds a buffer and progresses, one
chunk at a time at worst.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aiocoll._env import env_int
from aiocoll.device._device import Device, DeviceError, DeviceTensor, Event, HostBuffer, Stream

__all__ = [
    "CHUNK_BYTES",
    "POOL_BUFFERS",
    "CallerStreamContext",
    "DeviceSpan",
    "Lease",
    "Piece",
    "PinnedPool",
    "Staging",
    "caller_context",
    "record_caller_streams",
    "chunk_bounds",
    "run_pipeline",
    "staging_for",
]

log = logging.getLogger("aiocoll.staging")

CHUNK_BYTES = 4 * 1024 * 1024
"""Bytes of one pooled pinned buffer: big enough to keep a PCIe copy near full speed, small
enough that the first chunk's copy does not delay the network for long."""
POOL_BUFFERS = 4
"""Pinned buffers per device: two in flight per direction is what overlap needs."""
_WAIT_SLICE = 0.5  # seconds between deadline checks while the host waits for an event


# --------------------------------------------------------------------------------------------
# device spans: what a device tensor's Working holds instead of a host array


class DeviceSpan:
    """A range of elements of a device tensor, standing where a host array would be.

    The public layer slices a Working's array to build an operation's send and receive lists;
    for a device tensor that array is a DeviceSpan, so the same slicing code describes which
    device ranges the pipeline stages. Supports ``size``, ``nbytes``, ``dtype``, ``itemsize``,
    ``reshape(-1)`` and slicing with a step of 1.

    Attributes:
        tensor: the device tensor. start, stop: element range. dtype: numpy dtype of the host
            views (uint16 bits for bfloat16). read: the operation reads these values.
            write: results are copied back into them.
    """

    __slots__ = ("dtype", "read", "start", "stop", "tensor", "write")

    def __init__(
        self, tensor: DeviceTensor, dtype: np.dtype[Any], start: int, stop: int, *, read: bool, write: bool
    ) -> None:
        self.tensor = tensor
        self.dtype = dtype
        self.start = start
        self.stop = stop
        self.read = read
        self.write = write

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def itemsize(self) -> int:
        return int(self.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def reshape(self, *shape: Any) -> DeviceSpan:
        if shape not in ((-1,), ((-1,),)):
            raise TypeError("a DeviceSpan is flat; only reshape(-1) is meaningful")
        return self

    def __getitem__(self, index: slice) -> DeviceSpan:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a DeviceSpan takes contiguous slices only")
        a, b, _ = index.indices(self.size)
        b = max(a, b)
        return DeviceSpan(
            self.tensor, self.dtype, self.start + a, self.start + b, read=self.read, write=self.write
        )

    def same_range(self, other: DeviceSpan) -> bool:
        return self.tensor is other.tensor and self.start == other.start and self.stop == other.stop

    def __repr__(self) -> str:
        return f"<DeviceSpan {self.tensor.device.name} [{self.start}:{self.stop}] {self.dtype}>"


def chunk_bounds(count: int, chunk_elems: int) -> list[tuple[int, int]]:
    """Element ranges [a, b) cutting ``count`` elements into chunks of ``chunk_elems``; one empty
    chunk for ``count == 0`` (the operation still runs once, as every rank expects)."""
    if count <= 0:
        return [(0, 0)]
    step = max(1, chunk_elems)
    return [(a, min(a + step, count)) for a in range(0, count, step)]


# --------------------------------------------------------------------------------------------
# the pool


class Lease:
    """An operation's claim on a pool's buffers, taken when its body starts (see the module header)."""

    def __init__(self, pool: PinnedPool, limit: int) -> None:
        self.pool = pool
        self.limit = max(1, limit)
        self.held: list[HostBuffer] = []
        self.spare: list[HostBuffer] = []  # held, not in use by a chunk now
        self.closed = False

    @property
    def first_granted(self) -> bool:
        return bool(self.held)

    async def take(self) -> HostBuffer:
        """A buffer for the next chunk: a spare of this lease, else one from the pool (waits for
        the first; see ``try_take`` for more)."""
        if self.spare:
            return self.spare.pop()
        if not self.held:
            return await self.pool._grant_first(self)
        buf = self.try_take()
        if buf is None:
            raise RuntimeError("Lease.take: every held buffer is in use; give one back first")
        return buf

    def try_take(self) -> HostBuffer | None:
        """A spare, or one more buffer from the pool if the rules allow it now; else None."""
        if self.spare:
            return self.spare.pop()
        if self.held and len(self.held) < self.limit:
            return self.pool._grant_extra(self)
        return None

    def give_back(self, buf: HostBuffer) -> None:
        """The chunk using ``buf`` queued its last copy; the lease keeps it for its next chunk."""
        self.spare.append(buf)

    def close(self) -> None:
        """Return every held buffer to the pool (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.pool._release(self)


class PinnedPool:
    """A bounded set of reused pinned buffers of one device, shared by every operation.

    Args:
        device: allocates the buffers (lazily, up to ``capacity``). buffer_bytes: each buffer's
            size. capacity: at most this many buffers ever exist.
    """

    def __init__(self, device: Device, buffer_bytes: int = CHUNK_BYTES, capacity: int = POOL_BUFFERS) -> None:
        if capacity < 1 or buffer_bytes < 1:
            raise ValueError("a pinned pool needs at least one buffer of at least one byte")
        self.device = device
        self.buffer_bytes = buffer_bytes
        self.capacity = capacity
        self.allocated = 0
        self._free: list[HostBuffer] = []
        self._waiting: collections.deque[tuple[Lease, asyncio.Future[HostBuffer]]] = collections.deque()

    @property
    def in_use(self) -> int:
        return self.allocated - len(self._free)

    def lease(self, limit: int = POOL_BUFFERS) -> Lease:
        """A lease for one operation, taken when its body starts (bodies start in call order,
        so first buffers are granted in call order)."""
        return Lease(self, min(limit, self.capacity))

    def _pop_free(self) -> HostBuffer | None:
        if self._free:
            return self._free.pop()
        if self.allocated < self.capacity:
            self.allocated += 1
            return self.device.pinned_empty(self.buffer_bytes)
        return None

    async def _grant_first(self, lease: Lease) -> HostBuffer:
        if not self._waiting:
            buf = self._pop_free()
            if buf is not None:
                lease.held.append(buf)
                return buf
        fut: asyncio.Future[HostBuffer] = asyncio.get_running_loop().create_future()
        self._waiting.append((lease, fut))
        try:
            return await fut  # granted in arrival order by _release
        finally:
            self._waiting = collections.deque(w for w in self._waiting if w[1] is not fut)

    def _grant_extra(self, lease: Lease) -> HostBuffer | None:
        if self._waiting:
            return None  # someone waits for a first buffer: it comes first
        buf = self._pop_free()
        if buf is not None:
            lease.held.append(buf)
        return buf

    def _release(self, lease: Lease) -> None:
        self._waiting = collections.deque(w for w in self._waiting if w[0] is not lease)
        self._free.extend(lease.held)
        lease.held.clear()
        lease.spare.clear()
        while self._waiting and self._free:
            waiter, fut = self._waiting.popleft()
            if fut.done():
                continue
            buf = self._free.pop()
            waiter.held.append(buf)
            fut.set_result(buf)


# --------------------------------------------------------------------------------------------
# waiting for events without blocking the loop


class EventWaiter:
    """One thread per device that waits for events in order and wakes the loop.

    Every wait has a deadline: the thread waits in slices and gives up on a wait whose asyncio
    future was cancelled (the operation failed or ran out of time).
    """

    def __init__(self, name: str) -> None:
        self._lock = threading.Condition()
        self._items: collections.deque[tuple[Event, asyncio.Future[None], asyncio.AbstractEventLoop]] = (
            collections.deque()
        )
        self._thread = threading.Thread(target=self._run, name=f"aiocoll-wait-{name}", daemon=True)
        self._thread.start()

    def wait(self, event: Event) -> Awaitable[None]:
        """Complete when ``event`` is reached; fails with DeviceError when work before it failed."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if event.query():
            try:
                event.wait(0)
            except DeviceError as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(None)
            return fut
        with self._lock:
            self._items.append((event, fut, loop))
            self._lock.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._items:
                    self._lock.wait()
                event, fut, loop = self._items[0]
            error: BaseException | None = None
            while True:
                if fut.cancelled():
                    break
                try:
                    if event.wait(_WAIT_SLICE):
                        break
                except DeviceError as exc:
                    error = exc
                    break
            with self._lock:
                self._items.popleft()
            if not fut.cancelled():
                loop.call_soon_threadsafe(_settle, fut, error)


def _settle(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


# --------------------------------------------------------------------------------------------
# one device's staging state


def _env_int(name: str, default: int) -> int:
    value = env_int(name)
    return default if value is None else max(1, value)


class Staging:
    """A device's side stream, pinned pool and event waiter (one per device per process).

    Args:
        buffer_bytes, capacity: the pool's buffers; default from AIOCOLL_STAGING_CHUNK_BYTES and
            AIOCOLL_STAGING_BUFFERS, else CHUNK_BYTES and POOL_BUFFERS. Every rank must use the
            same buffer size (it decides how operations are cut into chunks).
    """

    def __init__(self, device: Device, buffer_bytes: int | None = None, capacity: int | None = None) -> None:
        buffer_bytes = buffer_bytes or _env_int("AIOCOLL_STAGING_CHUNK_BYTES", CHUNK_BYTES)
        capacity = capacity or _env_int("AIOCOLL_STAGING_BUFFERS", POOL_BUFFERS)
        self.device = device
        self.side = device.new_stream()
        self.pool = PinnedPool(device, buffer_bytes, capacity)
        self.waiter = EventWaiter(device.name)


_STAGINGS: dict[int, Staging] = {}
_STAGINGS_LOCK = threading.Lock()


def staging_for(device: Device) -> Staging:
    """The process's Staging of ``device`` (made on first use)."""
    with _STAGINGS_LOCK:
        found = _STAGINGS.get(id(device))
        if found is None or found.device is not device:
            found = _STAGINGS[id(device)] = Staging(device)
        return found


@dataclass
class CallerStreamContext:
    """Set by the torch backend around a call it forwards to the loop thread.

    Attributes:
        ready: events recorded on the caller's current stream at call time, by device name (the
            loop thread's own current stream is not the caller's).
        completion: filled by the operation unless ``wait_on_host``: events the caller's stream
            must wait for before it uses the results (the operation completes without waiting
            for them on the host).
        wait_on_host: the operation completes only once its results are on the device.
    """

    ready: dict[str, Event] = field(default_factory=dict)
    completion: list[tuple[Device, Event]] = field(default_factory=list)
    wait_on_host: bool = False


caller_context: contextvars.ContextVar[CallerStreamContext | None] = contextvars.ContextVar(
    "aiocoll_caller_stream", default=None
)


def record_caller_streams(devices: Sequence[Device]) -> CallerStreamContext:
    """On the calling thread: an event recorded now on its current stream of each device."""
    context = CallerStreamContext()
    for device in devices:
        event = device.new_event()
        event.record(device.current_stream())
        context.ready[device.name] = event
    return context


def ready_event(device: Device) -> Event:
    """The event marking the caller's work so far on ``device`` (recorded now unless the torch
    backend recorded it on the caller's thread already)."""
    ctx = caller_context.get()
    if ctx is not None and device.name in ctx.ready:
        return ctx.ready[device.name]
    event = device.new_event()
    event.record(device.current_stream())
    return event


# --------------------------------------------------------------------------------------------
# the pipeline


@dataclass
class Piece:
    """A device range one chunk stages: read (copied to the host first), write (copied back)."""

    span: DeviceSpan
    read: bool
    write: bool


Transfer = Callable[[int, list[np.ndarray]], Awaitable[None]]


async def run_pipeline(
    staging: Staging,
    chunks: Sequence[Sequence[Piece]],
    transfer: Transfer,
    *,
    ready: Event,
    lease: Lease,
    what: str,
    prepare: Callable[[Stream], None] | None = None,
    finish: Callable[[Stream], None] | None = None,
    host_wait: bool = True,
) -> Event:
    """Stage ``chunks`` through pinned buffers around ``transfer``; see the module header.

    Args:
        staging: the device's side stream, pool and waiter.
        chunks: per chunk, the device pieces it stages (their host views are laid out one after
            another in one pooled buffer, so a chunk's bytes must fit ``pool.buffer_bytes``).
        transfer: ``await transfer(k, views)`` moves chunk ``k``; ``views[i]`` is piece ``i``'s
            host array (typed like the span).
        ready: the caller's event (``ready_event``); the side stream waits for it first.
        lease: this operation's lease (taken when the body starts); closed here whatever happens.
        what: names the operation in errors ("all_reduce (group 'w', seq 3)").
        prepare: queues on the side stream, after its wait for ``ready``, whatever must precede
            the first copy (a flat copy of a strided caller tensor).
        finish: queues on the side stream whatever must follow the last copy back (copy of
            results into a strided caller tensor).
        host_wait: complete only once the results are on the device; False: return as soon as
            the completion event is recorded (the caller's stream waits for it).
    Returns:
        the completion event.
    Raises:
        DeviceError: a copy failed (named with its chunk); whatever ``transfer`` raised.
    """
    device, side, waiter = staging.device, staging.side, staging.waiter
    total = len(chunks)
    in_flight: collections.deque[tuple[int, HostBuffer, list[np.ndarray], Event]] = collections.deque()
    next_chunk = 0
    try:
        side.wait_event(ready)
        if prepare is not None:
            prepare(side)

        def issue(buf: HostBuffer) -> None:
            nonlocal next_chunk
            k = next_chunk
            next_chunk += 1
            views: list[np.ndarray] = []
            pos = 0
            for piece in chunks[k]:
                span = piece.span
                raw = buf.array[pos : pos + span.nbytes]
                pos += span.nbytes
                if piece.read and span.nbytes:
                    device.copy_to_host(raw, span.tensor, span.start * span.itemsize, side, pinned=buf)
                views.append(raw.view(span.dtype))
            if pos > buf.nbytes:
                raise ValueError(f"{what}: chunk {k} needs {pos} staging bytes, buffers hold {buf.nbytes}")
            landed = device.new_event()
            landed.record(side)
            in_flight.append((k, buf, views, landed))

        for k in range(total):
            # Queue copies of the chunks ahead while buffers are at hand (never waits).
            while next_chunk < total and (not in_flight or len(in_flight) < lease.limit):
                if not in_flight:
                    buf = await lease.take()
                else:
                    maybe = lease.try_take()
                    if maybe is None:
                        break
                    buf = maybe
                issue(buf)
            index, buf, views, landed = in_flight.popleft()
            assert index == k
            try:
                await waiter.wait(landed)
            except DeviceError as exc:
                raise DeviceError(
                    f"{what}: copying chunk {k + 1} of {total} to the host failed: {exc}"
                ) from exc
            await transfer(k, views)
            for piece, view in zip(chunks[k], views, strict=True):
                span = piece.span
                if piece.write and span.nbytes:
                    device.copy_to_device(
                        span.tensor, span.start * span.itemsize, view.view(np.uint8), side, pinned=buf
                    )
            lease.give_back(buf)  # safe by stream order (module header)
        if finish is not None:
            finish(side)
        done = device.new_event()
        done.record(side)
        if host_wait:
            try:
                await waiter.wait(done)
            except DeviceError as exc:
                raise DeviceError(f"{what}: copying results back to {device.name} failed: {exc}") from exc
        return done
    finally:
        lease.close()
