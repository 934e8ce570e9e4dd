"""Every operation on device tensors, staged through pinned buffers, between real processes.

The device is aiocoll's thread-backed one (streams are worker threads, copies run later than
they are queued): the same staging pipeline and the same public code paths as CUDA tensors take,
over real TCP links, with a pool buffer of 256 bytes so that every operation runs in many
chunks. Before each operation a slow "kernel" on the caller's stream writes the values to send,
so an operation that does not wait for the caller's stream sends stale values. Results are
compared with numpy; the flight recorder's dumps name the line of each call, staged or not.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiocoll.testing.world import run_world, unwrap

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

_HERE = os.path.abspath(__file__)
N = 3
CHUNK = 256  # bytes per pooled pinned buffer: a 1,000-element float32 all_reduce is 16 chunks


class Rank:
    """One rank's device, and a caller stream whose slow kernel writes the values to send."""

    def __init__(self) -> None:
        from aiocoll.device._device_threads import ThreadDevice

        self.dev = ThreadDevice(copy_delay=0.0005)
        self.caller = self.dev.new_stream()
        self.dev.set_current_stream(self.caller)

    def tensor(self, values: np.ndarray) -> Any:
        """A device tensor of zeros that the caller's stream fills with ``values`` a bit later."""
        t = self.dev.tensor(np.zeros_like(values))

        def kernel() -> None:
            time.sleep(0.02)
            t.flat[:] = values.reshape(-1)

        self.dev.launch(self.caller, kernel)
        return t

    def empty(self, shape: Any, dtype: Any) -> Any:
        return self.dev.tensor(np.zeros(shape, dtype))


