"""Per-step fault tolerance with replicas of several ranks, with real processes on loopback.

Replicas of two ranks each (tests/integration/ft_sharded_replica.py: a numpy
model sharded over them, each replica's own aiocoll group for its loss): one rank of replica B is
killed with kill -9; replica A commits a step without B within RECOVERY_BOUND, B's other rank
stops with an error naming the lost rank, its replica and host; B restarted whole heals each
shard from A's same shard and trains on, bit-identical to A per shard at every step.

A replaced rank: one rank of a replica is lost and a new process takes its place while the
replica's other rank waits (through a coordinator restart), and with torch FSDP2 sharding the
model inside each replica; every rank's shard at every step is bit-identical to a run without
faults.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ft_common import RECOVERY_BOUND, Ranks, load_script, stop_after

from aiocoll.testing.preload import TORCH

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch")

SHARDED = Path(__file__).resolve().parent / "ft_sharded_replica.py"
SHARDED_KILL_AT, SHARDED_MARGIN = 8, 5


@pytest.mark.timeout(150)
def test_two_replicas_of_two_ranks_lose_one_rank_train_on_and_heal_the_restarted_replica_per_shard(
    tmp_path: Path,
) -> None:
    """Replicas A and B, two ranks each (a numpy model sharded over them, the replica's own group
    for the loss); kill -9 of B's rank 1 mid-run: A completes a step without B within
    RECOVERY_BOUND, B's rank 0 stops with an error naming the lost rank, its replica and host;
    B restarted whole heals each shard from A's and trains on, bit-identical to A per shard."""
    import secrets
    import signal
    import time

    from aiocoll.testing.coordinator import CoordinatorProcess

    token = secrets.token_hex(16)
    coordinator = CoordinatorProcess(tmp_path / "coordinator.log", "--heartbeat-timeout", "5", token=token)
    until = tmp_path / "until"
    ranks = Ranks(tmp_path, SHARDED, token)
    procs, steps, wait_for = ranks.procs, ranks.records, ranks.wait_for

    def start(replica: str, rank: int) -> None:
        args = ["--coordinator", f"127.0.0.1:{coordinator.port}", "--until-file", str(until)]
        ranks.start(f"{replica}{rank}", [*args, "--replica", replica, "--rank", str(rank)])

    try:
        for replica in "AB":
            for rank in (0, 1):
                start(replica, rank)
        wait_for(
            "both replicas train together",
            lambda: any(e["step"] >= SHARDED_KILL_AT and e["members"] == ["A", "B"] for e in steps("A0")),
        )
        procs["B1"].send_signal(signal.SIGKILL)
        killed_at = time.time()
        procs["B1"].wait(10)
        wait_for("B0 stops", lambda: procs["B0"].poll() is not None, 30.0)
        assert procs["B0"].returncode == 3
        wait_for(
            "A trains without B",
            lambda: any(e["t"] > killed_at and e["members"] == ["A"] for e in steps("A1")),
        )
        first = {name: procs[name].pid for name in ("B0", "B1")}
        for rank in (0, 1):
            start("B", rank)
        wait_for(
            "the restarted B heals",
            lambda: all(any(e["healed"] and e["pid"] != first[n] for e in steps(n)) for n in ("B0", "B1")),
        )
        last = max(e["step"] for e in steps("A0")) + SHARDED_MARGIN
        stop_after(until, last)
        ranks.finish(["A0", "A1", "B0", "B1"])
    finally:
        ranks.stop()
        coordinator.stop()

    host = socket.gethostname()
    # A: one process per rank, every step committed once, in order, on both of its ranks
    for name in ("A0", "A1"):
        assert [e["step"] for e in steps(name)] == list(range(last)), name
        assert len({e["pid"] for e in ranks.all(name)}) == 1
    for a0, a1 in zip(steps("A0"), steps("A1"), strict=True):
        assert a0["members"] == a1["members"] and a0["quorum_id"] == a1["quorum_id"]
    # the survivors' next step without B, within the bound
    first_without = next(e for e in steps("A0") if e["t"] > killed_at and e["members"] == ["A"])
    recovery = first_without["t"] - killed_at
    assert recovery < RECOVERY_BOUND, recovery
    print(
        f"sharded replicas: A committed step {first_without['step']} without B {recovery:.3f}s after the kill"
    )
    # B's rank 0: an error naming the lost rank, its replica and host
    [error] = ranks.records("B0", "error")
    assert "replica 'B'" in error["error"] and f"rank 1 of 2 (host {host})" in error["error"], error
    assert "closed" in error["error"], error
    # a step the kill interrupted failed on every survivor, naming the lost rank (whichever group
    # it failed on: the shard's, the replica's own, the quorum's of every rank)
    for name in ("A0", "A1", "B0"):
        for e in ranks.records(name, "failed"):
            assert "replica 'B' rank 1 of 2 (rank " in e["error"] and f"host {host})" in e["error"], e
            assert "not committed" in e["error"], e
    # the restarted B: both ranks healed at one step from the same shard of A, then trained to the end
    by_rank = {}
    for rank in (0, 1):
        pids = list(dict.fromkeys(e["pid"] for e in steps(f"B{rank}")))
        second = [e for e in steps(f"B{rank}") if e["pid"] == pids[-1]]
        assert second[0]["healed"]["source"] == "A" and second[0]["healed"]["bytes"] > 0, second[0]
        assert [e["step"] for e in second] == list(range(second[0]["step"], last))
        by_rank[rank] = second
    assert by_rank[0][0]["step"] == by_rank[1][0]["step"]
    # per shard, per step: bit-identical on every replica that committed it
    for rank in (0, 1):
        digests = {e["step"]: e["digest"] for e in steps(f"A{rank}")}
        members = {e["step"]: e["members"] for e in steps(f"A{rank}")}
        for e in steps(f"B{rank}"):
            assert e["members"] == members[e["step"]] and "B" in e["members"], e
            assert e["digest"] == digests[e["step"]], (rank, e["step"])
        # the two shards are different parts of the model, not copies
        assert digests[last - 1] != {e["step"]: e["digest"] for e in steps(f"A{1 - rank}")}[last - 1]
    assert members[last - 1] == ["A", "B"]


