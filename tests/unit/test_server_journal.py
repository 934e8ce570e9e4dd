"""The coordinator's durable journal on a temporary directory: records survive reopening, a torn
tail is cut, and a snapshot hides the records it covers (no double-applied appends)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from aiocoll.server import CoordinatorState
from aiocoll.server._journal import Journal

pytestmark = pytest.mark.timeout(20)


def restored(path: Path) -> CoordinatorState:
    journal = Journal(str(path))
    snap, records = journal.load()
    journal.close()
    state = CoordinatorState(clock=lambda: 0.0)
    state.restore(snap, records)
    return state


def test_records_survive_reopening(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path))
    assert journal.load() == (None, [])
    journal.write(journal.encode([["set", "j", "a", b"1"], ["append", "j", "log", b"x"]]))
    journal.write(journal.encode([["append", "j", "log", b"y"], ["set", "k", "b", b"2"]]))
    journal.close()
    state = restored(tmp_path)
    assert state.jobs["j"].kv == {"a": b"1", "log": b"xy"}
    assert state.jobs["k"].kv == {"b": b"2"}


def test_torn_tail_is_cut_and_earlier_records_kept(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path))
    journal.load()
    journal.write(journal.encode([["set", "j", "a", b"1"]]))
    journal.write(journal.encode([["set", "j", "b", b"2"]]))
    journal.close()
    path = tmp_path / "journal"
    data = path.read_bytes()
    path.write_bytes(data[:-3])  # a crash in the middle of the second record
    state = restored(tmp_path)
    assert state.jobs["j"].kv == {"a": b"1"}
    # The cut file accepts new records after the good prefix.
    journal = Journal(str(tmp_path))
    journal.load()
    journal.write(journal.encode([["set", "j", "c", b"3"]]))
    journal.close()
    assert restored(tmp_path).jobs["j"].kv == {"a": b"1", "c": b"3"}


def test_snapshot_covers_earlier_records_even_if_the_journal_was_not_truncated(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path))
    journal.load()
    journal.write(journal.encode([["append", "j", "log", b"a"], ["append", "j", "log", b"b"]]))
    old_journal = (tmp_path / "journal").read_bytes()
    state = CoordinatorState(clock=lambda: 0.0)
    state.restore(None, [["append", "j", "log", b"a"], ["append", "j", "log", b"b"]])
    journal.install_snapshot(journal.encode_snapshot(state.snapshot()))
    journal.write(journal.encode([["append", "j", "log", b"c"]]))
    journal.close()
    assert restored(tmp_path).jobs["j"].kv == {"log": b"abc"}
    # Simulate a crash between the snapshot's rename and the journal's truncation.
    new_records = (tmp_path / "journal").read_bytes()
    (tmp_path / "journal").write_bytes(old_journal + new_records)
    assert restored(tmp_path).jobs["j"].kv == {"log": b"abc"}


def test_unreadable_snapshot_refuses_to_start(tmp_path: Path) -> None:
    (tmp_path / "snapshot").write_bytes(b"\xc1garbage")
    with pytest.raises(ValueError, match="snapshot"):
        Journal(str(tmp_path)).load()
    assert os.path.exists(tmp_path / "snapshot")  # never deleted behind the operator's back
