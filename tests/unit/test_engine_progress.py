"""The engine's issue-10 hooks over the in-memory transport: the record of the last operations
logged on a failure, one rank's timeout failing the others at once, and the progress report the
beat thread takes (nothing while operations complete quickly)."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from test_engine import all_reduce_body, close, engines

from aiocoll._errors import CollectiveTimeout

pytestmark = pytest.mark.timeout(30)


async def test_a_timeout_logs_the_last_operations_and_fails_the_group_s_other_ranks_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, engs = engines(3)
    groups = [e.group("w", (0, 1, 2)) for e in engs]
    x = [np.ones(4, np.float32) for _ in range(3)]
    for _ in range(2):
        works = [
            engs[r].submit(
                groups[r],
                "all_reduce",
                all_reduce_body(x[r], (0, 1, 2), r),
                timeout=10,
                signature={"kind": "all_reduce", "dtype": "float32", "count": 4},
            )
            for r in range(3)
        ]
        await asyncio.gather(*works)
    assert all(e.progress.report() is None for e in engs)  # fast: nothing to report
    caplog.set_level(logging.WARNING, logger="aiocoll.client.progress")
    # Rank 2 never calls seq 2; rank 1 gives up after 0.3 s; rank 0 would wait 60 s.
    loop = asyncio.get_running_loop()
    started = loop.time()
    patient = engs[0].submit(groups[0], "all_reduce", all_reduce_body(x[0], (0, 1, 2), 0), timeout=60)
    hasty = engs[1].submit(groups[1], "all_reduce", all_reduce_body(x[1], (0, 1, 2), 1), timeout=0.3)
    with pytest.raises(CollectiveTimeout):
        await hasty
    with pytest.raises(CollectiveTimeout, match="rank 1 gave up on it"):
        await patient
    assert loop.time() - started < 5.0
    record = "\n".join(r.getMessage() for r in caplog.records if "its last" in r.getMessage())
    assert (
        "rank 1: all_reduce (group 'world', seq 2) timed out after 0.3s waiting for rank(s) [2]; "
        "its last 2 operations, oldest first:" in record
    ), record
    assert "all_reduce group='world' seq=0 count=4 dtype=float32 start=" in record and " ok" in record
    await asyncio.sleep(0.05)  # the failed operation's task ends (and is recorded) a moment later
    report = engs[0].progress.report(full=True)
    assert report is not None and report["seqs"] == {"w": 3} and len(report["done"]) == 3
    await close(engs)
