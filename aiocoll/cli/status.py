"""`aiocoll status`: show a coordinator's jobs, members, liveness and last heartbeats, and what each
rank is doing when something waits (its group, sequence number, operation, state, age and the ranks
it waits for) with the rank(s) holding the job back.

Part of the public surface (cli/); it speaks the wire protocol directly through aiocoll.protocol
with a small admin-role client of its own, so it needs no worker runtime and imports nothing
heavy (no numpy, no torch): the CLI dispatcher imports this module for every `aiocoll` command.
It exists so that an operator can see at a glance which jobs a coordinator holds, whether they
completed rendezvous, and which members have gone silent.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any, TextIO

from aiocoll._env import env_text

__all__ = ["StatusError", "add_arguments", "format_table", "main", "parse_address", "query_status"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 29500
_MAX_REPLY_HEADER = 16 * 1024 * 1024  # a status table of thousands of members still fits
# Values above this are wall-clock timestamps (seconds since 1970); below, ages in seconds.
_EPOCH_THRESHOLD = 1e9


class StatusError(Exception):
    """A failure to get the status, with the message to show the user."""


def parse_address(text: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` for IPv6).

    Raises:
        ValueError: when the port is missing or not a number in 1..65535.
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"coordinator address {text!r} must be HOST:PORT, e.g. 127.0.0.1:29500")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"coordinator address {text!r} has a port that is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"coordinator address {text!r} has port {port} outside 1..65535")
    return host, port


def _default_address() -> str:
    # Inside an `aiocoll run` job the coordinator is AIOCOLL_COORDINATOR; MASTER_ADDR:MASTER_PORT
    # is then rank 0's torch store, so it comes second.
    named = env_text("AIOCOLL_COORDINATOR", strip=False)
    if named:
        return named
    host = os.environ.get("MASTER_ADDR") or DEFAULT_HOST
    port = os.environ.get("MASTER_PORT") or str(DEFAULT_PORT)
    from .._net import host_port

    return host_port(host, port)


_DESCRIPTION = """\
Show what an aiocoll coordinator holds: each job (world size, rendezvous round, whether it is
complete, keys), its members (rank, host, alive, last heartbeat) and, when something waits, what
each rank is doing (group, sequence number, operation, state, age, the ranks it waits for) with
the rank(s) holding the job back. It only looks: asking about a job creates nothing on the
coordinator. `aiocoll run` prints the command for its job when it starts it."""

_EPILOG = """\
examples:
  # the command `aiocoll run` printed for its job (its coordinator, job id and token file)
  aiocoll status --coordinator 127.0.0.1:43887 --job default --token-file /tmp/aiocoll-run-x/token

  # every job of a coordinator service, refreshed every 2 seconds
  aiocoll status --coordinator 10.0.0.1:29500 --token-file secret --watch

  # one job as JSON: members with their full host identity and 'progress' lists
  aiocoll status --coordinator 10.0.0.1:29500 --token-file secret --job exp42 --json

exit status: 0 when the coordinator answered (and holds the job --job names); 1 when it could
not be reached, refused the token, or holds no such job. See docs/COORDINATOR.md."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `aiocoll status` options (and its --help text) on ``parser``."""
    parser.description = _DESCRIPTION
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        default=None,
        help="the coordinator to ask ([v6]:PORT for IPv6). Default: AIOCOLL_COORDINATOR (set inside an "
        f"`aiocoll run` job), else MASTER_ADDR:MASTER_PORT, else {DEFAULT_HOST}:{DEFAULT_PORT}",
    )
    parser.add_argument(
        "--job",
        metavar="ID",
        default=None,
        help="show only this job; exit 1 if the coordinator holds no such job (default: every job)",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        default=None,
        help="file holding the shared token the coordinator was started with; surrounding whitespace "
        "is ignored (default: the AIOCOLL_TOKEN environment variable)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the jobs as JSON instead of a table (hosts as their full identity, "
        "HOSTNAME/BOOT_ID/NET_NS, where the table shows the hostname)",
    )
    parser.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="show the status again every SECONDS (default 2) until Ctrl-C",
    )
    parser.add_argument(
        "--stacks",
        action="store_true",
        help="also show each rank's Python stack as it is now (the user's frames first, file:line "
        "and function), fetched from the rank even while its event loop is blocked; a rank that "
        "does not answer within 1 s is named. --json gives each member a 'stack' list",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="give up on a coordinator that has not answered within SECONDS (default 10)",
    )


def _read_token(token_file: str | None) -> str | None:
    if token_file is None:
        return env_text("AIOCOLL_TOKEN", strip=False)
    from ._token_file import read_token_file

    try:
        return read_token_file(token_file)
    except ValueError as exc:
        raise StatusError(str(exc)) from exc


