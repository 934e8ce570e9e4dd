"""Issue 18: what a newcomer reads. The public errors print with their public names and pickle
whole; a wrapped cause is said once; a missing launcher is named; warnings point at the user's
line; the handshake says what answered and which side lacks a token."""

from __future__ import annotations

import asyncio
import pickle
import traceback
import warnings

import pytest

import aiocoll
import aiocoll.sync
from aiocoll._env import launch_variables_missing
from aiocoll._errors import (
    AuthenticationError,
    CollectiveTimeout,
    DistError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    RendezvousError,
    StoreError,
    StoreTimeout,
    chain,
    group_name,
)
from aiocoll._net import free_port
from aiocoll.protocol import ClientHandshake, ServerHandshake

PUBLIC_ERRORS = [
    CollectiveTimeout("all_reduce", "world", 3, [1, 2], 5.0),
    PeerLostError(1, "closed the connection"),
    StoreTimeout(["k"], 1.0),
    MismatchError("ranks disagree", group="w", seq=1, ranks=[0, 1]),
    ProtocolError("bad bytes", remote=False),
    AuthenticationError("wrong token"),
    RendezvousError("no"),
    StoreError("refused"),
    DistError("base"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("err", PUBLIC_ERRORS, ids=lambda e: type(e).__name__)
def test_public_errors_print_their_public_name_and_pickle_whole(err: DistError) -> None:
    name = type(err).__name__
    assert getattr(aiocoll, name) is type(err)
    assert repr(err).startswith(f"{name}(")
    assert f"aiocoll.{name}: " in "".join(traceback.format_exception_only(type(err), err))
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and vars(back) == vars(err)


@pytest.mark.timeout(10)
def test_a_peer_lost_reason_that_is_a_peer_lost_message_says_lost_rank_once() -> None:
    inner = PeerLostError(1, "closed the connection")
    outer = PeerLostError(1, str(inner))
    assert str(outer) == "lost rank 1: closed the connection" and outer.reason == "closed the connection"


@pytest.mark.timeout(10)
def test_chain_leaves_out_a_cause_the_message_already_says() -> None:
    cause = PeerLostError(1, "closed the connection")
    said = chain(DistError("all_reduce failed: lost rank 1 (closed the connection)"), cause)
    assert said.__cause__ is None and said.__suppress_context__
    news = chain(DistError("all_reduce failed"), cause)
    assert news.__cause__ is cause


@pytest.mark.timeout(10)
def test_the_world_group_is_named_world() -> None:
    assert group_name("w") == "world" and group_name("w.5") == "world.5" and group_name("mine") == "mine"
    assert "group 'world'" in str(CollectiveTimeout("all_reduce", group_name("w"), 0, [1], 1.0))


@pytest.mark.timeout(10)
async def test_env_rendezvous_without_a_launcher_names_the_variables_and_aiocoll_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "AIOCOLL_COORDINATOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AIOCOLL_TOKEN", "t")
    with pytest.raises(ValueError) as bare:
        await aiocoll.init_process_group()
    message = str(bare.value)
    assert "MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE" in message and "none of them is set" in message
    assert "`aiocoll run --nproc-per-node N script.py` (or torchrun)" in message
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match=r"and RANK and WORLD_SIZE are not set\. Launch the script with"):
        await aiocoll.init_process_group("env://")
    assert "WORLD_SIZE is not set" in str(launch_variables_missing(["WORLD_SIZE"]))


def _line_of(marker: str) -> int:
    with open(__file__, encoding="utf-8") as source:
        return next(n for n, line in enumerate(source, 1) if line.rstrip().endswith(marker))


@pytest.mark.timeout(60)
def test_the_no_token_warning_points_at_the_users_line_async_and_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AIOCOLL_TOKEN", raising=False)

    async def one_rank() -> None:
        pg = await aiocoll.init_process_group(f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)  # ASYNC
        await pg.destroy()

    url = f"tcp://127.0.0.1:{free_port()}"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        asyncio.run(one_rank())
        aiocoll.sync.init_process_group("gloo", init_method=url, rank=0, world_size=1)  # SYNC
        aiocoll.sync.destroy_process_group()
    sites = [(w.filename, w.lineno) for w in seen if "no token" in str(w.message)]
    assert sites == [(__file__, _line_of("# ASYNC")), (__file__, _line_of("# SYNC"))], sites


@pytest.mark.timeout(60)
def test_the_no_token_warning_points_at_the_users_line_under_the_torch_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dist = pytest.importorskip("torch.distributed")
    import aiocoll.torch  # noqa: F401  (registers the backend)

    monkeypatch.delenv("AIOCOLL_TOKEN", raising=False)
    url = f"tcp://127.0.0.1:{free_port()}"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dist.init_process_group("aiocoll", init_method=url, rank=0, world_size=1)  # TORCH
        dist.destroy_process_group()
    sites = [(w.filename, w.lineno) for w in seen if "no token" in str(w.message)]
    assert sites == [(__file__, _line_of("# TORCH"))], sites


