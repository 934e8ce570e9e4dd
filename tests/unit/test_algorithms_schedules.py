"""Schedules checked as pure data, without an event loop.

A symbolic simulator runs every rank's schedule: each element holds the set of (rank, buffer,
index) contributions it carries; a reducing receive must add only contributions the element
does not have yet (a double count fails), a plain receive overwrites. Sends snapshot their
range when their step starts, receives complete once the matching send happened, and lanes
advance independently, as the executor does. A schedule that deadlocks, double counts, leaves
a contribution out or pairs a send with no receive fails here.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import pytest

from aiocoll.algorithms import _schedule as S

Token = tuple[int, str, int, int]
Buffers = dict[S.BufRef, list[frozenset[Token]]]


def _buffers(rank: int, sizes: dict[S.BufRef, int]) -> Buffers:
    return {ref: [frozenset({(rank, ref[0], ref[1], i)}) for i in range(size)] for ref, size in sizes.items()}


def simulate(schedules: list[S.Schedule], buffers: list[Buffers]) -> None:
    """Run all ranks' schedules to completion symbolically, mutating ``buffers``."""
    n = len(schedules)
    mailbox: dict[tuple[int, int, int], list[frozenset[Token]]] = {}
    for rank in range(n):
        for c in schedules[rank].prologue:
            src = buffers[rank][c.src][c.src_start : c.src_start + c.count]
            buffers[rank][c.dst][c.dst_start : c.dst_start + c.count] = src
    position = [[0] * len(s.lanes) for s in schedules]
    posted = [[False] * len(s.lanes) for s in schedules]
    progress = True
    while progress:
        progress = False
        for rank in range(n):
            for lane_index, lane in enumerate(schedules[rank].lanes):
                if position[rank][lane_index] == len(lane):
                    continue
                step = lane[position[rank][lane_index]]
                if not posted[rank][lane_index]:
                    for send in step.sends:
                        key = (rank, send.peer, step.id)
                        assert key not in mailbox, f"rank {rank} sends twice to {send.peer} with id {step.id}"
                        mailbox[key] = buffers[rank][send.buf][send.start : send.stop]
                    posted[rank][lane_index] = True
                    progress = True
                keys = [(r.peer, rank, step.id) for r in step.recvs]
                if not all(k in mailbox for k in keys):
                    continue
                for recv, key in zip(step.recvs, keys, strict=True):
                    data = mailbox.pop(key)
                    assert len(data) == recv.stop - recv.start, f"size disagreement on {key}"
                    target = buffers[rank][recv.buf]
                    for i, tokens in enumerate(data):
                        if recv.reduce:
                            assert not (target[recv.start + i] & tokens), f"double count at rank {rank}"
                            target[recv.start + i] = target[recv.start + i] | tokens
                        else:
                            target[recv.start + i] = tokens
                position[rank][lane_index] += 1
                posted[rank][lane_index] = False
                progress = True
    stuck = [
        (r, li) for r in range(n) for li, lane in enumerate(schedules[r].lanes) if position[r][li] < len(lane)
    ]
    assert not stuck, f"deadlock: lanes {stuck} never finished"
    assert not mailbox, f"messages never received: {sorted(mailbox)}"
    for rank in range(n):
        for c in schedules[rank].epilogue:
            src = buffers[rank][c.src][c.src_start : c.src_start + c.count]
            buffers[rank][c.dst][c.dst_start : c.dst_start + c.count] = src


def everyone(n: int, buf: str, index: int, i: int) -> frozenset[Token]:
    return frozenset((r, buf, index, i) for r in range(n))


SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16]
COUNTS = [0, 1, 3, 17, 100]
# Small chunks so the pipelined variants really use several lanes.
SMALL = {"itemsize": 1, "chunk_bytes": 4, "max_lanes": 3}


def check_step_hygiene(schedule: S.Schedule, sizes: dict[S.BufRef, int]) -> None:
    """Ranges in bounds; within a step a plain receive overlaps no send and no other receive."""
    for step in schedule.steps():
        assert 0 <= step.id < max(schedule.span, 1)
        transfers: list[S.Send | S.Recv] = [*step.sends, *step.recvs]
        for t in transfers:
            assert 0 <= t.start <= t.stop <= sizes[t.buf]
        written = [(r.buf, r.start, r.stop) for r in step.recvs if not r.reduce]
        read = [(s.buf, s.start, s.stop) for s in step.sends]
        for i, (buf, a, b) in enumerate(written):
            for other, c, d in written[i + 1 :] + read:
                assert other != buf or b <= c or d <= a or a == b or c == d, f"overlap in step {step.id}"


