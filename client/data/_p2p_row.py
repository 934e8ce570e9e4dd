"""The p2p row of a group's provider table: send and recv of host memory over the links, with
the straight path that makes no record for one that ends inside its call, and the check of a
received message against the receiving tensor (``received``, which the device rows use too).

Imports foundations (aiocoll._errors, aiocoll._work, aiocoll.algorithms, the device staging's
chunk tags and working arrays) and the client's engine and operation record; never the public
surface, the table (client/data/providers.py) or the links' modules.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable
from typing import Any, ClassVar

from aiocoll._errors import DistError, MismatchError
from aiocoll._work import Work
from aiocoll.algorithms import Tag, Transport
from aiocoll.device._staged_ops import p2p_chunk_tag
from aiocoll.device._tensors import Working

from ._op_record import checked_timeout
from ._operation import (
    HANDED_OFF,
    HOST,
    P2P_KINDS,
    Body,
    Finish,
    Operation,
    Starter,
    as_starter,
    awaiting,
    copying_back,
    p2p_operation,
)
from .engine import Engine, GroupState, OpTransport, Stoppable

__all__ = ["P2PProvider", "received"]

_monotonic = time.monotonic


class P2PProvider:
    """Point-to-point over the links: a send is handed to the link; a receive checks that the
    message is of the receiving tensor's dtype and completes with the sender's group rank.

    Both take the straight path when they can (``send`` and ``recv``, which the table calls
    for host memory: no record, a Work born complete): a send whose payload the link took at
    once, a receive whose message is here or arrives within the transport's short in-place
    wait (Transport.recv_now). The rest get their record and run as a task that awaits the
    link. A receive takes the straight path only while no receive of its
    tag waits as a task: the task posts its receive when it first runs, and a later receive
    taking the message first would break the order in which receives of one tag match."""

    name: ClassVar[str] = "p2p"
    memory: ClassVar[frozenset[str]] = frozenset({HOST})
    priority: ClassVar[int] = 0
    kinds: frozenset[str] = P2P_KINDS
    why = "send and recv over the links"

    def __init__(self, ranks: tuple[int, ...], gid: str, engine: Engine, state: GroupState) -> None:
        self._ranks = ranks
        self._gid = gid
        self._engine = engine
        self._state = state
        self._waiting: dict[Tag, int] = {}  # receives running as tasks, by tag
        self._send: Starter = self._send_starter  # (bound once: see ``prepare``)
        self._recv: Starter = self._recv_starter

    def prepare(self, op: Operation) -> Starter:
        # (methods bound once: the record a starter is handed as its transport is the
        # operation, which holds what it runs on, so no starter is made per operation)
        return self._send if op.kind == "send" else self._recv

    # The straight path (ProviderTable.send and .recv, for host memory): the operation runs on
    # the transport before any record is made, and one that ends inside the call is only an
    # entry in the recorder's history and a Work born complete (Engine.ended_at_once). One
    # that does not gets its record and goes on through the engine from where it is, with the
    # call site read here (Engine.site: this method is as deep as Engine.submit_op).
    def send(self, peer: int, tag: int, w: Working, meta: dict[str, Any], timeout: Any) -> Work:
        """Send ``w``'s array to global rank ``peer`` with the user's ``tag``."""
        engine, group = self._engine, self._state
        timeout = checked_timeout(timeout)  # (refused before anything runs)
        array = w.array
        if not engine.straight_open(group):
            op = p2p_operation("send", meta, array, w, HOST, peer, tag, timeout)
            return engine.submit_op(group, op, self._send, True, engine.site())
        started = _monotonic()
        start: Starter | None = None
        try:
            rest = group.transport.send_nowait(peer, ("p", self._gid, tag), array.data, meta)
        except Exception as exc:  # (a link lost on the way: the Work says so, as for any send)
            start = _raising(exc)
        else:
            if rest is not None:
                start = _handing_off(peer, rest)
        # (the site is read once the message is on its way: a receiver waiting for it need not
        # wait for that too)
        site = engine.site()
        if start is None:
            return engine.ended_at_once("send", group, -1, None, started, site, None)
        op = p2p_operation("send", meta, array, w, HOST, peer, tag, timeout)
        return engine.submit_op(group, op, start, True, site, begun=True)

    def recv(self, peer: int | None, tag: int, w: Working, meta: dict[str, Any], timeout: Any) -> Work:
        """Receive into ``w``'s array from global rank ``peer`` (None: any) with ``tag``."""
        engine, group = self._engine, self._state
        timeout = checked_timeout(timeout)  # (refused before anything runs)
        site = engine.site()
        array = w.array
        key = ("p", self._gid, tag)
        if peer is None or w.staged or key in self._waiting or not engine.straight_open(group):
            op = p2p_operation("recv", meta, array, w, HOST, peer, tag, timeout)
            return engine.submit_op(group, op, self._recv, True, site)
        started = _monotonic()
        into = array.data.cast("B")
        here: tuple[int, dict[str, Any]] | None = None
        start: Starter
        try:
            here = group.transport.recv_now(peer, key, into)
            if here is not None and not here[1].get("chunks"):
                got = received(meta, tag, here[0], here[1], self._ranks, self._gid)
                return engine.ended_at_once("recv", group, -1, None, started, site, got)
            start = _landing(self, peer, into, here, None)
        except MismatchError as exc:  # (consumed: a wrong size, or a wrong dtype _landed says again)
            start = _landing(self, peer, into, here, exc if here is None else None)
        except Exception as exc:  # (a link lost on the way: the Work says so, as for any receive)
            start = _raising(exc)
        op = p2p_operation("recv", meta, array, w, HOST, peer, tag, timeout)
        return engine.submit_op(group, op, start, True, site, begun=True)

    def _send_starter(self, tag: Tag, op: OpTransport, finish: Finish) -> Stoppable:
        # A send completes once handed off: a small one usually is, inside this call (its Work
        # is born complete); the rest of a larger one runs as a task. (A working array is 1-D
        # and contiguous: its buffer is handed over as it is, and the links send its bytes
        # whatever its format.)
        peer = op.peers[0]
        rest = op.group.transport.send_nowait(peer, tag, op.inputs[0].data, op.meta)
        if rest is None:
            finish(None, None)
            return HANDED_OFF
        return _handing_off(peer, rest)(tag, op, finish)

    def _recv_starter(self, tag: Tag, op: OpTransport, finish: Finish) -> Stoppable:
        peers = op.peers
        source = peers[0] if peers else None
        into = op.outputs[0].data.cast("B")
        if tag in self._waiting:  # an earlier receive of this tag is not posted yet: after it
            return self._as_task(op, source, into, tag, op, finish)
        try:
            here = op.recv_now(source, tag, into)
        except MismatchError as exc:
            return self._landed(op, source, into, tag, finish, None, exc)
        return self._landed(op, source, into, tag, finish, here, None)

    def _landed(
        self,
        op: Operation,
        source: int | None,
        into: memoryview,
        tag: Tag,
        finish: Finish,
        here: tuple[int, dict[str, Any]] | None,
        failed: MismatchError | None,
    ) -> Stoppable:
        """A receive's start once the transport's straight receive (``recv_now``) answered:
        ``here`` (the sender and the message's meta; None: nothing came, the receive runs as a
        task), or ``failed`` (the message was consumed and did not fit)."""
        if failed is not None:
            if not failed.ranks:
                raise failed
            remote = getattr(failed, "remote_meta", None) or {}
            return copying_back(op, _refusal(remote, failed.ranks[0], op, self._ranks, self._gid, failed))(
                tag, op, finish
            )
        if here is None:
            return self._as_task(op, source, into, tag, op, finish)
        got, sent = here
        if sent.get("chunks"):  # a device tensor's staged message: see _refuse_staged_into_host
            return copying_back(op, _refusal(sent, got, op, self._ranks, self._gid, None))(tag, op, finish)
        op.result = received(op.meta, op.p2p_tag, got, sent, self._ranks, self._gid)
        op.finish_copied(None, None, None if finish == op.finish else finish)
        return HANDED_OFF

    def _as_task(
        self,
        op: Operation,
        source: int | None,
        into: memoryview,
        tag: Tag,
        transport: OpTransport,
        finish: Finish,
    ) -> Stoppable:
        """Run the receive ``op`` as a task that awaits the link (counted in ``_waiting`` until it
        finishes)."""
        ranks, gid, tasks = self._ranks, self._gid, self._waiting

        async def wait(tag: Tag, transport: OpTransport) -> None:
            try:
                got, sent = await transport.recv(source, tag, into)
            except MismatchError as exc:
                if exc.ranks:
                    await _refuse_staged_into_host(
                        getattr(exc, "remote_meta", None) or {},
                        exc.ranks[0],
                        op,
                        tag,
                        transport,
                        ranks,
                        gid,
                        exc,
                    )
                raise
            # a host tensor the size of a device tensor's first chunk: the rest is still coming
            await _refuse_staged_into_host(sent, got, op, tag, transport, ranks, gid, None)
            op.result = received(op.meta, op.p2p_tag, got, sent, ranks, gid)

        tasks[tag] = tasks.get(tag, 0) + 1

        def done(result: Any, exc: BaseException | None) -> None:
            left = tasks.pop(tag) - 1
            if left:
                tasks[tag] = left
            finish(result, exc)

        return copying_back(op, wait)(tag, transport, done)  # (as_starter finishes a task once)

    def close(self) -> None:
        pass


