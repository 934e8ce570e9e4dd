"""Every collective between real worker processes on loopback, compared with a numpy reference.

One world of 3 ranks (not a power of two) runs every check once; each test asserts its part.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from aiocoll.testing.world import run_world, unwrap

try:  # imported here, before any event loop runs: a multi-second import inside a worker would
    import torch  # stall its loop (and the coordinator rank 0 embeds) long enough to look dead
except ImportError:  # pragma: no cover
    torch = None

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

N = 3
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOAT_DTYPES = ["float16", "float32", "float64"]
COMPLEX_DTYPES = ["complex64", "complex128"]


def data(rank: int, n: int, dtype: str, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * salt + rank)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if dtype in INT_DTYPES:
        return rng.integers(0, 50, n).astype(dtype)
    if dtype in COMPLEX_DTYPES:
        return (rng.integers(-8, 8, n) + 1j * rng.integers(-8, 8, n)).astype(dtype)
    return rng.integers(-8, 8, n).astype(dtype)  # small integers: float sums are exact


def reduce_ref(arrays: list[np.ndarray], op: str) -> np.ndarray:
    dtype = arrays[0].dtype
    if op == "sum":
        out = arrays[0].copy()
        for a in arrays[1:]:
            out = (out + a) if dtype != np.bool_ else (out | a)
        return out.astype(dtype)
    if op == "product":
        out = arrays[0].copy()
        for a in arrays[1:]:
            out = (out * a) if dtype != np.bool_ else (out & a)
        return out.astype(dtype)
    if op == "min":
        return np.minimum.reduce(arrays).astype(dtype)
    if op == "max":
        return np.maximum.reduce(arrays).astype(dtype)
    if op == "avg":
        wide = np.complex128 if np.issubdtype(dtype, np.complexfloating) else np.float64
        return (sum(a.astype(wide) for a in arrays) / len(arrays)).astype(dtype)
    fn = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    return fn.reduce(arrays).astype(dtype)


def all_reduce_cases() -> list[tuple[str, str, int]]:
    cases = [
        (d, op, 17) for d in INT_DTYPES for op in ("sum", "product", "min", "max", "band", "bor", "bxor")
    ]
    cases += [(d, op, 17) for d in FLOAT_DTYPES for op in ("sum", "product", "min", "max", "avg")]
    cases += [(d, op, 9) for d in COMPLEX_DTYPES for op in ("sum", "product", "avg")]
    cases += [("bool", op, 33) for op in ("sum", "product", "min", "max", "band", "bor", "bxor")]
    cases += [("float32", "sum", 1 << 20), ("int64", "max", 300_001), ("float64", "avg", 70_000)]
    return cases


async def worker(pg: Any) -> dict[str, Any]:
    import aiocoll

    r, n = pg.rank, pg.size
    out: dict[str, Any] = {"rank": r, "size": n, "ranks": pg.ranks}

    for dtype, op, count in all_reduce_cases():
        x = data(r, count, dtype, salt=count)
        res = await pg.all_reduce(x, op=op)
        assert res is x
        out[f"all_reduce/{dtype}/{op}/{count}"] = x

    # shapes: 0-d, empty, 2-d, non-contiguous (results must land in place)
    z = np.array(float(r + 1))
    await pg.all_reduce(z)
    out["all_reduce/0d"] = z
    e = np.zeros((0, 3), np.float32)
    await pg.all_reduce(e)
    out["all_reduce/empty_shape"] = e.shape
    base = np.arange(24, dtype=np.float64).reshape(4, 6) * (r + 1)
    view = base[:, ::2]
    await pg.all_reduce(view)
    out["all_reduce/noncontig_base"] = base

    for root in range(n):
        b = data(r, 10, "float64", salt=50 + root).reshape(2, 5)
        await pg.broadcast(b, src=root)
        out[f"broadcast/{root}"] = b
    bb = np.zeros((6, 4), np.int32)
    if r == 1:
        bb[:] = np.arange(24).reshape(6, 4)
    await pg.broadcast(bb.T, src=1)
    out["broadcast/noncontig"] = bb
    big = data(r, 1 << 19, "float32", salt=77)
    await pg.broadcast(big, src=2)
    out["broadcast/big"] = big

    for dst in range(n):
        x = data(r, 12, "int32", salt=60 + dst)
        keep = x.copy()
        await pg.reduce(x, dst=dst, op=aiocoll.ReduceOp.MAX)
        out[f"reduce/{dst}"] = x
        out[f"reduce/{dst}/untouched"] = bool((x == keep).all()) if r != dst else None

    x = data(r, 7, "float32", salt=70)
    lst = [np.zeros(7, np.float32) for _ in range(n)]
    assert (await pg.all_gather(lst, x)) is lst
    out["all_gather"] = lst
    flat = np.zeros((n, 7), np.float32)
    await pg.all_gather_into_tensor(flat, x)
    out["all_gather_into_tensor"] = flat

    for dst in range(n):
        g = [np.zeros(5, np.int64) for _ in range(n)] if r == dst else None
        res = await pg.gather(data(r, 5, "int64", salt=80), gather_list=g, dst=dst)
        out[f"gather/{dst}"] = res

    for src in range(n):
        s = [data(i, 4, "float64", salt=90 + src) for i in range(n)] if r == src else None
        t = np.zeros(4, np.float64)
        await pg.scatter(t, scatter_list=s, src=src)
        out[f"scatter/{src}"] = t

    ins = [data(r, 6, "int32", salt=100 + i) for i in range(n)]
    o = np.zeros(6, np.int32)
    await pg.reduce_scatter(o, ins, op="sum")
    out["reduce_scatter"] = o
    flat_in = np.concatenate([data(r, 6, "float32", salt=110 + i) for i in range(n)])
    o2 = np.zeros(6, np.float32)
    await pg.reduce_scatter_tensor(o2, flat_in, op=aiocoll.ReduceOp.MIN)
    out["reduce_scatter_tensor"] = o2

    # all_to_all with a different size per (sender, receiver) pair
    ins = [np.full(r + j + 1, 10 * r + j, np.int16) for j in range(n)]
    outs = [np.zeros(j + r + 1, np.int16) for j in range(n)]
    await pg.all_to_all(outs, ins)
    out["all_to_all"] = outs
    single_in = np.arange(n * 2 * 3, dtype=np.float32).reshape(n * 2, 3) + 100 * r
    single_out = np.zeros_like(single_in)
    await pg.all_to_all_single(single_out, single_in)
    out["all_to_all_single/equal"] = single_out
    in_splits = [j + 1 for j in range(n)]  # rank r sends j+1 rows to rank j
    out_splits = [r + 1] * n  # and receives r+1 rows from everyone
    a_in = np.repeat(np.arange(sum(in_splits), dtype=np.int64)[:, None] + 1000 * r, 2, axis=1)
    a_out = np.zeros((sum(out_splits), 2), np.int64)
    await pg.all_to_all_single(a_out, a_in, output_split_sizes=out_splits, input_split_sizes=in_splits)
    out["all_to_all_single/splits"] = a_out

    await pg.barrier()
    out["bcast_obj"] = await pg.broadcast_object({"from": r, "list": [1, 2, r]} if r == 1 else None, src=1)
    out["all_gather_obj"] = await pg.all_gather_object(("r", r, "x" * (r * 100)))
    out["gather_obj"] = await pg.gather_object({"r": r}, dst=2)
    out["scatter_obj"] = await pg.scatter_object(
        [f"obj{i}" * (i + 1) for i in range(n)] if r == 0 else None, src=0
    )

    # many operations in flight at once match in call order on every rank
    xs = [np.full(3, r * 100 + i, np.int64) for i in range(40)]
    await asyncio.gather(*(pg.all_reduce(x) for x in xs))
    out["gather_of_40"] = [x.copy() for x in xs]
    mixed = [pg.all_reduce(np.full(2, i, np.int32)) for i in range(10)] + [pg.barrier()]
    res = await asyncio.gather(*mixed)
    out["mixed_results"] = [None if v is None else v.tolist() for v in res]

    # sub-groups: collective over the parent, None for non-members; ranks are group ranks
    sub = await pg.new_group([0, 2])
    if r == 1:
        out["sub"] = sub
    else:
        assert sub is not None
        y = np.full(2, float(r), np.float32)
        await sub.all_reduce(y)
        out["sub"] = (sub.rank, sub.size, sub.ranks, y)
        await sub.broadcast(y, src=1)
        await sub.destroy()
    rev = await pg.new_group([2, 1])
    if rev is not None:
        out["sub21"] = (rev.rank, rev.ranks)
        await rev.destroy()

    out["work"] = await work_api_checks(pg)
    # the signature of a good call with the same dtype and size as "band_of_floats" below is
    # made now: a bad op must still be refused (the check is skipped only for a known signature)
    await pg.all_reduce(np.zeros(2, np.float32), op=aiocoll.ReduceOp.SUM)
    out["bad_args"] = bad_argument_checks(pg)
    out["torch"] = await torch_checks(pg)
    return out


async def work_api_checks(pg: Any) -> dict[str, Any]:
    res: dict[str, Any] = {}
    x = np.ones(4, np.float32)
    work = pg.all_reduce(x)
    seen: list[Any] = []
    work.add_done_callback(lambda w: seen.append(w.is_completed()))
    res["before"] = work.is_completed()
    await work
    res["after"] = work.is_completed()
    res["exception"] = work.exception()
    res["callback"] = seen
    # wait() blocks a thread that is not the loop's
    y = np.ones(2, np.float64)
    w2 = pg.all_reduce(y)
    res["wait"] = await asyncio.to_thread(w2.wait, 30)
    res["wait_value"] = y.tolist()
    try:
        w2.wait()
        res["wait_on_loop_after_done"] = True
    except RuntimeError:
        res["wait_on_loop_after_done"] = False
    # an operation that cannot have finished yet: its message is sent only once every rank made
    # this check (a receive whose message is here already completes inside its call, and so
    # may a collective when the peers are there already, over shm)
    w3 = pg.recv(np.zeros(1, np.float32), src=(pg.rank + 1) % pg.size, tag=77)
    try:
        w3.wait()
        res["wait_on_loop_thread"] = "no error"
    except RuntimeError as exc:
        res["wait_on_loop_thread"] = "RuntimeError" if "event loop" in str(exc) else str(exc)
    await pg.barrier()
    await pg.send(np.zeros(1, np.float32), dst=(pg.rank - 1) % pg.size, tag=77)
    await w3
    # cancelling a task that awaits a Work leaves the operation (and the group) in step
    z = np.full(3, float(pg.rank), np.float64)
    w4 = pg.all_reduce(z)
    waiter = asyncio.ensure_future(_await(w4))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    await w4
    res["after_cancel"] = z.tolist()
    q = np.ones(1, np.int32)
    await pg.all_reduce(q)
    res["next_after_cancel"] = int(q[0])
    return res


async def _await(work: Any) -> Any:
    return await work


def bad_argument_checks(pg: Any) -> dict[str, str]:
    """Each bad call must raise at call time (no Work, nothing sent)."""
    import aiocoll

    n = pg.size
    calls = {
        "broadcast_src_out_of_range": lambda: pg.broadcast(np.zeros(2), src=n),
        "reduce_dst_negative": lambda: pg.reduce(np.zeros(2), dst=-1),
        "send_to_self": lambda: pg.send(np.zeros(2), dst=pg.rank),
        "send_dst_not_int": lambda: pg.send(np.zeros(2), dst="1"),
        "all_gather_short_list": lambda: pg.all_gather([np.zeros(2)] * (n - 1), np.zeros(2)),
        "all_gather_wrong_dtype": lambda: pg.all_gather([np.zeros(2, np.float32)] * n, np.zeros(2)),
        "avg_of_ints": lambda: pg.all_reduce(np.zeros(2, np.int32), op=aiocoll.ReduceOp.AVG),
        "band_of_floats": lambda: pg.all_reduce(np.zeros(2, np.float32), op="band"),
        "band_of_floats_again": lambda: pg.all_reduce(np.zeros(2, np.float32), op="band"),
        "not_a_tensor": lambda: pg.all_reduce([1, 2, 3]),
        "unsupported_dtype": lambda: pg.all_reduce(np.zeros(2, dtype="datetime64[s]")),
        "unknown_op": lambda: pg.all_reduce(np.zeros(2), op="median"),
        "a2a_single_bad_split": lambda: pg.all_to_all_single(
            np.zeros(6), np.zeros(6), input_split_sizes=[1] * n, output_split_sizes=[2] * n
        ),
        "gather_list_missing_at_dst": lambda: pg.gather(np.zeros(2), None, dst=pg.rank),
        "scatter_list_on_a_non_src_rank": lambda: pg.scatter(
            np.zeros(2), [np.zeros(2)] * n, src=(pg.rank + 1) % n
        ),
        "scatter_list_wrong_sizes_at_src": lambda: pg.scatter(np.zeros(2), [np.zeros(3)] * n, src=pg.rank),
        "all_gather_into_tensor_size": lambda: pg.all_gather_into_tensor(np.zeros(5), np.zeros(2)),
        "readonly_output": lambda: pg.all_reduce(np.frombuffer(b"\0" * 8, np.float32)),
    }
    outcome = {}
    for name, call in calls.items():
        try:
            call()
            outcome[name] = "no error"
        except (ValueError, TypeError) as exc:
            outcome[name] = type(exc).__name__ + ": " + str(exc)
    return outcome


async def torch_checks(pg: Any) -> dict[str, Any] | None:
    if torch is None:
        return None
    r = pg.rank
    res: dict[str, Any] = {}
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (r + 1)
    tv = t.t()  # non-contiguous
    await pg.all_reduce(tv)
    res["float32_noncontig"] = t.numpy().copy()
    bf = torch.tensor([1.5, 2.0, -3.25], dtype=torch.bfloat16) * (r + 1)
    await pg.all_reduce(bf)
    res["bfloat16"] = bf.float().numpy().copy()
    h = torch.full((5,), float(r + 1), dtype=torch.float16)
    await pg.all_reduce(h, op="max")
    res["float16_max"] = h.float().numpy().copy()
    lst = [torch.zeros(2, dtype=torch.int64) for _ in range(pg.size)]
    await pg.all_gather(lst, torch.tensor([r, r * 10]))
    res["all_gather"] = [x.numpy().copy() for x in lst]
    c = torch.ones(3, dtype=torch.complex64) * (r + 1j)
    await pg.all_reduce(c)
    res["complex64"] = c.numpy().copy()
    return res


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return unwrap(run_world(worker, N, timeout=150))


def test_every_rank_sees_its_rank_and_the_world(results: list[dict[str, Any]]) -> None:
    assert [r["rank"] for r in results] == list(range(N))
    assert all(r["size"] == N and r["ranks"] == list(range(N)) for r in results)


@pytest.mark.parametrize("dtype,op,count", all_reduce_cases())
def test_all_reduce_matches_numpy(results: list[dict[str, Any]], dtype: str, op: str, count: int) -> None:
    expected = reduce_ref([data(i, count, dtype, salt=count) for i in range(N)], op)
    for res in results:
        got = res[f"all_reduce/{dtype}/{op}/{count}"]
        assert got.dtype == np.dtype(dtype)
        if op == "avg":  # one division, rounded in the tensor's dtype
            np.testing.assert_allclose(got, expected, rtol=2e-3 if dtype == "float16" else 1e-6)
        else:
            np.testing.assert_array_equal(got, expected)


def test_all_reduce_handles_0d_empty_and_noncontiguous_in_place(results: list[dict[str, Any]]) -> None:
    base = [np.arange(24, dtype=np.float64).reshape(4, 6) * (i + 1) for i in range(N)]
    expected = base[0].copy()
    expected[:, ::2] = sum(b[:, ::2] for b in base)
    for res in results:
        assert res["all_reduce/0d"].shape == () and float(res["all_reduce/0d"]) == sum(range(1, N + 1))
        assert res["all_reduce/empty_shape"] == (0, 3)
    for i, res in enumerate(results):
        exp = base[i].copy()
        exp[:, ::2] = expected[:, ::2]
        np.testing.assert_array_equal(res["all_reduce/noncontig_base"], exp)


def test_broadcast_from_every_root_and_noncontiguous(results: list[dict[str, Any]]) -> None:
    for root in range(N):
        expected = data(root, 10, "float64", salt=50 + root).reshape(2, 5)
        for res in results:
            np.testing.assert_array_equal(res[f"broadcast/{root}"], expected)
    for res in results:
        np.testing.assert_array_equal(res["broadcast/noncontig"], np.arange(24).reshape(6, 4))
        np.testing.assert_array_equal(res["broadcast/big"], data(2, 1 << 19, "float32", salt=77))


def test_reduce_lands_at_dst_only(results: list[dict[str, Any]]) -> None:
    for dst in range(N):
        expected = np.maximum.reduce([data(i, 12, "int32", salt=60 + dst) for i in range(N)])
        np.testing.assert_array_equal(results[dst][f"reduce/{dst}"], expected)


def test_all_gather_and_all_gather_into_tensor(results: list[dict[str, Any]]) -> None:
    expected = [data(i, 7, "float32", salt=70) for i in range(N)]
    for res in results:
        for i in range(N):
            np.testing.assert_array_equal(res["all_gather"][i], expected[i])
            np.testing.assert_array_equal(res["all_gather_into_tensor"][i], expected[i])


def test_gather_returns_list_at_dst_and_none_elsewhere(results: list[dict[str, Any]]) -> None:
    for dst in range(N):
        for r, res in enumerate(results):
            got = res[f"gather/{dst}"]
            if r != dst:
                assert got is None
            else:
                for i in range(N):
                    np.testing.assert_array_equal(got[i], data(i, 5, "int64", salt=80))


def test_scatter_from_every_root(results: list[dict[str, Any]]) -> None:
    for src in range(N):
        for r, res in enumerate(results):
            np.testing.assert_array_equal(res[f"scatter/{src}"], data(r, 4, "float64", salt=90 + src))


def test_reduce_scatter_and_reduce_scatter_tensor(results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(results):
        exp = sum(data(i, 6, "int32", salt=100 + r) for i in range(N)).astype(np.int32)
        np.testing.assert_array_equal(res["reduce_scatter"], exp)
        exp2 = np.minimum.reduce([data(i, 6, "float32", salt=110 + r) for i in range(N)])
        np.testing.assert_array_equal(res["reduce_scatter_tensor"], exp2)


def test_all_to_all_with_uneven_sizes_and_split_sizes(results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(results):
        for j in range(N):
            np.testing.assert_array_equal(res["all_to_all"][j], np.full(j + r + 1, 10 * j + r, np.int16))
        ins = [np.arange(N * 2 * 3, dtype=np.float32).reshape(N * 2, 3) + 100 * i for i in range(N)]
        exp = np.concatenate([ins[j][2 * r : 2 * r + 2] for j in range(N)])
        np.testing.assert_array_equal(res["all_to_all_single/equal"], exp)
        rows = []
        for j in range(N):
            start = sum(k + 1 for k in range(r))
            block = np.arange(start, start + r + 1, dtype=np.int64) + 1000 * j
            rows.append(np.repeat(block[:, None], 2, axis=1))
        np.testing.assert_array_equal(res["all_to_all_single/splits"], np.concatenate(rows))


def test_object_operations(results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(results):
        assert res["bcast_obj"] == {"from": 1, "list": [1, 2, 1]}
        assert res["all_gather_obj"] == [("r", i, "x" * (i * 100)) for i in range(N)]
        assert res["gather_obj"] == ([{"r": i} for i in range(N)] if r == 2 else None)
        assert res["scatter_obj"] == f"obj{r}" * (r + 1)


def test_gather_of_many_operations_matches_in_call_order(results: list[dict[str, Any]]) -> None:
    for res in results:
        for i, x in enumerate(res["gather_of_40"]):
            np.testing.assert_array_equal(x, np.full(3, sum(k * 100 + i for k in range(N))))
        assert res["mixed_results"] == [[i * N, i * N] for i in range(10)] + [None]


def test_new_group_members_and_non_members(results: list[dict[str, Any]]) -> None:
    assert results[1]["sub"] is None
    for r in (0, 2):
        sub_rank, sub_size, sub_ranks, y = results[r]["sub"]
        assert (sub_rank, sub_size, sub_ranks) == ({0: 0, 2: 1}[r], 2, [0, 2])
        np.testing.assert_array_equal(y, np.full(2, 2.0, np.float32))
    assert results[0].get("sub21") is None
    assert results[1]["sub21"] == (0, [1, 2]) and results[2]["sub21"] == (1, [1, 2])


def test_work_handle_api(results: list[dict[str, Any]]) -> None:
    for res in results:
        w = res["work"]
        assert w["after"] is True and w["exception"] is None and w["callback"] == [True]
        assert w["wait"] is True and w["wait_value"] == [N, N]
        assert w["wait_on_loop_after_done"] is True
        assert w["wait_on_loop_thread"] == "RuntimeError"
        assert w["after_cancel"] == [float(sum(range(N)))] * 3
        assert w["next_after_cancel"] == N


def test_bad_arguments_raise_at_call_time_naming_the_problem(results: list[dict[str, Any]]) -> None:
    for res in results:
        bad = res["bad_args"]
        assert all(v != "no error" for v in bad.values()), bad
        assert (
            "ValueError" in bad["broadcast_src_out_of_range"] and "src=3" in bad["broadcast_src_out_of_range"]
        )
        assert "ValueError" in bad["all_gather_short_list"] and "2 tensors" in bad["all_gather_short_list"]
        assert "TypeError" in bad["all_gather_wrong_dtype"]
        assert "TypeError" in bad["avg_of_ints"] or "ValueError" in bad["avg_of_ints"]
        assert "int32" in bad["avg_of_ints"]
        assert "float32" in bad["band_of_floats"]
        assert bad["band_of_floats_again"] == bad["band_of_floats"]
        assert "datetime64" in bad["unsupported_dtype"]
        assert "is dst and must pass gather_list" in bad["gather_list_missing_at_dst"]
        assert "scatter_list must be None on rank" in bad["scatter_list_on_a_non_src_rank"]
        assert "ValueError" in bad["scatter_list_wrong_sizes_at_src"]
        assert "scatter_list[0] has 3 elements" in bad["scatter_list_wrong_sizes_at_src"]


def test_torch_tensors_including_bfloat16_and_noncontiguous(results: list[dict[str, Any]]) -> None:
    pytest.importorskip("torch")
    for r, res in enumerate(results):
        t = res["torch"]
        exp = sum(np.arange(12, dtype=np.float32).reshape(3, 4) * (i + 1) for i in range(N))
        np.testing.assert_array_equal(t["float32_noncontig"], exp)
        np.testing.assert_array_equal(t["bfloat16"], np.array([1.5, 2.0, -3.25]) * sum(range(1, N + 1)))
        np.testing.assert_array_equal(t["float16_max"], np.full(5, float(N)))
        for i in range(N):
            np.testing.assert_array_equal(t["all_gather"][i], [i, i * 10])
        np.testing.assert_array_equal(t["complex64"], np.ones(3) * sum(i + 1j for i in range(N)))
        del r
