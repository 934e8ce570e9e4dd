"""A CPU implementation of the device interface whose streams are worker threads.

Foundation layer: imports aiocoll.device._device and numpy only. It exists so that the staging
pipeline's ordering, chunking, pool and error rules are tested for real without a GPU: every
stream is a thread running its queue in order, copies really happen later than the call that
queued them, and an event is a real synchronisation point, so a pipeline that forgets to wait for
the caller's event copies stale data and fails a test. "Device memory" is a numpy array that, by
convention, only work queued on a stream touches (``launch`` queues such work: the stand-in for a
kernel). Tests inject faults and delays through ``copy_delay`` and ``fail_copy``.

With ``ipc=True`` its device memory from ``empty`` and its interprocess events live in shared
memory files (``/dev/shm``, created exclusively with mode 0600, so no other user can open them)
that another process on this host opens from the handle: the stand-in for CUDA IPC, so the IPC
path's cross-process ordering (events recorded in one process, waited for in another) is tested
for real. An interprocess event is two counters in such a file: how often it was recorded (by
the host, when ``record`` is called) and how far its stream got (by the stream thread). A process
that dies before closing its device (kill -9) leaves its files behind; as the CUDA driver frees a
dead process's memory, the next IPC ThreadDevice made on the host removes them.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from aiocoll._reduce import finish_avg, reduce_into
from aiocoll._types import ReduceOp
from aiocoll.device._device import Device, DeviceError, DeviceTensor, Event, HostBuffer, Stream, host_identity

__all__ = ["ThreadDevice", "ThreadDeviceTensor", "remove_dead_ipc_files"]

_SHM_DIR = "/dev/shm"
_IPC_PREFIX = "aiocoll-ipc-"  # then the owner's pid, "-", a random name

_STOP = object()


class _ThreadStream(Stream):
    def __init__(self, device: ThreadDevice, name: str) -> None:
        self.device = device
        self.name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._failure: BaseException | None = None  # reported by the next event recorded after it
        self._thread = threading.Thread(target=self._work, name=f"aiocoll-{name}", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                item(self)
            except BaseException as exc:  # a failed copy: surfaces at the next event, as on CUDA
                self._failure = exc

    def enqueue(self, work: Callable[[_ThreadStream], object]) -> None:
        self._queue.put(work)

    def wait_event(self, event: Event) -> None:
        if isinstance(event, _SharedEvent):
            target = event.recorded()  # the record that is latest now, as cudaStreamWaitEvent takes it
            self.enqueue(lambda _s: event.wait_for(target, None))
            return
        assert isinstance(event, _ThreadEvent)
        mark = event.latest()  # the record that is latest now, as cudaStreamWaitEvent takes it
        if mark is not None:
            self.enqueue(lambda _s: mark.wait_forever())

    def stop(self) -> None:
        self._queue.put(_STOP)


class _Mark:
    """One record of an event: set when the stream reaches it."""

    __slots__ = ("_done", "error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def set(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()

    def is_set(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None) -> bool:
        return self._done.wait(timeout)

    def wait_forever(self) -> None:
        # A stream blocked on another stream's event: the deadline belongs to whoever waits on
        # the host, so poll (a stopped device releases everything).
        while not self._done.wait(0.5):
            pass


class _ThreadEvent(Event):
    def __init__(self) -> None:
        self._mark: _Mark | None = None
        self._lock = threading.Lock()

    def latest(self) -> _Mark | None:
        with self._lock:
            return self._mark

    def record(self, stream: Stream) -> None:
        assert isinstance(stream, _ThreadStream)
        mark = _Mark()
        with self._lock:
            self._mark = mark

        def reach(s: _ThreadStream) -> None:
            failure, s._failure = s._failure, None
            mark.set(failure)

        stream.enqueue(reach)

    def query(self) -> bool:
        mark = self.latest()
        return mark is None or mark.is_set()

    def wait(self, timeout: float | None) -> bool:
        mark = self.latest()
        if mark is None:
            return True
        if not mark.wait(timeout):
            return False
        if mark.error is not None:
            raise DeviceError(f"work queued before this event failed: {mark.error}") from mark.error
        return True


def _shm_file(nbytes: int) -> tuple[str, mmap.mmap]:
    """A new shared memory file only this user can open, mapped; its path is the IPC handle."""
    path = f"{_SHM_DIR}/{_IPC_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(1, nbytes))
        return path, mmap.mmap(fd, max(1, nbytes))
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_dead_ipc_files() -> list[str]:
    """Remove this user's IPC files whose owner process is gone; returns their names."""
    removed = []
    me = os.getuid()
    for name in os.listdir(_SHM_DIR):
        pid = name[len(_IPC_PREFIX) :].partition("-")[0] if name.startswith(_IPC_PREFIX) else ""
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path = f"{_SHM_DIR}/{name}"
        with contextlib.suppress(OSError):
            if os.stat(path).st_uid == me:
                os.unlink(path)
                removed.append(name)
    return removed


