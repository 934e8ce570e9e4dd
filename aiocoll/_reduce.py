"""Reduce kernels on contiguous 1-D numpy arrays; imports only _types (no torch, no asyncio).

The algorithm executor combines a received chunk into a local one with ``reduce_into`` and,
for AVG, divides the final result with ``finish_avg``. Both write in place (numpy ``out=``), so
a reduction allocates nothing except for bfloat16, whose float32 temporaries cover at most
``BF16_BLOCK`` elements at a time: extra memory stays bounded whatever the message size.

Semantics follow torch's CPU kernels (and so gloo's): float16 is added element by element in
float16 (numpy widens each element to float32 internally and rounds back, as torch does; there
is no float32 accumulation across ranks); bool SUM is logical or and bool PRODUCT logical and;
integers wrap around. bfloat16 has no numpy dtype, so it travels as its raw ``uint16`` bits;
its kernels widen to float32 (exact), compute, and round back to nearest-even, which is what
torch does per element. ``check_reduce_op`` is the one place that decides which op is
meaningful for which dtype; the engine calls it at call time so a bad combination fails before
anything is sent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ._types import BITWISE_OPS, ReduceOp

__all__ = [
    "BF16_BLOCK",
    "BFLOAT16",
    "bf16_to_f32",
    "check_reduce_op",
    "combine",
    "f32_to_bf16",
    "finish_avg",
    "kernel",
    "quiet",
    "reduce_into",
    "restore",
]

BFLOAT16 = "bfloat16"

BF16_BLOCK = 64 * 1024
"""bfloat16 values widened at once: each float32 temporary of a reduction holds at most this many
(256 KiB), instead of the whole message (several full-size temporaries: 1.2 GiB for a 256 MiB
all_reduce on 2 ranks before this bound)."""

_INTEGER = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})
_FLOATING = frozenset({"float16", "float32", "float64", BFLOAT16})
_COMPLEX = frozenset({"complex64", "complex128"})
_KNOWN = _INTEGER | _FLOATING | _COMPLEX | {"bool"}

_UFUNCS: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,  # AVG reduces as SUM; finish_avg divides once at the end
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


# Keyed by the enum's value: hashing a ReduceOp runs Python code, hashing its str value does not.
_UFUNC_BY_VALUE: dict[str, Callable[..., Any]] = {op._value_: f for op, f in _UFUNCS.items()}
_CHECK_AT_REDUCE = frozenset(op._value_ for op in (*BITWISE_OPS, ReduceOp.AVG))

# (op value, dtype name) pairs already found meaningful: every collective checks its pair, and
# the checks below (enum hashing and set lookups in Python) cost more than the reduction of a
# small message. Bounded by the number of ops times the number of dtypes.
_CHECKED: set[tuple[str, str]] = set()


def check_reduce_op(op: ReduceOp, dtype_name: str) -> None:
    """Refuse reduce operations that mean nothing for a dtype.

    Args:
        op: the reduce operation.
        dtype_name: canonical dtype name ("float32", "bfloat16", "bool", "int64", ...).
    Raises:
        TypeError: bitwise ops on floating or complex data, MIN/MAX on complex data, AVG on
            integer or bool data, or a dtype aiocoll cannot reduce.
    """
    if type(op) is not ReduceOp:
        _check_reduce_op(op, dtype_name)
        return
    key = (op._value_, dtype_name)
    if key in _CHECKED:
        return
    _check_reduce_op(op, dtype_name)
    _CHECKED.add(key)


def _check_reduce_op(op: ReduceOp, dtype_name: str) -> None:
    if dtype_name not in _KNOWN:
        raise TypeError(
            f"aiocoll cannot reduce dtype {dtype_name!r}; supported: bool, int8..int64, uint8..uint64, "
            "float16, bfloat16, float32, float64, complex64, complex128"
        )
    if op in BITWISE_OPS and dtype_name not in _INTEGER and dtype_name != "bool":
        raise TypeError(
            f"ReduceOp.{op.name} is a bitwise operation and needs an integer or bool tensor, got "
            f"{dtype_name}; use SUM/PRODUCT/MIN/MAX/AVG for {dtype_name} data"
        )
    if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype_name in _COMPLEX:
        raise TypeError(
            f"ReduceOp.{op.name} is not defined for complex data ({dtype_name}): complex numbers have "
            "no order; reduce the real and imaginary parts or the magnitudes instead"
        )
    if op is ReduceOp.AVG and dtype_name not in _FLOATING and dtype_name not in _COMPLEX:
        raise TypeError(
            f"ReduceOp.AVG needs a floating-point or complex tensor, got {dtype_name}; "
            "use SUM and divide, or convert the tensor to a float dtype first"
        )


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 values (as uint16 bits) to a new float32 array; exact."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(values: np.ndarray, out: np.ndarray) -> None:
    """Round float32 values to bfloat16 bits (nearest, ties to even) into ``out`` (uint16).

    NaNs stay NaN (quieted), as torch's conversion keeps them.
    """
    u = values.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds to nearest with ties going to the even value.
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    rounded = (u + (np.uint32(0x7FFF) + lsb)) >> np.uint32(16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = (u[nan] >> np.uint32(16)) | np.uint32(0x0040)
    np.copyto(out, rounded, casting="unsafe")


def reduce_into(
    op: ReduceOp, dst: np.ndarray, src: np.ndarray, dtype_name: str, *, src_first: bool = False
) -> None:
    """Combine ``src`` into ``dst`` in place: ``dst = dst (op) src``.

    Args:
        op: the reduce operation (AVG reduces as SUM here; see ``finish_avg``).
        dst, src: 1-D arrays of equal length and dtype (uint16 bits for bfloat16).
        dtype_name: canonical dtype name; it tells bfloat16 apart from uint16.
        src_first: compute ``dst = src (op) dst`` instead. The ops are commutative in exact
            arithmetic, but e.g. numpy's complex product is not bit for bit; algorithms where two
            ranks compute the same combination use this to compute it in one order.
    Raises:
        TypeError: for a meaningless op/dtype pair (see ``check_reduce_op``).
    """
    if src_first:
        combine(op, dst, src, dst, dtype_name)
    else:
        combine(op, dst, dst, src, dtype_name)


def combine(op: ReduceOp, out: np.ndarray, a: np.ndarray, b: np.ndarray, dtype_name: str) -> None:
    """``out = a (op) b`` in one pass (``out`` may be ``a`` or ``b``): a reduction of two
    inputs into a third buffer without copying one of them there first."""
    kernel(op, dtype_name)(a, b, out=out)


Kernel = Callable[..., Any]
"""``kernel(a, b, out=out)`` computes ``out = a (op) b`` (a numpy ufunc, or bfloat16's blocks)."""

# (op value, dtype name) -> its kernel, checked when first made: a fold of a small message runs
# one kernel, and finding it (the checks, the table) costs more than the reduction. Bounded.
_KERNELS: dict[tuple[str, str], Kernel] = {}
_KERNELS_MAX = 256


def kernel(op: ReduceOp, dtype_name: str) -> Kernel:
    """The one function that computes ``out = a (op) b`` for ``op`` on ``dtype_name`` data, called
    as ``kernel(a, b, out=out)`` (``out`` may be ``a`` or ``b``): numpy's ufunc itself for every
    dtype numpy has; bfloat16's widening kernel, block by block, otherwise.

    Raises:
        TypeError: an unknown reduce op, or a meaningless op/dtype pair (see
            ``check_reduce_op``: checked for bfloat16, complex data, AVG and the bitwise ops).
    """
    if type(op) is not ReduceOp:
        raise TypeError(f"unknown reduce op {op!r}")
    key = (op._value_, dtype_name)
    found = _KERNELS.get(key)
    if found is not None:
        return found
    ufunc = _UFUNC_BY_VALUE.get(op._value_)
    if ufunc is None:
        raise TypeError(f"unknown reduce op {op!r}")
    if dtype_name == BFLOAT16 or op._value_ in _CHECK_AT_REDUCE or dtype_name in _COMPLEX:
        check_reduce_op(op, dtype_name)
    made: Kernel = _bf16_kernel(ufunc) if dtype_name == BFLOAT16 else ufunc
    if len(_KERNELS) >= _KERNELS_MAX:
        _KERNELS.clear()
    _KERNELS[key] = made
    return made


def _bf16_kernel(wide_op: Callable[..., Any]) -> Kernel:
    """bfloat16's kernel: widened to float32 (exact), ``wide_op`` there, rounded back, at most
    BF16_BLOCK elements at a time."""

    def bf16(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        for start in range(0, len(out), BF16_BLOCK):
            stop = start + BF16_BLOCK
            wide = bf16_to_f32(a[start:stop])
            wide_op(wide, bf16_to_f32(b[start:stop]), out=wide)
            f32_to_bf16(wide, out[start:stop])

    return bf16


def finish_avg(result: np.ndarray, world_size: int, dtype_name: str) -> None:
    """Divide a SUM result by the number of contributors, in place (the AVG epilogue).

    Raises:
        TypeError: for integer or bool data, where AVG is refused.
    """
    check_reduce_op(ReduceOp.AVG, dtype_name)
    if dtype_name == BFLOAT16:
        divisor = np.float32(world_size)
        for start in range(0, len(result), BF16_BLOCK):
            part = result[start : start + BF16_BLOCK]
            wide = bf16_to_f32(part)
            np.divide(wide, divisor, out=wide)
            f32_to_bf16(wide, part)
        return
    np.divide(result, world_size, out=result, casting="unsafe")


def _quiet_switch() -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """(quiet, restore) for numpy's floating-point error handling (see ``quiet``)."""
    try:
        # numpy 2 keeps the error state in a context variable: a prepared "ignore" state is set
        # and reset by two C calls, where np.errstate builds it anew in Python on every entry.
        from numpy._core._multiarray_umath import _extobj_contextvar, _make_extobj

        silent = _make_extobj(all="ignore")
    except (ImportError, AttributeError, TypeError):

        def enter() -> Any:
            state = np.errstate(all="ignore")
            state.__enter__()
            return state

        def leave(state: Any) -> None:
            state.__exit__(None, None, None)

        return enter, leave
    return functools.partial(_extobj_contextvar.set, silent), _extobj_contextvar.reset


quiet, restore = _quiet_switch()
"""``token = quiet()`` ... ``restore(token)``: numpy's floating-point errors (overflow, invalid,
divide, underflow) ignored in between, in this thread's context only, as ``np.errstate(all="ignore")``
does: a reduction's overflow gives inf and an invalid operation nan, as in torch, without warnings.
Cheaper than np.errstate's decorator, which the fold of a small message would pay on every call."""
