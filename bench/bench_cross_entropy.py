"""Fused (vocab-parallel) cross-entropy: ``mtp.ops.vocab_parallel_cross_entropy``.

Timed on one GPU (no tensor parallelism: the whole vocab on one rank), ``reduction="mean"`` and
``validate=False`` (the target-range check runs on the device, one ``_assert_async`` per call;
a trainer turns it off once its data is known to be good). Compared with: mtp's backends,
plain PyTorch (``F.cross_entropy(logits.float(), target)``) and ``torch.compile`` of it,
Liger-Kernel's
``LigerCrossEntropyLoss``, Transformer Engine's ``parallel_cross_entropy`` and Megatron-Core's
``vocab_parallel_cross_entropy`` (on a one-rank tensor-parallel group) when installed. Liger and
Transformer Engine compute the gradient during the forward and write it into the logits.

Bytes (``R`` rows, vocab ``V``, ``s`` = element size of the logits, ``si`` of the targets):

- forward: read the logits and targets, write the loss: ``R*V*s + R*si + 4*R``;
- forward+backward: the floor of a fused loss that writes the gradient while it reads the
  logits once: ``2*R*V*s + R*si + 8*R`` (loss out, ``dloss`` in). mtp computes the gradient in
  the forward (one read of each row, one write of the gradient; its backward moves no data
  for a unit upstream gradient), as Liger and Transformer Engine do.

Structure (CPU, :func:`structure`): the collectives of the vocab-parallel loss on real gloo
process groups, counted with :func:`mtp.testing.count_collectives`: one ``all_gather`` of
``3 * (R + 2)`` fp32 per rank (the row statistics and two metadata rows) forward, nothing
backward. :func:`traffic_cases`: the mid-size shapes of the bytes / floor column.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mtp.ops as ops
from mtp.ops.cross_entropy import vocab_parallel_cross_entropy_reference
from mtp.parallel.collective_check import ROW_WIDTH

from .core import (
    FLOAT64,
    Case,
    Provider,
    Run,
    compiled,
    import_peer,
    needs_compile,
    needs_cuda,
    peer_attr,
    randn,
    seeded,
    upcast,
)

FAMILY = "cross_entropy"
OPS = ("cross_entropy",)
BACKENDS = ("triton", "reference")

_SHAPES = {  # (rows, vocab)
    "smoke": [(7, 50), (33, 300)],
    "quick": [(8192, 128256)],
    "full": [(4096, 32000), (8192, 128256), (4096, 151936)],
}


def cross_entropy_bytes(rows: int, vocab: int, s: int, si: int, pass_: str) -> int:
    """Fewest HBM bytes of the loss over ``[rows, vocab]`` logits (see the module doc)."""
    if pass_ == "fwd":
        return rows * vocab * s + rows * si + 4 * rows
    return 2 * rows * vocab * s + rows * si + 8 * rows


def allgather_bytes_per_rank(rows: int) -> int:
    """Bytes each rank contributes to the forward's collectives: the agreement row (int64,
    :mod:`mtp.parallel.collective_check`), then the all-gather of 3 fp32 per row plus two rows
    of metadata (shard size, valid targets, target checksum, range check, rows)."""
    return 8 * ROW_WIDTH + 3 * 4 * (rows + 2)


def cases(size: str, dtype: torch.dtype) -> list[Case]:
    s = torch.empty((), dtype=dtype).element_size()
    return [
        Case("cross_entropy", f"rows={R} V={V}", {"rows": R, "vocab": V}, dtype, pass_,
             bytes=cross_entropy_bytes(R, V, s, 8, pass_))
        for R, V in _SHAPES[size]
        for pass_ in ("fwd", "fwd+bwd")
    ]  # fmt: skip


def traffic_cases(dtype: torch.dtype) -> list[Case]:
    """Mid-size shapes for the CPU bytes / floor figures (the interpreter runs them in
    seconds): a 16-byte-aligned vocab and GPT-2's 50257 (rows not aligned)."""
    s = torch.empty((), dtype=dtype).element_size()
    return [
        Case("cross_entropy", f"rows={R} V={V}", {"rows": R, "vocab": V}, dtype, pass_,
             bytes=cross_entropy_bytes(R, V, s, 8, pass_))
        for R, V in ((64, 8192), (4, 50257))
        for pass_ in ("fwd", "fwd+bwd")
    ]  # fmt: skip


def _megatron_ready(device: torch.device) -> str | None:
    reason = needs_cuda(device) or import_peer(
        "megatron.core.tensor_parallel.cross_entropy", "vocab_parallel_cross_entropy"
    )
    return reason or _megatron_tp1()


def _megatron_tp1() -> str | None:
    """Initialise a one-rank process group and Megatron-Core's parallel state (once)."""
    import os
    import tempfile

    import torch.distributed as dist

    try:
        from megatron.core import parallel_state

        if not dist.is_initialized():
            store = os.path.join(tempfile.mkdtemp(prefix="mtp-bench-"), "store")
            dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
    except Exception as exc:
        return f"Megatron-Core parallel state not available ({type(exc).__name__}: {exc})"
    return None


