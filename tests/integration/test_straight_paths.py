"""The straight paths (a send, a receive or an arena all_reduce of host memory that ends inside
its call makes no operation record) keep what the recorded path promised: a bad argument is
refused at the call before anything runs, on every rank alike, so the group stays in step; a
link that fails under a send or a receive fails its Work (not the call), as any operation's
failure does, with the flight recorder's entry and the group broken for what comes after."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from aiocoll.testing.world import run_world, unwrap

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def _outcome(call: Any) -> tuple[str, str]:
    """How ``call()`` ended: refused at the call, its Work failed, or its Work's result."""
    try:
        work = call()
    except Exception as exc:
        return ("refused", type(exc).__name__)
    try:
        return ("ok", repr(await work))
    except Exception as exc:
        return ("failed", f"{type(exc).__name__}: {exc}")


async def worker(pg: Any) -> dict[str, Any]:
    from aiocoll import PeerLostError

    r = pg.rank
    out: dict[str, Any] = {}
    x = np.ones(4, np.float32)

    # A negative timeout is refused at the call: a send, and a receive whose message is here.
    if r == 0:
        out["send"] = await _outcome(lambda: pg.send(x, 1, tag=5, timeout=-1))
        await pg.send(x, 1, tag=5)
        await pg.barrier()
    else:
        await pg.barrier()
        got = np.zeros(4, np.float32)
        out["recv"] = await _outcome(lambda: pg.recv(got, 0, tag=5, timeout=-1))
        out["recv_after"] = (await pg.recv(got, 0, tag=5), got.tolist())

    # ... and an all_reduce, whichever way each rank would have run it: rank 0 early with a
    # contiguous array (the arena's straight path), rank 1 late with a strided one (a staged
    # copy: the recorded path). Neither takes a sequence number, so the next one agrees.
    if r == 1:
        await asyncio.sleep(0.2)
    y = np.full(4, float(r + 1), np.float32) if r == 0 else np.full(8, 2.0, np.float32)[::2]
    out["all_reduce"] = await _outcome(lambda: pg.all_reduce(y, timeout=-1))
    await asyncio.sleep(0.2)
    out["y"] = y.tolist()  # (nothing ran: untouched)
    z = np.full(2, float(r + 1), np.float32)
    out["next"] = await _outcome(lambda: pg.all_reduce(z, timeout=10))
    out["z"] = z.tolist()

    # A link that fails under a straight send or receive fails its Work, on a group of its own
    # (the failure breaks it): the transport is made to raise as a link lost mid-call does.
    pair = await pg.new_group([0, 1])
    transport = pg._rt.transport
    if r == 0:
        real_send = transport.send_nowait

        def broken_send(dst: int, tag: Any, payload: Any, meta: Any) -> Any:
            raise PeerLostError(dst, "the link broke mid-send (test)")

        transport.send_nowait = broken_send
        try:
            out["lost_send"] = await _outcome(lambda: pair.send(x, 1, tag=9))
        finally:
            transport.send_nowait = real_send
        history = [h for h in pg._rt.engine.progress.history if h[0] == "send"]
        out["lost_send_entry"] = history[-1][6] if history else None
        out["after_lost_send"] = await _outcome(lambda: pair.barrier())
    else:
        real_recv = transport.recv_now

        def broken_recv(src: int, tag: Any, into: Any) -> Any:
            raise PeerLostError(src, "the link broke mid-receive (test)")

        transport.recv_now = broken_recv
        try:
            out["lost_recv"] = await _outcome(lambda: pair.recv(np.zeros(4, np.float32), 0, tag=11))
        finally:
            transport.recv_now = real_recv
        out["after_lost_recv"] = await _outcome(lambda: pair.barrier())
    await pg.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return unwrap(run_world(worker, 2))


def test_a_bad_timeout_is_refused_at_the_call_of_a_send_and_of_a_receive_whose_message_is_here(
    results: list[dict[str, Any]],
) -> None:
    assert results[0]["send"] == ("refused", "ValueError")
    assert results[1]["recv"] == ("refused", "ValueError")
    assert results[1]["recv_after"] == (0, [1.0, 1.0, 1.0, 1.0])  # (the message was not consumed)


def test_a_bad_timeout_on_an_all_reduce_takes_no_sequence_number_on_any_rank(
    results: list[dict[str, Any]],
) -> None:
    assert [res["all_reduce"] for res in results] == [("refused", "ValueError")] * 2
    assert results[0]["y"] == [1.0] * 4 and results[1]["y"] == [2.0] * 4
    assert [res["next"][0] for res in results] == ["ok", "ok"]
    assert [res["z"] for res in results] == [[3.0, 3.0]] * 2


def test_a_link_failing_under_a_straight_send_or_receive_fails_its_work(
    results: list[dict[str, Any]],
) -> None:
    kind, why = results[0]["lost_send"]
    assert kind == "failed" and "PeerLostError" in why and "send" in why, why
    assert results[0]["lost_send_entry"] == "PeerLostError"
    kind, why = results[1]["lost_recv"]
    assert kind == "failed" and "PeerLostError" in why and "recv" in why, why
    # the failure broke the group on the rank that saw it: its next call fails fast
    assert results[0]["after_lost_send"][0] in ("refused", "failed")
    assert results[1]["after_lost_recv"][0] in ("refused", "failed")
