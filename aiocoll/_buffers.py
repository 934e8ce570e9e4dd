"""Buffers as the step driver sees them: the one interface through which it allocates scratch,
views a range, hands a payload to a link, copies and reduces; and its host (numpy) implementation.

Imports only foundations (_reduce, _types) and numpy; never asyncio, client/ or the public surface.
Why it exists: the schedules and the driver (aiocoll/algorithms) must not know what memory they
run on. Host arrays are numpy today; device memory (the GPU path) is another implementation of
``Buffers``, chosen per operation, with no change to the schedules or the driver.

Bounded work per call: ``reduce_into`` never needs temporaries larger than a block (see
``_reduce.BF16_BLOCK``), and the driver calls it on at most ``REDUCE_BLOCK_BYTES`` at a time so a
large reduction never holds up the event loop (a link's read callback) for long. Scratch that an
operation gives back (``release``) serves the next ones, up to ``SCRATCH_KEEP_BYTES`` in all.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._reduce import finish_avg, quiet, reduce_into, restore
from ._types import ReduceOp

__all__ = ["NUMPY", "REDUCE_BLOCK_BYTES", "SCRATCH_KEEP_BYTES", "Buffers", "NumpyBuffers"]

REDUCE_BLOCK_BYTES = 1024 * 1024
"""The most bytes the driver reduces in one go; a step that reduces more hands the rest to later
turns of the event loop, one block per turn (a 1 MiB float32 add takes about 0.2 ms here)."""


SCRATCH_KEEP_BYTES = 64 * 1024 * 1024
"""Scratch that finished operations gave back and is kept for the next ones, at most (older
arrays are dropped first). Without it every large operation received into fresh memory: the
allocator returns freed large blocks to the system, and faulting 8 MiB back in costs about as
much CPU as the 16 MiB all_reduce's own copies (measured: 150-270 page faults per operation)."""

_KEEP_FROM_BYTES = 64 * 1024  # smaller arrays come from numpy's own cache at no cost



class Buffers(ABC):
    """What the planner and the step driver do with an operation's memory.

    An "array" is whatever the implementation keeps (a flat numpy array for ``NumpyBuffers``):
    one-dimensional, contiguous, of one dtype; ranges are in elements.
    """

    @abstractmethod
    def check_flat(self, arrays: Sequence[Any], what: str) -> None:
        """Raise ValueError (naming ``what``) unless every array is one this implementation runs on."""

    @abstractmethod
    def signature(self, arrays: Sequence[Any]) -> tuple[Any, ...] | None:
        """Everything a plan depends on about ``arrays`` (dtype, size, layout), hashable, or None
        when they are not plain arrays of this implementation (then nothing is cached)."""

    @abstractmethod
    def scratch(self, like: Any, count: int) -> Any:
        """A new uninitialised array of ``count`` elements of ``like``'s dtype (and device)."""

    @abstractmethod
    def release(self, array: Any) -> None:
        """``array`` (from ``scratch``) is no longer used by anyone: it may serve a later
        ``scratch`` call. Only call it once nothing can write into the array any more."""

    @abstractmethod
    def nothing(self) -> Any:
        """An empty byte array (what a barrier's messages carry)."""

    @abstractmethod
    def view(self, array: Any, start: int, stop: int) -> Any:
        """Elements ``start:stop`` of ``array``, sharing its memory."""

    @abstractmethod
    def payload(self, view: Any) -> memoryview:
        """The bytes of ``view`` as a link sends them or receives into them (same memory)."""

    @abstractmethod
    def landed(self, memory: memoryview, like: Any) -> Any:
        """The bytes a link left a payload in (``Transport.recv_landed``) read as ``like``'s dtype."""

    @abstractmethod
    def copy(self, dst: Any, src: Any) -> None:
        """``dst[:] = src`` (equal lengths and dtypes)."""

    @abstractmethod
    def reduce_into(self, op: ReduceOp, dst: Any, src: Any, dtype_name: str, *, src_first: bool) -> None:
        """``dst = dst (op) src`` in place, or ``src (op) dst`` when ``src_first``; overflow gives
        inf/nan or wraps as torch does. Temporaries stay bounded whatever the length."""

    @abstractmethod
    def finish_avg(self, result: Any, group_size: int, dtype_name: str) -> None:
        """Divide a summed ``result`` by ``group_size`` in place (ReduceOp.AVG's last step)."""

    @abstractmethod
    def size(self, array: Any) -> int:
        """Elements in ``array``."""

    @abstractmethod
    def itemsize(self, array: Any) -> int:
        """Bytes per element of ``array``."""