def _sharded_script() -> Any:
    return load_script(SHARDED)


def _sharded_reference(steps: int) -> dict[int, list[str]]:
    """Per shard, the digest after each step of a run without faults, in this process.

    The replicas' data is the same (``--shared-data``), so the mean over a quorum of one or two
    replicas is each one's gradient exactly: the model does not depend on who was in a quorum.
    The first quorum gives every replica replica A's initial shards (seeds 0 and 1).
    """
    script = _sharded_script()
    import hashlib

    w = [script.initial(rank) for rank in (0, 1)]
    out: dict[int, list[str]] = {0: [], 1: []}
    for step in range(steps):
        parts = [np.array([float(x @ x)]) for x in w]
        loss = float((parts[0] + parts[1])[0])  # the all_reduce of two ranks: one sum
        for rank in (0, 1):
            w[rank] -= 0.1 * script.gradient(w[rank], loss, "", rank, step)
            out[rank].append(hashlib.sha256(w[rank].tobytes()).hexdigest())
    return out


@pytest.mark.timeout(180)
def test_one_lost_rank_of_a_replica_is_replaced_and_its_replica_rejoins_bit_identical_to_a_run_without_faults(
    tmp_path: Path,
) -> None:
    """Replicas A and B, two ranks each (--replace-timeout 120): kill -9 of B's rank 1 mid-step. A
    commits on without B; B's rank 0 keeps its process and waits; the coordinator is killed and
    restarted (--state-dir) while it waits; a new process of B's rank 1 starts; B rejoins with a
    new generation (its ranks make their own group again), both its ranks heal their shards
    from A's, and every rank's shard at every step it committed is bit-identical to a run
    without faults."""
    import secrets
    import signal
    import time

    from aiocoll.testing.coordinator import CoordinatorProcess

    token = secrets.token_hex(16)
    state = tmp_path / "state"
    args = ("--heartbeat-timeout", "5", "--state-dir", str(state))
    coordinator = CoordinatorProcess(tmp_path / "coordinator.log", *args, token=token)
    port = coordinator.port
    until = tmp_path / "until"
    ranks = Ranks(tmp_path, SHARDED, token)
    procs, records, wait_for = ranks.procs, ranks.records, ranks.wait_for

    def start(replica: str, rank: int, seed: int) -> None:
        args = ["--coordinator", f"127.0.0.1:{port}", "--until-file", str(until), "--seed", str(seed)]
        args += ["--replica", replica, "--rank", str(rank), "--replace-timeout", "120", "--shared-data"]
        ranks.start(f"{replica}{rank}", args)

    try:
        for rank in (0, 1):
            start("A", rank, rank)
            start("B", rank, 100 + rank)  # B's own initial shards: the first quorum replaces them
        wait_for(
            "both replicas train together",
            lambda: any(e["step"] >= SHARDED_KILL_AT and e["members"] == ["A", "B"] for e in records("A0")),
        )
        procs["B1"].send_signal(signal.SIGKILL)
        killed_at = time.time()
        procs["B1"].wait(10)
        wait_for(
            "A trains without B",
            lambda: any(e["t"] > killed_at and e["members"] == ["A"] for e in records("A1")),
        )
        # the coordinator dies and comes back from its state while B's rank 0 waits
        coordinator.stop(signal.SIGKILL)
        coordinator = CoordinatorProcess(tmp_path / "coordinator2.log", *args, token=token, port=port)
        restarted_at = time.time()
        wait_for("A trains on after the coordinator's restart", lambda: records("A0")[-1]["t"] > restarted_at)
        assert procs["B0"].poll() is None, ranks.log("B0")
        first = procs["B0"].pid
        start("B", 1, 1001)  # the new process of B's rank 1, with shards of its own
        wait_for(
            "B's ranks heal",
            lambda: all(any(e["healed"] and e["t"] > restarted_at for e in records(n)) for n in ("B0", "B1")),
        )
        last = max(e["step"] for e in records("A0")) + SHARDED_MARGIN
        stop_after(until, last)
        ranks.finish(["A0", "A1", "B0", "B1"])
    finally:
        ranks.stop()
        coordinator.stop()

    host = socket.gethostname()
    reference = _sharded_reference(last)
    # A: the same processes, every step committed once and in order, also while B was away
    for name in ("A0", "A1"):
        assert [e["step"] for e in records(name)] == list(range(last)), name
        assert len({e["pid"] for e in ranks.all(name)}) == 1
        assert [e["generation"] for e in records(name, "generation")] == [1], name  # its own group kept
    alone = [e["step"] for e in records("A0") if e["members"] == ["A"]]
    assert alone and min(alone) >= SHARDED_KILL_AT, alone
    recovery = next(e["t"] for e in records("A0") if e["t"] > killed_at and e["members"] == ["A"]) - killed_at
    assert recovery < RECOVERY_BOUND, recovery
    print(f"replaced rank: A committed without B {recovery:.3f}s after the kill, {len(alone)} steps alone")
    # only the step in flight failed on A, naming B's lost rank
    for name in ("A0", "A1", "B0"):
        failed = records(name, "failed")
        assert len({e["step"] for e in failed}) <= 1, failed
        for e in failed:
            assert "replica 'B' rank 1 of 2 (rank " in e["error"] and f"host {host})" in e["error"], e
    # B's rank 0: one process throughout, never an error; after the replacement it healed and
    # made the replica's group anew, at the same step and generation as the new rank 1
    assert {e["pid"] for e in ranks.all("B0")} == {first}
    assert records("B0", "error") == []
    pids = list(dict.fromkeys(e["pid"] for e in records("B1")))
    assert len(pids) == 2, pids
    back = {}
    for name in ("B0", "B1"):
        after = [e for e in records(name) if e["t"] > restarted_at]
        assert after[0]["healed"]["source"] == "A" and after[0]["healed"]["bytes"] > 0, after[0]
        assert after[0]["members"] == ["A", "B"] and after[0]["pid"] == (first if name == "B0" else pids[1])
        assert [e["step"] for e in after] == list(range(after[0]["step"], last)), name
        back[name] = after[0]
    assert back["B0"]["step"] == back["B1"]["step"] > max(alone)
    assert back["B0"]["generation"] == back["B1"]["generation"] > records("B0")[0]["generation"]
    # every rank's shard at every step it committed: a run without faults, bit for bit
    for name in ("A0", "A1", "B0", "B1"):
        for e in records(name):
            assert e["digest"] == reference[int(name[1])][e["step"]], (name, e["step"])


