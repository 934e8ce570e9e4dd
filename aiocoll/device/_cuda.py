"""The CUDA implementation of the device interface: the only module that calls torch.cuda.

Foundation layer: imports torch (loaded only when a CUDA tensor is met, so torch is already in
the process), aiocoll.device._device and numpy. Everything above it (staging pipeline, IPC exchange,
torch backend) goes through aiocoll.device._device's classes, so the ordering rules tested with the
thread-backed device (aiocoll.device._device_threads) are the ones that run here.

NOT YET EXERCISED ON A GPU: written against torch 2.13's documented CUDA API (streams, events,
pinned memory, non_blocking copies, storage IPC handles) on a machine without one; the tests
marked ``cuda`` run it when a GPU is present.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import numpy as np
import torch

from aiocoll._types import ReduceOp
from aiocoll.device._device import Device, DeviceError, DeviceTensor, Event, HostBuffer, Stream, host_identity

__all__ = [
    "CudaDevice",
    "CudaTensor",
    "cuda_devices_of",
    "cuda_device",
    "cuda_unavailable",
    "device_count",
    "set_device",
    "synchronize",
    "wrap_cuda_tensor",
]


class CudaStream(Stream):
    __slots__ = ("native",)

    def __init__(self, native: torch.cuda.Stream) -> None:
        self.native = native

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, CudaEvent)
        self.native.wait_event(event.native)


class CudaEvent(Event):
    __slots__ = ("native",)

    def __init__(self, native: torch.cuda.Event) -> None:
        self.native = native

    def record(self, stream: Stream) -> None:
        assert isinstance(stream, CudaStream)
        self.native.record(stream.native)

    def query(self) -> bool:
        try:
            return bool(self.native.query())
        except RuntimeError as exc:  # an asynchronous error of earlier work on the stream
            raise DeviceError(str(exc)) from exc

    def wait(self, timeout: float | None) -> bool:
        # torch's Event.synchronize has no timeout: poll, sleeping longer as the wait grows.
        deadline = None if timeout is None else time.monotonic() + timeout
        # The cap keeps the overshoot past a chunk's copy small next to the copy itself.
        pause = 20e-6
        while not self.query():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 200e-6)
        return True


def _host_slice(pinned: HostBuffer, view: np.ndarray) -> torch.Tensor:
    """The part of the pinned torch tensor behind ``view`` (a uint8 slice of pinned.array)."""
    start = view.ctypes.data - pinned.array.ctypes.data
    native: torch.Tensor = pinned.native
    return native[start : start + view.nbytes]


class CudaTensor(DeviceTensor):
    """A torch CUDA tensor as a flat buffer; strided or conjugated tensors are copied into a flat
    one on the staging stream (``prepare``) and back (``finish``).

    Args:
        device: its CudaDevice. tensor: the caller's tensor. dtype_name: aiocoll's dtype name.
    """

    def __init__(self, device: CudaDevice, tensor: torch.Tensor, dtype_name: str) -> None:
        self.device = device
        self.tensor = tensor.detach()
        self.dtype_name = dtype_name
        self.shape = tuple(tensor.shape)
        self.numel = int(tensor.numel())
        self.itemsize = int(tensor.element_size())
        source = self.tensor
        self.direct = source.is_contiguous() and not source.is_conj() and not source.is_neg()
        self.flat: torch.Tensor | None = source.view(-1) if self.direct else None

    def prepare(self, stream: Stream, *, read: bool) -> None:
        if self.direct:
            return
        assert isinstance(stream, CudaStream)
        with torch.cuda.stream(stream.native):
            if read:
                self.flat = self.tensor.resolve_conj().resolve_neg().contiguous().view(-1)
            else:
                self.flat = torch.empty(self.numel, dtype=self.tensor.dtype, device=self.tensor.device)

    def finish(self, stream: Stream) -> None:
        if self.direct or self.flat is None:
            return
        assert isinstance(stream, CudaStream)
        with torch.cuda.stream(stream.native), torch.no_grad():
            self.tensor.copy_(self.flat.view(self.shape))
        self.tensor.record_stream(stream.native)

    def raw(self, stream: CudaStream) -> torch.Tensor:
        if self.flat is None:
            raise DeviceError(f"{self.device.name}: tensor used before prepare() ran")
        # The caller may free its tensor once the operation returned a torch Work; tell the
        # caching allocator the staging stream still uses the memory.
        self.flat.record_stream(stream.native)
        return self.flat.view(torch.uint8)


class CudaDevice(Device):
    """One CUDA device of this process, through torch.cuda.

    Args:
        index: the device ordinal.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.name = f"cuda:{index}"
        self.torch_device = torch.device("cuda", index)

    def current_stream(self) -> Stream:
        return CudaStream(torch.cuda.current_stream(self.torch_device))

    def new_stream(self) -> Stream:
        return CudaStream(torch.cuda.Stream(device=self.torch_device))

    def new_event(self, *, interprocess: bool = False) -> Event:
        return CudaEvent(torch.cuda.Event(interprocess=interprocess))

    def pinned_empty(self, nbytes: int) -> HostBuffer:
        native = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return HostBuffer(native.numpy(), native)

    def copy_to_host(
        self, dst: np.ndarray, src: DeviceTensor, offset: int, stream: Stream, *, pinned: HostBuffer
    ) -> None:
        assert isinstance(src, CudaTensor) and isinstance(stream, CudaStream)
        host = _host_slice(pinned, dst)
        with torch.cuda.stream(stream.native):
            host.copy_(src.raw(stream)[offset : offset + dst.nbytes], non_blocking=True)

    def copy_to_device(
        self, dst: DeviceTensor, offset: int, src: np.ndarray, stream: Stream, *, pinned: HostBuffer
    ) -> None:
        assert isinstance(dst, CudaTensor) and isinstance(stream, CudaStream)
        host = _host_slice(pinned, src)
        with torch.cuda.stream(stream.native):
            dst.raw(stream)[offset : offset + src.nbytes].copy_(host, non_blocking=True)

    def empty(self, nbytes: int) -> DeviceTensor:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)
        return CudaTensor(self, flat, "uint8")

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
        assert isinstance(dst, CudaTensor) and isinstance(src, CudaTensor) and isinstance(stream, CudaStream)
        dtype = getattr(torch, dtype_name)
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        d = dst.raw(stream)[dst_offset : dst_offset + nbytes].view(dtype)
        r = src.raw(stream)[src_offset : src_offset + nbytes].view(dtype)
        boolean = dtype == torch.bool
        with torch.cuda.stream(stream.native), torch.no_grad():
            if op in (ReduceOp.SUM, ReduceOp.AVG):
                torch.logical_or(d, r, out=d) if boolean else d.add_(r)
            elif op == ReduceOp.PRODUCT:
                torch.logical_and(d, r, out=d) if boolean else d.mul_(r)
            elif op == ReduceOp.MIN:
                torch.minimum(d, r, out=d)
            elif op == ReduceOp.MAX:
                torch.maximum(d, r, out=d)
            elif op == ReduceOp.BAND:
                d.bitwise_and_(r)
            elif op == ReduceOp.BOR:
                d.bitwise_or_(r)
            elif op == ReduceOp.BXOR:
                d.bitwise_xor_(r)
            else:
                raise DeviceError(f"{self.name}: no device kernel for {op}")

    def finish_avg(
        self, tensor: DeviceTensor, offset: int, count: int, dtype_name: str, group_size: int, stream: Stream
    ) -> None:
        assert isinstance(tensor, CudaTensor) and isinstance(stream, CudaStream)
        dtype = getattr(torch, dtype_name)
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        part = tensor.raw(stream)[offset : offset + nbytes].view(dtype)
        with torch.cuda.stream(stream.native), torch.no_grad():
            part.div_(group_size)

    def identity(self) -> str:
        try:
            uuid = str(torch.cuda.get_device_properties(self.index).uuid)
        except (RuntimeError, AttributeError):
            uuid = self.name
        return f"{host_identity()}/{uuid}"

    # -- IPC -----------------------------------------------------------------------------------
    def ipc_supported(self) -> str | None:
        try:
            torch.cuda.Event(interprocess=True)
        except RuntimeError as exc:  # e.g. a container or driver without IPC
            return f"{self.name}: CUDA IPC unavailable ({exc})"
        return None

    def ipc_export(self, tensor: DeviceTensor) -> bytes:
        assert isinstance(tensor, CudaTensor) and tensor.flat is not None
        storage = tensor.flat.untyped_storage()
        fields = storage._share_cuda_()  # (device, handle, size, offset, refcount handle, ...)
        device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = fields
        return bytes(
            msgpack.packb(
                [
                    int(device),
                    bytes(handle),
                    int(size),
                    int(offset),
                    bytes(ref_handle),
                    int(ref_offset),
                    bytes(event_handle) if event_handle else b"",
                    bool(event_sync),
                    tensor.flat.storage_offset() * tensor.itemsize,
                ]
            )
        )

    def ipc_open(self, handle: bytes, like: DeviceTensor) -> DeviceTensor:
        try:
            fields = msgpack.unpackb(handle)
            device, h, size, offset, ref_h, ref_off, ev_h, ev_sync, byte_offset = fields
            storage = torch.UntypedStorage._new_shared_cuda(
                device, h, size, offset, ref_h, ref_off, ev_h or None, ev_sync
            )
        except (RuntimeError, ValueError, TypeError) as exc:
            raise DeviceError(f"{self.name}: could not open a peer's CUDA IPC handle: {exc}") from exc
        flat = torch.empty(0, dtype=torch.uint8, device=self.torch_device)
        flat.set_(storage, byte_offset, (like.numel * like.itemsize,), (1,))
        opened = CudaTensor(self, flat, "uint8")
        return opened

    def ipc_event_export(self, event: Event) -> bytes:
        assert isinstance(event, CudaEvent)
        return bytes(event.native.ipc_handle())

    def ipc_event_open(self, handle: bytes) -> Event:
        try:
            return CudaEvent(torch.cuda.Event.from_ipc_handle(self.torch_device, handle))
        except RuntimeError as exc:
            raise DeviceError(f"{self.name}: could not open a peer's CUDA event: {exc}") from exc

    def copy_device(
        self,
        dst: DeviceTensor,
        dst_offset: int,
        src: DeviceTensor,
        src_offset: int,
        nbytes: int,
        stream: Stream,
    ) -> None:
        assert isinstance(dst, CudaTensor) and isinstance(src, CudaTensor) and isinstance(stream, CudaStream)
        with torch.cuda.stream(stream.native):
            dst.raw(stream)[dst_offset : dst_offset + nbytes].copy_(
                src.raw(stream)[src_offset : src_offset + nbytes], non_blocking=True
            )


