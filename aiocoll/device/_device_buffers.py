"""Device memory behind the step driver's buffer interface: scratch, views, copies and reductions
queued on a device stream.

Foundation layer: imports aiocoll._buffers (the interface), aiocoll.device._device, aiocoll.device._staging
(DeviceSpan) and aiocoll._types; never torch (the Device does the work), asyncio, client/ or the
public surface. Arrays are DeviceSpans
(a device tensor and an element range); every method queues its work on the stream it was made
with and returns at once, so ordering against copies and other processes is by that stream's
events. The IPC path (aiocoll.device._ipc) does its device-side copies and reductions through it.

Device memory never goes on a link as it is: ``payload`` and ``landed`` refuse, since bytes
between hosts travel through pinned staging (aiocoll.device._staging), chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiocoll._buffers import Buffers
from aiocoll._types import ReduceOp
from aiocoll.device._device import Device, DeviceError, Stream
from aiocoll.device._staging import DeviceSpan

__all__ = ["DeviceBuffers"]


class DeviceBuffers(Buffers):
    """Buffers whose arrays are DeviceSpans of ``device``, worked on in ``stream``'s order."""

    def __init__(self, device: Device, stream: Stream) -> None:
        self.device = device
        self.stream = stream

    def check_flat(self, arrays: Sequence[Any], what: str) -> None:
        for a in arrays:
            if not isinstance(a, DeviceSpan) or a.tensor.device is not self.device:
                raise ValueError(f"{what}: expected ranges of device memory on {self.device.name}, got {a!r}")

    def signature(self, arrays: Sequence[Any]) -> tuple[Any, ...] | None:
        return None  # plans over device memory are not cached

    def scratch(self, like: DeviceSpan, count: int) -> DeviceSpan:
        memory = self.device.empty(count * like.itemsize)
        return DeviceSpan(memory, like.dtype, 0, count, read=False, write=False)

    def release(self, array: DeviceSpan) -> None:
        return None  # device scratch is not kept between operations (the allocator may cache it)

    def nothing(self) -> DeviceSpan:
        import numpy as np

        return DeviceSpan(self.device.empty(0), np.dtype(np.uint8), 0, 0, read=False, write=False)

    def view(self, array: DeviceSpan, start: int, stop: int) -> DeviceSpan:
        return array[start:stop]

    def payload(self, view: DeviceSpan) -> memoryview:
        raise DeviceError(
            f"device memory on {self.device.name} goes on a link only through pinned staging "
            "(aiocoll.device._staging)"
        )

    def landed(self, memory: memoryview, like: DeviceSpan) -> DeviceSpan:
        raise DeviceError(f"a link cannot land bytes in device memory on {self.device.name}; stage them")

    def copy(self, dst: DeviceSpan, src: DeviceSpan) -> None:
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy between ranges of {dst.nbytes} and {src.nbytes} bytes")
        dst_at, src_at = dst.start * dst.itemsize, src.start * src.itemsize
        self.device.copy_device(dst.tensor, dst_at, src.tensor, src_at, dst.nbytes, self.stream)

    def reduce_into(
        self, op: ReduceOp, dst: DeviceSpan, src: DeviceSpan, dtype_name: str, *, src_first: bool
    ) -> None:
        if src_first and op == ReduceOp.PRODUCT and dtype_name.startswith("complex"):
            raise DeviceError("a device reduction computes dst (op) src; complex PRODUCT needs that order")
        self.device.reduce_into(
            op,
            dst.tensor,
            dst.start * dst.itemsize,
            src.tensor,
            src.start * src.itemsize,
            dst.size,
            dtype_name,
            self.stream,
        )

    def finish_avg(self, result: DeviceSpan, group_size: int, dtype_name: str) -> None:
        self.device.finish_avg(
            result.tensor, result.start * result.itemsize, result.size, dtype_name, group_size, self.stream
        )

    def size(self, array: DeviceSpan) -> int:
        return array.size

    def itemsize(self, array: DeviceSpan) -> int:
        return array.itemsize