async def query_status(
    host: str, port: int, *, token: str | None, job: str | None, timeout: float, stacks: bool = False
) -> list[dict[str, Any]]:
    """Ask the coordinator at ``host:port`` for its jobs (one job when ``job`` is given).

    Args:
        host: coordinator address (an IP literal or a name); port: its port.
        token: shared secret (None: the empty secret); job: a job id, or None for every job.
        timeout: seconds for the whole exchange.
        stacks: also ask every member for its Python stack now (``stack`` of each member; a rank
            that does not answer within the coordinator's limit gets ``stack_note`` instead).

    Returns:
        The ``jobs`` list of the coordinator's status reply.

    Raises:
        StatusError: with a message saying what went wrong and what to check.
    """
    import asyncio

    from .._errors import AuthenticationError, ProtocolError
    from ..protocol import ClientHandshake, FrameDecoder, encode_frame
    from ..protocol._coordinator import ROLE_ADMIN

    where = f"{host}:{port}"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    def remaining() -> float:
        left = deadline - loop.time()
        if left <= 0:
            raise asyncio.TimeoutError
        return left

    writer: asyncio.StreamWriter | None = None
    try:
        try:
            reader, stream = await asyncio.wait_for(asyncio.open_connection(host, port), remaining())
        except ConnectionRefusedError:
            raise StatusError(
                f"no coordinator answers at {where}; start one with `aiocoll coordinator`"
                f" (or pass --coordinator HOST:PORT)"
            ) from None
        except OSError as exc:
            raise StatusError(f"cannot connect to the coordinator at {where}: {exc.strerror or exc}") from exc
        writer = stream

        handshake = ClientHandshake(token, role=ROLE_ADMIN, job=job or "default")
        handshake.name_server(where)  # its errors name the address and what answered there
        stream.write(handshake.start())
        while not handshake.done:
            data = await asyncio.wait_for(reader.read(65536), remaining())
            if not data:
                raise StatusError(
                    f"the coordinator at {where} closed the connection during the handshake; "
                    f"its log says why (often a wrong token or a different aiocoll version)"
                )
            try:
                reply = handshake.receive_data(data)
            except AuthenticationError:
                stream.write(handshake.farewell)  # the coordinator's proof failed: say so
                raise
            if reply:
                stream.write(reply)

        decoder = FrameDecoder(max_header=_MAX_REPLY_HEADER, max_payload=_MAX_REPLY_HEADER)

        async def ask(request: dict[str, Any]) -> dict[str, Any]:
            stream.writelines(encode_frame(request))
            while True:
                data = await asyncio.wait_for(reader.read(256 * 1024), remaining())
                if not data:
                    raise StatusError(f"the coordinator at {where} closed the connection before answering")
                for frame in decoder.feed(data):
                    if frame.header.get("id") == request["id"]:
                        return frame.header  # (anything else is an unsolicited event)

        header = await ask({"op": "status", "id": 1, "job": job})
        if not header.get("ok"):
            reason = str(header.get("msg") or header.get("err") or "no reason given")
            if job is not None and "no such job" in reason:
                raise StatusError(
                    f"the coordinator at {where} answers: {reason.removeprefix('status: ')}; "
                    "check --job, or leave it out to list every job"
                )
            raise StatusError(f"the coordinator at {where} refused the status request: {reason}")
        jobs = header.get("jobs")
        if not isinstance(jobs, list):
            raise StatusError(f"the coordinator at {where} sent a status reply without a job list")
        for number, entry in enumerate(jobs if stacks else [], 2):
            members = entry.get("members") or []
            if not members:
                continue
            ranks = [m.get("rank") for m in members]
            answer = await ask({"op": "stacks", "id": number, "job": entry.get("job"), "ranks": ranks})
            if not answer.get("ok"):
                reason = str(answer.get("msg") or answer.get("err") or "no reason given")
                raise StatusError(f"the coordinator at {where} refused the stacks request: {reason}")
            _add_stacks(members, answer)
        return jobs
    except asyncio.TimeoutError:
        raise StatusError(
            f"the coordinator at {where} did not answer within {timeout:g}s; "
            f"is something else listening on that port? (raise --timeout if it is just slow)"
        ) from None
    except AuthenticationError as exc:
        raise StatusError(
            f"authentication with the coordinator at {where} failed: {exc}. Check that --token-file "
            f"or AIOCOLL_TOKEN holds the same token the coordinator was started with"
        ) from exc
    except ProtocolError as exc:  # it says what answered at the address and what to do
        raise StatusError(str(exc)) from exc
    except ConnectionError as exc:
        raise StatusError(f"the connection to the coordinator at {where} broke: {exc}") from exc
    finally:
        if writer is not None:
            writer.close()


