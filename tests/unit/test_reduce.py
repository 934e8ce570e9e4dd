"""Reduce kernels: which op is allowed for which dtype, and what each computes (torch's semantics)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

from aiocoll import _reduce
from aiocoll._reduce import bf16_to_f32, check_reduce_op, f32_to_bf16, finish_avg, kernel, reduce_into
from aiocoll._types import ReduceOp

INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
COMPLEX = ["complex64", "complex128"]
BITWISE = [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]


@pytest.mark.parametrize("dtype", [*INTS, *FLOATS, *COMPLEX, "bool"])
@pytest.mark.parametrize("op", list(ReduceOp))
def test_check_reduce_op_refuses_exactly_the_meaningless_pairs(dtype: str, op: ReduceOp) -> None:
    refused = (
        (op in BITWISE and dtype not in INTS and dtype != "bool")
        or (op in (ReduceOp.MIN, ReduceOp.MAX) and dtype in COMPLEX)
        or (op is ReduceOp.AVG and dtype not in FLOATS and dtype not in COMPLEX)
    )
    if refused:
        with pytest.raises(TypeError) as info:
            check_reduce_op(op, dtype)
        assert op.name in str(info.value) and dtype in str(info.value)
    else:
        check_reduce_op(op, dtype)


def test_check_reduce_op_refuses_unknown_dtypes() -> None:
    with pytest.raises(TypeError, match="float128"):
        check_reduce_op(ReduceOp.SUM, "float128")


@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, *BITWISE])
def test_integer_reductions_match_numpy_and_wrap_around(dtype: str, op: ReduceOp) -> None:
    info = np.iinfo(dtype)
    a = np.array([info.max, info.min, 3, 0, 7], dtype=dtype)
    b = np.array([1, info.max, 5, 0, 2], dtype=dtype)
    want = {
        ReduceOp.SUM: np.add,
        ReduceOp.PRODUCT: np.multiply,
        ReduceOp.MIN: np.minimum,
        ReduceOp.MAX: np.maximum,
        ReduceOp.BAND: np.bitwise_and,
        ReduceOp.BOR: np.bitwise_or,
        ReduceOp.BXOR: np.bitwise_xor,
    }[op](a, b)
    reduce_into(op, a, b, dtype)
    np.testing.assert_array_equal(a, want)
    assert a.dtype == np.dtype(dtype)


def test_integer_sum_wraps_like_torch() -> None:
    a = np.array([127, -128], dtype=np.int8)
    reduce_into(ReduceOp.SUM, a, np.array([1, -1], dtype=np.int8), "int8")
    assert a.tolist() == [-128, 127]


@pytest.mark.parametrize(
    ("op", "want"),
    [
        (ReduceOp.SUM, [False, True, True, True]),  # logical or, as torch does for bool
        (ReduceOp.PRODUCT, [False, False, False, True]),  # logical and
        (ReduceOp.MIN, [False, False, False, True]),
        (ReduceOp.MAX, [False, True, True, True]),
        (ReduceOp.BAND, [False, False, False, True]),
        (ReduceOp.BOR, [False, True, True, True]),
        (ReduceOp.BXOR, [False, True, True, False]),
    ],
)
def test_bool_reductions_are_logical(op: ReduceOp, want: list[bool]) -> None:
    a = np.array([False, False, True, True])
    reduce_into(op, a, np.array([False, True, False, True]), "bool")
    assert a.tolist() == want


def test_float16_sum_rounds_to_float16_each_time_like_gloo() -> None:
    a = np.array([2048.0, 0.1], dtype=np.float16)
    reduce_into(ReduceOp.SUM, a, np.array([1.0, 0.2], dtype=np.float16), "float16")
    assert a[0] == np.float16(2048.0)  # 2049 is not a float16; no wider accumulation
    assert a[1] == np.float16(np.float16(0.1) + np.float16(0.2))


def test_complex_product_is_complex_multiplication_and_src_first_swaps_operands() -> None:
    a = np.array([1 + 2j], dtype=np.complex128)
    reduce_into(ReduceOp.PRODUCT, a, np.array([3 - 1j]), "complex128")
    assert a[0] == (1 + 2j) * (3 - 1j)
    x = np.array([5.0, 1.0])
    reduce_into(ReduceOp.SUM, x, np.array([1.0, 2.0]), "float64", src_first=True)
    assert x.tolist() == [6.0, 3.0]


def test_reductions_with_invalid_ops_raise_type_error() -> None:
    with pytest.raises(TypeError):
        reduce_into(ReduceOp.BXOR, np.zeros(2), np.zeros(2), "float64")
    with pytest.raises(TypeError):
        reduce_into(ReduceOp.MAX, np.zeros(2, complex), np.zeros(2, complex), "complex128")
    with pytest.raises(TypeError):
        finish_avg(np.zeros(2, dtype=np.int64), 2, "int64")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "complex64"])
def test_finish_avg_divides_in_place(dtype: str) -> None:
    x = np.array([3, 6, 9], dtype=dtype)
    finish_avg(x, 3, dtype)
    np.testing.assert_array_equal(x, np.array([1, 2, 3], dtype=dtype))
    assert x.dtype == np.dtype(dtype)


# ------------------------------------------------------------------------------------- bfloat16


def _interesting_floats() -> np.ndarray:
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 2**32, size=20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ties = (np.arange(0, 2**16, 97, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # exact halfway
    special = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 3.4e38, -3.4e38, 1.0], dtype=np.float32
    )
    return np.concatenate([raw, ties, special])


def test_bfloat16_rounding_matches_torch_bit_for_bit() -> None:
    torch = pytest.importorskip("torch")
    values = _interesting_floats()
    ours = np.empty(values.size, dtype=np.uint16)
    f32_to_bf16(values, ours)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(ours[finite], theirs[finite])
    assert np.isnan(bf16_to_f32(ours[~finite])).all()


def test_bfloat16_widening_is_exact() -> None:
    torch = pytest.importorskip("torch")
    bits = np.arange(0, 2**16, dtype=np.uint32).astype(np.uint16)
    bits = bits[((bits & 0x7F80) != 0x7F80)]  # skip inf/nan patterns
    want = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(bf16_to_f32(bits), want)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX])
def test_bfloat16_reductions_match_torch_bit_for_bit(op: ReduceOp) -> None:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(1)
    a = (torch.randn(5000, generator=gen) * 100).to(torch.bfloat16)
    b = (torch.randn(5000, generator=gen) * 100).to(torch.bfloat16)
    want = {
        ReduceOp.SUM: torch.add,
        ReduceOp.PRODUCT: torch.mul,
        ReduceOp.MIN: torch.minimum,
        ReduceOp.MAX: torch.maximum,
    }[op](a, b)
    bits = a.view(torch.int16).numpy().view(np.uint16).copy()
    reduce_into(op, bits, b.view(torch.int16).numpy().view(np.uint16), "bfloat16")
    np.testing.assert_array_equal(bits, want.view(torch.int16).numpy().view(np.uint16))


def test_bfloat16_avg_matches_torch_division() -> None:
    torch = pytest.importorskip("torch")
    a = (torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 10).to(torch.bfloat16)
    bits = a.view(torch.int16).numpy().view(np.uint16).copy()
    finish_avg(bits, 3, "bfloat16")
    np.testing.assert_array_equal(bits, (a / 3).view(torch.int16).numpy().view(np.uint16))


def test_a_kernel_is_found_once_and_a_refused_pair_is_refused_every_time() -> None:
    assert kernel(ReduceOp.SUM, "float32") is kernel(ReduceOp.SUM, "float32") is np.add
    assert kernel(ReduceOp.AVG, "float64") is np.add  # AVG reduces as SUM (finish_avg divides)
    refused = [
        (ReduceOp.BXOR, "float64", "bitwise"),
        (ReduceOp.MAX, "complex64", "complex"),
        (ReduceOp.BAND, "bfloat16", "bitwise"),
    ]
    for op, dtype, why in refused * 2:  # a refusal is not kept as a kernel
        with pytest.raises(TypeError, match=why):
            kernel(op, dtype)
    with pytest.raises(TypeError, match="unknown reduce op"):
        kernel("sum", "float32")  # type: ignore[arg-type]
    a = np.array([1, 2, 3], np.int64)
    kernel(ReduceOp.BOR, "int64")(a, np.array([4, 4, 4], np.int64), out=a)
    assert a.tolist() == [5, 6, 7]


@pytest.mark.parametrize("numpy_state", [True, False], ids=["context-variable", "errstate"])
def test_quiet_silences_floating_point_errors_in_between_and_restores_the_callers_state(
    numpy_state: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """quiet()/restore(): overflow and invalid operations give inf and nan without a warning or
    an error, whatever the caller's error state, which holds again afterwards (both ways of
    switching: numpy 2's context variable, and np.errstate where that is missing)."""
    if numpy_state:
        quiet, restore = _reduce.quiet, _reduce.restore
    else:
        import builtins

        real_import = builtins.__import__

        def no_context_variable(name: str, *args: Any, **kwargs: Any) -> Any:
            if name == "numpy._core._multiarray_umath":
                raise ImportError(name)
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", no_context_variable)
        quiet, restore = _reduce._quiet_switch()
        monkeypatch.undo()
        assert quiet is not _reduce.quiet  # (the np.errstate way)
    big = np.array([3e38, np.inf], np.float32)
    with np.errstate(all="raise"):
        token = quiet()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                total = np.add(big, big)
                gap = np.subtract(total, total)
        finally:
            restore(token)
        assert np.isinf(total).all() and np.isnan(gap).all()
        assert np.geterr() == {"divide": "raise", "over": "raise", "under": "raise", "invalid": "raise"}
        with pytest.raises(FloatingPointError):
            np.add(big, big)
