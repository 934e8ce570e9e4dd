"""Single-copy reads from another process's memory: Linux's process_vm_readv, through ctypes.

Imports only the standard library; never the public surface or anything of aiocoll.

Why: a collective whose readers copy a peer's data out of shared memory needs the writer to copy
it in first (two copies per byte). For a large all_gather or broadcast a reader can instead
copy straight from the peer's own buffer with one system call (the kernel maps the peer's pages
and copies once), as MPICH does with the same call ("CMA"). The kernel allows it only between
processes of one user that may trace each other (ptrace access mode); containers' seccomp
filters often refuse it, so callers probe first and keep the shared-memory path as a fallback.
No process can read ours unless the kernel would let it attach a debugger to us anyway.
"""

from __future__ import annotations

import ctypes
import errno
import os
import queue
import threading

__all__ = ["DIRECT_ENV", "vm_read", "vm_read_available", "vm_read_split"]

DIRECT_ENV = "AIOCOLL_SHM_DIRECT"  # "0": never read peers' memory directly (the shared memory instead)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_readv = None
_unavailable: str | None = None


def _bind() -> None:
    global _readv, _unavailable
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError) as exc:
        _unavailable = f"process_vm_readv not found in the C library ({exc})"
        return
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    fn.restype = ctypes.c_ssize_t
    _readv = fn


def vm_read_available() -> bool:
    """Whether this process can call process_vm_readv at all (not whether a peer allows it)."""
    if _readv is None and _unavailable is None:
        _bind()
    return _readv is not None


def vm_read(pid: int, local: int, remote: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``remote`` of process ``pid`` to address ``local`` of ours.

    Raises:
        OSError: the kernel refused (EPERM: no ptrace access; ESRCH: no such process; EFAULT:
            the remote range is not mapped) or copied less than asked.
    """
    if not vm_read_available():
        raise OSError(errno.ENOSYS, _unavailable or "process_vm_readv is unavailable")
    assert _readv is not None
    done = 0
    while done < nbytes:
        loc = _IoVec(local + done, nbytes - done)
        rem = _IoVec(remote + done, nbytes - done)
        got = _readv(pid, ctypes.byref(loc), 1, ctypes.byref(rem), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        if got == 0:
            raise OSError(errno.EFAULT, f"process_vm_readv from pid {pid} copied nothing")
        done += got


# A read of at least this many bytes is split in two, copied at once by the calling thread and a
# helper thread: one core copies at well below the memory's bandwidth, and while one process reads
# (a point-to-point receive, a broadcast of two ranks) the process it reads from only waits, so
# its core is free. Below it, handing half to another thread and waiting for it costs about what
# it saves.
SPLIT_MIN = 32 << 20
_PART_WAIT_S = 60.0  # a copy of a few hundred MiB takes well under a second


class _Part:
    """One part of a split read, copied by the helper thread."""

    __slots__ = ("args", "done", "error")

    def __init__(self, args: tuple[int, int, int, int]) -> None:
        self.args = args
        self.error: OSError | None = None
        self.done = threading.Lock()
        self.done.acquire()

    def run(self) -> None:
        try:
            vm_read(*self.args)
        except OSError as exc:
            self.error = exc
        finally:
            self.done.release()


class _Helper:
    """The process's helper thread for split reads (made again in a forked child, which has no
    threads of its parent's)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.parts: queue.SimpleQueue[_Part] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="aiocoll-vm-read", daemon=True).start()

    def _run(self) -> None:
        while True:
            self.parts.get().run()


_helper: _Helper | None = None
_helper_lock = threading.Lock()
_cores: int | None = None


def vm_read_split(
    pid: int, local: int, remote: int, nbytes: int, readers: int = 1, split_min: int = SPLIT_MIN
) -> None:
    """``vm_read``; one of at least ``split_min`` bytes, where this process may run on two cores
    or more for each of the ``readers`` processes that read at the same time (this one included),
    copies its second half on a helper thread at the same time. Returns once both halves are
    copied. (Readers that already hold every core would only queue the helpers behind them.)

    Raises:
        OSError: as ``vm_read``, for either half (the first half's error first).
    """
    global _helper, _cores
    if _cores is None:
        _cores = len(os.sched_getaffinity(0))
    if nbytes < split_min or _cores < 2 * readers:
        vm_read(pid, local, remote, nbytes)
        return
    with _helper_lock:
        if _helper is None or _helper.pid != os.getpid():
            _helper = _Helper()
        helper = _helper
    half = (nbytes // 2) & ~4095  # whole pages each
    part = _Part((pid, local + half, remote + half, nbytes - half))
    helper.parts.put(part)
    try:
        vm_read(pid, local, remote, half)
    finally:
        # the destination is not the caller's again until the helper's half is in
        if not part.done.acquire(timeout=_PART_WAIT_S):
            raise OSError(
                errno.ETIMEDOUT, f"process_vm_readv from pid {pid}: the helper thread's half did not end"
            )
    if part.error is not None:
        raise part.error
