"""Same-host shared memory: one anonymous arena per process (memfd) and one wake-up descriptor
(eventfd), handed to the other ranks of the host over authenticated Unix-domain sockets.

Imports only foundations (aiocoll._errors) and client.data._peer (the peer handshake); never the
public surface. The collectives that use the arenas live in client.data._shm_coll.

Why these choices:

- **Nothing named, nothing to leak.** The arena is a memfd (no name in /dev/shm or anywhere in a
  file system) and the wake-up is an eventfd; both reach the peers as descriptors (SCM_RIGHTS)
  and vanish with the last process holding them, so a rank killed with SIGKILL leaves nothing.
- **Abstract Unix socket, not a socket file in a 0700 directory.** A socket file needs a
  directory that must be removed afterwards and stays behind after SIGKILL; an abstract name
  vanishes with its listener and is scoped to the network namespace (ranks in other containers
  cannot reach it, and fall back to TCP). Abstract names carry no permissions, so every
  connection is checked twice before a byte of it is parsed: the peer's credentials
  (SO_PEERCRED: the same uid as ours, on both ends) and then the token handshake (the same
  mutual HMAC handshake as the TCP peer links). The name is random (128 bits) and only published
  to authenticated members of the job, so it can be neither guessed nor squatted ahead of time.
- **Trust, but confirm.** Descriptors crossing the socket do not prove that the memory is
  shared (a sandbox may copy, a checkpointing tool may remap): each side writes a fresh nonce
  into its own arena, the other reads it through its mapping and sends it back over the socket;
  only when both nonces come back is the peer marked ``shared``.
- **Sealed size.** The arena's size is sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) before
  it is handed out, and the receiver checks the seals and the size before mapping: a peer cannot
  shrink the memory under our mapping (which would turn our reads into SIGBUS).
- **One ring per direction of a pair** (``ring_bytes`` > 0): besides the arena, each side makes,
  for each peer, a sealed memfd holding the ring its point-to-point payloads to that peer travel
  through (client.data._shm_ring) and an eventfd the peer writes when it frees ring space we wait for
  (or mails us a small message);
  both cross the socket with the arena. A ring is the sender's, so it vanishes with the pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import mmap
import os
import platform
import secrets
import socket
import stat
import struct
from collections.abc import Callable
from typing import Any

from aiocoll._errors import AuthenticationError, ProtocolError

from ._peer import client_handshake, dialler_rank, server_handshake

__all__ = [
    "ARENA_HEADER",
    "NONCE_BYTES",
    "PROBE_OFFSET",
    "STORES_IN_ORDER",
    "REGION_CONTROL",
    "RING_HEADER",
    "ShmHost",
    "ShmPeer",
    "ShmUnavailable",
]

log = logging.getLogger("aiocoll.client.shm")

ARENA_HEADER = 4096  # the first page: the probe nonce; group regions follow
# A group region (client/data/_shm_layout.py lays it out): its counters and signatures, then two slots
# of ``2 * chunk`` bytes each.
REGION_CONTROL = 4096


def region_bytes(chunk: int) -> int:
    """Bytes of one group region for steps of ``chunk`` bytes."""
    return REGION_CONTROL + 4 * chunk


RING_HEADER = 4096  # a ring's first page holds its counters (client.data._shm_ring); data follows
PROBE_OFFSET = 0
NONCE_BYTES = 16
_HELLO = struct.Struct("<8sQQQ")  # magic, arena bytes, region bytes, ring bytes
_HELLO_MAGIC = b"AIOSHM\x00\x02"
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_HANDSHAKE_TIMEOUT = 10.0
_MAX_PENDING = 64


class ShmUnavailable(OSError):
    """Shared memory cannot be used with a peer (not reachable, not shared, not allowed)."""


def _fence_halves() -> tuple[Callable[[], Any], Callable[[], None]]:
    """A full memory barrier callable from Python, in two C calls: an uncontended lock's acquire
    and release are atomic read-modify-writes (a locked instruction on x86), which no load or
    store crosses."""
    import threading

    lock = threading.Lock()
    return lock.acquire, lock.release


# Stores stay in order among themselves, and loads among themselves, without a fence (x86)
STORES_IN_ORDER = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")

fence_enter, fence_leave = _fence_halves()
"""``fence_enter(); fence_leave()``: ``fence``'s body, for a hot path that saves its Python call."""


