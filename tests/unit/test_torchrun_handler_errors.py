"""The torchrun rendezvous handler's questions between runs answer in torch's error types: an
unreadable node state is a RendezvousStateError, a coordinator that does not answer makes
is_closed say no (asked again next time) instead of failing torch's agent, and set_closed is
bounded by the operation timeout."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")


def _handler(monkeypatch: pytest.MonkeyPatch) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from aiocoll.torchrun import AiocollRendezvousHandler

    for name in ("AIOCOLL_COORDINATOR", "AIOCOLL_JOB", "AIOCOLL_TOKEN"):  # restored afterwards
        monkeypatch.setenv(name, "kept")
    params = RendezvousParameters("aiocoll", "127.0.0.1:9", "job", 1, 2, op_timeout="0.2")
    handler = AiocollRendezvousHandler(params)
    handler._opened = True
    return handler


@pytest.mark.timeout(60)
def test_questions_between_runs_answer_in_torchs_error_types(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousStateError

    from aiocoll.cli._launch_nodes import NodeStateError

    handler = _handler(monkeypatch)
    node = handler._node

    async def unreadable(*_: Any) -> Any:
        raise NodeStateError("bad version")

    async def silent(*_: Any) -> Any:
        raise ConnectionRefusedError("nobody there")

    monkeypatch.setattr(node, "is_over", silent)
    assert handler.is_closed() is False
    monkeypatch.setattr(node, "is_over", unreadable)
    with pytest.raises(RendezvousStateError, match="bad version"):
        handler.is_closed()
    handler._admitted = object()
    monkeypatch.setattr(node, "changes", unreadable)
    with pytest.raises(RendezvousStateError, match="bad version"):
        handler.num_nodes_waiting()

    async def never(_: str) -> None:
        await asyncio.sleep(3600)

    monkeypatch.setattr(node, "close_job", never)
    monkeypatch.setattr(node, "_op_timeout", 0.2)
    handler.set_closed()  # returns once the operation timeout ran out
