"""Tensor buffer handling: numpy arrays and torch tensors to contiguous 1-D numpy working arrays.

Imports only this package's device foundations (_device, _staging; _cuda when a CUDA tensor
is met) and never imports torch itself: a torch tensor can only exist if the
caller already imported torch, so we look for it in ``sys.modules``. The engine turns every
tensor an operation touches into a ``Working`` (a flat numpy view of the same memory where
possible, a staging copy otherwise) before the algorithms run, and calls ``finish()`` afterwards
so results land in the caller's tensor in place. Signatures use ``dtype_name`` and ``numel``.

Staging copies are needed for: non-contiguous or non-native-byte-order numpy arrays and CPU torch
tensors that are not contiguous or carry a lazy conjugate/negative bit. Tensors in device memory
(torch CUDA tensors, any aiocoll.device._device.DeviceTensor) are not copied here: their Working's
``array`` is a ``DeviceSpan`` and the operation runs through the pinned staging pipeline
(aiocoll.device._staged_ops), chunk by chunk. bfloat16 travels as its raw bits in a uint16
array (numpy has no bfloat16); ``aiocoll._reduce`` knows how to reduce those bits.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from aiocoll.device._device import DeviceTensor
from aiocoll.device._staging import DeviceSpan

__all__ = [
    "DEVICE",
    "HOST",
    "SUPPORTED_DTYPES",
    "Working",
    "as_working",
    "dtype_name",
    "is_torch_tensor",
    "numel",
]

SUPPORTED_DTYPES = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    }
)


HOST, DEVICE = "host", "device"  # the memory a tensor's working array is in


def _nothing() -> None:
    return None


class Working:
    """A tensor as the executor sees it.

    Attributes:
        array: contiguous 1-D numpy array (uint16 bits for bfloat16), or a DeviceSpan over a
            device tensor; writes to it reach the caller's tensor once ``finish()`` ran
            (immediately when no staging was needed).
        dtype_name: canonical dtype name ("float32", "bfloat16", ...).
        shape: the caller's shape. staged: True when ``array`` is a copy (or a device span).
        memory: HOST, or DEVICE for a device span (the operation record's memory).
    """

    # The fields every working sets are slots; the rest are class attributes until a staged
    # one sets them (``_staged``; then in its dict): the usual working, an array that is the
    # tensor's own memory, sets three.
    __slots__ = ("__dict__", "array", "dtype_name", "shape")
    staged = False
    # ``finish()`` copies results back into the caller's tensor if ``array`` is a staging copy
    # (a plain function, not a method that calls one: it runs once per tensor per operation)
    finish: Callable[[], None] = staticmethod(_nothing)
    memory = HOST

    def __init__(self, array: Any, dtype_name: str, shape: tuple[int, ...]) -> None:
        self.array = array
        self.dtype_name = dtype_name
        self.shape = shape

    @property
    def numel(self) -> int:
        return int(self.array.size)

    def __repr__(self) -> str:
        return (
            f"Working({self.dtype_name}, shape {self.shape}, {self.memory}"
            f"{', staged' if self.staged else ''}: {self.array!r})"
        )


def _staged(
    array: Any, name: str, shape: tuple[int, ...], finish: Callable[[], None], memory: str = HOST
) -> Working:
    """A Working whose array is not the tensor's own memory: ``finish`` copies results back."""
    w = Working(array, name, shape)
    w.staged = True
    if finish is not _nothing:
        w.finish = finish
    if memory != HOST:
        w.memory = memory
    return w


def is_torch_tensor(obj: object) -> bool:
    """True when ``obj`` is a torch.Tensor; never imports torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def dtype_name(obj: Any) -> str:
    """Canonical dtype name of a numpy array or torch tensor ("float32", "bfloat16", "bool", ...).

    Raises:
        TypeError: not a tensor, or a dtype aiocoll does not carry.
    """
    if isinstance(obj, np.ndarray):
        known = _NUMPY_NAMES.get(obj.dtype)
        if known is not None:
            return known
        name = obj.dtype.name
    elif is_torch_tensor(obj):
        known = _TORCH_NAMES.get(obj.dtype)
        if known is not None:
            return known
        name = str(obj.dtype).removeprefix("torch.")
    elif isinstance(obj, DeviceTensor):
        name = obj.dtype_name
    else:
        raise TypeError(f"expected a numpy.ndarray or torch.Tensor, got {type(obj).__name__}")
    if name not in SUPPORTED_DTYPES:
        raise TypeError(
            f"aiocoll does not carry dtype {name!r}; supported: {', '.join(sorted(SUPPORTED_DTYPES))}"
        )
    if isinstance(obj, np.ndarray):
        _NUMPY_NAMES[obj.dtype] = name
    elif is_torch_tensor(obj):
        _TORCH_NAMES[obj.dtype] = name
    return name


# Supported numpy (torch) dtypes seen so far -> name: numpy computes ``dtype.name`` in Python
# (torch formats its dtype as a string), which costs more than the rest of a small collective's
# bookkeeping. At most one entry per dtype.
_NUMPY_NAMES: dict[np.dtype[Any], str] = {}
_TORCH_NAMES: dict[Any, str] = {}


def numel(obj: Any) -> int:
    """Number of elements of a numpy array or torch tensor (1 for 0-d, 0 for empty)."""
    if isinstance(obj, np.ndarray):
        return int(obj.size)
    if is_torch_tensor(obj):
        return int(obj.numel())
    if isinstance(obj, DeviceTensor):
        return obj.numel
    raise TypeError(f"expected a numpy.ndarray or torch.Tensor, got {type(obj).__name__}")


def as_working(obj: Any, read: bool = True, write: bool = True) -> Working:
    """Flatten a tensor into a contiguous 1-D numpy working array.

    Args:
        obj: numpy array or torch tensor, any shape (0-d and empty included), contiguous or not.
        read: the operation reads the tensor's current values (a staging copy is filled).
        write: the operation writes results into it (``finish`` copies back; read-only numpy
            arrays are refused).
    Returns:
        a Working whose ``finish()`` must run after the operation completed successfully.
    Raises:
        TypeError: not a tensor, or an unsupported dtype or layout (sparse, meta device).
        ValueError: ``write`` and the numpy array is read-only.
        RuntimeError: a CUDA tensor while torch reports no usable CUDA.
    """
    if isinstance(obj, _ndarray):
        # (here, not in a function of its own: the commonest call, on every operation)
        flags = obj.flags  # a new object at each access: read it once
        name = _NATIVE_NAMES.get(obj.dtype)  # (None: a dtype not met yet, or not native)
        if name is not None and flags.c_contiguous and (flags.writeable or not write):
            return Working(obj if obj.ndim == 1 else obj.reshape(-1), name, obj.shape)
        return _numpy_working(obj, read, write)
    if is_torch_tensor(obj):
        return _torch_working(obj, read=read, write=write)
    if isinstance(obj, DeviceTensor):
        return device_working(obj, read=read, write=write)
    raise TypeError(f"expected a numpy.ndarray or torch.Tensor, got {type(obj).__name__}")


_ndarray = np.ndarray
# Supported numpy dtypes in native byte order met so far -> name: an array of one, contiguous,
# is its own working array (``as_working``). At most one entry per dtype.
_NATIVE_NAMES: dict[np.dtype[Any], str] = {}


def _numpy_working(arr: np.ndarray, read: bool, write: bool) -> Working:
    """as_working of a numpy array its first lines did not take: a dtype not met yet, a
    read-only array to write into (refused), or one to stage (not contiguous, not native)."""
    name = dtype_name(arr)
    shape = arr.shape
    flags = arr.flags
    if write and not flags.writeable:
        raise ValueError(
            f"cannot write the result into a read-only numpy array (shape {shape}, {name}); "
            "pass a writeable array (e.g. arr.copy())"
        )
    if arr.dtype.isnative:
        _NATIVE_NAMES[arr.dtype] = name
        if flags.c_contiguous:
            return Working(arr if arr.ndim == 1 else arr.reshape(-1), name, shape)
    return _numpy_staged(arr, name, read=read, write=write)


def _numpy_staged(arr: np.ndarray, name: str, *, read: bool, write: bool) -> Working:
    """as_working of a numpy array that is not contiguous or not in native byte order: a copy."""
    shape = arr.shape
    native = arr.dtype.newbyteorder("=")
    if read:
        staging = np.ascontiguousarray(arr, dtype=native).reshape(-1)
    else:
        staging = np.empty(arr.size, dtype=native)

    def finish() -> None:
        arr[...] = staging.reshape(shape)

    return _staged(staging, name, shape, finish if write else _nothing)


def _torch_working(tensor: Any, *, read: bool, write: bool) -> Working:
    seen = _VIEWS.get(id(tensor))
    if seen is not None:
        held, layout, array, name = seen
        # (the entry holds the tensor, so its id is no other object's)
        if held is tensor and layout == (tensor.data_ptr(), tensor.dtype, tensor.stride(), tensor.shape):
            return Working(array, name, layout[3])
    dtype = tensor.dtype
    name = _TORCH_NAMES.get(dtype) or dtype_name(tensor)
    if tensor.is_cpu and not tensor.requires_grad and name not in _NO_NUMPY_BRIDGE:
        # The common case (a dense CPU tensor): its memory as numpy, with the fewest torch calls
        # (each costs a dispatch). _host_view refuses a sparse tensor and one with a lazy
        # conjugate or negative bit; numpy's flags tell a contiguous one.
        try:
            view = _host_view(tensor)
        except (TypeError, RuntimeError, BufferError):
            pass
        else:
            if view.flags.c_contiguous:
                array = view if view.ndim == 1 else view.reshape(-1)
                shape = view.shape
                if array.nbytes <= _VIEW_BYTES:
                    if len(_VIEWS) >= _VIEW_ENTRIES:
                        # the oldest goes (unless another thread's call took it meanwhile)
                        with contextlib.suppress(RuntimeError, StopIteration, KeyError):
                            del _VIEWS[next(iter(_VIEWS))]
                    layout = (tensor.data_ptr(), dtype, tensor.stride(), shape)
                    _VIEWS[id(tensor)] = (tensor, layout, array, name)
                return Working(array, name, shape)
    return _torch_working_staged(tensor, name, read=read, write=write)


# The numpy views of the last few small dense CPU tensors met, by the tensor's id: a training loop
# or a blocking script passes the same small tensor at every call, and torch's numpy view costs
# more than a small collective's other bookkeeping. An entry is used only while the tensor's data
# pointer, dtype, strides and shape are those it was made with (an in-place resize_, set_ or
# ``.data =`` changes one of them; a change of values changes none, and the view sees it). The
# entry holds the tensor (a numpy view holds its tensor too): so the cache keeps at most
# _VIEW_ENTRIES tensors alive after their user dropped them, each of at most _VIEW_BYTES when it
# was cached (one resized larger afterwards stays alive until its entry is replaced).
_VIEW_ENTRIES = 4
_VIEW_BYTES = 64 * 1024
_VIEWS: dict[int, tuple[Any, tuple[Any, ...], np.ndarray, str]] = {}


def _torch_working_staged(tensor: Any, name: str, *, read: bool, write: bool) -> Working:
    """_torch_working for every tensor but a dense CPU one numpy can view as it is."""
    import torch  # already imported by whoever made the tensor; this binds the name only

    if (
        tensor.is_cpu
        and tensor.layout is torch.strided
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
    ):
        # dense and on the CPU, but it requires grad or numpy has no such dtype (bfloat16)
        source = tensor.detach() if tensor.requires_grad else tensor
        array = _torch_flat_to_numpy(source, name)
        return Working(array if array.ndim == 1 else array.reshape(-1), name, tuple(tensor.shape))
    shape = tuple(tensor.shape)
    if tensor.layout != torch.strided:
        raise TypeError(
            f"aiocoll needs dense (strided) tensors, got layout {tensor.layout}; call .to_dense()"
        )
    device = tensor.device
    if device.type == "meta":
        raise TypeError("a tensor on the 'meta' device has no data to communicate")
    if device.type == "cuda":
        from aiocoll.device._cuda import wrap_cuda_tensor

        return device_working(wrap_cuda_tensor(tensor, name), read=read, write=write)
    source = tensor.detach()
    direct = device.type == "cpu" and source.is_contiguous() and not source.is_conj() and not source.is_neg()
    if direct:
        flat = source.view(-1)
    else:
        # Staging through host memory: one copy in (when read), one copy back in finish().
        if read:
            flat = source.resolve_conj().resolve_neg().to("cpu").contiguous().view(-1)
            if flat.data_ptr() == source.data_ptr() and flat.numel():
                flat = flat.clone()
        else:
            flat = torch.empty(source.numel(), dtype=source.dtype, device="cpu")
    array = _torch_flat_to_numpy(flat, name)
    if direct:
        return Working(array, name, shape)

    def finish() -> None:
        with torch.no_grad():
            tensor.copy_(flat.view(shape))

    return _staged(array, name, shape, finish if write else _nothing)


def _host_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype a host view of a device tensor has (bfloat16 as its uint16 bits)."""
    return np.dtype("uint16") if name == "bfloat16" else np.dtype(name)


def device_working(tensor: DeviceTensor, *, read: bool, write: bool) -> Working:
    """A Working whose array is a DeviceSpan over the whole device tensor: operations see it as
    they see a host array and run through the staging pipeline (see the module header)."""
    span = DeviceSpan(tensor, _host_dtype(tensor.dtype_name), 0, tensor.numel, read=read, write=write)
    return _staged(span, tensor.dtype_name, tensor.shape, _nothing, DEVICE)


def _host_view(tensor: Any) -> np.ndarray:
    """A numpy array over a CPU tensor's own memory (the array holds the tensor).

    Through DLPack, not torch's ``.numpy()``: that marks the tensor's storage as never resizable
    again, so a script that resizes a tensor after a collective (FSDP frees and re-allocates its
    flat parameters that way) would fail where gloo lets it. DLPack exports a tensor with a lazy
    negative bit as its raw memory, so that one is refused here, as ``.numpy()`` refuses it.

    Raises:
        TypeError: a lazy negative bit. BufferError: what DLPack does not export (a lazy
            conjugate bit, a sparse layout, a tensor that requires grad). RuntimeError: a dtype
            it has no code for (bfloat16: take its bits through an int16 view).
    """
    if tensor.is_neg():
        raise TypeError("a tensor with a lazy negative bit is staged")
    return np.from_dlpack(tensor)


def _torch_flat_to_numpy(flat: Any, name: str) -> np.ndarray:
    if name not in _NO_NUMPY_BRIDGE:
        return _host_view(flat)  # the common case: no import statement on this path
    import torch

    if name == "bfloat16":
        return _host_view(flat.view(torch.int16)).view(np.uint16)  # raw bits; see aiocoll._reduce
    # Carried as the signed twin's bits, read as the unsigned type.
    signed = {"uint16": torch.int16, "uint32": torch.int32, "uint64": torch.int64}[name]
    return _host_view(flat.view(signed)).view(np.dtype(name))


# torch dtypes read through a same-width integer view (numpy has no bfloat16; DLPack may lack the
# newer unsigned types)
_NO_NUMPY_BRIDGE = frozenset(("bfloat16", "uint16", "uint32", "uint64"))