def _exchange(client: ClientHandshake, server: ServerHandshake) -> None:
    client.receive_data(server.receive_data(client.start()))


@pytest.mark.timeout(10)
def test_the_client_says_which_side_has_no_token() -> None:
    mine = ClientHandshake(None, role="worker", job="j")
    mine.name_server("10.0.0.1:29500")
    with pytest.raises(AuthenticationError) as none_here:
        _exchange(mine, ServerHandshake("secret", roles={"worker"}))
    assert str(none_here.value).startswith(
        "this process has no token (AIOCOLL_TOKEN is not set) but the coordinator at 10.0.0.1:29500 "
        "requires one: set AIOCOLL_TOKEN"
    )
    theirs = ClientHandshake("secret", role="worker", job="j")
    theirs.name_server("10.0.0.1:29500")
    with pytest.raises(AuthenticationError) as none_there:
        _exchange(theirs, ServerHandshake(None, roles={"worker"}))
    assert str(none_there.value).startswith(
        "the coordinator at 10.0.0.1:29500 has no token but this process has one"
    )
    assert "tokens differ" not in str(none_here.value) + str(none_there.value)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("reply", "said"),
    [
        (
            b"HTTP/1.1 408 Request Timeout\r\n",
            "an HTTP server answered at 10.0.0.1:8080 (the coordinator's --http-port",
        ),
        (b"<!DOCTYPE HTML>\n<html>", "an HTTP server answered at 10.0.0.1:8080"),
        (
            b"SSH-2.0-OpenSSH_9.6\r\n",
            "10.0.0.1:8080 answered with bytes that are not aiocoll's (first bytes: b'SSH-2.0",
        ),
    ],
)
def test_the_client_names_what_answered_instead_of_a_coordinator(reply: bytes, said: str) -> None:
    client = ClientHandshake(None, role="worker", job="j")
    client.name_server("10.0.0.1:8080")
    client.start()
    assert client.receive_data(reply[:5]) == b""  # too few bytes to judge yet
    with pytest.raises(ProtocolError) as err:
        client.receive_data(reply[5:])
    assert said in str(err.value) and "frame header" not in str(err.value)


@pytest.mark.timeout(30)
async def test_a_store_rendezvous_that_times_out_names_the_ranks_missing_and_a_world_size_at_odds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under torchrun (a store, no coordinator) a wrong world size names what is wrong."""
    monkeypatch.setenv("AIOCOLL_TOKEN", "t")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(aiocoll.RendezvousError) as err:
        await aiocoll.init_process_group(store=aiocoll.MemoryStore(), rank=0, world_size=3, timeout=1)
    said = str(err.value)
    assert said.startswith("rank 0: rank(s) [1, 2] of 3 did not publish their address in the store"), said
    assert "(1 did)" in said and "asked for world_size=3 but its WORLD_SIZE is 2" in said, said


@pytest.mark.timeout(30)
async def test_a_closed_manager_says_where_it_is_once_and_not_a_quorum_it_was_never_in() -> None:
    from aiocoll.ft import Manager, QuorumError

    manager = Manager(f"127.0.0.1:{free_port()}", replica="r0", token="t")
    await manager.close()
    with pytest.raises(QuorumError) as err:
        await manager.start_step()
    said = str(err.value)
    assert said.startswith("replica 'r0' (in no quorum yet, host "), said
    assert said.count("replica 'r0'") == 1 and said.endswith("the Manager is closed"), said


@pytest.mark.timeout(30)
def test_user_site_finds_the_users_frame_again_after_passing_the_same_aiocoll_and_torch_frames() -> None:
    # A blocking call walks the same frames of aiocoll and torch each time (user_site remembers
    # their codes): the user's frame must still be found, from whichever line it calls, and a
    # user's function called on the way out is the user's, not passed over.
    import sys
    import types

    from aiocoll._errors import user_site

    def module(name: str, source: str) -> types.ModuleType:
        mod = types.ModuleType(name)
        exec(compile(source, f"<{name}>", "exec"), mod.__dict__)
        return mod

    inner = module("aiocoll._fake_inner", "import sys\ndef call():\n    return sys._getframe(0)\n")
    torchish = module("torch._fake_dispatch", "def call(f):\n    return f()\n")
    user = module(
        "users_script",
        "def first(t, i):\n    return t.call(i.call)\ndef second(t, i):\n    return t.call(i.call)\n",
    )
    sites = [user_site(user.first(torchish, inner)) for _ in range(3)]
    sites += [user_site(user.second(torchish, inner)) for _ in range(2)]
    assert [(s[0], s[1], s[3]) for s in sites if s] == [("<users_script>", 2, "first")] * 3 + [
        ("<users_script>", 4, "second")
    ] * 2
    # The user's own function, called between aiocoll's frames, is where the walk stops.
    assert user_site(torchish.call(lambda: sys._getframe(0)))[3] == "<lambda>"  # type: ignore[index]
