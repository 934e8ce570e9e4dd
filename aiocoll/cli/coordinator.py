"""`aiocoll coordinator`: run the coordinator service (key-value store + rendezvous for many jobs).

Part of the public surface (cli/); imports aiocoll.server lazily inside main() so that building
the `aiocoll` parser stays cheap. Listens on 127.0.0.1 unless told otherwise: pass
``--host 0.0.0.0`` to serve other machines (the container image does). SIGTERM or SIGINT drains
and stops; a second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["add_arguments", "main"]

log = logging.getLogger("aiocoll.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the coordinator's flags to ``parser``."""
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; use 0.0.0.0 in a container "
        "or to serve other machines)",
    )
    parser.add_argument(
        "--port", type=int, default=29500, help="TCP port (default 29500; 0 picks a free one)"
    )
    parser.add_argument(
        "--token-file",
        metavar="F",
        help="file holding the shared token (default: the AIOCOLL_TOKEN environment variable)",
    )
    parser.add_argument(
        "--state-dir",
        metavar="D",
        help="directory for the durable journal and snapshots; a restart on the same "
        "directory keeps every acknowledged key (default: memory only)",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        metavar="Q",
        help="serve the live web page (/, open it as http://HOST:Q/#token=SECRET), /jobs (JSON; both "
        "need the token when the coordinator has one), /healthz and /metrics (Prometheus) on this port",
    )
    parser.add_argument("--http-host", metavar="H", help="address for the HTTP endpoints (default: --host)")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default INFO"
    )
    parser.add_argument(
        "--job-ttl",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="forget a job after this long with no connections and no activity (default 3600)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="declare a member lost after this long without a heartbeat on either of its "
        "connections (default: AIOCOLL_HEARTBEAT_TIMEOUT, else 10). Workers beat from a thread, so "
        "a busy event loop does not count as silence; a frozen or dead process does",
    )
    parser.add_argument(
        "--max-value-bytes",
        type=int,
        default=16 * 1024 * 1024,
        metavar="N",
        help="largest value one key may hold (default 16 MiB)",
    )


def _read_token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        from ._token_file import read_token_file

        try:
            return read_token_file(args.token_file)
        except ValueError as exc:
            raise SystemExit(f"aiocoll coordinator: {exc}") from exc
    from aiocoll._env import env_text

    return env_text("AIOCOLL_TOKEN", strip=False)


async def _serve(args: argparse.Namespace, token: str | None) -> int:
    from aiocoll.server import Coordinator

    coord = Coordinator(
        args.host,
        args.port,
        token=token,
        state_dir=args.state_dir,
        http_port=args.http_port,
        http_host=args.http_host,
        max_value_bytes=args.max_value_bytes,
        job_ttl=args.job_ttl,
        heartbeat_timeout=args.heartbeat_timeout,
        pace_collector=True,
    )
    loop = asyncio.get_running_loop()
    signals_seen: list[int] = []
    stopping: list[asyncio.Task[None]] = []

    def on_signal(signum: int) -> None:
        signals_seen.append(signum)
        if len(signals_seen) > 1:
            log.error("second signal (%s): exiting at once", signal.Signals(signum).name)
            logging.shutdown()
            os._exit(128 + signum)
        log.info("%s received: draining (send it again to exit at once)", signal.Signals(signum).name)
        stopping.append(loop.create_task(coord.stop()))

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await coord.start()
    if token is None:
        log.warning(
            "NO TOKEN: anyone who can reach %s can join any job and read or change every key; "
            "set AIOCOLL_TOKEN or pass --token-file",
            coord.address,
        )
    await coord.serve_forever()
    for task in stopping:
        await task
    # Drained. A signal from here until the process is gone still exits at once with its code:
    # the loop's handlers go with the loop, and the default action would kill the process.
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(signum)
        signal.signal(signum, _exit_at_once)
    return 0


def _exit_at_once(signum: int, _frame: object) -> None:
    os._exit(128 + signum)


def main(args: argparse.Namespace) -> int:
    """Run the coordinator until SIGTERM/SIGINT.

    Returns:
        0 after a clean drain; 1 when it could not start.
    """
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    token = _read_token(args)
    try:
        import uvloop
    except ImportError:  # uvloop is optional (absent on Windows): the stock loop works too
        return _run(asyncio.run, args, token)
    return _run(uvloop.run, args, token)


def _run(
    runner: Callable[[Coroutine[Any, Any, int]], int], args: argparse.Namespace, token: str | None
) -> int:
    try:
        return runner(_serve(args, token))
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", args.host, args.port, exc)
        return 1
    except (ValueError, RuntimeError) as exc:
        log.error("the coordinator stopped: %s", exc)
        return 1
