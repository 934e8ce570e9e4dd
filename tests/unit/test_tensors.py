"""Tensor handling: numpy arrays and torch tensors become flat working arrays; results land in place."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from aiocoll.device._tensors import SUPPORTED_DTYPES, as_working, dtype_name, is_torch_tensor, numel

NUMPY_DTYPES = sorted(SUPPORTED_DTYPES - {"bfloat16"})


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_contiguous_numpy_arrays_are_viewed_without_a_copy(dtype: str) -> None:
    arr = np.zeros((2, 3), dtype=dtype)
    w = as_working(arr)
    assert not w.staged and w.array.ndim == 1 and w.array.size == 6
    assert np.shares_memory(w.array, arr)
    assert (w.dtype_name, w.shape, w.numel) == (dtype, (2, 3), 6)
    w.array[4] = 1
    assert arr[1, 1] == 1


def test_zero_dimensional_and_empty_arrays() -> None:
    scalar = np.array(5.0)
    w = as_working(scalar)
    assert w.array.shape == (1,) and w.shape == ()
    w.array[0] = 7.0
    w.finish()
    assert scalar == 7.0
    empty = np.zeros((0, 4), dtype=np.int32)
    w = as_working(empty)
    assert w.array.size == 0 and w.shape == (0, 4) and numel(empty) == 0


def test_non_contiguous_numpy_array_is_staged_and_written_back_by_finish() -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    view = base[:, ::2].T  # strided and transposed
    w = as_working(view)
    assert w.staged and w.array.flags.c_contiguous
    np.testing.assert_array_equal(w.array, view.ravel())
    w.array *= -1
    assert base[0, 0] == 0 and base[0, 2] == 2, "nothing is written before finish()"
    w.finish()
    np.testing.assert_array_equal(base[:, ::2], -np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2])
    np.testing.assert_array_equal(base[:, 1::2], np.arange(24, dtype=np.float32).reshape(4, 6)[:, 1::2])


def test_read_false_skips_the_copy_in_and_write_false_skips_the_copy_back() -> None:
    base = np.arange(12, dtype=np.int64).reshape(3, 4)
    out = as_working(base[:, ::2], read=False)
    out.array[:] = 100
    out.finish()
    assert (base[:, ::2] == 100).all()
    src = np.arange(12, dtype=np.int64).reshape(3, 4)
    inp = as_working(src[:, ::2], write=False)
    np.testing.assert_array_equal(inp.array, src[:, ::2].ravel())
    inp.array[:] = -1
    inp.finish()
    assert (src >= 0).all()


def test_non_native_byte_order_is_staged_in_native_order() -> None:
    big = np.arange(5, dtype=">i4")
    w = as_working(big)
    assert w.staged and w.array.dtype.isnative and w.dtype_name == "int32"
    np.testing.assert_array_equal(w.array, [0, 1, 2, 3, 4])
    w.array += 10
    w.finish()
    assert big.tolist() == [10, 11, 12, 13, 14]


def test_read_only_array_is_refused_as_a_destination_but_fine_as_a_source() -> None:
    ro = np.arange(4)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        as_working(ro)
    assert as_working(ro, write=False).array.tolist() == [0, 1, 2, 3]


def test_unsupported_objects_and_dtypes_raise_type_error() -> None:
    with pytest.raises(TypeError, match="list"):
        as_working([1, 2, 3])
    with pytest.raises(TypeError, match="object"):
        as_working(np.array([object()]))
    with pytest.raises(TypeError, match="str"):
        dtype_name(np.array(["a"]))
    with pytest.raises(TypeError):
        numel("abc")


def test_importing_and_using_the_foundations_does_not_import_torch() -> None:
    code = (
        "import sys, numpy as np\n"
        "from aiocoll.device._tensors import as_working\n"
        "import aiocoll._reduce, aiocoll.algorithms, aiocoll.client.data.transports.memory\n"
        "as_working(np.zeros(3)).finish()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------------------------- torch

TORCH_DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]


@pytest.mark.parametrize("name", TORCH_DTYPES)
def test_contiguous_torch_tensors_share_memory_with_the_working_array(name: str) -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros(2, 3, dtype=getattr(torch, name))
    w = as_working(t)
    assert is_torch_tensor(t) and not w.staged
    assert (w.dtype_name, w.shape, w.numel, dtype_name(t), numel(t)) == (name, (2, 3), 6, name, 6)
    if name == "bfloat16":
        assert w.array.dtype == np.uint16
        w.array[5] = 0x3F80  # 1.0 in bfloat16
        assert t[1, 2].item() == 1.0
    else:
        assert w.array.dtype == np.dtype(name)
        w.array[5] = 1
        assert t[1, 2].item() == 1


@pytest.mark.parametrize("name", ["uint16", "uint32", "uint64"])
def test_torch_unsigned_types_are_carried_by_their_bits(name: str) -> None:
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"this torch has no {name}")
    t = torch.tensor([1, 2, 3], dtype=dtype)
    w = as_working(t)
    assert w.array.dtype == np.dtype(name) and w.array.tolist() == [1, 2, 3]
    w.array[0] = np.iinfo(name).max
    assert t[0].item() == np.iinfo(name).max


def test_non_contiguous_torch_tensor_is_staged_and_finish_writes_back() -> None:
    torch = pytest.importorskip("torch")
    base = torch.arange(12, dtype=torch.float16).reshape(3, 4)
    view = base.t()
    w = as_working(view)
    assert w.staged
    np.testing.assert_array_equal(w.array, view.contiguous().reshape(-1).numpy())
    w.array[:] = 0
    w.finish()
    assert (base == 0).all()


def test_conjugate_view_is_resolved_for_reading_and_written_back_through_the_view() -> None:
    torch = pytest.importorskip("torch")
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    conj = z.conj()
    w = as_working(conj)
    assert w.staged
    np.testing.assert_array_equal(w.array, np.array([1 - 2j, 3 + 4j], dtype=np.complex64))
    w.array[:] = np.array([5 + 1j, 0], dtype=np.complex64)
    w.finish()
    assert z.tolist() == [5 - 1j, 0]


def test_zero_dimensional_empty_and_grad_tensors() -> None:
    torch = pytest.importorskip("torch")
    scalar = torch.tensor(2.0, requires_grad=True)
    w = as_working(scalar)
    assert w.shape == () and w.array.tolist() == [2.0]
    w.array[0] = 3.0
    w.finish()
    assert scalar.item() == 3.0
    empty = torch.zeros(0, 5, dtype=torch.bfloat16)
    w = as_working(empty)
    assert w.array.size == 0 and w.dtype_name == "bfloat16"


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int64", "uint16"])
def test_a_tensor_stays_resizable_after_its_working_array(name: str) -> None:
    """As with gloo, a tensor that went through a collective may be resized afterwards, its
    storage freed and allocated again (as FSDP does with its flat parameters)."""
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"this torch has no {name}")
    t = torch.ones(4, dtype=dtype)
    w = as_working(t)
    assert not w.staged and w.array.size == 4
    del w
    t.resize_(1 << 16)  # larger: a new allocation
    assert t.numel() == 1 << 16
    storage = t.untyped_storage()
    storage.resize_(0)
    storage.resize_(8 * t.element_size())
    t.set_(storage, 0, (8,))
    t.fill_(1)
    w = as_working(t)  # the new memory, not the old
    assert not w.staged and w.array.size == 8
    w.array[:] = 0x4000 if name == "bfloat16" else 2  # (bfloat16 travels as its bits: 2.0)
    w.finish()
    assert t.tolist() == [2] * 8


def test_a_lazy_negative_view_is_staged_with_its_sign() -> None:
    torch = pytest.importorskip("torch")
    base = torch.tensor([2.0, -4.0])
    negative = torch._neg_view(base)  # contiguous, with the lazy negative bit: [-2, 4]
    assert negative.is_neg() and negative.is_contiguous()
    w = as_working(negative)
    assert w.staged and w.array.tolist() == [-2.0, 4.0]
    w.array[:] = [7.0, -1.0]
    w.finish()
    assert negative.tolist() == [7.0, -1.0] and base.tolist() == [-7.0, 1.0]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_unsupported_torch_tensors_raise_clear_errors() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="meta"):
        as_working(torch.zeros(2, device="meta"))
    with pytest.raises(TypeError, match="dense"):
        as_working(torch.zeros(2, 2).to_sparse())
    with pytest.raises(TypeError, match="complex32"):
        as_working(torch.zeros(2, dtype=torch.complex32))


def _added_through(w: Any, values: list[float]) -> None:
    """Add ``values`` into a Working as an operation's result would land (finish included)."""
    w.array[:] += np.asarray(values, dtype=w.array.dtype)
    w.finish()