def _add_stacks(members: list[dict[str, Any]], reply: dict[str, Any]) -> None:
    """Each member's ``stack`` from a ``stacks`` reply; ``stack_note`` for one that was silent."""
    got = reply.get("stacks") or {}
    missing = set(reply.get("missing") or [])
    wait = reply.get("wait", 1.0)
    for member in members:
        frames = got.get(str(member.get("rank")))
        if isinstance(frames, list):
            member["stack"] = frames
            member["stack_age"] = 0.0
        elif member.get("rank") in missing:
            member["stack"] = []
            member.pop("stack_age", None)
            member["stack_note"] = (
                f"did not answer within {wait:g} s"
                if member.get("alive")
                else f"not asked: it is {member.get('state') or 'gone'}"
            )


def _stack_lines(members: list[dict[str, Any]]) -> list[str]:
    """Each rank's Python stack (the user's frames first, innermost first), when the view has it."""
    shown = [m for m in members if "stack" in m or "stack_note" in m]
    if not shown:
        return []
    lines = ["", "  STACKS (the user's frames first, innermost first)"]
    for member in sorted(shown, key=lambda m: (m.get("rank") is None, m.get("rank") or 0)):
        note = member.get("stack_note")
        if note:
            lines.append(f"  rank {_cell(member.get('rank'))}: {note}")
            continue
        age = member.get("stack_age")
        when = f" ({age:.1f}s ago)" if isinstance(age, (int, float)) and age >= 0.5 else ""
        frames = member.get("stack") or []
        lines.append(f"  rank {_cell(member.get('rank'))}{when}:" + ("" if frames else " (no frames)"))
        for frame in frames:
            lines.append(f"    {frame.get('file')}:{frame.get('line')} in {frame.get('function')}")
    return lines


def _age(last_seen: object, now: float) -> str:
    if not isinstance(last_seen, (int, float)) or isinstance(last_seen, bool):
        return "-"
    age = now - last_seen if last_seen > _EPOCH_THRESHOLD else float(last_seen)
    age = max(0.0, age)
    if age < 60:
        return f"{age:.1f}s ago"
    if age < 3600:
        return f"{age / 60:.1f}m ago"
    return f"{age / 3600:.1f}h ago"


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def _host(value: object) -> str:
    """The hostname of a member's host identity (--json shows all of it)."""
    if not isinstance(value, str):
        return _cell(value)
    from .._host import host_label

    return host_label(value)


def _yes(value: object) -> str:
    return "yes" if value else "no"


