"""Swap an MoE layer into a small model and train it with expert parallelism; runs on CPU (gloo).

    torchrun --nproc-per-node 2 examples/moe_train.py --ep 2
    torchrun --nproc-per-node 4 examples/moe_train.py --ep 2 --capacity-factor 1.25

The model is a toy next-token predictor whose blocks have an ``mlp`` attribute (an ordinary
``nn.Sequential``). :func:`swap_in_moe` replaces it by :class:`mtp.moe.MoELayer`: the experts
are split over the expert-parallel ranks, each rank trains on its own batch (the EP ranks are
data-parallel ranks for everything else), and the load-balancing loss reaches the gradients
through the autograd graph (nothing to add to the loss). ``--check`` also verifies the first
step against the same model on one process holding every expert.
"""

import argparse
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mtp.parallel as mp
from mtp.moe import MoELayer


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [s, b] -> [s, b, vocab]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def swap_in_moe(model: TinyLM, args, ep_group=None) -> None:
    """Replace every block's MLP by an expert-parallel MoE layer (same hidden size)."""
    for block in model.blocks:
        block.mlp = MoELayer(
            args.hidden,
            2 * args.hidden,
            args.experts,
            args.topk,
            ep_group=ep_group,
            capacity_factor=args.capacity_factor,
            activation="swiglu",
            aux_loss_coeff=1e-2,
            z_loss_coeff=1e-3,
        )


def build(args, ep_group=None) -> TinyLM:
    torch.manual_seed(1234)  # same seed on every rank: dense weights identical, experts sliced
    model = TinyLM(args.vocab, args.hidden, args.layers)
    swap_in_moe(model, args, ep_group)
    return model


def batch(args, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, args.vocab, (args.seq + 1, args.batch), generator=g)  # [s + 1, b]


def lm_loss(model: TinyLM, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[1:].reshape(-1))


def average_gradients(model: nn.Module, world: int) -> None:
    """The global loss is the mean of the ranks' losses. Dense gradients: sum over the data
    parallel group / world. Expert gradients (``allreduce = False``) already hold every EP
    rank's tokens: sum over the expert-data-parallel group / world."""
    dp, edp = mp.get_data_parallel_group(), mp.get_expert_data_parallel_group()
    for p in model.parameters():
        if p.grad is None:
            continue
        group = edp if getattr(p, "allreduce", True) is False else dp
        dist.all_reduce(p.grad, group=group)
        p.grad /= world


def check_first_step(args, model: TinyLM, rank: int) -> None:
    """The EP model's loss and gradients on this rank's batch equal those of one process."""
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    ref = build(args, ep_group=solo)
    tokens = batch(args, rank, 0)
    loss, ref_loss = lm_loss(model, tokens), lm_loss(ref, tokens)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(model.embed.weight.grad, ref.embed.weight.grad)
    model.zero_grad()
    print(
        f"rank {rank}: check ok (loss {loss.item():.5f} = single-process {ref_loss.item():.5f})",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=None)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()

    timeout = datetime.timedelta(minutes=2)  # a stuck peer fails the job in minutes
    dist.init_process_group("gloo", timeout=timeout)
    mp.initialize_model_parallel(expert_model_parallel_size=args.ep, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args)  # MoELayer picks up the expert-parallel group of mtp.parallel
    moe = model.blocks[0].mlp
    # one write per line (ranks share stdout; a separate newline write could interleave)
    line = f"rank {rank}: experts {moe.local_expert_indices} of {args.experts}, ep={moe.ep_size}"
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    if args.check:
        check_first_step(args, model, rank)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        loss = lm_loss(model, batch(args, rank, step % 4))  # 4 batches, seen repeatedly
        opt.zero_grad()
        loss.backward()  # includes the MoE aux and z losses
        average_gradients(model, world)
        opt.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            aux = sum(float(b.mlp.aux_loss) for b in model.blocks)
            print(f"step {step:3d} loss {loss.item():.4f} aux {aux:.5f}", flush=True)
    mp.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