FSDP = Path(__file__).resolve().parent / "ft_fsdp_replica.py"


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_an_fsdp2_replica_replaces_a_lost_rank_and_its_sharded_state_is_bit_identical_to_a_run_without_faults(
    tmp_path: Path,
) -> None:
    """Replicas A and B of two ranks each, the model sharded inside each replica with torch FSDP2
    (``fully_shard`` on the CPU over the "aiocoll" backend; tests/integration/ft_fsdp_replica.py).
    kill -9 of B's rank 1 mid-step; A commits on; a new process of B's rank 1 (its own initial
    model) starts; B's two ranks rebuild their group and FSDP model for the new generation and
    heal their sharded state (each parameter's and momentum's local shard) from A's same rank.
    Every rank's sharded state at every step it committed is bit-identical to the same rank's in
    a second run of the same job without the fault."""
    import secrets
    import signal
    import time

    from aiocoll.testing.coordinator import CoordinatorProcess

    token = secrets.token_hex(16)
    coordinator = CoordinatorProcess(tmp_path / "coordinator.log", "--heartbeat-timeout", "5", token=token)
    ranks = Ranks(tmp_path, FSDP, token, preload=TORCH)
    procs, records, wait_for = ranks.procs, ranks.records, ranks.wait_for

    def start(run: str, replica: str, rank: int, seed: int, ahead: bool = False, go: str = "") -> None:
        args = [
            "--coordinator",
            f"127.0.0.1:{coordinator.port}",
            "--until-file",
            str(tmp_path / f"{run}.until"),
        ]
        args += ["--replica", replica, "--rank", str(rank), "--seed", str(seed)]
        if go:
            args += ["--start-file", str(tmp_path / go)]
        name = f"{run}-{replica}{rank}"
        ranks.start(f"{name}-ahead" if ahead else name, args, job=run, files=name)

    def finish(run: str) -> None:
        ranks.finish([n for n in procs if n.startswith(f"{run}-")], 180.0)

    try:
        for replica in "AB":
            for rank in (0, 1):
                start("faulty", replica, rank, 0)
        # Started now and held until their turn with torch loaded: the new process of B's rank 1
        # (another initial model), whose joining soon after the kill keeps A's steps alone few,
        # and the same job without the fault (its own job name), run once the faulty one's last
        # step is known.
        start("faulty", "B", 1, 7, ahead=True, go="replace.go")
        for replica in "AB":
            for rank in (0, 1):
                start("clean", replica, rank, 0, go="clean.go")
        wait_for(
            "both replicas train together",
            lambda: any(
                e["step"] >= SHARDED_KILL_AT and e["members"] == ["A", "B"] for e in records("faulty-A0")
            ),
            240.0,  # four processes starting torch at once on a loaded machine (seen: 59 s to a quorum)
        )
        procs["faulty-B1"].send_signal(signal.SIGKILL)
        killed_at = time.time()
        procs["faulty-B1"].wait(10)
        procs["faulty-B1"] = procs.pop("faulty-B1-ahead")  # its place, once it joins
        wait_for(
            "A trains without B",
            lambda: any(e["t"] > killed_at and e["members"] == ["A"] for e in records("faulty-A1")),
        )
        assert procs["faulty-B0"].poll() is None, ranks.log("faulty-B0")
        replaced_at = time.time()
        (tmp_path / "replace.go").touch()
        wait_for(
            "B's ranks heal",
            lambda: all(
                any(e["healed"] and e["t"] > replaced_at for e in records(f"faulty-{n}"))
                for n in ("B0", "B1")
            ),
            240.0,
        )
        last = max(e["step"] for e in records("faulty-A0")) + SHARDED_MARGIN
        stop_after(tmp_path / "faulty.until", last)
        stop_after(tmp_path / "clean.until", last)
        (tmp_path / "clean.go").touch()
        finish("faulty")
        finish("clean")
    finally:
        ranks.stop()
        coordinator.stop()

    host = socket.gethostname()
    clean = {rank: {e["step"]: e["digest"] for e in records(f"clean-A{rank}")} for rank in (0, 1)}
    for rank in (0, 1):
        assert sorted(clean[rank]) == list(range(len(clean[rank]))) and len(clean[rank]) >= last
        assert [e["digest"] for e in records(f"clean-B{rank}")] == [
            clean[rank][s] for s in range(len(clean[rank]))
        ]
    # A: the same processes, every step committed once, also while B was away
    for name in ("A0", "A1"):
        assert [e["step"] for e in records(f"faulty-{name}")] == list(range(last)), name
        assert len({e["pid"] for e in ranks.all(f"faulty-{name}")}) == 1
    alone = [e["step"] for e in records("faulty-A0") if e["members"] == ["A"]]
    assert alone, "A never committed without B"
    for name in ("A0", "A1", "B0"):
        for e in records(f"faulty-{name}", "failed"):
            assert "replica 'B' rank 1 of 2 (rank " in e["error"] and f"host {host})" in e["error"], e
    # B's rank 0 kept its process; both B ranks healed from A at one step, in a new generation
    assert len({e["pid"] for e in ranks.all("faulty-B0")}) == 1
    assert records("faulty-B0", "error") == []
    back = {}
    for name in ("B0", "B1"):
        after = [e for e in records(f"faulty-{name}") if e["t"] > replaced_at]
        assert after[0]["healed"]["source"] == "A" and after[0]["healed"]["bytes"] > 0, after[0]
        assert [e["step"] for e in after] == list(range(after[0]["step"], last)), name
        back[name] = after[0]
    assert back["B0"]["step"] == back["B1"]["step"] > max(alone)
    assert back["B0"]["generation"] == back["B1"]["generation"] > records("faulty-B0")[0]["generation"]
    # every rank's sharded parameters and momentum at every step it committed: the run without faults
    for name in ("A0", "A1", "B0", "B1"):
        for e in records(f"faulty-{name}"):
            assert e["digest"] == clean[int(name[1])][e["step"]], (name, e["step"])
    # the two ranks hold different shards, and the model trained
    assert clean[0][last - 1] != clean[1][last - 1] and clean[0][0] != clean[0][last - 1]
