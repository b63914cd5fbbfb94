"""`make demo`: a small GPT (or its MoE variant) trained end to end with mtp on CPU or GPUs.

    torchrun --nproc-per-node 4 examples/demo_train.py                  # tp=2 x dp=2, dense
    torchrun --nproc-per-node 4 examples/demo_train.py --moe --ep 2     # + experts over ep=2

Everything mtp offers for training is in the loop: tensor-parallel layers with sequence
parallelism (``VocabParallelEmbedding``, ``ParallelSelfAttention``, ``ParallelMLP``, a
column-parallel output layer), expert-parallel ``MoELayer`` blocks, the vocab-parallel
cross-entropy (the logits are never gathered), data parallelism through
``mtp.optim.DistributedDataParallel`` and the ZeRO-1 ``DistributedOptimizer`` (AdamW, gradient
clipping). The corpus is generated (character level, sentences of a small grammar), so the loss
falls quickly from ln(128). Rank 0 shows a progress bar, prints the loss and tokens/s, checks
that every tensor-parallel rank computed the same loss, and writes a PNG of the curve.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import mtp.parallel as mp
from mtp.moe import MoELayer
from mtp.optim import DistributedDataParallel, DistributedOptimizer
from mtp.tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    VocabParallelEmbedding,
    VocabParallelLinearCrossEntropy,
    mark_sequence_parallel_parameters,
    vocab_parallel_cross_entropy,
)

VOCAB = 128  # bytes of ASCII text


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------

_WORDS = {
    "adj": "small red quick lazy bright quiet old new happy green".split(),
    "noun": "cat dog bird fox tree river house robot child model".split(),
    "verb": "sees likes follows finds chases helps watches trains".split(),
}


def make_corpus(n_sentences: int = 4000, seed: int = 0) -> bytes:
    """Sentences ``the <adj> <noun> <verb> the <adj> <noun>.`` drawn from a fixed seed."""
    rng = random.Random(seed)
    pick = lambda kind: rng.choice(_WORDS[kind])  # noqa: E731
    lines = [
        f"the {pick('adj')} {pick('noun')} {pick('verb')} the {pick('adj')} {pick('noun')}."
        for _ in range(n_sentences)
    ]
    return " ".join(lines).encode("ascii")


def get_batch(data: torch.Tensor, seq: int, batch: int, step: int, dp_rank: int):
    """``(tokens, targets)`` ``[s, b]`` for this data-parallel rank (same on its tp ranks)."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g, device="cpu")
    window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()], dim=1)
    return window[:-1].long(), window[1:].long()


# --------------------------------------------------------------------------------------------
# Model ([s, b, h] layout, sequence parallel between the blocks)
# --------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, args) -> None:
        super().__init__()
        sp = args.tp > 1
        self.norm1 = nn.LayerNorm(args.hidden)
        self.attn = ParallelSelfAttention(args.hidden, args.heads, sequence_parallel=sp)
        self.norm2 = nn.LayerNorm(args.hidden)
        if args.moe:
            self.mlp = MoELayer(  # takes this rank's sequence chunk under sequence parallelism
                args.hidden, 2 * args.hidden, args.experts, args.topk, aux_loss_coeff=1e-2,
                sequence_parallel=sp,
            )
        else:
            self.mlp = ParallelMLP(args.hidden, 4 * args.hidden, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, args) -> None:
        super().__init__()
        sp = args.tp > 1
        self.tp_rank = mp.get_tensor_model_parallel_rank()
        self.embed = VocabParallelEmbedding(VOCAB, args.hidden, sequence_parallel=sp)
        self.pos = nn.Parameter(torch.randn(args.seq, 1, args.hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.layers))
        self.norm = nn.LayerNorm(args.hidden)
        self.head = ColumnParallelLinear(args.hidden, VOCAB, bias=False, sequence_parallel=sp)
        if sp:  # replicated parameters that see this rank's sequence chunk: partial gradients
            # (the layers' attributes say which: shards, experts and the MoE router / shared
            # expert, whose gradients the layer already sums over tp, are left alone)
            mark_sequence_parallel_parameters(self)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[s, b]`` ids -> ``[s(/tp), b, h]`` the final hidden states (this rank's chunk)."""
        x = self.embed(tokens)  # [s/tp, b, h] under sequence parallel
        chunk = x.size(0)  # positions of this rank's chunk
        x = x + self.pos[self.tp_rank * chunk : (self.tp_rank + 1) * chunk]
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[s, b]`` ids -> ``[s, b, V/tp]`` this rank's vocabulary shard of the logits."""
        return self.head(self.hidden(tokens))


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ep", type=int, default=None,
                   help="expert parallel size (with --moe; default and with tp > 1: = tp)")
    p.add_argument("--moe", action="store_true", help="MoE blocks instead of dense MLPs")
    p.add_argument("--fused-loss", action="store_true",
                   help="LM head + loss fused (VocabParallelLinearCrossEntropy: no logits)")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", default="demo_loss.png", help="loss curve ('' to skip)")
    p.add_argument("--json", default="", help="write a summary here (rank 0)")
    p.add_argument("--log-every", type=int, default=25)
    return p.parse_args(argv)


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")  # one write per line: ranks share stdout
    sys.stdout.flush()


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)