def _handing_off(peer: int, rest: Awaitable[None]) -> Starter:
    """The starter of a send the transport took in part at once: it runs as a task that awaits
    the rest of the hand-off, counted as the operation's wait for ``peer``."""

    def start(tag: Tag, op: OpTransport, finish: Finish) -> Stoppable:
        return as_starter(awaiting(op.sending(peer, rest)))(tag, op, finish)

    return start


def _raising(exc: Exception) -> Starter:
    """The starter of an operation whose straight path failed in the transport: it fails with
    ``exc`` as a starter that raised does (Engine.submit_op)."""

    def start(tag: Tag, op: OpTransport, finish: Finish) -> Stoppable:
        raise exc

    return start


def _landing(
    row: P2PProvider,
    peer: int,
    into: memoryview,
    here: tuple[int, dict[str, Any]] | None,
    failed: MismatchError | None,
) -> Starter:
    """The starter of a receive whose straight path did not end it (P2PProvider.recv): it goes
    on from what the transport answered (P2PProvider._landed)."""

    def start(tag: Tag, op: OpTransport, finish: Finish) -> Stoppable:
        return row._landed(op, peer, into, tag, finish, here, failed)

    return start


async def _refuse_staged_into_host(
    sent: dict[str, Any],
    src: int,
    op: Operation,
    tag: Tag,
    transport: Transport,
    ranks: tuple[int, ...],
    gid: str,
    exc: MismatchError | None,
) -> None:
    """A receive into a host tensor met the first chunk of a device tensor's message of several
    chunks (its meta ``sent`` says so, from rank ``src``; ``exc``: the length mismatch, when the
    chunk did not fit): take the other chunks off the wire, so that they do not stay behind for a
    later receive on the tag, and raise an error that says what to do. Returns when the message
    was something else."""
    chunks, chunk_bytes, nbytes = (int(sent.get(k, 0) or 0) for k in ("chunks", "chunk_bytes", "nbytes"))
    if chunks < 2:
        return
    with contextlib.suppress(DistError):  # a sender lost meanwhile: the refusal is still the news
        for k in range(1, chunks):
            size = max(0, min(chunk_bytes, nbytes - k * chunk_bytes))
            await transport.recv(src, p2p_chunk_tag(tag, k), memoryview(bytearray(size)))
    sender = ranks.index(src) if src in ranks else src
    raise MismatchError(
        f"recv (group {gid!r}, tag {op.p2p_tag}): rank {sender} sent a device tensor of {nbytes} bytes, "
        f"staged in {chunks} chunks of {chunk_bytes} bytes, but this rank receives into a host tensor "
        f"of {op.outputs[0].nbytes} bytes: a host tensor receives a device tensor's message only when it "
        f"fits in one staging chunk (AIOCOLL_STAGING_CHUNK_BYTES). Receive into a device tensor, or "
        f"send a host copy (tensor.cpu())",
        group=gid,
        ranks=[src],
    ) from exc


