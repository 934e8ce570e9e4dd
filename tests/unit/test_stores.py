"""The store conformance suite against MemoryStore, FileStore and PrefixStore, plus what is
particular to each (file cleanup, prefix isolation)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aiocoll import FileStore, MemoryStore, PrefixStore, Store, StoreError, StoreTimeout
from aiocoll.testing.store_conformance import StoreConformance, StoreFactory


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    async def store_factory(self) -> AsyncIterator[StoreFactory]:
        shared = MemoryStore()

        async def make() -> Store:
            return shared

        yield make
        await shared.aclose()


class TestFileStore(StoreConformance):
    @pytest.fixture
    async def store_factory(self, tmp_path: Path) -> AsyncIterator[StoreFactory]:
        made: list[FileStore] = []

        async def make() -> Store:
            made.append(await FileStore.open(tmp_path / "store"))
            return made[-1]

        yield make
        for store in made:
            await store.aclose()
        assert not (tmp_path / "store").exists(), "the last user to close must remove the file"


class TestPrefixStore(StoreConformance):
    @pytest.fixture
    async def store_factory(self) -> AsyncIterator[StoreFactory]:
        shared = MemoryStore()

        async def make() -> Store:
            return PrefixStore("group/7", shared)

        yield make


@pytest.mark.timeout(30)
async def test_prefix_store_keeps_keys_under_its_prefix_and_apart_from_others() -> None:
    base = MemoryStore(timeout=0.2)
    a, b = PrefixStore("a", base), PrefixStore("b", base)
    await a.set("k", b"from-a")
    await b.set("k", b"from-b")
    assert await base.get("a/k") == b"from-a"
    assert await a.get("k") == b"from-a"
    assert await b.get("k") == b"from-b"
    assert await PrefixStore("a", a).check(["k"]) is False
    with pytest.raises(StoreTimeout) as info:
        await a.wait(["missing"])
    assert info.value.keys == ["missing"], "the caller's key, not the prefixed one"
    a.set_timeout(3)
    assert base.timeout == 3


@pytest.mark.timeout(30)
async def test_file_store_removes_the_file_only_when_the_last_user_closes(tmp_path: Path) -> None:
    path = tmp_path / "rdzv"
    first = await FileStore.open(path)
    second = await FileStore.open(path)
    await first.set("k", b"v")
    await first.aclose()
    assert path.exists()
    assert await second.get("k") == b"v"
    await second.aclose()
    assert not path.exists()
    with pytest.raises(StoreError, match="closed"):
        await second.get("k")


@pytest.mark.timeout(30)
async def test_file_store_with_world_size_keeps_the_file_until_that_many_closed(tmp_path: Path) -> None:
    path = tmp_path / "rdzv"
    first = await FileStore.open(path, world_size=2)
    await first.set("early", b"1")
    await first.aclose()
    assert path.exists(), "one of two users closed: a late joiner must still find the keys"
    second = await FileStore.open(path, world_size=2)
    assert await second.get("early") == b"1"
    await second.aclose()
    assert not path.exists()


@pytest.mark.timeout(30)
async def test_file_store_reopened_after_removal_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "rdzv"
    async with await FileStore.open(path) as store:
        await store.set("old", b"x")
    async with await FileStore.open(path, timeout=0.1) as store:
        assert await store.num_keys() == 0


@pytest.mark.timeout(30)
async def test_file_store_refuses_a_file_it_did_not_write(tmp_path: Path) -> None:
    path = tmp_path / "foreign"
    path.write_bytes(b"this is not a store log at all")
    store = FileStore(path, timeout=0.2)
    with pytest.raises(StoreError, match=r"torn record|unknown record"):
        await store.set("k", b"v")
    os.unlink(path)


@pytest.mark.timeout(30)
async def test_store_timeout_must_be_finite() -> None:
    with pytest.raises(ValueError, match="finite"):
        MemoryStore(timeout=None)  # type: ignore[arg-type]