def providers(op: str = "cross_entropy") -> list[Provider]:
    return [
        Provider("triton", "mtp"),
        Provider("reference", "baseline"),
        Provider("pytorch", "baseline"),
        Provider("torch.compile", "baseline", cpu=False, needs=needs_compile),
        Provider("liger", "peer", cpu=False,
                 needs=lambda d: import_peer("liger_kernel.transformers", "LigerCrossEntropyLoss")),
        Provider("te", "peer", cpu=False,
                 needs=lambda d: import_peer("transformer_engine.pytorch.cross_entropy",
                                             "parallel_cross_entropy")),
        Provider("megatron", "peer", cpu=False, needs=_megatron_ready),
    ]  # fmt: skip


def pytorch_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: ``F.cross_entropy`` on fp32 logits, mean over the rows."""
    return F.cross_entropy(logits.float(), target)


def _loss_fn(provider: str):
    """``f(logits [R, V], target [R]) -> scalar mean loss``."""
    if provider == FLOAT64:
        return lambda x, t: F.cross_entropy(x, t)
    if provider == "pytorch":
        return pytorch_cross_entropy
    if provider == "torch.compile":
        return compiled(pytorch_cross_entropy)
    if provider == "reference":
        return lambda x, t: vocab_parallel_cross_entropy_reference(
            x, t, reduction="mean", validate=False
        )
    if provider == "liger":
        loss = peer_attr("liger_kernel.transformers", "LigerCrossEntropyLoss")()

        def liger(x, t):
            out = loss(x, t)
            return out[0] if isinstance(out, tuple) else out

        return liger
    if provider == "te":
        te_ce = peer_attr("transformer_engine.pytorch.cross_entropy", "parallel_cross_entropy")
        return lambda x, t: te_ce(x.unsqueeze(0), t.unsqueeze(0), 0.0, False, None).float().mean()
    if provider == "megatron":
        mg_ce = peer_attr(
            "megatron.core.tensor_parallel.cross_entropy", "vocab_parallel_cross_entropy"
        )
        return lambda x, t: mg_ce(x, t).mean()
    return lambda x, t: ops.vocab_parallel_cross_entropy(
        x, t, reduction="mean", validate=False, backend=provider
    )


def setup_cross_entropy(case: Case, provider: str, device: torch.device) -> Run:
    """Mean cross-entropy over ``[rows, vocab]`` logits, forward or forward+backward."""
    R, V = case.params["rows"], case.params["vocab"]
    gen = seeded(case, device)
    logits = randn((R, V), case.dtype, device, gen, 2.0).requires_grad_(case.pass_ != "fwd")
    target = torch.randint(0, V, (R,), generator=gen, device=device)
    logits = upcast(logits, provider)
    f = _loss_fn(provider)
    if case.pass_ == "fwd":
        return Run(lambda: (f(logits, target),), inputs=[logits, target])

    def fwd_bwd():
        loss = f(logits, target)
        return (loss, *torch.autograd.grad(loss, (logits,)))

    return Run(fwd_bwd, inputs=[logits, target])


SETUP = {"cross_entropy": setup_cross_entropy}


# --------------------------------------------------------------------------------------------
# Structure: collectives of the vocab-parallel loss on real process groups (CPU, gloo)
# --------------------------------------------------------------------------------------------


def _collectives_worker(rank: int, world: int, rows: int, v_local: int, backends) -> list[dict]:
    """On each rank: the loss of its vocab shard per backend, its collectives and its error."""
    import torch.distributed as dist

    from mtp.testing import count_collectives

    gen = torch.Generator().manual_seed(1234)
    full = torch.randn(rows, v_local * world, generator=gen)
    target = torch.randint(0, v_local * world, (rows,), generator=gen)
    expected = F.cross_entropy(full.double(), target, reduction="none")
    out = []
    for backend in backends:
        shard = full[:, rank * v_local : (rank + 1) * v_local].clone().requires_grad_(True)
        with count_collectives() as fwd:
            loss = ops.vocab_parallel_cross_entropy(
                shard, target, group=dist.group.WORLD, validate=False, backend=backend
            )
        with count_collectives() as bwd:
            loss.sum().backward()
        err = (loss.double() - expected).norm().item() / expected.norm().item()
        for pass_, log in (("fwd", fwd), ("bwd", bwd)):
            out.append({
                "world_size": world, "backend": backend, "pass": pass_, "rows": rows,
                "calls": [{"name": c.name, "bytes_per_rank": c.nbytes} for c in log.calls],
                "bytes_per_rank": log.nbytes(), "rel_err": err,
            })  # fmt: skip
    return out


def structure(size: str) -> dict:
    """Collectives and bytes per rank of the vocab-parallel loss, by world size and backend."""
    from mtp.testing import run_distributed

    rows, v_local = 24, 40
    rows_out = []
    for world in (2,) if size != "full" else (2, 4):
        per_rank = run_distributed(_collectives_worker, world, rows, v_local, BACKENDS)
        for rec in per_rank[0]:  # every rank sends the same amount; rank 0 speaks for them
            fwd = rec["pass"] == "fwd"
            rec["formula_bytes_per_rank"] = allgather_bytes_per_rank(rows) if fwd else 0
            rec["same_on_all_ranks"] = all(
                r["bytes_per_rank"] == rec["bytes_per_rank"]
                for other in per_rank
                for r in other
                if r["backend"] == rec["backend"] and r["pass"] == rec["pass"]
            )
            rows_out.append(rec)
    return {"cross_entropy_collectives": rows_out}
