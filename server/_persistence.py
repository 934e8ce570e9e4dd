"""The coordinator's snapshot-and-replay part: the whole durable state as plain msgpack-able data,
and rebuilding it from a snapshot plus the journal records written after it. Each part writes and
reads its own section (keys, the completed round, client memories); this module only puts them
together and routes each journal record to the part that wrote it. Sans-IO; imports the parts.

The record format is the journal's (server/_journal.py holds the files): ``set``, ``del``,
``append`` (key-value), ``round``, ``gone`` (rendezvous), ``req`` (a numbered mutation with its
reply and its own records), ``drop`` (a job expired).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._dedupe import Dedupe
from ._membership import Membership
from ._model import Record

if TYPE_CHECKING:
    from ._state import CoordinatorState

__all__ = ["apply_record", "restore", "snapshot"]

SNAPSHOT_FORMAT = 1


def snapshot(state: CoordinatorState) -> dict[str, Any]:
    """The whole durable state: each job's keys, next round number, completed round and the
    replies kept for its clients."""
    jobs = []
    for j in state.jobs.values():
        jobs.append(
            {
                "name": j.name,
                "kv": j.kv,
                "next_round": j.next_round,
                "round": Membership.snapshot(j),
                "clients": Dedupe.snapshot(j),
            }
        )
    return {"format": SNAPSHOT_FORMAT, "jobs": jobs}


def restore(state: CoordinatorState, snap: dict[str, Any] | None, records: list[Record]) -> None:
    """Rebuild from a snapshot plus the journal records after it; members start ``resuming``."""
    now = state.clock()
    durable, state.durable = state.durable, False  # replay must not re-journal
    try:
        for jd in (snap or {}).get("jobs", []):
            job = state.job(jd["name"], now)
            job.kv.update(jd["kv"])
            job.next_round = jd["next_round"]
            rd = jd["round"]
            if rd is not None:
                state.membership.restore_round(
                    job, rd["number"], rd["world_size"], rd["members"], rd["broken"]
                )
            Dedupe.restore(job, jd.get("clients", []), now)
        for rec in records:
            apply_record(state, rec)
    finally:
        state.durable = durable
    state.membership.restored(now)


def apply_record(state: CoordinatorState, rec: Record) -> None:
    """Replay one journal record, as a live mutation wrote it.

    Raises:
        ValueError: for a record kind no part knows.
    """
    kind, name = rec[0], rec[1]
    now = state.clock()
    if kind == "drop":
        job = state.jobs.get(name)
        if job is not None:
            state.drop_job(job)
        return
    job = state.job(name, now)
    if kind == "req":
        Dedupe.apply(job, rec, now, lambda sub: apply_record(state, sub))
    elif not (state.kv.apply(job, rec) or state.membership.apply(job, rec)):
        raise ValueError(f"unknown journal record kind {kind!r}")
