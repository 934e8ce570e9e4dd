"""Per-step fault tolerance for an ordinary torch training loop: an optimizer wrapper over aiocoll.ft.

Public surface (an addition to the contract, docs/FAULT_TOLERANCE.md); imports torch, aiocoll.ft
and the loop thread the blocking facade runs on. Holds no logic of its own beyond torch's side:
which tensors are the state, and the gradients as one flat buffer.

    manager = aiocoll.ft.Manager("10.0.0.1:29500", replica="r0", min_replicas=2)
    opt = FaultTolerantOptimizer(manager, torch.optim.SGD(model.parameters(), lr=0.1), model)
    while manager.step < steps:
        opt.zero_grad()                        # quorum; receives the state when behind
        loss_fn(model(*batch(manager.step))).backward()
        opt.step()                             # averaged over the quorum; applied if committed

For a replica of several ranks, each rank wraps its own part of the model with its own Manager
(``replica_rank``, ``replica_size``): its gradients are averaged with the same rank of the other
replicas, and the state it sends or receives when a replica heals is that rank's model and
optimizer ``state_dict``.

The Manager's coroutines run on aiocoll's loop thread (the one aiocoll.sync uses); these
methods block until they finish.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from aiocoll._sync_loop import Outcome, get_loop_thread, issue_on_caller_streams
from aiocoll.ft import Manager

__all__ = ["DiLoCo", "FaultTolerantOptimizer", "Manager"]


class FaultTolerantOptimizer:
    """An optimizer that runs only the steps every replica of the quorum completed.

    Args:
        manager: this replica's Manager. When it has no ``state_dict``/``load_state_dict`` yet,
            they become the model's and the optimizer's (what a replica that heals receives).
        optimizer: the torch optimizer to wrap (its param_groups hold what is trained).
        model: the module, so that its buffers (BatchNorm statistics) travel in a heal too; None:
            the optimizer's parameters only.

    Attributes:
        manager: as given.
        optimizer: the wrapped optimizer.
        model: as given.
        committed: whether the last ``step`` was applied.
    """

    def __init__(
        self, manager: Manager, optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None
    ) -> None:
        self.manager = manager
        self.optimizer = optimizer
        self.model = model
        self.committed = False
        if manager.state_dict is None:
            manager.state_dict = self._state
        if manager.load_state_dict is None:
            manager.load_state_dict = self._load

    # -- the state a replica heals with -------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _state(self) -> dict[str, Any]:
        if self.model is not None:
            trained: Any = self.model.state_dict()
        else:
            trained = [p.detach() for p in self._params()]
        return {"model": trained, "optimizer": self.optimizer.state_dict()}

    def _load(self, state: dict[str, Any]) -> None:
        if self.model is not None:
            self.model.load_state_dict(state["model"])
        else:
            with torch.no_grad():
                for p, value in zip(self._params(), state["model"], strict=True):
                    p.copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])

    # -- the training loop's calls ------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a step (the quorum; the state received when behind), then clear the gradients.

        Args:
            set_to_none: as torch's ``Optimizer.zero_grad``.

        Raises:
            aiocoll.ft.QuorumError: no quorum within the Manager's quorum_timeout.
        """
        get_loop_thread().run(self.manager.start_step())
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> bool:
        """Average the gradients over the quorum, commit, and apply the step only if committed.

        The wrapped optimizer's step runs only when every replica of the quorum completed this
        step. A parameter without a gradient counts as a zero gradient, so that every replica
        reduces the same tensors.

        Args:
            closure: as torch's ``Optimizer.step``: called (with gradients enabled) before the
                gradients are averaged.

        Returns:
            Whether the step was committed and applied (``manager.last_error`` says why not).
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        params = self._params()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        flats = list(_flatten(grads).values())
        # As aiocoll.sync issues a call: a CUDA buffer is read after what the calling thread's
        # streams computed, and the call returns once the result is on the device.
        averaging, _ = issue_on_caller_streams(
            lambda: self.manager.all_reduce_mean(flats), flats, wait_on_host=True
        )
        if averaging.result():
            _unflatten(grads, flats)
        self.committed = get_loop_thread().run(self.manager.commit())
        if self.committed:
            self.optimizer.step()
        return self.committed

    def close(self) -> None:
        """Leave the quorum (the Manager's ``close``)."""
        get_loop_thread().run(self.manager.close())

    # -- the wrapped optimizer's face ---------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's ``param_groups``."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's ``state``."""
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` (for checkpoints).

        Returns:
            The wrapped optimizer's state_dict.
        """
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state into the wrapped optimizer (from a checkpoint).

        Args:
            state_dict: what ``state_dict`` returned.
        """
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"FaultTolerantOptimizer({self.optimizer!r}, {self.manager!r})"


def _flatten(grads: list[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], torch.Tensor]:
    """The gradients as one contiguous buffer per dtype and device: one all_reduce each."""
    parts: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in grads:
        parts.setdefault((g.dtype, g.device), []).append(g.reshape(-1))
    return {key: torch.cat(tensors) for key, tensors in parts.items()}


def _unflatten(grads: list[torch.Tensor], flats: list[torch.Tensor]) -> None:
    """Copy the averaged buffers back into the gradients (in the order ``_flatten`` took them)."""
    by_key = {(f.dtype, f.device): f for f in flats}
    offsets = dict.fromkeys(by_key, 0)
    for g in grads:
        key = (g.dtype, g.device)
        start = offsets[key]
        g.copy_(by_key[key][start : start + g.numel()].view_as(g))
        offsets[key] = start + g.numel()


class DiLoCo:
    """DiLoCo over the Manager: local inner steps, and a fault-tolerant outer step every ``sync_every``.

    Every ``sync_every`` inner steps the replicas of the quorum average their pseudo-gradients
    (the parameters at the last sync minus the parameters now) and an outer optimizer applies
    them. A cycle starts with a quorum (``zero_grad`` of its first inner step: a replica that is
    behind heals there, receiving the parameters of the last sync and the outer optimizer's
    state); it ends, at the ``sync_every``-th ``step``, with the average over the quorum, the
    commit, and the outer step, applied only if committed. A replica lost during a cycle fails
    its end on the others: nobody applies it, every replica goes back to the parameters of the
    last sync, and the next cycle's quorum leaves the lost one out. Communication: one average
    of the parameters' size and one quorum per ``sync_every`` inner steps, against one of each
    per step for ``FaultTolerantOptimizer``. ``manager.step`` counts the syncs committed.

    Streaming (``fragments`` > 1): the parameters are cut into ``fragments`` parts of about the
    same size (whole tensors, in the model's order), and each cycle is ``fragments`` shorter
    ones of ``sync_every // fragments`` inner steps that each sync one part in turn, so each
    part still syncs every ``sync_every`` inner steps while a sync moves 1/``fragments`` of the
    bytes. With ``delay`` > 0 a sync overlaps the next ``delay`` inner steps: its average and
    commit run on aiocoll's loop thread while this thread trains on, and the outer step is
    applied ``delay`` steps later, the part's parameters then becoming ``mix`` times what they are
    locally plus (1 - ``mix``) times the new synced value. Each short cycle is one Manager step: its
    quorum comes after the previous sync is applied, and a failed sync resets only its part to
    the last synced value. ``fragments=1, delay=0`` is plain DiLoCo.

    Args:
        manager: this replica's Manager; its ``state_dict``/``load_state_dict``, when unset,
            become the parameters of the last sync and the outer optimizer's state.
        model: the module whose parameters are trained.
        inner_optimizer: the optimizer of the local steps (over ``model``'s parameters).
        outer_optimizer: the optimizer of the syncs, over the same parameters (DiLoCo's: SGD
            with Nesterov momentum); the pseudo-gradient is its gradient.
        sync_every: inner steps between two syncs of the same parameters (H).
        fragments: parts synced in turn (1: all at once); divides ``sync_every``, at most the
            number of parameter tensors.
        delay: inner steps a sync overlaps before it is applied, below ``sync_every //
            fragments``.
        mix: with ``delay``, the weight of the local parameters when a sync is applied (0: the
            synced value replaces them).

    Attributes:
        local_step: inner steps done since the last sync (0..sync_every // fragments - 1).
        inner_step: the inner steps of the job so far, the same number on every replica of the
            quorum (after a heal too, and back by a cycle after a failed sync): use it for data.
        last_sync: the number (``manager.step`` when it began) of the last sync applied or
            failed; None before the first.
        committed: whether the last sync was applied (None before the first).
    """

    def __init__(
        self,
        manager: Manager,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer,
        sync_every: int,
        *,
        fragments: int = 1,
        delay: int = 0,
        mix: float = 0.0,
    ) -> None:
        params = [p for p in model.parameters()]
        for name, value, low in (
            ("sync_every", sync_every, 1),
            ("fragments", fragments, 1),
            ("delay", delay, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"DiLoCo: {name} must be an int >= {low}, got {value!r}")
        if sync_every % fragments or fragments > len(params):
            raise ValueError(
                f"DiLoCo: fragments={fragments} must divide sync_every={sync_every} and be at most the "
                f"model's {len(params)} parameter tensors"
            )
        if delay >= sync_every // fragments:
            raise ValueError(
                f"DiLoCo: delay={delay} must be below sync_every // fragments = {sync_every // fragments} "
                f"(a sync is applied before the next one starts)"
            )
        if not 0.0 <= float(mix) <= 1.0:
            raise ValueError(f"DiLoCo: mix must be between 0 and 1, got {mix!r}")
        self.manager = manager
        self.model = model
        self.inner = inner_optimizer
        self.outer = outer_optimizer
        self.sync_every = sync_every
        self.fragments = fragments
        self.delay = delay
        self.mix = float(mix)
        self.local_step = 0
        self.inner_step = 0
        self.last_sync: int | None = None
        self.committed: bool | None = None
        self._params = params
        self._parts = _fragments(params, fragments)
        self._cycle = sync_every // fragments
        with torch.no_grad():
            self._synced = [p.detach().clone() for p in params]
        self._quorum_due = True
        self._sync_step = 0  # manager.step at the current short cycle's quorum
        # the sync in flight: (its number, its part, the deltas, their flat buffers, its outcome)
        self._pending: tuple[int, list[int], list[torch.Tensor], list[torch.Tensor], Outcome] | None = None
        if manager.state_dict is None:
            manager.state_dict = self.state_dict
        if manager.load_state_dict is None:
            manager.load_state_dict = self.load_state_dict

    @property
    def synced(self) -> list[torch.Tensor]:
        """The parameters as of the last sync, in the model's order.

        The same on every replica of the quorum (the model's own drift from them between syncs).
        Read, do not modify.
        """
        return self._synced

    def state_dict(self) -> dict[str, Any]:
        """What a replica that heals receives, and what to checkpoint.

        The synced parameters and the outer optimizer's state. Take it when a ``step`` has just
        returned True: then ``manager.step`` is the checkpoint's step, for ``Manager.restore``.

        Returns:
            ``{"synced": [tensors], "outer": the outer optimizer's state_dict}``.
        """
        return {"synced": self._synced, "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` returned: the synced parameters (the model's too), the outer state.

        Args:
            state: a ``state_dict()``, from a heal or a checkpoint.
        """
        with torch.no_grad():
            for mine, value, p in zip(self._synced, state["synced"], self._params, strict=True):
                mine.copy_(value)  # nothing to copy when it was received in place
                p.copy_(mine)
        self.outer.load_state_dict(state["outer"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; first, when a short cycle's quorum is due, ask for it (and heal).

        Raises:
            aiocoll.ft.QuorumError: no quorum within the Manager's quorum_timeout.
        """
        if self._quorum_due:
            self._sync_step = get_loop_thread().run(self.manager.start_step())
            self._quorum_due = False
            self.inner_step = self._sync_step * self._cycle + self.local_step
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self) -> bool | None:
        """An inner step; at a short cycle's end, its sync; ``delay`` steps later, its outer step.

        Without a delay the sync is applied in the same call.

        Returns:
            None, or when a sync was applied in this call, whether it was committed (when not,
            its part of the parameters is back at the last sync's; ``manager.last_error`` says
            why).
        """
        self.inner.step()
        self.local_step += 1
        self.inner_step += 1
        applied: bool | None = None
        if self._pending is not None and self.local_step == self.delay:
            applied = self._apply()
        if self.local_step < self._cycle:
            return applied
        self.local_step = 0
        part = self._parts[self._sync_step % self.fragments]
        with torch.no_grad():
            deltas = [self._synced[i] - self._params[i].detach() for i in part]
        flats = list(_flatten(deltas).values())
        outcome, _ = issue_on_caller_streams(
            lambda: self._average_and_commit(flats), flats, wait_on_host=True
        )
        self._pending = (self._sync_step, part, deltas, flats, outcome)
        if self.delay == 0:
            applied = self._apply()
        return applied

    async def _average_and_commit(self, flats: list[torch.Tensor]) -> tuple[bool, bool]:
        averaged = await self.manager.all_reduce_mean(flats)
        return averaged, await self.manager.commit()

    def _apply(self) -> bool:
        """Wait for the sync in flight and apply its outer step to its part, if committed."""
        assert self._pending is not None
        number, part, deltas, flats, outcome = self._pending
        self._pending = None
        averaged, committed = outcome.result()
        self.committed = bool(committed and averaged)
        self.last_sync = number
        self._quorum_due = True
        params = self._params
        with torch.no_grad():
            local = [params[i].detach().clone() for i in part] if self.committed and self.mix else None
            for i in part:
                params[i].copy_(self._synced[i])
        if not self.committed:
            return False
        _unflatten(deltas, flats)
        for p in params:
            p.grad = None
        for i, d in zip(part, deltas, strict=True):
            params[i].grad = d
        self.outer.step()
        with torch.no_grad():
            for k, i in enumerate(part):
                self._synced[i].copy_(params[i])
                if local is not None:
                    params[i].mul_(1.0 - self.mix).add_(local[k], alpha=self.mix)
        return True

    def close(self) -> None:
        """Apply a sync still in flight, then leave the quorum (the Manager's ``close``)."""
        if self._pending is not None:
            self._apply()
        get_loop_thread().run(self.manager.close())


def _fragments(params: Sequence[torch.Tensor], n: int) -> list[list[int]]:
    """``params``' indices cut into ``n`` runs of whole tensors, in order, of about the same size."""
    total = sum(p.numel() for p in params)
    parts: list[list[int]] = [[] for _ in range(n)]
    seen = 0
    for i, p in enumerate(params):
        # the part the tensor's middle falls in, but never one that leaves a later part empty
        k = min(n - 1, int((seen + p.numel() / 2) * n / total)) if total else 0
        k = max(k, n - (len(params) - i))
        k = min(k, max((j for j, part in enumerate(parts) if part), default=-1) + 1)
        parts[k].append(i)
        seen += p.numel()
    return parts
