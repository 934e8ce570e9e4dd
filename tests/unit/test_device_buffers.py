"""Device memory behind the buffer interface: copies and reductions queue on the stream, in order."""

from __future__ import annotations

import time

import numpy as np
import pytest

from aiocoll._types import ReduceOp
from aiocoll.device._device import DeviceError
from aiocoll.device._device_buffers import DeviceBuffers
from aiocoll.device._device_threads import ThreadDevice
from aiocoll.device._staging import DeviceSpan

pytestmark = pytest.mark.timeout(30)


def test_copies_and_reductions_run_on_the_stream_after_earlier_work() -> None:
    dev = ThreadDevice(copy_delay=0.01)
    try:
        stream = dev.new_stream()
        bufs = DeviceBuffers(dev, stream)
        a = dev.tensor(np.zeros(8, np.float32))
        b = dev.tensor(np.arange(8, dtype=np.float32))
        whole_a = DeviceSpan(a, a.flat.dtype, 0, 8, read=True, write=True)
        whole_b = DeviceSpan(b, b.flat.dtype, 0, 8, read=True, write=True)
        # a slow "kernel" on the stream writes b first; the copy queued after it must see that
        dev.launch(stream, lambda: (time.sleep(0.1), b.flat.__setitem__(slice(None), 5.0)))
        bufs.copy(bufs.view(whole_a, 0, 4), bufs.view(whole_b, 4, 8))
        bufs.reduce_into(
            ReduceOp.SUM, bufs.view(whole_a, 0, 4), bufs.view(whole_b, 0, 4), "float32", src_first=False
        )
        bufs.finish_avg(bufs.view(whole_a, 0, 4), 2, "float32")
        scratch = bufs.scratch(whole_a, 3)
        assert (bufs.size(scratch), bufs.itemsize(scratch)) == (3, 4)
        np.testing.assert_array_equal(a.snapshot(), [5, 5, 5, 5, 0, 0, 0, 0])
        with pytest.raises(DeviceError, match="pinned staging"):
            bufs.payload(whole_a)
        with pytest.raises(ValueError, match="device memory"):
            bufs.check_flat([np.zeros(3)], "test")
    finally:
        dev.close()
