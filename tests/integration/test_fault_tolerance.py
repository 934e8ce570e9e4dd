"""Per-step fault tolerance without restart (issue 20, part 2), with real processes on loopback.

One run of examples/fault_tolerant_training.py --demo: a coordinator, three replicas training a
small torch model through aiocoll.ft_torch; one is killed with kill -9 after its step 20 and
restarted a few steps later. Checked from the replicas' records, independently of the demo's own
checks: the survivors commit a step without it within RECOVERY_BOUND seconds of the kill and are
never restarted; every step 0..N-1 is committed once, by the replicas of its quorum, with
bit-identical parameters and momentum on all of them (N: STEPS, or more when the restarted
replica healed late on a loaded machine: the demo has every replica train 20 steps past the
heal); the restarted replica heals from a live one to that same state and trains on; and every
step's parameters equal, bit for bit, a reference run in this process with the same membership
history (gradients summed in rank order and divided by the quorum's size, as the replicas'
shared-memory all_reduce does on one host). What the survivors logged names the lost replica,
its rank and its host.

A second world, of three processes, moves states with the Manager's state transfer: a pytree of
numpy arrays and torch tensors of several dtypes and shapes (0-d, empty, bfloat16, non-contiguous)
with the containers and attributes pickle keeps, from one process to another, compared exactly;
then it broadcasts one from one process to the two others (what a quorum does when every other
member heals from one).

Replicas of several ranks are in test_ft_sharded.py, DiLoCo in test_ft_diloco.py.
"""

from __future__ import annotations

import collections
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ft_common import RECOVERY_BOUND, ROOT, load_script

from aiocoll.testing.world import run_world, unwrap

pytestmark = pytest.mark.integration

EXAMPLE = ROOT / "examples" / "fault_tolerant_training.py"
STEPS, KILL_AT, RESTART_AT = 50, 20, 25

torch = pytest.importorskip("torch")


def _example() -> Any:
    return load_script(EXAMPLE)