def _plot(losses: list[float], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _say("matplotlib is not installed: no PNG (pip install mtp[bench])")
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.axhline(math.log(VOCAB), ls="--", c="gray", lw=0.8, label="ln(128): uniform guess")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.moe:
        args.ep = args.tp if args.ep is None else args.ep
        if args.tp > 1 and args.ep != args.tp:
            # the tp ranks hold different sequence chunks; the experts must see all of them
            raise ValueError(f"--moe with --tp {args.tp} needs --ep {args.tp} (got {args.ep})")
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    data = torch.frombuffer(bytearray(make_corpus(seed=args.seed)), dtype=torch.uint8)
    device = torch.device("cuda" if cuda else "cpu")
    torch.set_default_device(device)
    mp.initialize_model_parallel(
        tensor_model_parallel_size=args.tp,
        expert_model_parallel_size=args.ep or 1,
        expert_tensor_parallel_size=1,
    )
    rank, dp_rank = dist.get_rank(), mp.get_data_parallel_rank()
    torch.manual_seed(args.seed)  # same full weights everywhere; each rank keeps its shards
    model = DistributedDataParallel(TinyGPT(args), use_distributed_optimizer=True)
    opt = DistributedOptimizer(torch.optim.AdamW, model, lr=args.lr, weight_decay=0.01,
                               clip_grad=1.0)
    fused_loss = None
    if args.fused_loss:  # shares the head's weight (reduction="mean" over the tokens)
        fused_loss = VocabParallelLinearCrossEntropy.from_column_parallel(
            model.module.head, chunk_size=256
        )
    sizes = mp.get_parallel_sizes()
    kind = f"MoE ({args.experts} experts, top-{args.topk})" if args.moe else "dense"
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        _say(f"demo: {kind} GPT, world={dist.get_world_size()} tp={sizes.tp} dp={sizes.dp} "
             f"ep={sizes.ep}, {params} parameters on rank 0, {len(data)} corpus bytes")
    bar = _progress(args.steps, rank == 0)
    losses, tp_equal, start = [], True, time.perf_counter()
    tokens_per_step = args.seq * args.batch * sizes.dp
    for step in range(args.steps):
        tokens, targets = get_batch(data, args.seq, args.batch, step, dp_rank)
        tokens, targets = tokens.to(device), targets.to(device)
        opt.zero_grad()
        if fused_loss is not None:  # the head's GEMM and the loss chunk by chunk, no logits
            loss = fused_loss(model.module.hidden(tokens), targets)
        else:
            loss = vocab_parallel_cross_entropy(model(tokens), targets).mean()
        loss.backward()
        opt.step()
        # the loss is replicated over tp; average it over dp for the curve
        value = loss.detach().clone()
        same = torch.stack([value, -value])
        dist.all_reduce(same, op=dist.ReduceOp.MAX, group=mp.get_tensor_model_parallel_group())
        tp_equal &= bool(same[0] == value and -same[1] == value)
        dist.all_reduce(value, group=mp.get_data_parallel_group())
        losses.append(float(value) / sizes.dp)
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            bar.update()
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            rate = tokens_per_step * (step + 1) / (time.perf_counter() - start)
            line = f"step {step:4d}  loss {losses[-1]:.4f}  {rate:,.0f} tokens/s"
            if bar is not None:
                bar.write(line, file=sys.stdout)
            else:
                _say(line)
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    flag = torch.tensor([int(tp_equal)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    summary = {
        "model": kind, "tp": sizes.tp, "dp": sizes.dp, "ep": sizes.ep, "losses": losses,
        "tokens_per_s": tokens_per_step * args.steps / elapsed, "seconds": elapsed,
        "tp_ranks_equal": bool(flag.item()),
    }
    if rank == 0:
        _say(f"done: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps, "
             f"{summary['tokens_per_s']:,.0f} tokens/s, {elapsed:.1f} s; tensor-parallel ranks "
             f"computed {'the same' if summary['tp_ranks_equal'] else 'DIFFERENT'} losses")
        if args.png and _plot(losses, args.png, f"mtp demo: {kind} GPT, tp={sizes.tp} "
                              f"dp={sizes.dp} ep={sizes.ep}"):
            _say(f"wrote {args.png}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f)
    mp.destroy_model_parallel()
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
