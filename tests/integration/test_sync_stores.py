"""aiocoll.sync's torch-style stores behave like torch.distributed's.

The same sequence of store calls runs against torch's TCPStore, HashStore, FileStore and
PrefixStore and against aiocoll.sync's, and the answers are compared one by one. TCPStore here
is served by a real aiocoll coordinator on loopback, started by the ``is_master`` instance.
"""

from __future__ import annotations

import datetime
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import aiocoll
import aiocoll.sync as sync

pytestmark = [pytest.mark.integration, pytest.mark.torch, pytest.mark.timeout(60)]
tdist = pytest.importorskip("torch.distributed")

SHORT = datetime.timedelta(seconds=0.3)


@pytest.fixture(autouse=True)
def _token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOCOLL_TOKEN", "store-test")


def exercise(store: Any) -> dict[str, Any]:
    """Every store method, in an order that exercises their edge cases."""
    out: dict[str, Any] = {}
    store.set("a", "1")
    out["get"] = store.get("a")
    store.set("bytes", b"\x00\xff")
    out["get/bytes"] = store.get("bytes")
    out["add/new"] = store.add("counter", 5)
    out["add/again"] = store.add("counter", -2)
    out["get/counter"] = store.get("counter")
    out["compare_set/match"] = store.compare_set("a", "1", "2")
    out["compare_set/mismatch"] = store.compare_set("a", "x", "3")
    out["compare_set/missing"] = store.compare_set("nokey", "x", "3")
    out["compare_set/missing_empty"] = store.compare_set("fresh", "", "new")
    out["check/present"] = store.check(["a", "counter"])
    out["check/absent"] = store.check(["a", "never"])
    out["num_keys"] = store.num_keys()
    out["delete_key"] = store.delete_key("a")
    out["delete_key/missing"] = store.delete_key("a")
    out["check/deleted"] = store.check(["a"])
    store.multi_set(["m1", "m2"], ["v1", b"v2"])
    out["multi_get"] = store.multi_get(["m1", "m2", "bytes"])
    store.append("log", "x")
    store.append("log", b"y")
    out["append"] = store.get("log")
    out["num_keys/after"] = store.num_keys()
    store.wait(["m1", "log"])
    store.wait(["m1"], SHORT)
    store.set_timeout(SHORT)
    out["timeout"] = store.timeout
    for what, call in (
        ("get", lambda: store.get("missing")),
        ("wait", lambda: store.wait(["missing"], SHORT)),
    ):
        started = time.monotonic()
        try:
            call()
            out[f"{what}/missing"] = "no error"
        except RuntimeError as exc:  # torch's DistStoreError and aiocoll's StoreTimeout both are
            out[f"{what}/missing"] = "RuntimeError"
            out[f"{what}/missing/took_under_10s"] = time.monotonic() - started < 10
            out[f"{what}/missing/named"] = "missing" in str(exc) or "timeout" in str(exc).lower()
    return out


def _assert_same(theirs: dict[str, Any], ours: dict[str, Any], differences: tuple[str, ...] = ()) -> None:
    assert set(theirs) == set(ours)
    diffs = [
        f"{k}: torch {theirs[k]!r} vs aiocoll {ours[k]!r}"
        for k in theirs
        if k not in differences and theirs[k] != ours[k]
    ]
    assert not diffs, "\n".join(diffs)


def test_tcp_store_answers_like_torch() -> None:
    theirs = tdist.TCPStore(
        "127.0.0.1", 0, world_size=1, is_master=True, timeout=datetime.timedelta(seconds=10)
    )
    ours = sync.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=datetime.timedelta(seconds=10))
    try:
        assert ours.port > 0 and ours.host == "127.0.0.1"
        _assert_same(exercise(theirs), exercise(ours))
    finally:
        ours.close()


def test_hash_store_answers_like_torch() -> None:
    _assert_same(exercise(tdist.HashStore()), exercise(sync.HashStore()))


def test_file_store_answers_like_torch(tmp_path: Path) -> None:
    # torch's FileStore reports a deleted key as deleted again, and counts keys differently from
    # its own other stores; aiocoll's FileStore keeps the HashStore answers there.
    _assert_same(
        exercise(tdist.FileStore(str(tmp_path / "torch"), 1)),
        exercise(sync.FileStore(str(tmp_path / "aiocoll"), 1)),
        differences=("delete_key/missing", "num_keys", "num_keys/after"),
    )


def test_prefix_store_answers_like_torch_over_ours_and_over_torch_stores() -> None:
    theirs = exercise(tdist.PrefixStore("p", tdist.HashStore()))
    _assert_same(theirs, exercise(sync.PrefixStore("p", sync.HashStore())))
    # Over a torch store, through the adapter that runs torch's blocking calls off the loop.
    _assert_same(theirs, exercise(sync.PrefixStore("p", tdist.HashStore())))


def test_prefix_store_keys_land_under_the_prefix() -> None:
    base = sync.HashStore()
    sync.PrefixStore("job", base).set("k", "v")
    assert base.get("job/k") == b"v"
    assert not base.check(["k"])


def test_tcp_store_master_waits_for_world_size_workers() -> None:
    master_box: dict[str, Any] = {}

    def start_master() -> None:
        master_box["store"] = sync.TCPStore("127.0.0.1", port, world_size=2, is_master=True, timeout=timeout)

    timeout = datetime.timedelta(seconds=20)
    probe = sync.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout)
    port = probe.port
    probe.close()
    master = threading.Thread(target=start_master)
    master.start()
    time.sleep(0.2)
    assert master.is_alive(), "the master must still be waiting for the second worker"
    worker = sync.TCPStore("127.0.0.1", port, world_size=2, is_master=False, timeout=timeout)
    master.join(20)
    assert not master.is_alive()
    try:
        worker.set("from_worker", "hi")
        assert master_box["store"].get("from_worker") == b"hi"
        assert master_box["store"].get("init/") == b"2"
    finally:
        worker.close()
        master_box["store"].close()


def test_tcp_store_master_without_workers_fails_naming_the_count() -> None:
    started = time.monotonic()
    with pytest.raises(aiocoll.StoreTimeout, match="1 of 3"):
        sync.TCPStore("127.0.0.1", 0, world_size=3, is_master=True, timeout=datetime.timedelta(seconds=1))
    assert time.monotonic() - started < 15


def test_store_wait_that_runs_out_raises_store_timeout_naming_the_keys() -> None:
    store = sync.HashStore()
    store.set("here", "1")
    with pytest.raises(aiocoll.StoreTimeout) as info:
        store.wait(["here", "absent"], datetime.timedelta(seconds=0.2))
    assert info.value.keys == ["absent"]
    assert isinstance(info.value, TimeoutError)