class NumpyBuffers(Buffers):
    """Host memory: flat, contiguous numpy arrays (bfloat16 as its uint16 bits, see _reduce)."""

    def check_flat(self, arrays: Sequence[Any], what: str) -> None:
        for a in arrays:
            if not isinstance(a, np.ndarray) or a.ndim != 1 or not a.flags.c_contiguous:
                raise ValueError(
                    f"{what}: the executor needs contiguous 1-D numpy arrays, got {type(a).__name__}"
                )

    def signature(self, arrays: Sequence[Any]) -> tuple[Any, ...] | None:
        if len(arrays) == 1:  # the common case, without a list
            a = arrays[0]
            if type(a) is not np.ndarray:
                return None
            return (a.dtype, a.size, a.ndim, a.flags.c_contiguous)
        out = []
        for a in arrays:
            if type(a) is not np.ndarray:
                return None
            out.append((a.dtype, a.size, a.ndim, a.flags.c_contiguous))
        return tuple(out)

    def __init__(self) -> None:
        # (dtype, count) -> arrays given back, oldest key first; bounded by SCRATCH_KEEP_BYTES.
        self._kept: dict[tuple[Any, int], list[np.ndarray]] = {}
        self._kept_bytes = 0
        self._lock = threading.Lock()  # several event loops (threads) may share one instance

    def scratch(self, like: np.ndarray, count: int) -> np.ndarray:
        if count * like.itemsize >= _KEEP_FROM_BYTES and self._kept:
            with self._lock:
                kept = self._kept.get((like.dtype, count))
                if kept:
                    array = kept.pop()
                    if not kept:
                        del self._kept[(like.dtype, count)]
                    self._kept_bytes -= array.nbytes
                    return array
        return np.empty(count, dtype=like.dtype)

    def release(self, array: np.ndarray) -> None:
        if not _KEEP_FROM_BYTES <= array.nbytes <= SCRATCH_KEEP_BYTES:
            return
        with self._lock:
            self._kept.setdefault((array.dtype, array.size), []).append(array)
            self._kept_bytes += array.nbytes
            while self._kept_bytes > SCRATCH_KEEP_BYTES:
                key = next(iter(self._kept))
                kept = self._kept[key]
                self._kept_bytes -= kept.pop(0).nbytes
                if not kept:
                    del self._kept[key]

    def nothing(self) -> np.ndarray:
        return np.empty(0, dtype=np.uint8)

    def view(self, array: np.ndarray, start: int, stop: int) -> np.ndarray:
        return array[start:stop]

    def payload(self, view: np.ndarray) -> memoryview:
        return view.view(np.uint8).data

    def landed(self, memory: memoryview, like: np.ndarray) -> np.ndarray:
        return np.frombuffer(memory, dtype=like.dtype)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def reduce_into(
        self, op: ReduceOp, dst: np.ndarray, src: np.ndarray, dtype_name: str, *, src_first: bool
    ) -> None:
        # Overflow to inf/nan is the result, as in torch: no floating-point warnings.
        token = quiet()
        try:
            reduce_into(op, dst, src, dtype_name, src_first=src_first)
        finally:
            restore(token)

    def finish_avg(self, result: np.ndarray, group_size: int, dtype_name: str) -> None:
        token = quiet()
        try:
            finish_avg(result, group_size, dtype_name)
        finally:
            restore(token)

    def size(self, array: np.ndarray) -> int:
        return int(array.size)

    def itemsize(self, array: np.ndarray) -> int:
        return int(array.itemsize)


NUMPY = NumpyBuffers()
"""The host implementation every operation on numpy arrays (and CPU tensors) uses."""