def _open_shm(path: str, nbytes: int) -> mmap.mmap:
    if not path.startswith(f"{_SHM_DIR}/{_IPC_PREFIX}") or "/" in path[len(_SHM_DIR) + 1 :]:
        raise DeviceError(f"not an aiocoll IPC handle: {path!r}")
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise DeviceError(f"could not open a peer's IPC handle {path}: {exc}") from exc
    try:
        return mmap.mmap(fd, max(1, nbytes))
    finally:
        os.close(fd)


class _SharedEvent(Event):
    """An interprocess event: [times recorded, times reached] as int64 in a shared file."""

    def __init__(self, path: str, region: mmap.mmap, *, owner: bool) -> None:
        self.path = path
        self.region = region
        self.counters = np.frombuffer(region, dtype=np.int64, count=2)
        self.owner = owner

    def recorded(self) -> int:
        return int(self.counters[0])

    def record(self, stream: Stream) -> None:
        assert isinstance(stream, _ThreadStream)
        target = int(self.counters[0]) + 1
        self.counters[0] = target

        def reach(s: _ThreadStream) -> None:
            self.counters[1] = target

        stream.enqueue(reach)

    def query(self) -> bool:
        return int(self.counters[1]) >= int(self.counters[0])

    def wait_for(self, target: int, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while int(self.counters[1]) < target:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.0002)
        return True

    def wait(self, timeout: float | None) -> bool:
        return self.wait_for(self.recorded(), timeout)


class ThreadDeviceTensor(DeviceTensor):
    """A flat numpy array posing as device memory of a ThreadDevice.

    Args:
        device: its ThreadDevice. data: the values (copied; any shape and dtype numpy carries).
        dtype_name: the name aiocoll uses (defaults to numpy's).
    """

    def __init__(
        self, device: ThreadDevice, data: np.ndarray, dtype_name: str | None = None, *, shared: Any = None
    ) -> None:
        self.device = self.thread_device = device
        self.shape = tuple(data.shape)
        self.shared = shared  # (path, mmap) when the memory is an IPC-shareable file
        self.flat = data.reshape(-1) if shared is not None else np.ascontiguousarray(data).reshape(-1).copy()
        self.dtype_name = dtype_name or self.flat.dtype.name
        self.numel = int(self.flat.size)
        self.itemsize = int(self.flat.dtype.itemsize)

    def host_dtype(self) -> np.dtype[Any]:
        return self.flat.dtype

    def snapshot(self) -> np.ndarray:
        """The values once every stream of the device drained (test helper)."""
        self.thread_device.synchronize()
        return self.flat.reshape(self.shape).copy()


