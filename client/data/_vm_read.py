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

__all__ = ["DIRECT_ENV", "vm_read", "vm_read_available"]

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