_DEVICES: dict[int, CudaDevice] = {}
_LOCK = threading.Lock()


def cuda_device(index: int) -> CudaDevice:
    """The process's CudaDevice for ``index`` (one per device, so one staging side stream)."""
    with _LOCK:
        found = _DEVICES.get(index)
        if found is None:
            found = _DEVICES[index] = CudaDevice(index)
        return found


def wrap_cuda_tensor(tensor: Any, dtype_name: str) -> CudaTensor:
    """A CudaTensor for a torch CUDA tensor.

    Raises:
        RuntimeError: torch reports no usable CUDA in this process.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"tensor is on {tensor.device} but torch reports no usable CUDA device in this process; "
            "move it to the CPU (tensor.cpu()) or run where CUDA is available"
        )
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    return CudaTensor(cuda_device(int(index)), tensor, dtype_name)


def cuda_devices_of(tensors: Any) -> list[CudaDevice]:
    """The CUDA devices of the torch tensors among ``tensors`` (anything else is skipped); with
    none among them, the current device when CUDA is initialized (c10d passes some methods'
    inputs apart from their outputs); else none."""
    indices = {t.device.index for t in tensors if getattr(t, "is_cuda", False)}
    if not indices:
        if not torch.cuda.is_initialized():
            return []
        indices = {torch.cuda.current_device()}
    return [cuda_device(int(i) if i is not None else torch.cuda.current_device()) for i in indices]


def cuda_unavailable() -> str | None:
    """None when this process can use a CUDA device, else why not (for clear errors)."""
    if not torch.backends.cuda.is_built():
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False in this process (no GPU visible, or no driver)"
    return None


def device_count() -> int:
    return int(torch.cuda.device_count()) if cuda_unavailable() is None else 0


def set_device(index: int) -> torch.device:
    """Make ``index`` this process's current CUDA device; returns it as a torch.device."""
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def synchronize(index: int | None = None) -> None:
    """Block until all work on the device (default: current) finished (benchmarks only)."""
    torch.cuda.synchronize(index)
