"""Where a 4-byte ping-pong's time goes, layer by layer: the same round trip between ranks 0 and
1 run four ways, in alternating blocks of one run, so that the machine's drifting speed falls on
all four alike. A developer's yardstick; docs/PERFORMANCE.md quotes it.

    aiocoll run --nproc-per-node 2 scripts/pingpong_layers.py            # 10 blocks of 3000
    aiocoll run --nproc-per-node 2 scripts/pingpong_layers.py --ops 5000 --blocks 6

The four ways, from the whole path down (each prints µs one way, the median of its blocks):

- ``api``: ``await pg.send(...)`` and ``await pg.recv(...)``, as a user calls them.
- ``transport``: the group's transport called directly (``send_nowait``, ``recv_now``), with the
  least bookkeeping an operation needs: the call site, a history entry and a Work born complete.
- ``links``: the transport called directly with no bookkeeping at all.
- ``mailbox``: the shared-memory ring's mailbox written and spun on directly (msgpack packs and
  unpacks the message as the link does), with none of the transport, the link or the matcher.

It reaches into aiocoll's private objects, so it runs on the shared-memory link only (two ranks
of one host) and may need updating when they change.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import operator
import os
import sys
import time
from typing import Any

import numpy as np
from aiocoll.client.data.transports.shm import _unpack_mail

import aiocoll
from aiocoll._work import Work


async def main(ops: int, blocks: int) -> None:
    pg = await aiocoll.init_process_group()
    rank, peer = pg.rank, 1 - pg.rank
    if pg.size != 2:
        raise SystemExit("pingpong_layers.py runs with exactly 2 ranks (--nproc-per-node 2)")
    buf = np.zeros(1, np.float32)
    transport = pg._rt.transport
    link = transport.link(peer)
    writer, reader = getattr(link, "_writer", None), getattr(link, "_reader", None)
    if writer is None or reader is None:
        raise SystemExit("pingpong_layers.py needs the shared-memory link (two ranks of one host)")
    pack = link._packer.pack
    history = pg._rt.engine.progress.history.append
    loop = asyncio.get_running_loop()
    tag = ("p", pg._state.gid, 0)
    meta = {"dtype": "float32", "count": 1}
    payload = buf.data.cast("B")
    code_at, frame, clock = operator.attrgetter("f_code", "f_lasti"), sys._getframe, time.monotonic

    def describe(kind: str) -> str:
        return kind

    async def api() -> None:
        if rank == 0:
            await pg.send(buf, 1)
            await pg.recv(buf, 1)
        else:
            await pg.recv(buf, 0)
            await pg.send(buf, 0)

    def send_recorded() -> Work:
        started, site = clock(), code_at(frame(1))
        rest = transport.send_nowait(peer, tag, buf.data, {"dtype": "float32", "count": buf.size})
        assert rest is None
        history(("send", tag[1], -1, None, started, clock(), "ok", site))
        return Work.born(None, loop, functools.partial(describe, "send"))

    async def recv_recorded() -> None:
        started, site = clock(), code_at(frame(1))
        got = transport.recv_now(peer, tag, buf.data.cast("B"))
        if got is None:
            got = await transport.recv(peer, tag, buf.data.cast("B"))
        history(("recv", tag[1], -1, None, started, clock(), "ok", site))
        await Work.born(got[0], loop, functools.partial(describe, "recv"))

    async def recorded() -> None:
        if rank == 0:
            await send_recorded()
            await recv_recorded()
        else:
            await recv_recorded()
            await send_recorded()

    async def receive_plain() -> None:
        if transport.recv_now(peer, tag, payload) is None:
            await transport.recv(peer, tag, payload)

    async def links() -> None:
        if rank == 0:
            assert transport.send_nowait(peer, tag, payload, meta) is None
            await receive_plain()
        else:
            await receive_plain()
            assert transport.send_nowait(peer, tag, payload, meta) is None

    def mail() -> None:
        polling = writer.mail(link.frames_out, pack, [tag, meta, payload])
        if polling is None:  # (the mailbox is not open: the link's own way)
            assert transport.send_nowait(peer, tag, payload, meta) is None
        elif not polling:
            os.eventfd_write(link._peer_efd, 1)

    def take_mail() -> bool:
        reader.start_polling(True)
        message = None
        for _ in range(100_000):
            message = reader.mail(_unpack_mail)
            if message is not None:
                break
        if reader.stop_polling() and message is None:
            message = reader.mail(_unpack_mail)
        if message is None:
            return False
        payload[:] = message[2]
        return True

    async def mailbox() -> None:
        if rank == 0:
            mail()
            if not take_mail():
                await transport.recv(peer, tag, payload)
        else:
            if not take_mail():
                await transport.recv(peer, tag, payload)
            mail()

    ways: dict[str, Any] = {"api": api, "transport": recorded, "links": links, "mailbox": mailbox}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for way in ways.values():
        for _ in range(500):
            await way()
    for block in range(blocks):
        order = list(ways.items()) if block % 2 == 0 else list(ways.items())[::-1]
        for name, way in order:
            await pg.barrier()
            start = time.perf_counter()
            for _ in range(ops):
                await way()
            times[name].append((time.perf_counter() - start) / ops / 2 * 1e6)
    if rank == 0:
        for name, values in times.items():
            values.sort()
            print(
                f"{name:9s} {values[len(values) // 2]:6.2f} us one way (median of {blocks} blocks, "
                f"fastest {values[0]:.2f})",
                flush=True,
            )
    await pg.barrier()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=3000, help="round trips per block (default 3000)")
    parser.add_argument("--blocks", type=int, default=10, help="blocks per way (default 10)")
    args = parser.parse_args()
    aiocoll.run(main(args.ops, args.blocks))