def _grid(rows: list[list[str]], indent: str = "") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        lines.append(indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return lines


def format_table(jobs: list[dict[str, Any]], *, now: float | None = None) -> str:
    """Render the coordinator's job list as a plain-text table, members indented under each job.

    Args:
        jobs: the ``jobs`` list of a status reply.
        now: wall-clock time for heartbeat ages (default: time.time()).
    """
    now = time.time() if now is None else now
    if not jobs:
        return "no jobs on this coordinator"
    lines: list[str] = []
    for index, job in enumerate(sorted(jobs, key=lambda j: str(j.get("job", "")))):
        if index:
            lines.append("")
        lines.extend(
            _grid(
                [
                    ["JOB", "WORLD SIZE", "ROUND", "COMPLETE", "KEYS"],
                    [
                        _cell(job.get("job", "?")),
                        _cell(job.get("world_size")),
                        _cell(job.get("round")),
                        _yes(job.get("complete")),
                        _cell(job.get("keys")),
                    ],
                ]
            )
        )
        members = job.get("members") or []
        if not members:
            lines.append("  (no members)")
            continue
        rows = [["RANK", "HOST", "ALIVE", "LAST HEARTBEAT"]]
        for member in sorted(members, key=lambda m: (m.get("rank") is None, m.get("rank") or 0)):
            rows.append(
                [
                    _cell(member.get("rank", "?")),
                    member.get("hostname") or _host(member.get("host")),
                    _yes(member.get("alive")),
                    _age(member.get("last_seen"), now),
                ]
            )
        lines.extend(_grid(rows, indent="  "))
        total = job.get("members_total")
        if isinstance(total, int) and total > len(members):
            lines.append(
                f"  ... {total - len(members)} more members not shown ({job.get('members_alive')} of "
                f"{total} alive); listed first are those not alive, holding the job back or reporting"
            )
        lines.extend(_progress_lines(job, members, now))
        lines.extend(_stack_lines(members))
    return "\n".join(lines)


def _progress_lines(job: dict[str, Any], members: list[dict[str, Any]], now: float) -> list[str]:
    """A line per rank with what it reported waiting in, and who holds the job back."""
    rows = [["RANK", "GROUP", "SEQ", "OPERATION", "STATE", "AGE", "WAITING FOR"]]
    for member in sorted(members, key=lambda m: (m.get("rank") is None, m.get("rank") or 0)):
        progress = member.get("progress") or []
        if not progress:
            state = "running" if member.get("alive") else str(member.get("state") or "gone")
            rows.append([_cell(member.get("rank", "?")), "-", "-", "-", state, "-", "-"])
        for entry in progress:
            waits = entry.get("waiting_for") or []
            rows.append(
                [
                    _cell(member.get("rank", "?")),
                    _cell(entry.get("group_name") or entry.get("group")),
                    _cell(entry.get("seq")),
                    _cell(entry.get("op")),
                    _cell(entry.get("state")),
                    _age(entry.get("since"), now).removesuffix(" ago"),
                    ", ".join(str(w) for w in waits) if waits else "-",
                ]
            )
    if len(rows) == 1 or not any(m.get("progress") for m in members):
        if not any(m.get("alive") for m in members):
            return ["  progress: no rank is alive (every member left or was lost)"]
        return ["  progress: nothing has waited longer than the threshold (every rank is running)"]
    lines = ["", *_grid(rows, indent="  ")]
    summary = job.get("summary")
    if summary:
        lines.append(f"  {summary}")
    return lines


def _json_safe(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def main(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run `aiocoll status`; returns the exit status (0 on success, 1 on any failure)."""

    out = out or sys.stdout
    err = err or sys.stderr
    try:
        host, port = parse_address(args.coordinator or _default_address())
        if args.timeout is None or args.timeout <= 0:
            raise StatusError(f"--timeout must be a positive number of seconds, got {args.timeout}")
        token = _read_token(args.token_file)
        watch = getattr(args, "watch", None)
        if watch is not None and watch <= 0:
            raise StatusError(f"--watch must be a positive number of seconds, got {watch}")
    except (StatusError, ValueError) as exc:
        print(f"aiocoll status: {exc}", file=err)
        return 1
    if watch is None:
        return _show_once(args, host, port, token, out, err)
    import asyncio

    try:
        return asyncio.run(_watch(args, host, port, token, watch, out, err))
    except KeyboardInterrupt:  # Ctrl-C before the loop took it over
        return 0


async def _watch(
    args: argparse.Namespace, host: str, port: int, token: str | None, watch: float, out: TextIO, err: TextIO
) -> int:
    """Refresh every ``watch`` seconds until Ctrl-C, in one event loop.

    Ctrl-C only sets a flag that every wait races against. It may not interrupt a query by
    cancelling it: asyncio.run turns Ctrl-C into a cancellation, and on Python 3.11 ``wait_for``
    swallows a cancellation that arrives in the turn its reply does, so a Ctrl-C during a
    refresh was lost and the watch went on forever.
    """
    import asyncio

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        while True:
            if out.isatty():
                out.write("\x1b[H\x1b[2J")  # clear the screen, cursor home
            if not args.json:
                stamp = time.strftime("%H:%M:%S")
                print(f"aiocoll status {host}:{port}  {stamp}  (every {watch:g}s; Ctrl-C stops)", file=out)
                out.flush()
            query = asyncio.ensure_future(
                query_status(host, port, token=token, job=args.job, timeout=args.timeout, stacks=args.stacks)
            )
            await asyncio.wait({query, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                query.cancel()
                await asyncio.wait({query})
                return 0
            try:
                jobs = query.result()
            except StatusError as exc:
                print(f"aiocoll status: {exc}", file=err)
            else:
                _render(args, jobs, host, port, out, err)
            out.flush()
            await asyncio.wait({stopped}, timeout=watch)
            if stop.is_set():
                return 0
    finally:
        stopped.cancel()
        loop.remove_signal_handler(signal.SIGINT)


def _show_once(
    args: argparse.Namespace, host: str, port: int, token: str | None, out: TextIO, err: TextIO
) -> int:
    import asyncio

    try:
        jobs = asyncio.run(
            query_status(host, port, token=token, job=args.job, timeout=args.timeout, stacks=args.stacks)
        )
    except StatusError as exc:
        print(f"aiocoll status: {exc}", file=err)
        return 1
    return _render(args, jobs, host, port, out, err)


def _render(
    args: argparse.Namespace, jobs: list[dict[str, Any]], host: str, port: int, out: TextIO, err: TextIO
) -> int:
    """Print one answer (table or JSON); 1 when the job asked for is not there."""
    if args.job is not None:
        jobs = [j for j in jobs if j.get("job") == args.job]
    if args.json:
        print(json.dumps(_json_safe(jobs), indent=2, sort_keys=True), file=out)
    elif jobs or args.job is None:
        print(format_table(jobs), file=out)
    if args.job is not None and not jobs:
        print(
            f"aiocoll status: the coordinator at {host}:{port} has no job {args.job!r}; check --job, "
            "or leave it out to list every job",
            file=err,
        )
        return 1
    return 0