def fence() -> None:
    """A full memory barrier: no load or store crosses it."""
    fence_enter()
    fence_leave()


def _cpu_getter() -> Callable[[], int]:
    """The CPU this thread runs on now (the C library's sched_getcpu, a vDSO read on Linux),
    or a function returning -1 where there is none."""
    import ctypes

    try:
        getcpu = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return lambda: -1
    getcpu.restype = ctypes.c_int
    getcpu.argtypes = []
    return getcpu


current_cpu = _cpu_getter()


def _same_user(sock: socket.socket) -> int:
    """The peer's pid after checking it runs as our uid (SO_PEERCRED).

    Raises:
        AuthenticationError: another user's process is at the other end.
    """
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise AuthenticationError(
            f"a process of uid {uid} (pid {pid}) tried to share memory with uid {os.getuid()}; "
            "shared memory is only shared between processes of one user"
        )
    return pid


async def _wait_readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, lambda: None if fut.done() else fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_reader(fd)


async def _recv_with_fds(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int, max_fds: int
) -> tuple[bytes, list[int]]:
    """Exactly one message of ``size`` bytes with at most ``max_fds`` descriptors (the caller
    checks how many it needs, once it has read what the message says)."""
    while True:
        try:
            data, fds, flags, _ = socket.recv_fds(sock, size, max_fds)
            break
        except (BlockingIOError, InterruptedError):
            await _wait_readable(loop, sock)
    if flags & socket.MSG_CTRUNC or len(data) != size or len(fds) > max_fds:
        for fd in fds:
            os.close(fd)
        if not data:
            raise ConnectionError("the peer closed the shared-memory socket during the exchange")
        raise ProtocolError(
            f"shared-memory exchange: expected {size} bytes and {max_fds} descriptors, got "
            f"{len(data)} bytes and {len(fds)} descriptors"
        )
    return data, fds


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the shared-memory socket during the exchange")
        buf += chunk
    return bytes(buf)


