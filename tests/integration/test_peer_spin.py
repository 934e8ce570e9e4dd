"""AIOCOLL_SPIN_US (opt-in busy-polling inside large payloads on TCP links) keeps results exact.

Two ranks with the spin on run large and small collectives whose payloads span many reads, and
compare them with numpy; what the spin does to timing is the bench's to measure, not a test's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiocoll.testing.world import run_world, unwrap

pytestmark = pytest.mark.integration


def _data(rank: int, count: int) -> np.ndarray:
    return np.random.default_rng(rank * 7 + count).integers(-100, 100, count).astype(np.float64)


async def _checks(pg: Any) -> None:
    n = pg.size
    for count in (3, 100_000, 2_500_000):  # 2.5M float64 = 20 MB: many reads per payload
        x = _data(pg.rank, count)
        await pg.all_reduce(x)
        np.testing.assert_array_equal(x, np.sum([_data(r, count) for r in range(n)], axis=0))
    b = _data(pg.rank, 1_000_000)
    await pg.broadcast(b, src=1)
    np.testing.assert_array_equal(b, _data(1, 1_000_000))


@pytest.mark.timeout(90)
def test_collectives_with_the_link_spin_on_match_numpy() -> None:
    # TCP links (ranks of one host would share memory instead, and the spin would not run)
    unwrap(run_world(_checks, 2, timeout=80, env={"AIOCOLL_SPIN_US": "300", "AIOCOLL_TRANSPORT": "tcp"}))