def _refusal(
    sent: dict[str, Any],
    src: int,
    op: Operation,
    ranks: tuple[int, ...],
    gid: str,
    exc: MismatchError | None,
) -> Body:
    """A receive taken on the straight path that met a device tensor's staged message (or a
    length mismatch ``exc``): the refusal, which takes the rest off the wire, runs as a task
    (``copying_back``: a message of one chunk after all is received as usual)."""

    async def refuse(tag: Tag, transport: OpTransport) -> None:
        await _refuse_staged_into_host(sent, src, op, tag, transport, ranks, gid, exc)
        if exc is not None:
            raise exc
        op.result = received(op.meta, op.p2p_tag, src, sent, ranks, gid)  # (one chunk: nothing to refuse)

    return refuse


def received(
    meta: dict[str, Any], p2p_tag: Any, got: int, sent: dict[str, Any], ranks: tuple[int, ...], gid: str
) -> int:
    """The group rank of a receive's sender (global rank ``got``), once its message (meta
    ``sent``) is checked against the receiving tensor (the receive's ``meta``, its tag
    ``p2p_tag``).

    Raises:
        MismatchError: the message's dtype is not the receiving tensor's.
    """
    if sent.get("dtype") != meta.get("dtype"):
        sender = ranks.index(got) if got in ranks else got
        raise MismatchError(
            f"recv (group {gid!r}, tag {p2p_tag}): rank {sender} sent {sent.get('dtype')} "
            f"but the receiving tensor is {meta.get('dtype')}",
            group=gid,
            ranks=[got],
        )
    return ranks.index(got)