def test_a_small_tensor_reused_gets_its_current_memory_after_every_in_place_change() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros(2, 3)
    first = as_working(t)
    again = as_working(t)
    assert again.array is first.array, "the view of a small tensor met again is remembered"
    assert (again.dtype_name, again.shape, again.staged) == ("float32", (2, 3), False)
    t.fill_(4.0)  # new values, the same memory: the remembered view sees them
    w = as_working(t)
    assert w.array.tolist() == [4.0] * 6
    _added_through(w, [1.0] * 6)
    assert t.tolist() == [[5.0] * 3] * 2
    # another size in the same memory (a storage numpy views cannot grow: torch refuses that)
    t.resize_(4).fill_(1.0)
    w = as_working(t)
    assert w.shape == (4,) and w.array.size == 4 and np.shares_memory(w.array, t.numpy())
    _added_through(w, list(range(4)))
    assert t.tolist() == [1.0, 2.0, 3.0, 4.0]
    other = torch.arange(4, dtype=torch.float32)
    t.set_(other)  # another storage
    w = as_working(t)
    assert w.shape == (4,) and np.shares_memory(w.array, other.numpy())
    _added_through(w, [10.0] * 4)
    assert other.tolist() == [10.0, 11.0, 12.0, 13.0]
    t.set_(other.untyped_storage(), 0, (2, 2), (1, 2))  # the same memory and shape, transposed
    w = as_working(t)
    assert w.staged and w.array.tolist() == [10.0, 12.0, 11.0, 13.0]
    _added_through(w, [1.0, 2.0, 3.0, 4.0])
    assert t.tolist() == [[11.0, 14.0], [14.0, 17.0]] and other.tolist() == [11.0, 14.0, 14.0, 17.0]
    t.set_(other.untyped_storage(), 0, (2, 2), (2, 1))  # back to rows: a view again
    w = as_working(t)
    assert not w.staged and np.shares_memory(w.array, other.numpy())
    assert w.array.tolist() == [11.0, 14.0, 14.0, 17.0]
    t.data = other.view(torch.int32).view(2, 2)  # the same memory, shape and strides; another dtype
    w = as_working(t)
    assert w.dtype_name == "int32" and w.array.dtype == np.int32
    assert w.array.tolist() == other.numpy().view(np.int32).tolist()


def test_big_tensors_are_not_remembered_and_small_ones_only_a_few() -> None:
    torch = pytest.importorskip("torch")
    import gc
    import weakref

    big = torch.zeros(16 * 1024 + 1)  # just over 64 KiB
    w = as_working(big)
    assert as_working(big).array is not w.array  # not remembered: a view made each time
    gone = weakref.ref(big)
    del big, w
    gc.collect()
    assert gone() is None, "a big tensor the caller dropped is still held"
    small = torch.zeros(3)
    as_working(small)
    gone = weakref.ref(small)
    del small
    for _ in range(8):  # other small tensors: the first one's entry goes
        as_working(torch.zeros(2))
    gc.collect()
    assert gone() is None, "a small tensor the caller dropped outlived a few others"
