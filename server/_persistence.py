"""The coordinator's snapshot-and-replay part: the whole durable state as plain msgpack-able data,
and rebuilding it from a snapshot plus the journal records written after it. Each part writes and
reads its own section (keys, the completed round, client memories); this module only puts them
together and routes each journal record to the part that wrote it. Sans-IO; imports the parts
(_kv, _membership, _dedupe) and _model.

The record format is the journal's (server/_journal.py holds the files): ``set``, ``del``,
``append`` (key-value), ``round``, ``gone`` (rendezvous), ``req`` (a numbered mutation with its
reply and its own records), ``drop`` (a job expired).

It is handed the state as a ``Durable`` (what snapshot and replay read and call), so it never
imports the dispatcher (_state) that calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ._dedupe import Dedupe
from ._kv import KeyValue
from ._membership import Membership
from ._model import Job, Record

__all__ = ["Durable", "apply_record", "restore", "snapshot"]

SNAPSHOT_FORMAT = 1


class Durable(Protocol):
    """What snapshot and replay need of the coordinator's state (CoordinatorState is one): its
    clock and jobs, the parts that own a section, and making and dropping a job."""

    clock: Callable[[], float]
    durable: bool
    jobs: dict[str, Job]
    kv: KeyValue
    membership: Membership

    def job(self, name: str, now: float) -> Job: ...

    def drop_job(self, job: Job) -> None: ...


def snapshot(jobs: dict[str, Job]) -> dict[str, Any]:
    """The whole durable state: each job's keys, next round number, completed round and the
    replies kept for its clients, each section written by the part that owns it."""
    return {
        "format": SNAPSHOT_FORMAT,
        "jobs": [
            {
                "name": j.name,
                "kv": KeyValue.snapshot(j),
                "next_round": j.next_round,
                "round": Membership.snapshot(j),
                "clients": Dedupe.snapshot(j),
            }
            for j in jobs.values()
        ],
    }


def restore(state: Durable, snap: dict[str, Any] | None, records: list[Record]) -> None:
    """Rebuild from a snapshot plus the journal records after it; members start ``resuming``."""
    now = state.clock()
    durable, state.durable = state.durable, False  # replay must not re-journal
    try:
        for jd in (snap or {}).get("jobs", []):
            job = state.job(jd["name"], now)
            KeyValue.restore(job, jd["kv"])
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


def apply_record(state: Durable, rec: Record) -> None:
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
