"""The survivors' next group, inside Managers, when their agreement over the links they hold fails.

Four one-rank replicas (tests/integration/ft_regroup_replica.py: a numpy model whose every step
is the same, bit for bit, as a run without faults) train with a coordinator. D is killed with
kill -9; A, B and C are the next quorum, the same processes as in their last group, so they form
their group over its links (``ProcessGroup._survivors_group``), but C kills itself as it enters
that agreement. A and B's agreement fails; each makes its next group through the coordinator
instead, and they train on as a quorum of two within RECOVERY_BOUND of the kill. D restarted
heals from one of them; killed again, A and B form their group over the links of the group made
through the coordinator. Every step is committed once, in order, by A and B (one process each
from start to end), and every replica's model after every step it committed is bit-identical to
a run without faults.
"""

from __future__ import annotations

import secrets
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from ft_common import RECOVERY_BOUND, Ranks, load_script, stop_after

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parent / "ft_regroup_replica.py"
KILL_AT = 5


@pytest.mark.timeout(180)
def test_a_failed_survivors_agreement_falls_back_to_the_coordinator_and_training_goes_on_bit_for_bit(
    tmp_path: Path,
) -> None:
    from aiocoll.testing.coordinator import CoordinatorProcess

    replica = load_script(SCRIPT)
    token = secrets.token_hex(16)
    coordinator = CoordinatorProcess(tmp_path / "coordinator.log", "--heartbeat-timeout", "5", token=token)
    until = tmp_path / "until"
    ranks = Ranks(tmp_path, SCRIPT, token)
    procs, steps, wait_for = ranks.procs, ranks.records, ranks.wait_for

    def start(name: str, *extra: str) -> None:
        args = ["--coordinator", f"127.0.0.1:{coordinator.port}", "--until-file", str(until)]
        ranks.start(name, [*args, "--replica", name, *extra])

    def committed(name: str, members: list[str], since: float) -> list[dict[str, Any]]:
        return [e for e in steps(name) if e["t"] > since and e["members"] == members]

    try:
        for name in "ABD":
            start(name)
        start("C", "--die-in-agreement")
        wait_for(
            "the four replicas train together",
            lambda: any(e["step"] >= KILL_AT and e["members"] == list("ABCD") for e in steps("A")),
        )
        procs["D"].send_signal(signal.SIGKILL)
        killed_at = time.time()
        procs["D"].wait(10)
        wait_for("C dies in the survivors' agreement", lambda: procs["C"].poll() is not None, 30.0)
        assert procs["C"].returncode == -signal.SIGKILL, ranks.log("C")
        (agreement,) = ranks.records("C", "agreement")
        assert agreement["ranks"] == [0, 1, 2], agreement  # A, B and C of the group of four
        wait_for("A and B train on as two", lambda: committed("A", ["A", "B"], killed_at), 30.0)
        first = committed("A", ["A", "B"], killed_at)[0]
        assert first["t"] - killed_at < RECOVERY_BOUND, first["t"] - killed_at
        # no step was committed by A, B and C: their group never formed
        assert not any(e["t"] > killed_at and e["members"] == list("ABC") for e in steps("A") + steps("B"))
        # A and B made the group of two through the coordinator (a new job's world group), not a
        # sub-group of the last one; each said why
        assert first["group"] == "w", first
        for name in "AB":
            text = (tmp_path / f"{name}.log").read_text()
            assert f"joining quorum {agreement['gid'][1:]} failed" in text, text[-3000:]

        start("D")  # a new process of D: it heals from A or B
        wait_for("D heals and trains with A and B", lambda: committed("A", list("ABD"), killed_at), 60.0)
        # A can record the step before D does (each replica writes its own record after the commit)
        wait_for("D records its first step", lambda: committed("D", list("ABD"), killed_at), 30.0)
        healed = [e for e in steps("D") if e["t"] > killed_at]
        assert healed[0]["healed"] is not None and healed[0]["healed"]["source"] in ("A", "B"), healed[0]
        procs["D"].send_signal(signal.SIGKILL)
        killed_again = time.time()
        procs["D"].wait(10)
        wait_for("A and B train on as two again", lambda: committed("A", ["A", "B"], killed_again), 30.0)
        # this time over the links of the group they made through the coordinator
        again = committed("A", ["A", "B"], killed_again)[0]
        assert again["group"] == f"q{again['quorum']}", again
        assert again["t"] - killed_again < RECOVERY_BOUND, again["t"] - killed_again

        last = max(e["step"] for e in steps("A")) + 3
        stop_after(until, last)
        ranks.finish(["A", "B"])
    finally:
        ranks.stop()
        coordinator.stop()

    # A and B: one process each, every step committed once, in order
    for name in "AB":
        assert len({e["pid"] for e in ranks.all(name)}) == 1, name
        assert [e["step"] for e in steps(name)] == list(range(last)), name
    # every replica's model after every step it committed: bit-identical to a run without faults
    w = replica.initial()
    reference = []
    for step in range(last):
        w -= 0.1 * replica.gradient(step)
        reference.append(replica.digest(w))
    for name in "ABCD":
        for e in steps(name):
            assert e["digest"] == reference[e["step"]], (name, e)
