"""The composition property test's two models (see ``test_composition.py``).

- :func:`reference_run`: a float64 (or float32) single-process model written here in plain
  PyTorch from a dict of full weights: vocab embedding, pre-LayerNorm causal attention, dense
  GeLU MLP, a MoE block (top-k softmax routing with optional capacity dropping per routing
  chunk, Switch auxiliary loss, SwiGLU experts with biases, a gated SwiGLU shared expert), the
  LM head and the mean cross-entropy; two clipped AdamW steps with ``torch.optim.AdamW`` and
  ``torch.nn.utils.clip_grad_norm_``.
- :func:`shard`: this rank's piece of a full weight, cut by the test's own rules (the q/k/v and
  SwiGLU gate/up blocks split one by one, experts by expert-parallel rank, expert features by
  expert-tensor-parallel rank), never by mtp's helpers.
- :func:`build_mtp_model`: the same model from mtp's layers, loaded with :func:`shard`.

Weights are in mtp's full layout (``experts.weight1 [E, H, 2F]``, ``x @ w``; the others as
``nn.Linear``/``nn.Embedding`` store them), so the full state dict compares name by name.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

V, H, HEADS, FFN, E, FE, FS = 64, 16, 4, 32, 4, 8, 8
S, B = 8, 2  # sequence length, sequences per data-parallel replica
AUX = 0.05
LR, EPS, WD, CLIP = 1e-2, 1e-3, 0.1, 0.05  # a large Adam eps keeps the update sensitive to clipping


@dataclasses.dataclass(frozen=True)
class Config:
    world: int
    tp: int = 1
    ep: int = 1
    etp: int = 1
    sp: bool = False
    dispatcher: str = "alltoall"
    topk: int = 2
    capacity: float | None = None
    zero_token: bool = False  # the experts of the last expert-parallel rank get no tokens
    optim: str = "ddp"  # "ddp" (DDP + clip_grad_norm + torch AdamW), "distopt", "mixed"
    fused_loss: bool = False
    micro_batches: int = 1
    seed: int = 0

    @property
    def dp(self) -> int:
        return self.world // self.tp

    def __str__(self) -> str:
        parts = [f"w{self.world}", f"tp{self.tp}", f"ep{self.ep}", f"etp{self.etp}"]
        parts += ["sp"] if self.sp else []
        parts += [self.dispatcher, f"top{self.topk}"]
        parts += [f"cap{self.capacity}"] if self.capacity else ["dropless"]
        parts += ["zero"] if self.zero_token else []
        parts += [self.optim] + (["lce"] if self.fused_loss else [])
        parts += [f"mb{self.micro_batches}"] if self.micro_batches > 1 else []
        return "-".join(parts + [f"s{self.seed}"])


# --------------------------------------------------------------------------------------------
# Full weights and data
# --------------------------------------------------------------------------------------------


def full_weights(cfg: Config) -> dict[str, torch.Tensor]:
    """float64 full weights (mtp's names and full layout), drawn from ``cfg.seed``."""
    g = torch.Generator().manual_seed(1000 + cfg.seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    w = {"embedding.weight": rnd(V, H)}
    for ln in ("ln1", "ln2", "ln3", "lnf"):
        w[f"{ln}.weight"] = 1 + rnd(H, scale=0.1)
        w[f"{ln}.bias"] = rnd(H, scale=0.1)
    w["attn.linear_qkv.weight"] = rnd(3 * H, H, scale=H**-0.5)
    w["attn.linear_qkv.bias"] = rnd(3 * H, scale=0.1)
    w["attn.linear_proj.weight"] = rnd(H, H, scale=H**-0.5)
    w["attn.linear_proj.bias"] = rnd(H, scale=0.1)
    w["mlp.linear_fc1.weight"] = rnd(FFN, H, scale=H**-0.5)
    w["mlp.linear_fc1.bias"] = rnd(FFN, scale=0.1)
    w["mlp.linear_fc2.weight"] = rnd(H, FFN, scale=FFN**-0.5)
    w["mlp.linear_fc2.bias"] = rnd(H, scale=0.1)
    w["moe.router.weight"] = rnd(E, H, scale=0.5)
    bias = rnd(E, scale=0.1)
    if cfg.zero_token:
        bias[E - E // cfg.ep :] = -30.0  # never in any token's top-k
    w["moe.router.bias"] = bias
    w["moe.experts.weight1"] = rnd(E, H, 2 * FE, scale=H**-0.5)
    w["moe.experts.weight2"] = rnd(E, FE, H, scale=FE**-0.5)
    w["moe.experts.bias1"] = rnd(E, 2 * FE, scale=0.1)
    w["moe.experts.bias2"] = rnd(E, H, scale=0.1)
    w["moe.shared_experts.linear_fc1.weight"] = rnd(2 * FS, H, scale=H**-0.5)
    w["moe.shared_experts.linear_fc2.weight"] = rnd(H, FS, scale=FS**-0.5)
    w["moe.shared_experts.gate_weight"] = rnd(1, H, scale=0.5)
    w["head.weight"] = rnd(V, H, scale=H**-0.5)
    return w


def batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)`` ``[S, dp * B]``: replica ``d`` holds columns ``[d B, (d+1) B)``."""
    g = torch.Generator().manual_seed(7919 * (cfg.seed + 1) + step)
    ids = torch.randint(0, V, (S + 1, cfg.dp * B), generator=g)
    return ids[:-1], ids[1:]


# --------------------------------------------------------------------------------------------
# The reference model
# --------------------------------------------------------------------------------------------


def _swiglu(h):
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b


def _moe_chunk(x, w, cfg):
    """``(out [T, H], scores [T, E], topk map [T, E])`` of one routing chunk ``x [T, H]``."""
    t = x.shape[0]
    logits = x @ w["moe.router.weight"].t() + w["moe.router.bias"]
    top, idx = logits.topk(cfg.topk, dim=1)
    probs = torch.softmax(top, dim=1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if cfg.capacity is not None:
        cap = min(math.ceil(t * cfg.topk / E * cfg.capacity), t)
        for e in range(E):
            p = probs.detach()
            pairs = sorted((-float(p[i, j]), i, j) for i in range(t) for j in range(cfg.topk)
                           if int(idx[i, j]) == e)  # fmt: skip
            for _, i, j in pairs[cap:]:
                keep[i, j] = False
    out = x.new_zeros(t, H)
    for j in range(cfg.topk):
        e = idx[:, j]
        h = _swiglu(torch.einsum("th,thf->tf", x, w["moe.experts.weight1"][e])
                    + w["moe.experts.bias1"][e])  # fmt: skip
        h = h * probs[:, j : j + 1]
        y = torch.einsum("tf,tfh->th", h, w["moe.experts.weight2"][e]) + w["moe.experts.bias2"][e]
        out = out + torch.where(keep[:, j : j + 1], y, torch.zeros_like(y))
    shared = _swiglu(x @ w["moe.shared_experts.linear_fc1.weight"].t())
    shared = shared @ w["moe.shared_experts.linear_fc2.weight"].t()
    out = out + torch.sigmoid(x @ w["moe.shared_experts.gate_weight"].t()) * shared
    tmap = torch.zeros(t, E, dtype=x.dtype).scatter(1, idx, 1.0)
    return out, torch.softmax(logits, dim=1), tmap


def _moe(x, w, cfg):
    """MoE of one micro-batch of one replica ``x [s, b, H]``: routing chunks are the
    tensor-parallel ranks' sequence slices; returns ``(out, aux loss)``."""
    s, b, _ = x.shape
    outs, scores, maps = [], [], []
    for chunk in x.chunk(cfg.tp, dim=0):
        out, sc, tm = _moe_chunk(chunk.reshape(-1, H), w, cfg)
        outs.append(out.view(chunk.shape))
        scores.append(sc)
        maps.append(tm)
    scores, maps = torch.cat(scores), torch.cat(maps)
    n = s * b
    aux = AUX * E / (cfg.topk * n * n) * (scores.sum(0) * maps.sum(0)).sum()
    return torch.cat(outs), aux


def _ln(x, w, name):
    return F.layer_norm(x, (H,), w[f"{name}.weight"], w[f"{name}.bias"], 1e-5)


def reference_loss(w, tokens, targets, cfg):
    """``(cross-entropy, total loss)`` of one micro-batch of one replica (``[s, b]`` ids)."""
    x = w["embedding.weight"][tokens]
    s, b, _ = x.shape
    qkv = _ln(x, w, "ln1") @ w["attn.linear_qkv.weight"].t() + w["attn.linear_qkv.bias"]
    q, k, v = (t.reshape(s, b, HEADS, H // HEADS).permute(1, 2, 0, 3) for t in qkv.chunk(3, -1))
    ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3)
    x = x + ctx.reshape(s, b, H) @ w["attn.linear_proj.weight"].t() + w["attn.linear_proj.bias"]
    h = F.gelu(_ln(x, w, "ln2") @ w["mlp.linear_fc1.weight"].t() + w["mlp.linear_fc1.bias"])
    x = x + h @ w["mlp.linear_fc2.weight"].t() + w["mlp.linear_fc2.bias"]
    moe, aux = _moe(_ln(x, w, "ln3"), w, cfg)
    x = x + moe
    logits = _ln(x, w, "lnf") @ w["head.weight"].t()
    ce = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    return ce, ce + aux


def reference_run(cfg: Config, dtype=torch.float64, steps: int = 2) -> dict:
    """Losses, full gradients (first step), norms and the weights after each clipped AdamW step
    of the single-process model in ``dtype``."""
    params = {k: nn.Parameter(v.to(dtype)) for k, v in full_weights(cfg).items()}
    opt = torch.optim.AdamW(params.values(), lr=LR, eps=EPS, weight_decay=WD)
    out = {"ce": [], "norm": [], "grads": None, "params": []}
    mb = cfg.micro_batches
    for step in range(steps):
        tokens, targets = batch(cfg, step)
        opt.zero_grad()
        ce_total = 0.0
        for d in range(cfg.dp):
            cols = slice(d * B, (d + 1) * B)
            for m in range(mb):
                sub = slice(cols.start + m * B // mb, cols.start + (m + 1) * B // mb)
                ce, loss = reference_loss(params, tokens[:, sub], targets[:, sub], cfg)
                (loss / (cfg.dp * mb)).backward()
                ce_total += float(ce.detach()) / (cfg.dp * mb)
        out["ce"].append(ce_total)
        if step == 0:
            out["grads"] = {k: p.grad.detach().clone() for k, p in params.items()}
        out["norm"].append(float(torch.nn.utils.clip_grad_norm_(params.values(), CLIP)))
        opt.step()
        out["params"].append({k: p.detach().clone() for k, p in params.items()})
    return out


# --------------------------------------------------------------------------------------------
# The test's own sharding
# --------------------------------------------------------------------------------------------


def _cut(t, dim, rank, world, blocks=1):
    """Chunk ``rank`` of ``world`` of each of ``blocks`` equal blocks of ``t`` along ``dim``."""
    return torch.cat([blk.chunk(world, dim)[rank] for blk in t.chunk(blocks, dim)], dim)


_TP_ROWS = {"embedding.weight": 1, "mlp.linear_fc1.weight": 1, "mlp.linear_fc1.bias": 1,
            "head.weight": 1, "attn.linear_qkv.weight": 3, "attn.linear_qkv.bias": 3}
_TP_COLS = ("attn.linear_proj.weight", "mlp.linear_fc2.weight")


def shard(name: str, full: torch.Tensor, c: dict) -> torch.Tensor:
    """This rank's piece of ``full`` (coordinates ``c``: tp/ep/etp ranks and sizes)."""
    if name in _TP_ROWS:
        return _cut(full, 0, c["tp_rank"], c["tp"], _TP_ROWS[name])
    if name in _TP_COLS:
        return _cut(full, 1, c["tp_rank"], c["tp"])
    if name.startswith("moe.experts."):
        local = full.chunk(c["ep"], 0)[c["ep_rank"]]
        if name.endswith("weight1"):
            return _cut(local, 2, c["etp_rank"], c["etp"], 2)  # gate block, then up block
        if name.endswith("bias1"):
            return _cut(local, 1, c["etp_rank"], c["etp"], 2)
        if name.endswith("weight2"):
            return _cut(local, 1, c["etp_rank"], c["etp"])
        return local  # bias2: replicated over expert-TP
    return full


# --------------------------------------------------------------------------------------------
# The model from mtp's layers
# --------------------------------------------------------------------------------------------


class TinyModel(nn.Module):
    def __init__(self, cfg: Config) -> None:
        from mtp.moe import MoELayer
        from mtp.tensor_parallel import (
            ColumnParallelLinear,
            ParallelMLP,
            ParallelSelfAttention,
            VocabParallelEmbedding,
        )

        super().__init__()
        sp, no_init = cfg.sp, dict(perform_initialization=False)
        self.embedding = VocabParallelEmbedding(V, H, sequence_parallel=sp, **no_init)
        self.ln1, self.ln2, self.ln3, self.lnf = (nn.LayerNorm(H) for _ in range(4))
        self.attn = ParallelSelfAttention(H, HEADS, sequence_parallel=sp, **no_init)
        self.mlp = ParallelMLP(H, FFN, activation="gelu", sequence_parallel=sp, **no_init)
        self.moe = MoELayer(
            H, FE, E, cfg.topk, sequence_parallel=sp, capacity_factor=cfg.capacity,
            activation="swiglu", bias=True, token_dispatcher_type=cfg.dispatcher,
            shared_expert_intermediate_size=FS, shared_expert_gate=True, aux_loss_coeff=AUX,
            router_bias=True, **no_init,
        )  # fmt: skip
        self.head = ColumnParallelLinear(H, V, bias=False, sequence_parallel=sp, **no_init)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        x = x + self.moe(self.ln3(x))
        return self.lnf(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(tokens))


def coordinates() -> dict:
    import mtp.parallel as mp

    return dict(
        tp_rank=mp.get_tensor_model_parallel_rank(), tp=mp.get_tensor_model_parallel_world_size(),
        ep_rank=mp.get_expert_model_parallel_rank(),
        ep=mp.get_expert_model_parallel_world_size(),
        etp_rank=mp.get_expert_tensor_parallel_rank(),
        etp=mp.get_expert_tensor_parallel_world_size(),
    )  # fmt: skip


@torch.no_grad()
def build_mtp_model(cfg: Config) -> TinyModel:
    """The mtp model of ``cfg`` on this rank, holding this rank's :func:`shard` of the weights
    (``mtp.parallel`` initialised); sequence-parallel parameters marked by
    :func:`mtp.tensor_parallel.mark_sequence_parallel_parameters` on the whole model."""
    from mtp.tensor_parallel import mark_sequence_parallel_parameters

    model = TinyModel(cfg)
    full, c = full_weights(cfg), coordinates()
    names = dict(model.named_parameters())
    assert set(names) == set(full), set(names) ^ set(full)
    for name, p in names.items():
        p.copy_(shard(name, full[name], c))
    if cfg.sp:
        mark_sequence_parallel_parameters(model)
    return model
