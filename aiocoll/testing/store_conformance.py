"""One conformance suite for every aiocoll Store: memory, file, prefix, coordinator.

Part of the public testing surface; imports pytest and aiocoll's foundations (errors, stores)
only. Write a test class that inherits ``StoreConformance`` and defines a ``store_factory``
fixture: an async callable that returns a new client of one shared, empty store (every call must
see the same data, so the suite can check visibility across clients); the fixture closes what it
made. Every test then runs against that store, which keeps the stores' behaviour identical by
construction.

    class TestMemoryStore(StoreConformance):
        @pytest.fixture
        async def store_factory(self):
            shared = MemoryStore()
            async def make():
                return shared
            yield make
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from .._errors import StoreError, StoreTimeout
from ..stores import Store

__all__ = ["StoreConformance", "StoreFactory"]

StoreFactory = Callable[[], Awaitable[Store]]

# Short enough to keep the suite quick, long enough for a loaded 2-core machine to answer.
_SHORT = 0.3


class StoreConformance:
    """Mixin of behaviour tests; subclasses provide the ``store_factory`` fixture."""

    @pytest.fixture
    async def store(self, store_factory: StoreFactory) -> Store:
        return await store_factory()

    @pytest.mark.timeout(30)
    async def test_set_then_get_returns_the_bytes(self, store: Store) -> None:
        await store.set("alpha", b"\x00\x01value")
        assert await store.get("alpha") == b"\x00\x01value"

    @pytest.mark.timeout(30)
    async def test_str_value_is_stored_as_utf8(self, store: Store) -> None:
        await store.set("text", "grüße")
        assert await store.get("text") == "grüße".encode()

    @pytest.mark.timeout(30)
    async def test_empty_binary_and_large_values_round_trip(self, store: Store) -> None:
        big = bytes(range(256)) * 4096  # 1 MiB
        await store.multi_set(["empty", "binary"], [b"", bytes(range(256))])
        await store.set("big", big)
        assert await store.get("empty") == b""
        assert await store.get("binary") == bytes(range(256))
        assert await store.get("big") == big

    @pytest.mark.timeout(30)
    async def test_set_replaces_the_previous_value(self, store: Store) -> None:
        await store.set("k", b"first")
        await store.set("k", b"second")
        assert await store.get("k") == b"second"

    @pytest.mark.timeout(30)
    async def test_set_by_one_client_is_seen_by_another(self, store_factory: StoreFactory) -> None:
        first, second = await store_factory(), await store_factory()
        await first.set("shared", b"from-first")
        assert await second.get("shared") == b"from-first"

    @pytest.mark.timeout(30)
    async def test_get_waits_for_a_key_set_later_by_another_client(self, store_factory: StoreFactory) -> None:
        waiter, setter = await store_factory(), await store_factory()

        async def set_later() -> None:
            await asyncio.sleep(0.1)
            await setter.set("late", b"here")

        task = asyncio.ensure_future(set_later())
        assert await waiter.get("late") == b"here"
        await task

    @pytest.mark.timeout(30)
    async def test_get_of_a_missing_key_raises_store_timeout_naming_it(self, store: Store) -> None:
        store.set_timeout(_SHORT)
        with pytest.raises(StoreTimeout) as info:
            await store.get("never-set")
        assert info.value.keys == ["never-set"]
        assert "never-set" in str(info.value)
        assert isinstance(info.value, TimeoutError)

    @pytest.mark.timeout(30)
    async def test_set_timeout_changes_the_default_wait(self, store: Store) -> None:
        store.set_timeout(0.05)
        assert store.timeout == pytest.approx(0.05)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(StoreTimeout):
            await store.get("missing")
        # Not a hang: the short timeout took effect (generous bound for a loaded machine).
        assert loop.time() - started < 10
        with pytest.raises(ValueError):
            store.set_timeout(-1)

    @pytest.mark.timeout(30)
    async def test_add_starts_from_zero_and_returns_the_new_total(self, store: Store) -> None:
        assert await store.add("counter", 5) == 5
        assert await store.add("counter", -2) == 3
        assert await store.add("counter", 0) == 3
        assert await store.get("counter") == b"3"

    @pytest.mark.timeout(60)
    async def test_concurrent_adds_from_many_clients_count_every_call(
        self, store_factory: StoreFactory
    ) -> None:
        clients = [await store_factory() for _ in range(4)]
        results = await asyncio.gather(*(c.add("total", 1) for c in clients for _ in range(25)))
        assert sorted(results) == list(range(1, 101))
        assert await clients[0].get("total") == b"100"

    @pytest.mark.timeout(30)
    async def test_add_on_a_non_integer_value_raises_store_error_naming_the_key(self, store: Store) -> None:
        await store.set("word", b"hello")
        with pytest.raises(StoreError, match="word"):
            await store.add("word", 1)
        assert await store.get("word") == b"hello"

    @pytest.mark.timeout(30)
    async def test_compare_set_on_a_missing_key_with_empty_expected_sets_desired(self, store: Store) -> None:
        assert await store.compare_set("cas", b"", b"new") == b"new"
        assert await store.get("cas") == b"new"

    @pytest.mark.timeout(30)
    async def test_compare_set_on_a_missing_key_with_other_expected_sets_nothing(self, store: Store) -> None:
        assert await store.compare_set("cas", b"old", b"new") == b"old"
        assert not await store.check(["cas"])

    @pytest.mark.timeout(30)
    async def test_compare_set_swaps_only_when_the_value_matches(self, store: Store) -> None:
        await store.set("cas", b"one")
        assert await store.compare_set("cas", b"wrong", b"two") == b"one"
        assert await store.get("cas") == b"one"
        assert await store.compare_set("cas", "one", "two") == b"two"
        assert await store.get("cas") == b"two"

    @pytest.mark.timeout(30)
    async def test_wait_returns_once_every_key_exists(self, store_factory: StoreFactory) -> None:
        waiter, setter = await store_factory(), await store_factory()
        task = asyncio.ensure_future(waiter.wait(["w1", "w2"], timeout=20))
        await setter.set("w1", b"1")
        await asyncio.sleep(0.05)
        assert not task.done()
        await setter.set("w2", b"2")
        await task

    @pytest.mark.timeout(30)
    async def test_wait_timeout_names_only_the_missing_keys(self, store: Store) -> None:
        await store.set("present", b"")
        with pytest.raises(StoreTimeout) as info:
            await store.wait(["present", "absent-1", "absent-2"], timeout=_SHORT)
        assert sorted(info.value.keys) == ["absent-1", "absent-2"]
        assert "absent-1" in str(info.value)

    @pytest.mark.timeout(30)
    async def test_wait_with_no_timeout_uses_the_store_timeout(self, store: Store) -> None:
        store.set_timeout(_SHORT)
        with pytest.raises(StoreTimeout):
            await store.wait(["absent"])

    @pytest.mark.timeout(30)
    async def test_check_is_true_only_when_every_key_exists(self, store: Store) -> None:
        await store.set("c1", b"x")
        assert await store.check(["c1"])
        assert not await store.check(["c1", "c2"])
        assert await store.check([])

    @pytest.mark.timeout(30)
    async def test_delete_key_reports_whether_the_key_existed(self, store: Store) -> None:
        await store.set("gone", b"x")
        assert await store.delete_key("gone") is True
        assert await store.delete_key("gone") is False
        assert not await store.check(["gone"])

    @pytest.mark.timeout(30)
    async def test_num_keys_counts_new_keys_once_and_forgets_deleted_ones(self, store: Store) -> None:
        before = await store.num_keys()
        await store.set("n1", b"a")
        await store.set("n1", b"b")
        await store.add("n2", 1)
        assert await store.num_keys() == before + 2
        await store.delete_key("n1")
        assert await store.num_keys() == before + 1

    @pytest.mark.timeout(30)
    async def test_multi_set_then_multi_get_round_trips_in_order(self, store: Store) -> None:
        await store.multi_set(["m3", "m1", "m2"], [b"three", "one", b""])
        assert await store.multi_get(["m1", "m2", "m3", "m1"]) == [b"one", b"", b"three", b"one"]

    @pytest.mark.timeout(30)
    async def test_multi_get_names_the_missing_keys_when_it_times_out(self, store: Store) -> None:
        store.set_timeout(_SHORT)
        await store.set("here", b"")
        with pytest.raises(StoreTimeout) as info:
            await store.multi_get(["here", "not-here"])
        assert info.value.keys == ["not-here"]

    @pytest.mark.timeout(30)
    async def test_multi_set_with_mismatched_lengths_raises_value_error(self, store: Store) -> None:
        with pytest.raises(ValueError, match="2 keys but 1 values"):
            await store.multi_set(["a", "b"], [b"only-one"])
        assert not await store.check(["a"])

    @pytest.mark.timeout(30)
    async def test_append_creates_then_extends(self, store: Store) -> None:
        await store.append("log", b"ab")
        await store.append("log", "cd")
        assert await store.get("log") == b"abcd"

    @pytest.mark.timeout(30)
    async def test_wrong_typed_keys_raise_type_error_naming_the_key(self, store: Store) -> None:
        with pytest.raises(TypeError, match="42"):
            await store.set(42, b"x")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="b'raw'"):
            await store.get(b"raw")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            await store.wait("abc")  # a lone str would otherwise wait for 'a', 'b', 'c'
        with pytest.raises(TypeError, match="7"):
            await store.check(["ok", 7])  # type: ignore[list-item]
        with pytest.raises(ValueError):
            await store.set("", b"x")

    @pytest.mark.timeout(30)
    async def test_wrong_typed_values_raise_type_error_naming_the_key(self, store: Store) -> None:
        with pytest.raises(TypeError, match="'number'"):
            await store.set("number", 3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="'items'"):
            await store.multi_set(["items"], [None])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="'counter'"):
            await store.add("counter", 1.5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="'cas'"):
            await store.compare_set("cas", b"", 1)  # type: ignore[arg-type]
        assert not await store.check(["number", "items", "counter", "cas"])

    @pytest.mark.timeout(30)
    async def test_aclose_twice_is_fine(self, store_factory: StoreFactory) -> None:
        extra = await store_factory()
        await extra.aclose()
        await extra.aclose()
