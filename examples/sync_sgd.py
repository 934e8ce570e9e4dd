"""Distributed synchronous SGD: each rank trains on its partition, gradients are averaged.

Run:  aiocoll run --nproc-per-node 2 examples/sync_sgd.py --epochs 5
The data set is scikit-learn's handwritten digits (shipped with the package). A partitioner gives
each rank a disjoint share; after every backward pass the gradients are all-reduced and divided by
the world size, so all ranks keep identical models. The script checks that the loss falls and that
every rank ends with the same parameters.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import aiocoll.sync as dist


class Partitioner:
    """Shuffles indices with a shared seed and hands out disjoint fractions."""

    def __init__(self, size: int, fractions: list[float], seed: int = 1234) -> None:
        indices = list(range(size))
        random.Random(seed).shuffle(indices)
        self.partitions = []
        for fraction in fractions:
            take = int(fraction * size)
            self.partitions.append(indices[:take])
            indices = indices[take:]

    def use(self, part: int) -> list[int]:
        return self.partitions[part]


def average_gradients(model: torch.nn.Module) -> None:
    size = float(dist.get_world_size())
    for param in model.parameters():
        assert param.grad is not None
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial model on every rank

    digits = load_digits()
    features = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    mine = Partitioner(len(labels), [1.0 / size] * size).use(rank)
    x, y = features[mine], labels[mine]

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for epoch in range(args.epochs):
        epoch_loss = torch.zeros(1)
        for start in range(0, len(y), args.batch):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[start : start + args.batch]), y[start : start + args.batch])
            loss.backward()
            average_gradients(model)
            optimizer.step()
            epoch_loss += loss.detach()
        dist.all_reduce(epoch_loss)
        losses.append(epoch_loss.item() / size)
        if rank == 0:
            print(f"epoch {epoch}: mean loss {losses[-1]:.4f}")

    assert losses[-1] < 0.5 * losses[0], f"the loss did not fall: {losses}"
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    assert torch.equal(flat, reference), "ranks ended with different parameters"
    if rank == 0:
        print(f"loss fell from {losses[0]:.3f} to {losses[-1]:.3f}; all {size} ranks hold the same model")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