async def worker(pg: Any) -> dict[str, Any]:
    r, n = pg.rank, pg.size
    d = Rank()
    out: dict[str, Any] = {}

    x = d.tensor(np.arange(1000, dtype=np.float32) * (r + 1))
    assert await pg.all_reduce(x) is x
    out["all_reduce"] = x.snapshot()

    y = d.tensor(np.arange(777, dtype=np.int64) + r * 1000)
    await pg.all_reduce(y, op="max")
    out["all_reduce_max"] = y.snapshot()

    z = d.tensor(np.full(300, r + 1, np.float64)) if r == 1 else d.empty(300, np.float64)
    await pg.broadcast(z, src=1)
    out["broadcast"] = z.snapshot()

    w = d.tensor(np.arange(200, dtype=np.int32) + r)
    await pg.reduce(w, dst=2)
    out["reduce"] = w.snapshot()

    outs = [d.empty(150, np.float32) for _ in range(n)]
    await pg.all_gather(outs, d.tensor(np.full(150, r, np.float32)))
    out["all_gather"] = [o.snapshot() for o in outs]

    big = d.empty(n * 130, np.int16)
    await pg.all_gather_into_tensor(big, d.tensor(np.arange(130, dtype=np.int16) + 100 * r))
    out["all_gather_into_tensor"] = big.snapshot()

    glist = [d.empty(90, np.float32) for _ in range(n)] if r == 0 else None
    await pg.gather(d.tensor(np.full(90, r * 2, np.float32)), glist, dst=0)
    out["gather"] = [g.snapshot() for g in glist] if glist else None

    sc = d.empty(80, np.float32)
    slist = [d.tensor(np.full(80, i * 3, np.float32)) for i in range(n)] if r == 2 else None
    await pg.scatter(sc, slist, src=2)
    out["scatter"] = sc.snapshot()

    rs = d.empty(100, np.float32)
    await pg.reduce_scatter(rs, [d.tensor(np.full(100, i + r, np.float32)) for i in range(n)])
    out["reduce_scatter"] = rs.snapshot()

    rst = d.empty(70, np.float64)
    await pg.reduce_scatter_tensor(rst, d.tensor(np.arange(n * 70, dtype=np.float64)))
    out["reduce_scatter_tensor"] = rst.snapshot()

    a2a_out = [d.empty(60, np.int32) for _ in range(n)]
    await pg.all_to_all(a2a_out, [d.tensor(np.full(60, 10 * r + j, np.int32)) for j in range(n)])
    out["all_to_all"] = [o.snapshot() for o in a2a_out]

    # unequal splits: rank r sends j+1 rows of 40 to rank j
    rows_in = [j + 1 for j in range(n)]
    rows_out = [r + 1] * n
    inp = d.tensor(np.concatenate([np.full((j + 1, 40), 100 * r + j, np.int64) for j in range(n)]))
    res = d.empty((sum(rows_out), 40), np.int64)
    await pg.all_to_all_single(res, inp, rows_out, rows_in)
    out["all_to_all_single"] = res.snapshot()

    # point to point: many chunks, two messages on one tag in flight, any source
    if r == 0:
        first = d.tensor(np.arange(500, dtype=np.float32))
        second = d.tensor(np.arange(500, dtype=np.float32) * -1)
        await asyncio.gather(pg.send(first, 1, tag=5), pg.send(second, 1, tag=5))
    elif r == 1:
        a, b = d.empty(500, np.float32), d.empty(500, np.float32)
        srcs = await asyncio.gather(pg.recv(a, None, tag=5), pg.recv(b, 0, tag=5))
        out["p2p"] = (srcs, a.snapshot(), b.snapshot())

    # A device tensor of several chunks sent into a host tensor (one of its first chunk's size
    # too), and a host tensor larger than a chunk sent into a device tensor: each refused on the
    # receiver, saying what to do; the tag's stream stays usable (the refused chunks were taken
    # off the wire: a device message after them on the same tag arrives whole).
    if r == 0:
        await pg.send(d.tensor(np.arange(500, dtype=np.float32)), 1, tag=6)
        await pg.send(d.tensor(np.arange(500, dtype=np.float32)), 1, tag=6)
        await pg.send(np.arange(300, dtype=np.float32), 1, tag=7)
        await pg.send(d.tensor(np.full(500, 7, np.float32)), 1, tag=6)
    elif r == 1:
        from aiocoll import MismatchError

        refused: list[str | None] = []
        first_chunk = CHUNK // 4  # float32 elements of one staged chunk
        for buf, tag in (
            (np.zeros(500, np.float32), 6),
            (np.zeros(first_chunk, np.float32), 6),
            (d.empty(300, np.float32), 7),
        ):
            try:
                await pg.recv(buf, 0, tag=tag)
                refused.append(None)
            except MismatchError as exc:
                refused.append(str(exc))
        after = d.empty(500, np.float32)
        await pg.recv(after, 0, tag=6)
        out["refused"] = (refused, after.snapshot())

    # a host tensor on one rank, device tensors on the others: fine within one chunk
    small = np.full(8, r + 1, np.float32) if r == 2 else d.tensor(np.full(8, r + 1, np.float32))
    await pg.all_reduce(small)
    out["mixed"] = small if r == 2 else small.snapshot()

    # The torch backend's mode: the caller's event comes from the context (recorded on the
    # caller's stream by another thread, here a busy stream that is not this thread's current
    # one), and the operation leaves its completion events there instead of waiting on the host.
    from aiocoll.device._staging import CallerStreamContext, caller_context

    busy = d.dev.new_stream()
    vals = d.empty(600, np.float32)

    def late() -> None:
        time.sleep(0.05)
        vals.flat[:] = r + 1

    d.dev.launch(busy, late)
    ready = d.dev.new_event()
    ready.record(busy)
    context = CallerStreamContext(ready={d.dev.name: ready})
    token = caller_context.set(context)
    try:
        work = pg.all_reduce(vals)
    finally:
        caller_context.reset(token)
    await work
    reader = d.dev.new_stream()
    for _device, event in context.completion:
        reader.wait_event(event)
    seen: list[np.ndarray] = []
    d.dev.launch(reader, lambda: seen.append(vals.flat.copy()))
    d.dev.synchronize()
    out["context"] = (len(context.completion), seen[0])

    # many operations in flight at once share the bounded pool without deadlock
    many = [d.tensor(np.full(400, r + i, np.float32)) for i in range(8)]
    await asyncio.gather(*(pg.all_reduce(t) for t in many))
    out["many"] = [t.snapshot() for t in many]
    from aiocoll.device._staging import staging_for

    pool = staging_for(d.dev).pool
    out["pool"] = (pool.allocated, pool.capacity, pool.in_use, d.dev.pinned_allocations)

    # The flight recorder names the line of each call, on the host or staged (the two reach the
    # engine by different paths): the rank's dump on SIGUSR1.
    await pg.all_reduce(np.ones(4, np.float32))  # HOST CALL
    await pg.all_reduce(d.tensor(np.ones(4, np.float32)))  # STAGED CALL
    dump = Path(os.environ["AIOCOLL_DUMP_DIR"]) / f"{os.environ.get('AIOCOLL_JOB') or 'default'}-rank{r}.json"
    asked = time.time()
    os.kill(os.getpid(), signal.SIGUSR1)
    # A thread of this rank writes it. The mismatch above wrote dumps of its own, one maybe
    # moments ago (failures close together are dumped together): read one written since.
    ops = (await asyncio.to_thread(_dump_since, dump, asked, 30.0))["ops"]
    out["sites"] = [op["site"] for op in ops if op["op"].startswith("all_reduce")][-2:]
    d.dev.close()
    return out


