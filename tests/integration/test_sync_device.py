"""aiocoll.sync with device tensors: the facade stages after the calling thread's stream.

The facade runs every operation on its loop thread, whose current stream is not the caller's.
A slow "kernel" on the caller's stream (the thread-backed stand-in device) writes the values just
before each call; the facade must record the caller's stream event on the calling thread and
hand it to the operation, else it stages the stale zeros. One process (world of one) is enough.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SCRIPT = r"""
import json, os, sys, time
import numpy as np
import aiocoll.sync as dist
from aiocoll.device._device_threads import ThreadDevice

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
dev = ThreadDevice(copy_delay=0.001)
caller = dev.new_stream()
dev.set_current_stream(caller)
out = {}
for name, async_op in (("blocking", False), ("async_op", True)):
    t = dev.tensor(np.zeros(3000, np.float32))   # 12 chunks of 1 KiB
    def kernel(t=t):
        time.sleep(0.2)
        t.flat[:] = 7.0
    dev.launch(caller, kernel)
    work = dist.all_reduce(t, async_op=async_op)
    if async_op:
        work.wait()
    out[name] = float(t.flat.min()), float(t.flat.max())   # landed: no snapshot() needed
dist.destroy_process_group()
dev.close()
print(json.dumps(out))
"""


def test_sync_facade_stages_after_the_calling_threads_stream(tmp_path: Path) -> None:
    env = {**os.environ, "AIOCOLL_STAGING_CHUNK_BYTES": "1024"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "rdv")],
        capture_output=True,
        text=True,
        timeout=80,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"blocking": [7.0, 7.0], "async_op": [7.0, 7.0]}