# ------------------------------------------------------------------------------------- all_reduce


ALL_REDUCE: dict[str, Callable[..., S.Schedule]] = {
    "ring": lambda n, me, count: S.ring_all_reduce_schedule(n, me, count, **SMALL),
    "rhd-small": lambda n, me, count: S.rhd_all_reduce_schedule(
        n, me, count, itemsize=1, rd_max_bytes=1 << 30
    ),
    "rhd-halving": lambda n, me, count: S.rhd_all_reduce_schedule(n, me, count, itemsize=1, rd_max_bytes=0),
    "tree": lambda n, me, count: S.tree_all_reduce_schedule(n, me, count, **SMALL),
}


@pytest.mark.parametrize("algorithm", sorted(ALL_REDUCE))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", COUNTS)
def test_all_reduce_schedule_leaves_every_contribution_exactly_once_everywhere(
    algorithm: str, n: int, count: int
) -> None:
    schedules = [ALL_REDUCE[algorithm](n, me, count) for me in range(n)]
    buffers = [_buffers(r, {S.W: count}) for r in range(n)]
    for s in schedules:
        check_step_hygiene(s, {S.W: count})
    simulate(schedules, buffers)
    for rank in range(n):
        assert buffers[rank][S.W] == [everyone(n, "w", 0, i) for i in range(count)]


@pytest.mark.parametrize("n", SIZES)
def test_ring_all_reduce_moves_each_block_n_minus_1_times_per_phase(n: int) -> None:
    count = 12 * n
    schedules = [S.ring_all_reduce_schedule(n, me, count) for me in range(n)]
    for s in schedules:
        steps = s.steps()
        assert len(steps) == 2 * (n - 1)
        # Bandwidth optimum: each rank sends 2(n-1)/n of the vector, in equal messages.
        assert sum(x.stop - x.start for st in steps for x in st.sends) == 2 * (n - 1) * count // n
        assert all(len(st.sends) == 1 and len(st.recvs) == 1 for st in steps)
    # Each block crosses n-1 links while being reduced and n-1 while being gathered.
    moves: Counter[tuple[int, bool]] = Counter()
    for s in schedules:
        for st in s.steps():
            moves[(st.sends[0].start, st.id < n - 1)] += 1
    assert set(moves.values()) <= {n - 1}
    assert len(moves) == (2 * n if n > 1 else 0)


def test_ring_all_reduce_is_pipelined_over_bounded_lanes() -> None:
    n, count = 4, 4 * 1000
    schedule = S.ring_all_reduce_schedule(n, 0, count, itemsize=4, chunk_bytes=400, max_lanes=3)
    assert len(schedule.lanes) == 3
    ids = [st.id for st in schedule.steps()]
    assert len(ids) == len(set(ids)), "step ids must be unique within an operation"
    payloads = {x.stop - x.start for st in schedule.steps() for x in st.sends}
    assert max(payloads) <= 100


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_halving_doubling_sends_the_bandwidth_optimum_for_powers_of_two(n: int) -> None:
    count = 64 * n
    for me in range(n):
        steps = S.rhd_all_reduce_schedule(n, me, count, itemsize=1, rd_max_bytes=0).steps()
        assert len(steps) == 2 * (n.bit_length() - 1)
        assert sum(x.stop - x.start for st in steps for x in st.sends) == 2 * (n - 1) * count // n


@pytest.mark.parametrize("n", [3, 5, 6, 7])
def test_recursive_doubling_folds_extra_ranks_for_non_powers_of_two(n: int) -> None:
    p = 1 << (n.bit_length() - 1)
    lengths = [len(S.rhd_all_reduce_schedule(n, me, 4, itemsize=1).steps()) for me in range(n)]
    folded = [me for me in range(2 * (n - p)) if me % 2 == 0]
    assert all(lengths[me] == 2 for me in folded)
    # Active ranks run log2(p) rounds; those standing in for a folded neighbour two more.
    logp = p.bit_length() - 1
    for me in set(range(n)) - set(folded):
        assert lengths[me] == logp + (2 if me < 2 * (n - p) else 0)