def _dump_since(path: Path, since: float, seconds: float) -> dict[str, Any]:
    """The dump at ``path`` once one written at or after ``since`` (wall clock) is there: each
    dump replaces the last whole."""
    deadline = time.monotonic() + seconds
    seen = None
    while time.monotonic() < deadline:
        if path.exists():
            body = json.loads(path.read_text())
            if body["time"] >= since:
                return body
            seen = body["reason"]
        time.sleep(0.05)
    raise AssertionError(f"no dump at {path} written since the signal within {seconds} s (last: {seen!r})")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    # Over TCP links, as the module header says: the "mixed" check (a host tensor on one rank,
    # device tensors on the others) interoperates over links only; in a group of one host whose
    # collectives read each other's shared memory, host tensors take that path (README).
    env = {
        "AIOCOLL_STAGING_CHUNK_BYTES": str(CHUNK),
        "AIOCOLL_STAGING_BUFFERS": "3",
        "AIOCOLL_TRANSPORT": "tcp",
        "AIOCOLL_DUMP_DIR": str(tmp_path_factory.mktemp("dumps")),
    }
    return unwrap(run_world(worker, N, timeout=150, env=env))


def test_reductions(results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(results):
        np.testing.assert_array_equal(res["all_reduce"], np.arange(1000, dtype=np.float32) * 6)
        np.testing.assert_array_equal(res["all_reduce_max"], np.arange(777) + 2000)
        np.testing.assert_array_equal(res["broadcast"], np.full(300, 2.0))
        expect = sum(np.arange(200, dtype=np.int32) + i for i in range(N))
        np.testing.assert_array_equal(res["reduce"], expect if r == 2 else np.arange(200) + r)
        np.testing.assert_array_equal(res["reduce_scatter"], np.full(100, sum(r + i for i in range(N))))
        np.testing.assert_array_equal(res["reduce_scatter_tensor"], np.arange(r * 70, r * 70 + 70) * N)
        np.testing.assert_array_equal(res["mixed"], np.full(8, 6.0))
        completions, seen = res["context"]
        assert completions == 1
        np.testing.assert_array_equal(seen, np.full(600, 6.0))
        for i, t in enumerate(res["many"]):
            np.testing.assert_array_equal(t, np.full(400, sum(k + i for k in range(N))))


def test_gathers_scatters_and_all_to_all(results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(results):
        for i in range(N):
            np.testing.assert_array_equal(res["all_gather"][i], np.full(150, i))
            np.testing.assert_array_equal(res["all_to_all"][i], np.full(60, 10 * i + r))
        np.testing.assert_array_equal(
            res["all_gather_into_tensor"], np.concatenate([np.arange(130) + 100 * i for i in range(N)])
        )
        if r == 0:
            for i in range(N):
                np.testing.assert_array_equal(res["gather"][i], np.full(90, i * 2))
        else:
            assert res["gather"] is None
        np.testing.assert_array_equal(res["scatter"], np.full(80, r * 3))
        expect = np.concatenate([np.full((r + 1, 40), 100 * i + r) for i in range(N)])
        np.testing.assert_array_equal(res["all_to_all_single"], expect)


def test_the_flight_recorder_names_the_line_of_host_and_staged_calls(results: list[dict[str, Any]]) -> None:
    lines = Path(_HERE).read_text().splitlines()
    host, staged = (
        next(n for n, t in enumerate(lines, 1) if t.endswith(m)) for m in ("# HOST CALL", "# STAGED CALL")
    )
    for res in results:
        assert res["sites"] == [
            {"file": _HERE, "line": host, "function": "worker"},
            {"file": _HERE, "line": staged, "function": "worker"},
        ], res["sites"]


def test_point_to_point_in_chunks_keeps_message_order(results: list[dict[str, Any]]) -> None:
    srcs, a, b = results[1]["p2p"]
    assert srcs == [0, 0]
    np.testing.assert_array_equal(a, np.arange(500, dtype=np.float32))
    np.testing.assert_array_equal(b, -np.arange(500, dtype=np.float32))


def test_a_message_of_several_chunks_between_a_host_and_a_device_tensor_is_refused_saying_what_to_do(
    results: list[dict[str, Any]],
) -> None:
    refused, after = results[1]["refused"]
    for msg in refused[:2]:
        assert msg is not None and "rank 0 sent a device tensor of 2000 bytes" in msg, refused
        assert "receives into a host tensor" in msg and "tensor.cpu()" in msg, msg
    assert refused[2] is not None and "rank 0 sent a host tensor's message in one piece" in refused[2], (
        refused
    )
    assert "Send from a device tensor, or receive into a host tensor" in refused[2], refused
    np.testing.assert_array_equal(after, np.full(500, 7, np.float32))


def test_pinned_buffers_stay_within_the_pool(results: list[dict[str, Any]]) -> None:
    for res in results:
        allocated, capacity, in_use, pinned = res["pool"]
        assert capacity == 3 and allocated <= 3 and pinned == allocated and in_use == 0


async def dies_mid_pipeline(pg: Any) -> dict[str, Any]:
    """Rank 1 is killed while a 400-chunk all_reduce of device tensors is under way."""
    import os
    import signal

    from aiocoll.device._device_threads import ThreadDevice
    from aiocoll.device._staging import staging_for

    def die_at_the_first_copy_back(direction: str, nbytes: int) -> None:
        # A chunk copied back to the device was reduced with rank 0's part of it, which came
        # through rank 0's staging buffers: both pipelines are under way, and 400 chunks long.
        # (A timer could kill rank 1 before rank 0 staged anything, on a loaded machine.)
        if direction == "to_device":
            os.kill(os.getpid(), signal.SIGKILL)

    dev = ThreadDevice(copy_delay=0.001, fail_copy=die_at_the_first_copy_back if pg.rank == 1 else None)
    x = dev.tensor(np.ones(25_600, np.float32))  # 400 chunks of 256 bytes
    await pg.barrier()
    out: dict[str, Any] = {}
    try:
        await pg.all_reduce(x, timeout=60)
        out["error"] = None
    except Exception as exc:
        out["error"] = (type(exc).__name__, str(exc))
    # The lost peer fails the Work at once: the engine does not wait for the operation's body
    # (it may be stuck), it cancels it. The pipeline gives its buffers back in its `finally` as
    # that cancellation unwinds the body, one or more loop turns after the Work failed. So wait
    # for them, with a deadline: a buffer that is never given back still fails the test.
    pool = staging_for(dev).pool
    out["in_use_when_failed"] = pool.in_use  # 3 when it failed while waiting for a copy
    for _ in range(1000):  # up to 10 s
        if not pool.in_use:
            break
        await asyncio.sleep(0.01)
    out["pool"] = (pool.in_use, pool.allocated)
    return out


def test_a_rank_lost_mid_pipeline_fails_the_operation_and_the_pool_gets_its_buffers_back() -> None:
    import signal

    env = {"AIOCOLL_STAGING_CHUNK_BYTES": str(CHUNK), "AIOCOLL_STAGING_BUFFERS": "3"}
    results = run_world(dies_mid_pipeline, 2, timeout=120, env=env)
    assert results[1].exitcode == -signal.SIGKILL
    out = results[0].value
    assert out is not None, results[0].error
    assert out["error"] is not None and out["error"][0] == "PeerLostError", out["error"]
    assert "rank 1" in out["error"][1]
    in_use, allocated = out["pool"]
    assert in_use == 0 and 1 <= allocated <= 3, out