class ThreadDevice(Device):
    """Streams as threads, pinned memory as numpy, for tests of the staging pipeline.

    Args:
        copy_delay: seconds each copy sleeps on its stream before copying (makes races visible).
        fail_copy: called with ("to_host" | "to_device", nbytes) before each copy; raise to make
            that copy fail on its stream.
    """

    _ids = itertools.count()

    def __init__(
        self,
        copy_delay: float = 0.0,
        fail_copy: Callable[[str, int], None] | None = None,
        *,
        ipc: bool = False,
        identity: str | None = None,
    ) -> None:
        self.name = f"threads:{next(self._ids)}"
        self.ipc = ipc
        if ipc:
            remove_dead_ipc_files()
        self._identity = identity or f"{host_identity()}/threads-{os.getpid()}-{self.name}"
        self._files: list[str] = []
        self.copy_delay = copy_delay
        self.fail_copy = fail_copy
        self.pinned_allocations = 0
        self.copies: list[tuple[str, int]] = []  # (direction, nbytes) in the order they ran
        self._local = threading.local()
        self._streams: list[_ThreadStream] = []
        self._default = self.new_stream()

    # -- streams and events ------------------------------------------------------------------
    def current_stream(self) -> Stream:
        return getattr(self._local, "stream", None) or self._default

    def set_current_stream(self, stream: Stream | None) -> None:
        """Make ``stream`` this thread's current stream (None: the default stream)."""
        self._local.stream = stream

    def new_stream(self) -> Stream:
        stream = _ThreadStream(self, f"{self.name}-s{len(self._streams)}")
        self._streams.append(stream)
        return stream

    def new_event(self, *, interprocess: bool = False) -> Event:
        if interprocess and self.ipc:
            path, region = _shm_file(16)
            self._files.append(path)
            np.frombuffer(region, dtype=np.int64, count=2)[:] = 0
            return _SharedEvent(path, region, owner=True)
        return _ThreadEvent()

    def launch(self, stream: Stream, kernel: Callable[[], None]) -> None:
        """Queue ``kernel`` on ``stream`` (the stand-in for a CUDA kernel launch)."""
        assert isinstance(stream, _ThreadStream)
        stream.enqueue(lambda _s: kernel())

    def synchronize(self, timeout: float = 30.0) -> None:
        """Block until every stream drained (test helper)."""
        for stream in list(self._streams):
            event = self.new_event()
            event.record(stream)
            if not event.wait(timeout):
                raise TimeoutError(f"{stream.name} did not drain within {timeout}s")

    def close(self) -> None:
        for stream in self._streams:
            stream.stop()
        for path in self._files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._files.clear()

    # -- memory and copies -------------------------------------------------------------------
    def pinned_empty(self, nbytes: int) -> HostBuffer:
        self.pinned_allocations += 1
        return HostBuffer(np.empty(nbytes, dtype=np.uint8))

    def _copy(self, stream: Stream, direction: str, dst: np.ndarray, src: np.ndarray) -> None:
        assert isinstance(stream, _ThreadStream)
        nbytes = int(src.nbytes)

        def run(_s: _ThreadStream) -> None:
            if self.copy_delay:
                time.sleep(self.copy_delay)
            if self.fail_copy is not None:
                self.fail_copy(direction, nbytes)
            np.copyto(dst, src)
            self.copies.append((direction, nbytes))

        stream.enqueue(run)

    def copy_to_host(
        self, dst: np.ndarray, src: DeviceTensor, offset: int, stream: Stream, *, pinned: HostBuffer
    ) -> None:
        assert isinstance(src, ThreadDeviceTensor)
        raw = src.flat.view(np.uint8)[offset : offset + dst.nbytes]
        self._copy(stream, "to_host", dst, raw)

    def copy_to_device(
        self, dst: DeviceTensor, offset: int, src: np.ndarray, stream: Stream, *, pinned: HostBuffer
    ) -> None:
        assert isinstance(dst, ThreadDeviceTensor)
        raw = dst.flat.view(np.uint8)[offset : offset + src.nbytes]
        self._copy(stream, "to_device", raw, src)

    def empty(self, nbytes: int) -> DeviceTensor:
        if not self.ipc:
            return ThreadDeviceTensor(self, np.empty(nbytes, np.uint8), "uint8")
        path, region = _shm_file(nbytes)
        self._files.append(path)
        data = np.frombuffer(region, dtype=np.uint8, count=nbytes)
        return ThreadDeviceTensor(self, data, "uint8", shared=(path, region))

    def reduce_into(
        self,
        op: ReduceOp,
        dst: DeviceTensor,
        dst_offset: int,
        src: DeviceTensor,
        src_offset: int,
        count: int,
        dtype_name: str,
        stream: Stream,
    ) -> None:
        assert isinstance(dst, ThreadDeviceTensor) and isinstance(src, ThreadDeviceTensor)
        assert isinstance(stream, _ThreadStream)
        host = np.dtype("uint16") if dtype_name == "bfloat16" else np.dtype(dtype_name)
        nbytes = count * host.itemsize
        d = dst.flat.view(np.uint8)[dst_offset : dst_offset + nbytes].view(host)
        r = src.flat.view(np.uint8)[src_offset : src_offset + nbytes].view(host)
        stream.enqueue(lambda _s: reduce_into(op, d, r, dtype_name))

    def finish_avg(
        self, tensor: DeviceTensor, offset: int, count: int, dtype_name: str, group_size: int, stream: Stream
    ) -> None:
        assert isinstance(tensor, ThreadDeviceTensor) and isinstance(stream, _ThreadStream)
        host = np.dtype("uint16") if dtype_name == "bfloat16" else np.dtype(dtype_name)
        part = tensor.flat.view(np.uint8)[offset : offset + count * host.itemsize].view(host)
        stream.enqueue(lambda _s: finish_avg(part, group_size, dtype_name))

    def copy_device(
        self,
        dst: DeviceTensor,
        dst_offset: int,
        src: DeviceTensor,
        src_offset: int,
        nbytes: int,
        stream: Stream,
    ) -> None:
        assert isinstance(dst, ThreadDeviceTensor) and isinstance(src, ThreadDeviceTensor)
        d = dst.flat.view(np.uint8)[dst_offset : dst_offset + nbytes]
        r = src.flat.view(np.uint8)[src_offset : src_offset + nbytes]
        self._copy(stream, "device", d, r)

    # -- IPC through shared memory files -----------------------------------------------------
    def identity(self) -> str:
        return self._identity

    def ipc_supported(self) -> str | None:
        return None if self.ipc else f"{self.name} was made without ipc=True"

    def ipc_export(self, tensor: DeviceTensor) -> bytes:
        assert isinstance(tensor, ThreadDeviceTensor)
        if tensor.shared is None:
            raise DeviceError(f"{self.name}: only memory from empty() of an ipc device can be shared")
        return str(tensor.shared[0]).encode()

    def ipc_open(self, handle: bytes, like: DeviceTensor) -> DeviceTensor:
        nbytes = like.numel * like.itemsize
        region = _open_shm(handle.decode(), nbytes)
        data = np.frombuffer(region, dtype=np.uint8, count=nbytes)
        return ThreadDeviceTensor(self, data, "uint8", shared=(handle.decode(), region))

    def ipc_event_export(self, event: Event) -> bytes:
        assert isinstance(event, _SharedEvent)
        return event.path.encode()

    def ipc_event_open(self, handle: bytes) -> Event:
        path = handle.decode()
        return _SharedEvent(path, _open_shm(path, 16), owner=False)

    def tensor(self, data: Any, dtype_name: str | None = None) -> ThreadDeviceTensor:
        """A device tensor holding ``data`` (test helper)."""
        return ThreadDeviceTensor(self, np.asarray(data), dtype_name)

    def __repr__(self) -> str:
        return f"<ThreadDevice {self.name}>"


def raise_device_error(message: str) -> Callable[[str, int], None]:
    """A ``fail_copy`` hook that fails every copy with ``message`` (test helper)."""

    def fail(direction: str, nbytes: int) -> None:
        raise DeviceError(f"{message} ({direction}, {nbytes} bytes)")

    return fail
