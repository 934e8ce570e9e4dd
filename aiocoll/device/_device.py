"""The device interface: streams, events, pinned host buffers, async copies and IPC handles.

Foundation layer: imports only the standard library, numpy and aiocoll foundations (_host,
_types), never torch. The staging pipeline (aiocoll.device._staging) and the IPC path are written
against these classes alone, so that their ordering, chunking, pool and error rules can be
tested with a CPU implementation whose copies run on worker threads (aiocoll.device._device_threads)
and run unchanged on CUDA (aiocoll.device._cuda, the only module that calls torch.cuda).

The semantics are CUDA's, kept to what the pipeline needs:
- A ``Stream`` runs the work queued on it in order, asynchronously to the host.
- ``Event.record(stream)`` marks the point reached by everything queued on ``stream`` so far;
  ``stream.wait_event(event)`` makes later work on ``stream`` wait for the most recent record
  (a never-recorded event is already complete); ``event.wait(timeout)`` blocks the host.
- Copies between device memory and host buffers are queued on a stream and return at once;
  a copy that fails surfaces when an event recorded after it is waited for (``DeviceError``).
- Device memory is addressed as ``DeviceTensor`` spans: a flat buffer, a byte offset and a
  length. What a DeviceTensor wraps (a torch CUDA tensor, a numpy array) is the
  implementation's business.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from aiocoll._host import host_identity as machine_identity
from aiocoll._types import ReduceOp

__all__ = ["Device", "DeviceError", "DeviceTensor", "Event", "HostBuffer", "Stream"]


class DeviceError(RuntimeError):
    """A device operation (an async copy, an IPC open) failed; the message names which."""


class Stream(ABC):
    """An in-order queue of device work."""

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Work queued on this stream after this call waits for ``event``'s latest record."""


class Event(ABC):
    """A point in a stream's work, recorded any number of times (the latest record counts)."""

    @abstractmethod
    def record(self, stream: Stream) -> None:
        """Mark everything queued on ``stream`` so far."""

    @abstractmethod
    def query(self) -> bool:
        """True once the work before the latest record finished (or it was never recorded)."""

    @abstractmethod
    def wait(self, timeout: float | None) -> bool:
        """Block the host until ``query()`` holds; False when ``timeout`` seconds ran out first.

        Raises:
            DeviceError: work queued before the record failed.
        """


class HostBuffer:
    """A page-locked host buffer: ``array`` is its bytes as a numpy uint8 array.

    Attributes:
        array: the whole buffer (uint8). native: the implementation's own handle (the pinned
            torch tensor for CUDA), kept alive with it.
    """

    __slots__ = ("array", "native")

    def __init__(self, array: np.ndarray, native: Any = None) -> None:
        self.array = array
        self.native = native

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


class DeviceTensor(ABC):
    """A tensor in device memory as aiocoll's staging sees it: flat, contiguous, one dtype.

    ``as_working`` turns any object implementing this into a device working (see
    aiocoll.device._staging); a torch CUDA tensor is wrapped by aiocoll.device._cuda.

    Attributes:
        device: the Device it lives on. dtype_name: canonical dtype ("float32", "bfloat16", ...).
        shape: the caller's shape. numel: elements. itemsize: bytes per element.
    """

    device: Device
    dtype_name: str
    shape: tuple[int, ...]
    numel: int
    itemsize: int

    def prepare(self, stream: Stream, *, read: bool) -> None:
        """Queue on ``stream`` (the caller's) whatever makes the flat buffer hold the values
        (a contiguous copy of a strided tensor); nothing for a flat one."""
        return None

    def finish(self, stream: Stream) -> None:
        """Queue on ``stream`` the copy of results from the flat buffer back into the caller's
        tensor when the flat buffer is a separate copy; nothing otherwise."""
        return None


