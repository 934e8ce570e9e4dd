"""The bench's CPU hogs end with the bench, even when the bench is killed with SIGKILL."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

_BENCH_STAND_IN = """
import sys, time
from aiocoll.cli._bench_servers import cpu_hogs
with cpu_hogs(2) as hogs:
    print(" ".join(str(h.pid) for h in hogs), flush=True)
    time.sleep(120)
"""


def _spinning(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline") as cmdline:
            return state != "Z" and "1000003" in cmdline.read()
    except FileNotFoundError:
        return False


@pytest.mark.timeout(60)
def test_hogs_stop_when_the_bench_that_started_them_is_killed() -> None:
    bench = subprocess.Popen([sys.executable, "-c", _BENCH_STAND_IN], stdout=subprocess.PIPE, text=True)
    assert bench.stdout is not None
    pids = [int(word) for word in bench.stdout.readline().split()]
    # A child just started can show an empty command line for a moment (the kernel sets up its
    # new image), so "spinning" is looked for until it shows, with a deadline.
    deadline = time.monotonic() + 30
    while not all(_spinning(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pids) == 2 and all(_spinning(pid) for pid in pids), pids
    bench.kill()  # no finally block runs: the hogs must notice by themselves
    bench.wait()
    deadline = time.monotonic() + 30
    while any(_spinning(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if _spinning(pid)]
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"hogs {left} still spin after their bench was killed"
