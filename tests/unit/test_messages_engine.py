"""Issue 18: the engine's errors over the in-memory transport name the world group "world" and
say a cause once."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_engine import all_reduce_body, close, engines

from aiocoll._errors import MismatchError

pytestmark = pytest.mark.timeout(30)


async def test_a_mismatch_in_the_world_group_names_it_world() -> None:
    _, engs = engines(2)
    groups = [e.group("w", (0, 1)) for e in engs]
    x = [np.ones(4, np.float32), np.ones(8, np.float32)]
    works = [
        engs[r].submit(groups[r], "all_reduce", all_reduce_body(x[r], (0, 1), r), timeout=5) for r in range(2)
    ]
    results = await asyncio.gather(*works, return_exceptions=True)
    for err in results:
        assert isinstance(err, MismatchError), results
        assert "group 'world'" in str(err) and "'w'" not in str(err), err
        assert err.group == "w"  # the id stays the wire's
        assert err.__cause__ is None or str(err.__cause__) not in str(err), err
    await close(engs)
