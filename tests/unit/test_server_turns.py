"""The coordinator's share of a loop turn (server/_turns.py): work put off runs first come, first
served, a turn stops taking work once its share is spent, and a light load schedules nothing."""

from __future__ import annotations

import asyncio

import pytest
from aiocoll.server._turns import Turns

pytestmark = pytest.mark.timeout(10)


async def test_work_put_off_runs_in_order_a_share_per_turn_and_a_light_load_schedules_nothing() -> None:
    loop = asyncio.get_running_loop()
    turns = Turns(budget=1.0)
    turns.attach(loop)
    turns.charge(0.1)  # under a quarter of the share: no turn asked for
    assert not turns._next_turn_asked and not turns.exhausted
    turns.charge(0.2)  # past a quarter: the next turn starts from zero
    assert turns._next_turn_asked
    turns.charge(0.8)
    assert turns.exhausted
    ran: list[tuple[int, int]] = []
    turn = 0

    def work(i: int) -> None:
        ran.append((turn, i))
        turns.charge(0.6)  # two pieces spend more than one turn's share

    for i in range(5):
        turns.later(lambda i=i: work(i))
    assert turns.backlog == 5
    while turns.backlog:
        turn += 1
        await asyncio.sleep(0)
    assert [i for _, i in ran] == [0, 1, 2, 3, 4]
    per_turn = [sum(1 for t, _ in ran if t == n) for n in sorted({t for t, _ in ran})]
    assert per_turn == [2, 2, 1]


async def test_run_all_empties_the_queue_whatever_the_time() -> None:
    turns = Turns(budget=0.0)
    turns.attach(asyncio.get_running_loop())
    done: list[int] = []
    for i in range(3):
        turns.later(lambda i=i: (done.append(i), turns.charge(1.0)))
    turns.run_all()
    assert done == [0, 1, 2] and turns.backlog == 0


async def test_a_budget_set_later_moves_the_point_where_a_turn_is_spent() -> None:
    turns = Turns()
    turns.attach(asyncio.get_running_loop())
    turns.budget = 0.0
    turns.charge(1e-6)
    assert turns.exhausted, "with a budget of zero any charge spends the turn"
    await asyncio.sleep(0)
    assert not turns.exhausted and turns.spent == 0.0
    turns.budget = 10.0
    turns.charge(1.0)
    assert not turns.exhausted
