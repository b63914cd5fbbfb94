"""Train a small model split over pipeline stages (1F1B or interleaved 1F1B); CPU/gloo works.

    torchrun --nproc-per-node 2 examples/pipeline_train.py --check
    torchrun --nproc-per-node 4 examples/pipeline_train.py --vpp 2 --microbatches 8 --check

The model (embedding, ``pp * vpp * layers_per_stage`` residual MLP blocks, output head) is built
whole on every rank from one seed; rank ``r`` keeps virtual stages ``r, r + pp, ...`` (the first
holds the embedding, the last the head). Each step runs
:func:`mtp.pipeline.forward_backward_pipelining` on ``--microbatches`` microbatches, then SGD.
``--check`` compares the first step's loss and this rank's gradients with the whole model on one
process.
"""

import argparse
import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtp.pipeline import forward_backward_pipelining, get_pipeline_order


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def build_stages(args) -> list[nn.Sequential]:
    torch.manual_seed(args.seed)
    n = args.pp * args.vpp
    stages = [nn.Sequential(*[Block(args.hidden) for _ in range(args.layers_per_stage)])
              for _ in range(n)]
    stages[0].insert(0, nn.Embedding(args.vocab, args.hidden))
    stages[-1].append(nn.Linear(args.hidden, args.vocab))
    return stages


def microbatches(args, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, args.vocab, (args.microbatches, args.seq + 1, 2), generator=g)
    return [t[:-1] for t in tokens], [t[1:] for t in tokens]  # [s, b] inputs and targets


def loss_fn(targets):
    return lambda logits, m: F.cross_entropy(logits.flatten(0, 1), targets[m].flatten())


def check(args, stages, mine, loss, rank) -> None:
    ref = nn.Sequential(*stages)
    inputs, targets = microbatches(args, 0)
    ref_losses = [loss_fn(targets)(ref(x), m) for m, x in enumerate(inputs)]
    (sum(ref_losses) / len(ref_losses)).backward()
    diff = torch.zeros(2)
    if loss is not None:
        diff[0] = (loss - torch.stack(ref_losses).mean()).abs()
    for c, chunk in enumerate(mine):
        ref_chunk = stages[c * args.pp + rank]
        for p, q in zip(chunk.parameters(), ref_chunk.parameters()):
            diff[1] = max(diff[1], (p.grad - q.grad).abs().max())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    if rank == 0:
        sys.stdout.write(f"check: |loss - ref| {diff[0]:.2e}, max |grad - ref| {diff[1]:.2e}\n")
        assert diff.max() < 1e-5, diff


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vpp", type=int, default=1, help="model chunks per rank (interleaved)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--layers-per-stage", type=int, default=1)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, args.pp = dist.get_rank(), dist.get_world_size()
    stages = build_stages(args)
    mine = [copy.deepcopy(stages[c * args.pp + rank]) for c in range(args.vpp)]
    if rank == 0:
        order = get_pipeline_order(args.pp, 0, args.microbatches, args.vpp)
        sys.stdout.write(f"pp={args.pp} vpp={args.vpp} rank 0 order: {order}\n")
    opt = torch.optim.SGD([q for c in mine for q in c.parameters()], lr=args.lr)
    inputs, targets = microbatches(args, 0)  # one fixed batch: the loss must go down
    for step in range(args.steps):
        opt.zero_grad()
        losses = forward_backward_pipelining(
            mine, inputs if rank == 0 else None, loss_fn(targets),
            num_microbatches=args.microbatches,
        )
        loss = torch.stack(losses).mean() if losses else None
        if step == 0 and args.check:
            check(args, stages, mine, loss, rank)
        if loss is not None:
            sys.stdout.write(f"step {step} loss {loss.item():.4f}\n")
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
