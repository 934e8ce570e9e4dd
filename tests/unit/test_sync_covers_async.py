"""aiocoll.sync covers the async API, and speaks torch.distributed's signatures.

The mapping between the two lives in aiocoll.sync (ASYNC_COUNTERPART: async operation -> facade
function; FACADE_ONLY: facade functions with no single async counterpart). These tests fail
when an operation is added to either side without its counterpart, or when a facade function's
parameters drift from torch.distributed's.
"""

from __future__ import annotations

import inspect

import pytest

import aiocoll
import aiocoll.sync as sync

# contract §3: what a torch.distributed script may use
CONTRACT_NAMES = [
    "init_process_group", "is_initialized", "get_rank", "get_world_size", "get_backend", "new_group",
    "destroy_process_group", "send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp", "broadcast",
    "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list", "ReduceOp",
    "GroupMember", "TCPStore", "FileStore", "HashStore", "PrefixStore",
]  # fmt: skip


def _async_operations() -> set[str]:
    ops = set()
    for name in dir(aiocoll.ProcessGroup):
        if name.startswith("_"):
            continue
        if callable(inspect.getattr_static(aiocoll.ProcessGroup, name)):
            ops.add(name)
    return ops


def _facade_functions() -> set[str]:
    return {n for n in sync.__all__ if inspect.isfunction(getattr(sync, n))}


def test_every_async_operation_has_a_facade_counterpart() -> None:
    missing = sorted(_async_operations() - set(sync.ASYNC_COUNTERPART))
    assert not missing, f"aiocoll.ProcessGroup operations missing from sync.ASYNC_COUNTERPART: {missing}"


def test_the_mapping_names_only_operations_that_exist() -> None:
    stale = sorted(set(sync.ASYNC_COUNTERPART) - _async_operations())
    assert not stale, f"ASYNC_COUNTERPART names operations aiocoll.ProcessGroup does not have: {stale}"
    for facade in sync.ASYNC_COUNTERPART.values():
        assert callable(getattr(sync, facade, None)), f"aiocoll.sync.{facade} is missing"


def test_every_facade_function_forwards_to_an_async_operation_or_says_why_not() -> None:
    accounted = set(sync.ASYNC_COUNTERPART.values()) | set(sync.FACADE_ONLY)
    unaccounted = sorted(_facade_functions() - accounted)
    assert not unaccounted, f"sync functions in neither ASYNC_COUNTERPART nor FACADE_ONLY: {unaccounted}"
    stale = sorted(set(sync.FACADE_ONLY) - _facade_functions())
    assert not stale, f"FACADE_ONLY names functions aiocoll.sync does not have: {stale}"


def test_the_facade_has_every_name_of_the_contract() -> None:
    missing = [n for n in CONTRACT_NAMES if not hasattr(sync, n)]
    assert not missing
    assert set(CONTRACT_NAMES) <= set(sync.__all__)


def test_group_member_and_reduce_op_behave_as_in_torch() -> None:
    assert sync.GroupMember.WORLD is None  # nothing initialised in this process
    assert sync.GroupMember.NON_GROUP_MEMBER == -100
    assert sync.ReduceOp.coerce("sum") is sync.ReduceOp.SUM
    assert sync.get_rank(sync.GroupMember.NON_GROUP_MEMBER) == -1
    with pytest.raises(ValueError, match="init_process_group"):
        sync.get_rank()
    with pytest.raises(ValueError, match="backend"):
        sync.init_process_group("carrier-pigeon")


@pytest.mark.torch
def test_facade_functions_take_torch_distributed_parameters_in_the_same_order() -> None:
    tdist = pytest.importorskip("torch.distributed")
    drift = []
    for name in CONTRACT_NAMES:
        theirs_obj, ours_obj = getattr(tdist, name), getattr(sync, name)
        # pybind classes (the stores) have no introspectable signature: checked below
        if name in ("ReduceOp", "GroupMember"):
            continue
        try:
            theirs = [p for p in inspect.signature(theirs_obj).parameters if not p.startswith("_")]
        except ValueError:  # pybind classes (the stores) have no introspectable signature
            continue
        ours = list(inspect.signature(ours_obj).parameters)
        if ours[: len(theirs)] != theirs:
            drift.append(f"{name}: torch {theirs} vs aiocoll.sync {ours}")
    assert not drift, "\n".join(drift)


@pytest.mark.torch
def test_store_classes_take_torch_constructor_parameters() -> None:
    pytest.importorskip("torch.distributed")
    params = list(inspect.signature(sync.TCPStore).parameters)
    assert params[:9] == [
        "host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant",
        "master_listen_fd", "use_libuv",
    ]  # fmt: skip
    assert list(inspect.signature(sync.FileStore).parameters) == ["file_name", "world_size"]
    assert list(inspect.signature(sync.PrefixStore).parameters) == ["prefix", "store"]
    assert list(inspect.signature(sync.HashStore).parameters) == []