# --------------------------------------------------------------------------------- rooted kinds


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", [0, 1, 17])
@pytest.mark.parametrize("algorithm", ["tree", "direct"])
def test_broadcast_schedule_copies_the_roots_vector_to_every_rank(n: int, count: int, algorithm: str) -> None:
    for root in {0, n // 2, n - 1}:
        if algorithm == "tree":
            schedules = [S.tree_broadcast_schedule(n, me, root, count, **SMALL) for me in range(n)]
        else:
            schedules = [S.direct_broadcast_schedule(n, me, root, count) for me in range(n)]
        buffers = [_buffers(r, {S.W: count}) for r in range(n)]
        simulate(schedules, buffers)
        for rank in range(n):
            assert buffers[rank][S.W] == [frozenset({(root, "w", 0, i)}) for i in range(count)]


@pytest.mark.parametrize("n", SIZES)
def test_tree_broadcast_takes_log_rounds_and_each_rank_receives_once(n: int) -> None:
    rounds = max(0, (n - 1).bit_length())
    receives: Counter[int] = Counter()
    for me in range(n):
        schedule = S.tree_broadcast_schedule(n, me, 1 % n, 8)
        assert schedule.span == rounds
        for st in schedule.steps():
            receives[me] += len(st.recvs)
    assert receives[1 % n] == 0
    assert all(receives[r] == 1 for r in range(n) if r != 1 % n)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", [0, 1, 17])
@pytest.mark.parametrize("algorithm", ["tree", "direct"])
def test_reduce_schedule_gathers_every_contribution_once_at_the_root(
    n: int, count: int, algorithm: str
) -> None:
    for root in {0, n // 2, n - 1}:
        if algorithm == "tree":
            schedules = [S.tree_reduce_schedule(n, me, root, count, **SMALL) for me in range(n)]
        else:
            schedules = [S.direct_reduce_schedule(n, me, root, count) for me in range(n)]
        buffers = [_buffers(r, {S.W: count}) for r in range(n)]
        simulate(schedules, buffers)
        assert buffers[root][S.W] == [everyone(n, "w", 0, i) for i in range(count)]


# ------------------------------------------------------------------------------ gather / scatter


def _io_sizes(n: int, count: int, sends: int, recvs: int) -> dict[S.BufRef, int]:
    sizes: dict[S.BufRef, int] = {("s", i): count for i in range(sends)}
    sizes.update({("r", i): count for i in range(recvs)})
    return sizes


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", [0, 1, 17])
@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_all_gather_schedule_puts_rank_js_input_into_everyones_output_j(
    n: int, count: int, algorithm: str
) -> None:
    if algorithm == "ring":
        schedules = [S.ring_all_gather_schedule(n, me, count, **SMALL) for me in range(n)]
    else:
        schedules = [S.direct_all_gather_schedule(n, me, count) for me in range(n)]
    sizes = _io_sizes(n, count, 1, n)
    for s in schedules:
        check_step_hygiene(s, sizes)
    buffers = [_buffers(r, sizes) for r in range(n)]
    simulate(schedules, buffers)
    for rank in range(n):
        for j in range(n):
            assert buffers[rank][("r", j)] == [frozenset({(j, "s", 0, i)}) for i in range(count)]


@pytest.mark.parametrize("n", SIZES)
def test_gather_and_scatter_schedules_move_the_right_blocks(n: int) -> None:
    count = 5
    for root in {0, n - 1}:
        gathers = [S.direct_gather_schedule(n, me, root, count) for me in range(n)]
        buffers = [_buffers(r, _io_sizes(n, count, 1, n if r == root else 0)) for r in range(n)]
        simulate(gathers, buffers)
        for j in range(n):
            assert buffers[root][("r", j)] == [frozenset({(j, "s", 0, i)}) for i in range(count)]
        scatters = [S.direct_scatter_schedule(n, me, root, count) for me in range(n)]
        buffers = [_buffers(r, _io_sizes(n, count, n if r == root else 0, 1)) for r in range(n)]
        simulate(scatters, buffers)
        for j in range(n):
            assert buffers[j][("r", 0)] == [frozenset({(root, "s", j, i)}) for i in range(count)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", [0, 1, 17])
def test_reduce_scatter_schedules_reduce_block_j_onto_rank_j(n: int, count: int) -> None:
    ring = [S.ring_reduce_scatter_schedule(n, me, count, **SMALL) for me in range(n)]
    buffers = [_buffers(r, {S.W: n * count, ("r", 0): count}) for r in range(n)]
    simulate(ring, buffers)
    for j in range(n):
        assert buffers[j][("r", 0)] == [everyone(n, "w", 0, j * count + i) for i in range(count)]
    direct = [S.direct_reduce_scatter_schedule(n, me, count) for me in range(n)]
    buffers = [_buffers(r, _io_sizes(n, count, n, 1)) for r in range(n)]
    # The prologue copies the own block into R0; the receives add every other rank's block j.
    simulate(direct, buffers)
    for j in range(n):
        assert buffers[j][("r", 0)] == [frozenset((r, "s", j, i) for r in range(n)) for i in range(count)]


@pytest.mark.parametrize("n", SIZES)
def test_all_to_all_schedule_delivers_blocks_of_different_sizes(n: int) -> None:
    def size(src: int, dst: int) -> int:
        return (3 * src + dst) % 4

    schedules = [
        S.direct_all_to_all_schedule(n, me, [size(me, j) for j in range(n)], [size(j, me) for j in range(n)])
        for me in range(n)
    ]
    buffers: list[Buffers] = []
    for r in range(n):
        sizes = {("s", j): size(r, j) for j in range(n)}
        sizes.update({("r", j): size(j, r) for j in range(n)})
        buffers.append(_buffers(r, sizes))
    simulate(schedules, buffers)
    for r in range(n):
        for j in range(n):
            assert buffers[r][("r", j)] == [frozenset({(j, "s", r, i)}) for i in range(size(j, r))]


@pytest.mark.parametrize("n", SIZES)
def test_dissemination_barrier_lets_every_rank_hear_from_every_rank(n: int) -> None:
    schedules = [S.dissemination_barrier_schedule(n, me) for me in range(n)]
    heard = [{me} for me in range(n)]
    # Round by round: what a rank knows travels with its message.
    for rnd in range(max(0, (n - 1).bit_length())):
        snapshot = [set(h) for h in heard]
        for me in range(n):
            (step,) = [st for st in schedules[me].steps() if st.id == rnd]
            heard[me] |= snapshot[step.recvs[0].peer]
    assert all(h == set(range(n)) for h in heard)
    simulate(schedules, [_buffers(r, {S.Z: 0}) for r in range(n)])


def test_split_bounds_cover_the_range_in_near_equal_parts() -> None:
    assert S.split_bounds(10, 3) == [0, 3, 6, 10]
    assert S.split_bounds(0, 4) == [0, 0, 0, 0, 0]
    bounds = S.split_bounds(1001, 7)
    widths = [b - a for a, b in itertools.pairwise(bounds)]
    assert sum(widths) == 1001 and max(widths) - min(widths) <= 1


def test_simulator_detects_a_double_count() -> None:
    # A broken all_reduce: rank 1 sends its vector twice (two steps) to rank 0, which reduces both.
    bad = [
        S.Schedule(
            (
                (
                    S.Step(0, recvs=(S.Recv(1, S.W, 0, 1, True),)),
                    S.Step(1, recvs=(S.Recv(1, S.W, 0, 1, True),)),
                ),
            ),
            2,
        ),
        S.Schedule(
            ((S.Step(0, sends=(S.Send(0, S.W, 0, 1),)), S.Step(1, sends=(S.Send(0, S.W, 0, 1),))),), 2
        ),
    ]
    with pytest.raises(AssertionError, match="double count"):
        simulate(bad, [_buffers(r, {S.W: 1}) for r in range(2)])


def test_simulator_detects_a_deadlock() -> None:
    waits = [S.Schedule(((S.Step(0, recvs=(S.Recv(1 - r, S.W, 0, 1),)),),), 1) for r in range(2)]
    with pytest.raises(AssertionError, match="deadlock"):
        simulate(waits, [_buffers(r, {S.W: 1}) for r in range(2)])
