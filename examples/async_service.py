"""An asyncio service whose request handler all-reduces across the workers of a job.

Run:  aiocoll run --nproc-per-node 3 examples/async_service.py --requests 20
Every rank runs the same small TCP service on its own port. A client (here: each rank's own load
generator) sends numbers; a request is answered only after the ranks have all-reduced that
request's value, so every reply carries the job-wide sum. The all-reduce is an awaitable, so the
event loop keeps serving other connections while a collective is in flight, and many requests'
collectives overlap, matched across ranks by call order.
"""

from __future__ import annotations

import argparse
import asyncio
import struct

import numpy as np

import aiocoll


class SumService:
    """Answers each request (an 8-byte integer) with the sum of that request's value over all ranks."""

    def __init__(self, pg: aiocoll.ProcessGroup) -> None:
        self.pg = pg
        self.lock = asyncio.Lock()  # operations must be *issued* in the same order on every rank

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.readexactly(8):
                (value,) = struct.unpack("!q", data)
                buffer = np.array([value], dtype=np.int64)
                async with self.lock:
                    work = self.pg.all_reduce(buffer)  # issued in order; completes concurrently
                await work
                writer.write(struct.pack("!q", int(buffer[0])))
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()

    async with await aiocoll.init_process_group(timeout=60) as pg:
        service = SumService(pg)
        server = await asyncio.start_server(service.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            replies = []
            for i in range(args.requests):  # request i carries value rank * 1000 + i on each rank
                writer.write(struct.pack("!q", pg.rank * 1000 + i))
                await writer.drain()
                replies.append(struct.unpack("!q", await reader.readexactly(8))[0])
            writer.close()
        expected = [sum(r * 1000 + i for r in range(pg.size)) for i in range(args.requests)]
        assert replies == expected, (replies[:5], expected[:5])
        await pg.barrier()
        print(f"rank {pg.rank}: served {args.requests} requests, each answered with the job-wide sum")


if __name__ == "__main__":
    aiocoll.run(main())  # asyncio.run on uvloop when installed
