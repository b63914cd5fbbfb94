"""Tensor-parallelise an existing GPT with ``mtp.tensor_parallel.parallelize()``.

    torchrun --nproc-per-node 2 examples/tp_parallelize_gpt.py            # tp=2 (CPU: gloo)
    torchrun --nproc-per-node 4 examples/tp_parallelize_gpt.py --tp 2     # tp=2 x dp=2
    torchrun --nproc-per-node 2 examples/tp_parallelize_gpt.py --check    # compare with 1 GPU

The model below is a plain nanoGPT-style GPT that knows nothing about mtp. Every rank builds
it from the same seed, then ``parallelize`` swaps its embedding and linear layers for
tensor-parallel ones holding this rank's shard of the same weights (the tied embedding /
output weight stays tied). Data-parallel replicas average their gradients over the dp group.
With ``--check`` every rank also trains the unmodified model on the whole global batch and
prints how far the losses and weights are apart (float64 rounding only).
Uses NCCL on GPUs when CUDA is available, gloo on CPU otherwise.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mtp.parallel as mp
import mtp.tensor_parallel as tp

# ---------------------------------------------------------------------------------------------
# An ordinary GPT (no mtp inside). Its only concession to tensor parallelism: the attention
# takes the number of heads from the tensor (view(B, T, -1, head_dim)), because after
# parallelize() each rank holds n_head / tp of them.
# ---------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.head_dim = n_embd // n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        B, T = q.shape[:2]
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_embd: int, n_head: int, n_layer: int):
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, n_embd),
                "wpe": nn.Embedding(block_size, n_embd),
                "h": nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer)),
                "ln_f": nn.LayerNorm(n_embd),
            }
        )
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# The tensor-parallel plan: Megatron's column -> row pairs, the vocab-parallel embedding, and an
# output layer that gathers the logits (the vocab-parallel cross-entropy avoids that gather).
PLAN = {
    "transformer.wte": "vocab",
    "*.attn.c_attn": {"style": "column", "stride": 3},  # fused [q; k; v]: split each block
    "*.attn.c_proj": "row",
    "*.mlp.c_fc": "column",
    "*.mlp.c_proj": "row",
    "lm_head": {"style": "column", "gather_output": True},
}


def batch(step: int, dp_rank: int, args, device) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's batch (the same on every tp rank of its group)."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.block_size + 1), generator=g)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(model, opt, idx, targets, dp_group) -> float:
    loss = model(idx, targets)
    loss.backward()
    dp = dist.get_world_size(dp_group)
    if dp > 1:  # average the gradients over the data-parallel replicas
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=dp_group)
                p.grad.div_(dp)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=dp_group)
    return loss.item() / dp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: all)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--check", action="store_true", help="compare with the unparallelized model")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    timeout = datetime.timedelta(minutes=2)  # a stuck peer fails the job in minutes
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    tp_size = args.tp or dist.get_world_size()
    mp.initialize_model_parallel(tensor_model_parallel_size=tp_size, timeout=timeout)
    dp_group, dp_rank = mp.get_data_parallel_group(), mp.get_data_parallel_rank()
    dp_size = mp.get_data_parallel_world_size()
    # The same default seed on every rank (replicated weights and dropout), a distinct
    # "model-parallel-rng" stream per tp rank (dropout inside the parallel regions).
    mp.model_parallel_manual_seed(1234)
    dtype = torch.float64 if args.check else torch.float32

    model = GPT(args.vocab, args.block_size, args.n_embd, args.n_head, args.n_layer)
    model = model.to(device=device, dtype=dtype)
    reference = copy.deepcopy(model) if args.check else None
    tp.parallelize(model, PLAN)  # <- the only change to the training script
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3) if args.check else None

    me = dist.get_rank()
    if me == 0:
        n_local = sum(p.numel() for p in model.parameters())
        print(f"tp={tp_size} dp={dp_size}: {n_local} parameters on rank 0", flush=True)
    worst = 0.0
    for step in range(args.steps):
        idx, targets = batch(step, dp_rank, args, device)
        loss = train_step(model, opt, idx, targets, dp_group)
        line = f"step {step}: loss {loss:.6f}"
        if reference is not None:
            # the whole global batch on one "device": the dp ranks' batches concatenated
            pieces = [batch(step, r, args, device) for r in range(dp_size)]
            ref_loss = reference(
                torch.cat([i for i, _ in pieces]), torch.cat([t for _, t in pieces])
            )
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            worst = max(worst, abs(loss - ref_loss.item()))
            line += f"  (single-device model: {ref_loss.item():.6f})"
        if me == 0:
            print(line, flush=True)
    if reference is not None:
        # weights after training: this rank's shard of the reference's output layer
        tp_rank, rows = mp.get_tensor_model_parallel_rank(), args.vocab // tp_size
        shard = reference.lm_head.weight[tp_rank * rows : (tp_rank + 1) * rows]
        diff = torch.tensor([worst, (model.lm_head.weight - shard).abs().max().item()])
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        if me == 0:
            print(
                f"max |loss - single-device loss| = {diff[0]:.3e}; "
                f"max |weight - single-device weight| = {diff[1]:.3e}",
                flush=True,
            )
            assert diff.max() < 1e-9, "tensor-parallel model diverged from the single-device one"
    mp.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
