"""The Transport conformance suite over every link kind (aiocoll.testing.transport_conformance.LINK_KINDS)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from aiocoll.algorithms import Transport
from aiocoll.testing.transport_conformance import (
    LINK_KINDS,
    KillRank,
    MakeWorld,
    TransportConformance,
    abort_rank,
    close_world,
)


@pytest.fixture(params=sorted(LINK_KINDS))
async def make_world(request: pytest.FixtureRequest) -> AsyncIterator[MakeWorld]:
    made: list[list[Transport]] = []

    async def make(n: int, **bounds: int) -> list[Transport]:
        made.append(await LINK_KINDS[request.param](n, **bounds))
        return made[-1]

    yield make
    for world in made:
        await close_world(world)


@pytest.fixture
def kill_rank() -> KillRank:
    return abort_rank


class TestLinkConformance(TransportConformance):
    """Every test of the suite, once per link kind."""