def _sealed_memfd(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A fresh anonymous memory file of ``size`` bytes, sealed against resizing, and its mapping."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


def _check_memfd(fd: int, size: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        raise ProtocolError(f"the peer's arena is not a {size}-byte memory file")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & _SEALS != _SEALS:
        raise ProtocolError("the peer's arena is not sealed against resizing")


def _check_eventfd(fd: int) -> None:
    if os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:[eventfd]":
        raise ProtocolError("the peer's wake-up descriptor is not an eventfd")


class ShmPeer:
    """What this process holds of one same-host peer.

    Attributes:
        rank: the peer's global rank. sock: the authenticated Unix socket (its end-of-file is the
        peer's loss). mem: the peer's arena, mapped read-write. efd: the peer's eventfd (write 1
        to wake it). shared: the probe confirmed that the mapping is the peer's memory.
        pid: the peer's process id (from SO_PEERCRED).
        out_ring / out_efd: the ring our payloads to the peer travel through (our memory) and
        the eventfd the peer writes when it frees space in it, or puts a message for us in its
        own ring's mailbox (we watch it); in_ring / in_efd: the peer's ring towards us and its
        eventfd (we write it when we free space there, or mail it a message).
        None / -1 when the host was made without rings.
    """

    __slots__ = ("efd", "in_efd", "in_ring", "mem", "out_efd", "out_ring", "pid", "rank", "shared", "sock")

    def __init__(self, rank: int, sock: socket.socket, mem: mmap.mmap, efd: int, pid: int) -> None:
        self.rank = rank
        self.sock = sock
        self.mem = mem
        self.efd = efd
        self.pid = pid
        self.shared = False
        self.out_ring: mmap.mmap | None = None
        self.out_efd = -1
        self.in_ring: mmap.mmap | None = None
        self.in_efd = -1

    def close(self, *, sock: bool = True) -> None:
        """Release the mappings and the eventfds; the socket too unless a link owns it."""
        for name in ("efd", "out_efd", "in_efd"):
            fd = getattr(self, name)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)
        for mem in (self.mem, self.out_ring, self.in_ring):
            if mem is not None:
                with contextlib.suppress(BufferError, ValueError):
                    mem.close()  # views still alive keep it mapped until they go
        if sock:
            self.sock.close()


class ShmHost:
    """This process's arena and eventfd, the listener same-host peers dial, and their mappings.

    Higher ranks dial lower ranks (as the TCP links do). Every connection is checked for the
    same uid (SO_PEERCRED) before the token handshake, and for the same job and the right
    ranks after it; only then are descriptors exchanged and the sharing confirmed.

    Args:
        rank: this process's global rank (None: not known yet, see ``assign``).
        token, job: as for the TCP links.
        regions: how many group regions the arena holds. region_bytes: the size of each.
        ring_bytes: the capacity of each point-to-point ring (0: no rings; every member of a
            job uses the same value).
        watch: watch every peer's socket for end-of-file and report it through ``on_lost``
            (leave False when a link reads the socket and reports loss itself).
        on_peer: called with every peer that dialled us, once its sharing is confirmed.
    """

    def __init__(
        self,
        rank: int | None,
        *,
        token: str | bytes | None,
        job: str,
        regions: int,
        region_bytes: int,
        ring_bytes: int = 0,
        watch: bool = True,
        on_peer: Callable[[ShmPeer], None] | None = None,
    ) -> None:
        self.rank = -1 if rank is None else rank
        self._known: asyncio.Future[None] | None = None
        self._on_peer = on_peer
        self._token = token
        self._job = job
        self.region_bytes = region_bytes
        self.regions = regions
        self.ring_bytes = ring_bytes
        self.arena_bytes = ARENA_HEADER + regions * region_bytes
        self._watch = watch
        self._loop = asyncio.get_running_loop()
        self._memfd, self.mem = _sealed_memfd("aiocoll-arena", self.arena_bytes)
        self.efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._nonce = secrets.token_bytes(NONCE_BYTES)
        self.mem[PROBE_OFFSET : PROBE_OFFSET + NONCE_BYTES] = self._nonce
        self.peers: dict[int, ShmPeer] = {}
        self._waiting: dict[int, asyncio.Future[ShmPeer]] = {}
        self._lost_handlers: list[Callable[[int, str], None]] = []
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self.address = ""
        self.rejected = 0
        self.closed = False
        self.waker: Any = None  # client.data._shm_waker's ShmWaker, made with the first group
        self.chunk = 0  # bytes per collective step (set by whoever sized the regions)
        self.regions_used: set[int] = set()  # group regions of our arena in use by live groups
        # regions offered to a group still agreeing on its region: not offered to another group
        # forming at the same time (two would otherwise agree on the same region)
        self.regions_offered = 0
        self.forced = False  # AIOCOLL_TRANSPORT=shm: no falling back to tcp

    # -- setting up ------------------------------------------------------------------------
    def assign(self, rank: int) -> None:
        """Fix this process's rank once rendezvous told it (peers may dial before that)."""
        self.rank = rank
        if self._known is not None and not self._known.done():
            self._known.set_result(None)

    async def _known_rank(self) -> None:
        if self.rank >= 0:
            return
        if self._known is None:
            self._known = self._loop.create_future()
        await asyncio.shield(self._known)

    def listen(self) -> str:
        """Listen on a fresh abstract Unix address; returns it ("@name", to publish)."""
        name = f"aiocoll-{secrets.token_hex(16)}"
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        lsock.bind("\0" + name)
        lsock.listen(128)
        lsock.setblocking(False)
        self._listener = lsock
        self.address = "@" + name
        self._accepting = self._loop.create_task(self._accept_loop(lsock))
        return self.address

    def on_lost(self, handler: Callable[[int, str], None]) -> None:
        """Call ``handler(rank, reason)`` when a peer's socket reaches end-of-file."""
        self._lost_handlers.append(handler)

    async def connect(self, peer: int, address: str, timeout: float = _HANDSHAKE_TIMEOUT) -> ShmPeer:
        """Dial a lower rank's address (see ``listen``) and exchange arenas.

        Raises:
            ShmUnavailable: the address cannot be reached from here (another network namespace),
                or the memory turned out not to be shared.
            AuthenticationError / ProtocolError: the other end is not a member of our job.
        """
        if not address.startswith("@"):
            raise ShmUnavailable(f"rank {peer}: {address!r} is not a shared-memory address")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            try:
                await asyncio.wait_for(self._loop.sock_connect(sock, "\0" + address[1:]), timeout)
            except (ConnectionRefusedError, FileNotFoundError) as exc:
                raise ShmUnavailable(
                    f"rank {peer}'s shared-memory address is not reachable from here ({exc}): it runs "
                    "in another network namespace or is gone"
                ) from exc
            pid = _same_user(sock)
            await asyncio.wait_for(
                client_handshake(sock, token=self._token, job=self._job, rank=self.rank, peer=peer), timeout
            )
            shm = await asyncio.wait_for(self._exchange(sock, peer, pid), timeout)
        except BaseException:
            sock.close()
            raise
        self._adopt(shm)
        return shm

    async def peer(self, rank: int, timeout: float) -> ShmPeer:
        """The peer ``rank`` once it has dialled us (a higher rank)."""
        got = self.peers.get(rank)
        if got is not None:
            return got
        fut = self._waiting.get(rank)
        if fut is None:
            fut = self._waiting[rank] = self._loop.create_future()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError as exc:
            raise ShmUnavailable(f"rank {rank} did not dial our shared-memory address in {timeout}s") from exc

    async def _accept_loop(self, lsock: socket.socket) -> None:
        while not self.closed:
            try:
                sock, _ = await self._loop.sock_accept(lsock)
            except OSError as exc:
                if self.closed:
                    return
                log.warning("rank %d: shared-memory accept failed (%s)", self.rank, exc)
                await asyncio.sleep(0.1)
                continue
            if len(self._handshakes) >= _MAX_PENDING:
                sock.close()
                self.rejected += 1
                continue
            task = self._loop.create_task(self._accept_one(sock))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _accept_one(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        try:
            # Credentials first: a process of another user is turned away before we read a byte.
            pid = _same_user(sock)
            hello = await asyncio.wait_for(server_handshake(sock, token=self._token), _HANDSHAKE_TIMEOUT)
            await asyncio.wait_for(self._known_rank(), _HANDSHAKE_TIMEOUT)
            peer = dialler_rank(hello, job=self._job, rank=self.rank, world_size=None)
            if peer in self.peers:
                raise ProtocolError(f"rank {peer} already shares memory with rank {self.rank}")
            shm = await asyncio.wait_for(self._exchange(sock, peer, pid), _HANDSHAKE_TIMEOUT)
        except (AuthenticationError, ProtocolError, ShmUnavailable, OSError, asyncio.TimeoutError) as exc:
            log.warning(
                "rank %d: refused a shared-memory connection: %s", self.rank, exc or type(exc).__name__
            )
            self.rejected += 1
            sock.close()
            return
        except BaseException:
            sock.close()
            raise
        self._adopt(shm)

    async def _exchange(self, sock: socket.socket, peer: int, pid: int) -> ShmPeer:
        """Both sides: send our arena and eventfd (and our ring towards the peer with its
        eventfd), map theirs, and confirm the sharing."""
        loop = self._loop
        hello = _HELLO.pack(_HELLO_MAGIC, self.arena_bytes, self.region_bytes, self.ring_bytes)
        out_fd = out_efd = -1
        out_ring: mmap.mmap | None = None
        if self.ring_bytes:
            out_fd, out_ring = _sealed_memfd("aiocoll-ring", RING_HEADER + self.ring_bytes)
            out_efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        mine = [self._memfd, self.efd] + ([out_fd, out_efd] if self.ring_bytes else [])
        fds: list[int] = []
        mem: mmap.mmap | None = None
        in_ring: mmap.mmap | None = None
        try:
            try:
                while True:
                    try:
                        socket.send_fds(sock, [hello], mine)
                        break
                    except (BlockingIOError, InterruptedError):
                        await asyncio.sleep(0.001)
            finally:
                if out_fd >= 0:
                    os.close(out_fd)  # the peer got it (or never will); our mapping keeps the ring
            data, fds = await _recv_with_fds(loop, sock, _HELLO.size, 4)
            magic, arena_bytes, region_bytes, ring_bytes = _HELLO.unpack(data)
            if magic != _HELLO_MAGIC:
                raise ProtocolError("the peer speaks another shared-memory layout (use one aiocoll release)")
            if arena_bytes != self.arena_bytes or region_bytes != self.region_bytes:
                raise ProtocolError(
                    f"rank {peer} has a {arena_bytes}-byte arena of {region_bytes}-byte regions, we have "
                    f"{self.arena_bytes} of {self.region_bytes}: set AIOCOLL_SHM_CHUNK alike on every rank"
                )
            if ring_bytes != self.ring_bytes:
                raise ProtocolError(
                    f"rank {peer} has {ring_bytes}-byte point-to-point rings, we have {self.ring_bytes} "
                    "(use one aiocoll release on every rank)"
                )
            if len(fds) != (4 if ring_bytes else 2):
                raise ProtocolError(f"shared-memory exchange: rank {peer} sent {len(fds)} descriptors")
            _check_memfd(fds[0], arena_bytes)
            _check_eventfd(fds[1])
            if ring_bytes:
                _check_memfd(fds[2], RING_HEADER + ring_bytes)
                _check_eventfd(fds[3])
                in_ring = mmap.mmap(fds[2], RING_HEADER + ring_bytes)
            mem = self._map(fds[0], arena_bytes)
        except BaseException:
            for fd in fds:
                os.close(fd)
            for m in (out_ring, in_ring):
                if m is not None:
                    m.close()
            if out_efd >= 0:
                os.close(out_efd)
            raise
        os.close(fds[0])  # the mappings keep the memory
        shm = ShmPeer(peer, sock, mem, fds[1], pid)
        if ring_bytes:
            os.close(fds[2])
            shm.out_ring, shm.out_efd, shm.in_ring, shm.in_efd = out_ring, out_efd, in_ring, fds[3]
        try:
            await loop.sock_sendall(sock, bytes(mem[PROBE_OFFSET : PROBE_OFFSET + NONCE_BYTES]))
            echoed = await _recv_exactly(loop, sock, NONCE_BYTES)
            mine_ok = secrets.compare_digest(echoed, self._nonce)
            await loop.sock_sendall(sock, b"\x01" if mine_ok else b"\x00")
            theirs_ok = await _recv_exactly(loop, sock, 1) == b"\x01"
        except BaseException:
            shm.close(sock=False)
            raise
        if not (mine_ok and theirs_ok):
            shm.close(sock=False)
            raise ShmUnavailable(
                f"rank {peer}: descriptors crossed the socket but the memory is not shared "
                "(separate containers or a sandbox); use TCP"
            )
        shm.shared = True
        return shm

    def free_regions(self) -> int:
        """A bit mask of the group regions no live group of this process uses, nor is offered
        to a group still forming."""
        mask = ((1 << self.regions) - 1) & ~self.regions_offered
        for region in self.regions_used:
            mask &= ~(1 << region)
        return mask

    def _map(self, fd: int, size: int) -> mmap.mmap:
        """Map a peer's arena (a seam for the test that simulates memory that is not shared)."""
        return mmap.mmap(fd, size)

    def _adopt(self, shm: ShmPeer) -> None:
        if self.closed:
            shm.close()
            return
        self.peers[shm.rank] = shm
        if self._on_peer is not None:
            self._on_peer(shm)
        if self._watch:
            self._loop.add_reader(shm.sock.fileno(), self._on_socket, shm)
        fut = self._waiting.pop(shm.rank, None)
        if fut is not None and not fut.done():
            fut.set_result(shm)

    def _on_socket(self, shm: ShmPeer) -> None:
        try:
            data = shm.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            data, reason = b"", str(exc)
        else:
            reason = "its shared-memory socket closed (the process exited or was killed)"
        if data:
            return  # nothing is sent on a watched socket; drop it
        self._lose(shm, reason)

    def _lose(self, shm: ShmPeer, reason: str) -> None:
        if self.peers.get(shm.rank) is not shm:
            return
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(shm.sock.fileno())
        for handler in list(self._lost_handlers):
            handler(shm.rank, reason)

    # -- closing ---------------------------------------------------------------------------
    def close(self) -> None:
        """Close everything; idempotent. Mappings still viewed stay until their views go."""
        if self.closed:
            return
        self.closed = True
        if self.waker is not None:
            self.waker.close()  # it watches our eventfd: unwatch before closing it
        if self._accepting is not None:
            self._accepting.cancel()
        for task in list(self._handshakes):
            task.cancel()
        if self._listener is not None:
            self._listener.close()
        for shm in self.peers.values():
            if self._watch:
                with contextlib.suppress(ValueError, OSError):
                    self._loop.remove_reader(shm.sock.fileno())
            shm.close(sock=self._watch)  # an unwatched socket is a link's: it says goodbye on it
        self.peers.clear()
        for fut in self._waiting.values():
            if not fut.done():
                fut.cancel()
        with contextlib.suppress(OSError):
            os.close(self.efd)
        with contextlib.suppress(OSError):
            os.close(self._memfd)
        with contextlib.suppress(BufferError, ValueError):
            self.mem.close()

    def describe(self) -> dict[str, Any]:
        return {"address": self.address, "peers": sorted(self.peers), "rejected": self.rejected}