def _reference(example: Any, history: list[list[str]]) -> list[str]:
    """The digest after each step of one process doing what the replicas did together."""
    torch.set_num_threads(1)
    model = example.make_model(history[0][0])  # the first quorum takes its first member's model
    optimizer = example.make_optimizer(model)
    params = list(model.parameters())
    digests = []
    for step, members in enumerate(history):
        total = None
        for name in sorted(members):  # quorum rank order
            model.zero_grad()
            example.loss_of(model, name, step).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            total = flat if total is None else total + flat
        assert total is not None
        mean = total / len(members)
        offset = 0
        for p in params:
            p.grad.copy_(mean[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()
        digests.append(example.digest(model, optimizer))
    return digests


@pytest.mark.timeout(300)
def test_three_replicas_survive_a_kill_without_restart_and_heal_the_restarted_one_bit_for_bit(
    tmp_path: Path,
) -> None:
    command = [sys.executable, str(EXAMPLE), "--demo", "--out", str(tmp_path), "--steps", str(STEPS)]
    command += ["--kill-at", str(KILL_AT), "--restart-at", str(RESTART_AT), "--deadline", "240"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))
    assert run.returncode == 0, run.stdout + run.stderr + logs
    assert re.search(
        r"fault-tolerant training: 3 replicas, .* bit-identical parameters at every step", run.stdout
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    records = {
        name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        for name in ("r0", "r1", "r2")
    }
    steps = {name: [e for e in entries if e["event"] == "step"] for name, entries in records.items()}
    last = summary["steps"]
    assert last >= STEPS

    # the survivors: one process each from start to end, every step committed once, in order
    for name in ("r0", "r2"):
        assert len({e["pid"] for e in records[name]}) == 1, name
        assert [e["step"] for e in steps[name]] == list(range(last)), name
    killed_at = summary["killed_at"]
    after = [e for e in steps["r0"] if e["t"] > killed_at]
    first_without = next(e for e in after if "r1" not in e["members"])
    assert first_without["step"] <= KILL_AT + 2  # the step in flight at the kill, or the next
    assert first_without["t"] - killed_at < RECOVERY_BOUND, first_without["t"] - killed_at
    assert summary["recovery_s"] == pytest.approx(first_without["t"] - killed_at)
    # the survivors formed their group over the links of the last one (a sub-group of it, not a
    # new job's world group "w"), and the quorum with the restarted replica made a new one
    assert first_without["group"] == f"q{first_without['quorum']}", first_without

    # the victim: two processes; the second healed from a live replica, then trained to the end
    pids = list(dict.fromkeys(e["pid"] for e in records["r1"]))
    assert len(pids) == 2
    second = [e for e in steps["r1"] if e["pid"] == pids[1]]
    assert second[0]["healed"] is not None and second[0]["healed"]["source"] in ("r0", "r2")
    assert second[0]["healed"]["bytes"] > 0
    assert [e["step"] for e in second] == list(range(second[0]["step"], last))
    assert second[0]["group"] == "w", second[0]
    assert last - second[0]["step"] >= 20

    # every step: committed by exactly its quorum's replicas, bit-identical on all of them
    killed = [e for e in steps["r1"] if e["pid"] == pids[0]]
    history = []
    for step in range(last):
        members = steps["r0"][step]["members"]
        history.append(members)
        entries = [e for name in steps for e in steps[name] if e["step"] == step]
        if killed[-1] in entries and killed[-1]["members"] != members:
            entries.remove(killed[-1])  # it died after its own commit, before the others'
        assert sorted(e["replica"] for e in entries) == sorted(members), step
        assert all(e["members"] == members for e in entries), step
        assert {e["digest"] for e in entries} == {steps["r0"][step]["digest"]}, step
    assert history[0] == ["r0", "r1", "r2"]
    assert history[first_without["step"]] == ["r0", "r2"]
    assert history[second[0]["step"]] == ["r0", "r1", "r2"] == history[-1]

    # the same steps in one process: bit for bit, at every step
    expected = _reference(_example(), history)
    assert [e["digest"] for e in steps["r0"]] == expected

    # what the survivors said: the lost replica by name, rank and host. The next quorum always
    # says whom it left out; a step the kill interrupted failed naming it (a kill between two
    # steps fails no operation: the quorum that follows simply forms without it).
    host = socket.gethostname()
    for name in ("r0", "r2"):
        log = (tmp_path / f"{name}.log").read_text()
        assert re.search(rf"leaves out replica 'r1' \(rank 1 of quorum \d+, host {re.escape(host)}\)", log), (
            log[-3000:]
        )
        for e in (e for e in records[name] if e["event"] == "failed"):
            assert f"replica 'r1' (rank 1, host {host})" in e["error"] and "not committed" in e["error"], e


# ---------------------------------------------------------------------------------------------
# state transfer


def _state(rank: int) -> Any:
    import torch as t

    meta = collections.OrderedDict(w=t.arange(12, dtype=t.float32).reshape(3, 4) + rank)
    meta._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]  (torch's state_dict carries one)
    return {
        "model": meta,
        "bf16": t.linspace(-1, 1, 7, dtype=t.bfloat16) * (rank + 1),
        "strided": (t.arange(20, dtype=t.int64).reshape(4, 5) * (rank + 2)).t(),
        "scalar": t.tensor(3.5 + rank),
        "empty": np.zeros((0, 3), np.float16),
        "zero_d": np.array(7 + rank, np.int32),
        "nested": [np.full((2, 2), rank, np.complex64), ("text", 1 + rank, None), {"flag": True}],
        "big": np.arange(300_000, dtype=np.float64) * (rank + 1),
    }


def _same(a: Any, b: Any) -> bool:
    import torch as t

    if isinstance(a, t.Tensor):
        return isinstance(b, t.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(t.equal(a, b))
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        )
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


async def _state_moves(pg: Any) -> dict[str, Any]:
    """One world of three for both: the transfer from rank 0 to rank 1 (rank 2 joins only its
    barrier), then the broadcast from rank 0 to ranks 1 and 2."""
    return {"transfer": await _transfer(pg), "broadcast": await _broadcast(pg)}


@pytest.fixture(scope="module")
def state_moves() -> list[dict[str, Any]]:
    return unwrap(run_world(_state_moves, 3, timeout=100))


async def _transfer(pg: Any) -> dict[str, Any] | None:
    from aiocoll.ft import pack_state, recv_state, send_state

    if pg.rank == 2:
        await pg.barrier()
        return None
    if pg.rank == 0:
        sent = await send_state(pg, pack_state(_state(0)), 1, 30.0)
        await send_state(pg, pack_state(_state(0)), 1, 30.0)
        await pg.barrier()  # the receiver has taken both (a send completes when handed over)
        return {"sent": sent}
    state, nbytes = await recv_state(pg, 0, 30.0)
    # Again, into the receiver's own state: the arrays at the same path with the same dtype and
    # shape are received in place; the others (another shape, not contiguous) into new ones.
    own = _state(1)
    own["big"] = own["big"][:1000].copy()
    overwrites: list[int] = []
    into, _ = await recv_state(pg, 0, 30.0, into=own, on_overwrite=lambda: overwrites.append(1))
    await pg.barrier()
    return {
        "bytes": nbytes,
        "equal": _same(_state(0), state),
        "metadata": state["model"]._metadata,
        "contiguous": state["strided"].is_contiguous(),
        "into_equal": _same(_state(0), into),
        "in_place": {
            "w": into["model"]["w"].data_ptr() == own["model"]["w"].data_ptr(),
            "bf16": into["bf16"].data_ptr() == own["bf16"].data_ptr(),
            "complex": into["nested"][0] is own["nested"][0],
            "zero_d": into["zero_d"] is own["zero_d"],
            "big": into["big"] is own["big"],
            "strided": into["strided"].data_ptr() == own["strided"].data_ptr(),
        },
        "overwrites": len(overwrites),
    }


@pytest.mark.timeout(120)
def test_state_transfer_moves_a_pytree_of_arrays_and_tensors_exactly(
    state_moves: list[dict[str, Any]],
) -> None:
    sender, receiver, bystander = (rank["transfer"] for rank in state_moves)
    assert bystander is None
    assert receiver["equal"] is True
    assert receiver["metadata"] == {"": {"version": 2}}
    assert receiver["bytes"] == sender["sent"] > 300_000 * 8
    assert receiver["into_equal"] is True
    assert receiver["in_place"] == {
        "w": True,
        "bf16": True,
        "complex": True,
        "zero_d": True,
        "big": False,
        "strided": False,
    }
    assert receiver["overwrites"] == 1


async def _broadcast(pg: Any) -> dict[str, Any]:
    from aiocoll.ft import _single_source, broadcast_state, pack_state

    packed = pack_state(_state(0)) if pg.rank == 0 else None
    state, nbytes = await broadcast_state(pg, packed, 0, 30.0)
    if pg.rank == 0:
        return {"bytes": nbytes, "state": state}
    return {
        "bytes": nbytes,
        "equal": _same(_state(0), state),
        "metadata": state["model"]._metadata,
        # the Manager broadcasts only when every other member heals from one, and they are 3+
        "plans": [
            _single_source({i: s for i, s in enumerate(p) if s >= 0}, len(p))
            for p in ([-1, 0, 0], [1, -1, 1], [-1, 0], [-1, 0, 1], [-1, -1, 0])
        ],
    }


@pytest.mark.timeout(120)
def test_state_broadcast_moves_a_pytree_from_one_rank_to_all_others_exactly(
    state_moves: list[dict[str, Any]],
) -> None:
    sender, *receivers = (rank["broadcast"] for rank in state_moves)
    assert sender["state"] is None
    for receiver in receivers:
        assert receiver["equal"] is True
        assert receiver["metadata"] == {"": {"version": 2}}
        assert receiver["bytes"] == sender["bytes"] > 300_000 * 8
        assert receiver["plans"] == [0, 1, None, None, None]


@pytest.mark.timeout(10)
def test_a_managers_replica_rank_and_size_come_from_the_environment_and_are_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiocoll.ft import Manager

    monkeypatch.setenv("AIOCOLL_REPLICA_SIZE", "3")
    monkeypatch.setenv("AIOCOLL_REPLICA_RANK", "2")
    manager = Manager("127.0.0.1:1", replica="r")  # connects nowhere until start_step
    assert (manager.replica_rank, manager.replica_size) == (2, 3)
    assert (Manager("127.0.0.1:1", replica="r", replica_rank=0, replica_size=1).replica_size) == 1
    monkeypatch.delenv("AIOCOLL_REPLICA_SIZE")
    monkeypatch.delenv("AIOCOLL_REPLICA_RANK")
    assert (Manager("127.0.0.1:1", replica="r").replica_rank, Manager("127.0.0.1:1").replica_size) == (0, 1)
    for rank, size in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match=rf"replica_rank={rank}, replica_size={size}"):
            Manager("127.0.0.1:1", replica="r", replica_rank=rank, replica_size=size)
    monkeypatch.setenv("AIOCOLL_REPLICA_SIZE", "two")
    with pytest.raises(ValueError, match="AIOCOLL_REPLICA_SIZE"):
        Manager("127.0.0.1:1", replica="r")
    assert Manager("127.0.0.1:1", replica="r", replica_size=1).replace_timeout == 0.0
    assert Manager("127.0.0.1:1", replica="r", replica_size=1, replace_timeout=30).replica_generation == 0
    for bad in (-1, "5", True):
        with pytest.raises(ValueError, match="replace_timeout"):
            Manager("127.0.0.1:1", replica="r", replica_size=1, replace_timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"replace_timeout \(90 s\) must be less than quorum_timeout"):
        Manager("127.0.0.1:1", replica="r", replica_size=2, replace_timeout=90, quorum_timeout=60)


# ---------------------------------------------------------------------------------------------
# a short chaos soak

SOAK = ROOT / "scripts" / "ft_soak.py"


@pytest.mark.timeout(240)
def test_a_short_chaos_soak_kills_and_restarts_replicas_with_no_inconsistent_commit_and_no_hang() -> None:
    """Three replicas, one killed (kill -9) and restarted every 5 s for 20 s: every step's
    parameters hash the same on every replica that committed it, commits never stop for 30 s,
    every replica stops at the end, and the restarted ones heal."""
    command = [sys.executable, str(SOAK), "--replicas", "3", "--kill-every", "5", "--minutes", "0.34"]
    command += ["--params", "1000", "--compute-ms", "20", "--no-baseline", "--seed", "1"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "inconsistent commits: 0" in run.stdout and "hangs: 0" in run.stdout, run.stdout
    kills = int(re.search(r"\((\d+) kills\)", run.stdout).group(1))  # type: ignore[union-attr]
    heals = int(re.search(r"heals: (\d+)", run.stdout).group(1))  # type: ignore[union-attr]
    assert kills >= 3 and heals >= 1, run.stdout


_RESTORING = """
import asyncio, sys
import numpy as np
import aiocoll.ft

async def main(coordinator, name, restore, steps, least):
    state = {"w": np.zeros(4)}
    manager = aiocoll.ft.Manager(
        coordinator, replica=name, job="restored", min_replicas=least, join_timeout=2, quorum_timeout=60,
        state_dict=lambda: state, load_state_dict=state.update,
    )
    if restore >= 0:
        state["w"][:] = restore  # the checkpoint saved after step restore - 1: what it had then
        manager.restore(restore)
    try:
        while manager.step < steps:
            await manager.start_step()
            grad = np.ones(4)
            await manager.all_reduce_mean([grad])
            if await manager.commit():
                state["w"] += grad
        print("trained", manager.step, state["w"].tolist(), flush=True)
    except aiocoll.ft.QuorumError as exc:
        print("refused", exc, flush=True)
    await manager.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])))
"""


@pytest.mark.timeout(180)
def test_a_job_restarted_from_a_checkpoint_under_its_name_goes_back_to_its_step_only_when_restored(
    tmp_path: Path,
) -> None:
    """A replica commits steps 0..3 and stops. Restarted from a checkpoint of step 1 with
    Manager.restore, it trains steps 1..3 again on the same coordinator, which remembers step 3;
    restarted from its initial state without it, it is refused, saying how to restore. (Several
    replicas, one of them not restored: test_server_quorum.py.)"""
    from aiocoll.testing.coordinator import CoordinatorProcess

    token = "restore-test-token"
    coordinator = CoordinatorProcess(tmp_path / "coordinator.log", token=token)

    def run(*replicas: tuple[str, int, int, int]) -> list[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIOCOLL_")}
        env["AIOCOLL_TOKEN"] = token
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _RESTORING, f"127.0.0.1:{coordinator.port}", name, *map(str, rest)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for name, *rest in replicas
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        return [out.strip().splitlines()[-1] for out in outs]

    try:
        assert run(("a", -1, 4, 1)) == ["trained 4 [4.0, 4.0, 4.0, 4.0]"]
        assert run(("a", 1, 4, 1)) == ["trained 4 [4.0, 4.0, 4.0, 4.0]"]
        [said] = run(("a", -1, 4, 1))
    finally:
        coordinator.stop()
    # (the coordinator knows the step the last quorum formed at, 3: steps 0..2 were committed)
    assert (
        said.startswith("refused") and "committed steps 0..2" in said and "Manager.restore(step)" in said
    ), said
