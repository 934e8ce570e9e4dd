"""Reads of another process's memory (client.data._vm_read): a read large enough to be split
between the calling thread and a helper thread lands every byte where it belongs, and a fault in
either half raises instead of hanging or returning a partial copy."""

from __future__ import annotations

import errno
import mmap
import os
import signal
import threading
import time

import numpy as np
import pytest
from aiocoll.client.data._vm_read import SPLIT_MIN, vm_read_available, vm_read_split

pytestmark = pytest.mark.timeout(60)


def test_a_split_read_lands_every_byte_and_a_fault_in_either_half_raises() -> None:
    if not vm_read_available():
        pytest.skip("process_vm_readv is unavailable here")
    page = mmap.PAGESIZE
    hole = SPLIT_MIN + page  # the child has no memory from here (2 pages)
    src = mmap.mmap(-1, hole + 2 * page)
    view = np.frombuffer(src, np.uint8)
    view[:] = (np.arange(view.size, dtype=np.int64) * 131 % 251).astype(np.uint8)
    addr = view.ctypes.data
    src.madvise(mmap.MADV_DONTFORK, hole, 2 * page)
    n = hole - 5  # the second half ends mid-page
    child = os.fork()
    if child == 0:  # the same addresses, copy-on-write; sleeps until killed
        time.sleep(60)
        os._exit(0)
    try:
        dst = np.zeros(hole + 2 * page, np.uint8)
        vm_read_split(child, dst.ctypes.data, addr, n)
        assert np.array_equal(dst[:n], view[:n]) and not dst[n:].any()
        assert "aiocoll-vm-read" in [t.name for t in threading.enumerate()]  # it was split
        with pytest.raises(OSError) as second:  # the helper's half runs into the hole
            vm_read_split(child, dst.ctypes.data, addr, hole + page)
        assert second.value.errno == errno.EFAULT, second.value
        with pytest.raises(OSError) as first:  # both halves fault: the caller's is the one said
            vm_read_split(child, dst.ctypes.data, 4096, n)
        assert first.value.errno == errno.EFAULT, first.value
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
