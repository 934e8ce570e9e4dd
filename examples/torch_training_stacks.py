"""Today's torch training stacks on the aiocoll backend (CPU): DeviceMesh, DTensor, FSDP2, DDP, DCP.

Run:  aiocoll run --nproc-per-node 2 examples/torch_training_stacks.py
      aiocoll run --nproc-per-node 2 examples/torch_training_stacks.py --backend gloo   # the same on gloo

Each scenario trains or reshuffles something small and checks itself (every rank agrees, values
are what they must be); with ``--out FILE`` rank 0 also saves every scenario's final parameters,
so two runs (gloo and aiocoll) can be compared tensor by tensor, as
tests/integration/test_examples.py does. Scenarios:

- mesh_dtensor: ``init_device_mesh("cpu", ...)``, a DTensor sharded, redistributed to replicated
  and to the other dimension; the full tensor must survive every move.
- fsdp2: ``fully_shard`` on a small MLP, a few optimizer steps.
- ddp_join: DDP with ``Join`` on uneven inputs (rank r has r more batches).
- ddp_no_sync: gradient accumulation under ``no_sync()`` then one synchronised step.
- ddp_static_graph / ddp_find_unused / ddp_bucket_view: DDP with ``static_graph=True``,
  ``find_unused_parameters=True`` (a branch unused on odd steps), ``gradient_as_bucket_view=True``.
- ddp_buffers: BatchNorm's running statistics broadcast from rank 0 on every forward.
- dcp: ``torch.distributed.checkpoint`` save of a DDP model and its optimizer, load into a fresh
  model, continue training.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import aiocoll.torch  # noqa: F401  (registers the torch.distributed backend "aiocoll")

STEPS = 4


def _data(rank: int, step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own batch for a step (deterministic, so gloo and aiocoll runs see the same)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 8, generator=gen, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True).sin()


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def _same_on_every_rank(t: torch.Tensor, what: str) -> None:
    copies = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, t.contiguous())
    assert all(torch.equal(copies[0], c) for c in copies), f"{what}: ranks disagree"


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.removeprefix("module.")] = full.detach().clone()
    for name, b in model.named_buffers():
        out["buffer:" + name.removeprefix("module.")] = b.detach().clone()
    for name, t in out.items():
        _same_on_every_rank(t, name)
    return out


def _train(model: torch.nn.Module, rank: int, steps: int = STEPS, lr: float = 0.1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = _data(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


# ------------------------------------------------------------------------------------ scenarios


def mesh_dtensor(rank: int, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(4 * world * 6, dtype=torch.float64).reshape(4 * world, 6)
    rows = distribute_tensor(full, mesh, [Shard(0)])
    assert rows.to_local().shape == (4, 6)
    replicated = rows.redistribute(mesh, [Replicate()])
    assert torch.equal(replicated.to_local(), full)
    cols = replicated.redistribute(mesh, [Shard(1)])
    back = cols.redistribute(mesh, [Shard(0)]).full_tensor()
    assert torch.equal(back, full)
    total = (rows * 2).sum().full_tensor()  # a reduction across shards (all_reduce underneath)
    assert float(total) == float(full.sum() * 2)
    out = {"cols_local": cols.to_local().contiguous()}
    if world % 2 == 0:  # a 2-D mesh: the rows and columns of ranks are groups of their own
        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        grid = distribute_tensor(full, mesh2, [Shard(0), Shard(1)])
        assert torch.equal(grid.full_tensor(), full)
        out["grid_local"] = grid.to_local().contiguous()
    return out


def fsdp2(rank: int, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, rank)
    return _params(model)


def ddp_join(rank: int, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.algorithms.join import Join

    model = DDP(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model]):
        for step in range(STEPS + rank):  # uneven: higher ranks have more batches
            x, y = _data(rank, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return _params(model)


def ddp_no_sync(rank: int, world: int) -> dict[str, torch.Tensor]:
    model = DDP(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = _data(rank, step)
        if step % 2 == 0:
            with model.no_sync():  # accumulate locally, no all-reduce
                torch.nn.functional.mse_loss(model(x), y).backward()
            continue
        torch.nn.functional.mse_loss(model(x), y).backward()  # all-reduces the accumulated grads
        opt.step()
        opt.zero_grad()
    return _params(model)


def ddp_static_graph(rank: int, world: int) -> dict[str, torch.Tensor]:
    model = DDP(_mlp(), static_graph=True)
    _train(model, rank)
    return _params(model)


class _Branchy(torch.nn.Module):
    """A second head used only on even steps: its parameters get no gradient on odd ones."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()
        self.extra = torch.nn.Linear(8, 1).double()
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        if self.step % 2 == 0:
            out = out + self.extra(x)
        self.step += 1
        return out


def ddp_find_unused(rank: int, world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = DDP(_Branchy(), find_unused_parameters=True)
    _train(model, rank)
    return _params(model)


def ddp_bucket_view(rank: int, world: int) -> dict[str, torch.Tensor]:
    model = DDP(_mlp(), gradient_as_bucket_view=True, bucket_cap_mb=0.0005)  # several tiny buckets
    _train(model, rank)
    return _params(model)


def ddp_buffers(rank: int, world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1)
    ).double()
    if rank != 0:
        with torch.no_grad():  # rank 0's running statistics win: DDP broadcasts them each forward
            net[1].running_mean.fill_(float(rank))
    model = DDP(net, forward_sync_buffers=True)  # formerly broadcast_buffers=True
    _train(model, rank)
    # Each forward first broadcasts rank 0's buffers, then (training) updates them from local
    # data; an eval-mode forward broadcasts without updating, so every rank ends with rank 0's.
    model.eval()
    model(_data(rank, 0)[0])
    return _params(model)


def dcp(rank: int, world: int) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp_api

    model = DDP(_mlp())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(STEPS):
        x, y = _data(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    where = [tempfile.mkdtemp(prefix="aiocoll-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    dcp_api.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=where[0])

    fresh = DDP(_mlp(seed=7))  # different weights: the load must replace them
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh_opt.zero_grad()
    torch.nn.functional.mse_loss(fresh(_data(rank, 0)[0]), _data(rank, 0)[1]).backward()
    fresh_opt.step()  # materialise the optimizer's state so it has tensors to load into
    state = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    dcp_api.load(state, checkpoint_id=where[0])
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optim"])
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), f"dcp: {name} differs after load"
    for step in range(STEPS, STEPS + 2):  # training continues from the loaded state
        x, y = _data(rank, step)
        fresh_opt.zero_grad()
        torch.nn.functional.mse_loss(fresh(x), y).backward()
        fresh_opt.step()
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(where[0], ignore_errors=True)
    return _params(fresh)


SCENARIOS: dict[str, Callable[[int, int], dict[str, torch.Tensor]]] = {
    f.__name__: f
    for f in (
        mesh_dtensor,
        fsdp2,
        ddp_join,
        ddp_no_sync,
        ddp_static_graph,
        ddp_find_unused,
        ddp_bucket_view,
        ddp_buffers,
        dcp,
    )
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="aiocoll", choices=["aiocoll", "gloo"])
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), help="run only these scenarios")
    parser.add_argument("--out", type=Path, help="rank 0 saves every scenario's final parameters here")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in args.only or SCENARIOS:
        results[name] = SCENARIOS[name](rank, world)
        if rank == 0:
            print(f"{name}: ok", flush=True)
    if rank == 0 and args.out is not None:
        torch.save(results, args.out)
    dist.barrier()
    if rank == 0:
        print(
            f"training stacks on {args.backend}: {len(results)} scenarios checked on {world} ranks",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