class Device(ABC):
    """One accelerator as seen by this process.

    Attributes:
        name: e.g. "cuda:0" or "threads:0", for logs and errors.
    """

    name: str

    @abstractmethod
    def current_stream(self) -> Stream:
        """The calling thread's current stream on this device (where its last work was queued)."""

    @abstractmethod
    def new_stream(self) -> Stream:
        """A new stream (the staging side stream)."""

    @abstractmethod
    def new_event(self, *, interprocess: bool = False) -> Event:
        """A new event; ``interprocess`` makes one whose handle another process can open."""

    @abstractmethod
    def pinned_empty(self, nbytes: int) -> HostBuffer:
        """Allocate ``nbytes`` of page-locked host memory (contents undefined)."""

    @abstractmethod
    def copy_to_host(
        self, dst: np.ndarray, src: DeviceTensor, offset: int, stream: Stream, *, pinned: HostBuffer
    ) -> None:
        """Queue on ``stream`` a copy of ``dst.nbytes`` bytes from ``src`` at byte ``offset`` into
        ``dst`` (a uint8 view inside ``pinned``); returns at once."""

    @abstractmethod
    def copy_to_device(
        self, dst: DeviceTensor, offset: int, src: np.ndarray, stream: Stream, *, pinned: HostBuffer
    ) -> None:
        """Queue on ``stream`` a copy of ``src`` (a uint8 view inside ``pinned``) into ``dst`` at
        byte ``offset``; returns at once."""

    @abstractmethod
    def empty(self, nbytes: int) -> DeviceTensor:
        """``nbytes`` of device memory (a uint8 DeviceTensor; contents undefined)."""

    @abstractmethod
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
        """Queue on ``stream``: ``count`` elements of ``dtype_name`` at byte ``dst_offset`` of
        ``dst`` become ``dst (op) src`` (``src`` at byte ``src_offset``, possibly a peer's opened
        buffer on this device). AVG reduces as SUM."""

    @abstractmethod
    def finish_avg(
        self, tensor: DeviceTensor, offset: int, count: int, dtype_name: str, group_size: int, stream: Stream
    ) -> None:
        """Queue on ``stream``: divide ``count`` elements at byte ``offset`` by ``group_size``
        (ReduceOp.AVG's last step, on a SUM)."""

    # -- IPC: device memory and events shared with other processes on this host ---------------
    def identity(self) -> str:
        """Which physical device this is, the same string in every process that uses it."""
        return f"{host_identity()}/{self.name}"

    def ipc_supported(self) -> str | None:
        """None when buffers and events can be shared with other processes, else why not."""
        return f"{self.name} does not share device memory between processes"

    def ipc_export(self, tensor: DeviceTensor) -> bytes:
        """An opaque handle another process opens with ``ipc_open`` (the same device)."""
        raise DeviceError(self.ipc_supported() or "no IPC")

    def ipc_open(self, handle: bytes, like: DeviceTensor) -> DeviceTensor:
        """Open a peer's buffer (dtype and size of ``like``); valid while the peer keeps it."""
        raise DeviceError(self.ipc_supported() or "no IPC")

    def ipc_event_export(self, event: Event) -> bytes:
        """An opaque handle of an interprocess event."""
        raise DeviceError(self.ipc_supported() or "no IPC")

    def ipc_event_open(self, handle: bytes) -> Event:
        """Open a peer's interprocess event: wait on its records from this process."""
        raise DeviceError(self.ipc_supported() or "no IPC")

    def copy_device(
        self,
        dst: DeviceTensor,
        dst_offset: int,
        src: DeviceTensor,
        src_offset: int,
        nbytes: int,
        stream: Stream,
    ) -> None:
        """Queue on ``stream`` a device-to-device copy (possibly from a peer's opened buffer)."""
        raise DeviceError(f"{self.name} has no device-to-device copy")


def host_identity() -> str:
    """This machine as IPC needs it: the machine identity every link and routing decision uses
    (aiocoll._host: host name, boot id, network namespace) plus this process's user, since CUDA
    IPC handles are only opened between processes of one user."""
    return f"{machine_identity()}:{os.getuid()}"
