"""Run a model split into pipeline stages: 1F1B / interleaved 1F1B over point-to-point sends.

Rank ``r`` of the pipeline group (size ``pp``) holds ``vpp = len(model_chunks)`` chunks; chunk
``c`` of rank ``r`` is virtual stage ``c * pp + r`` of ``pp * vpp`` (Megatron-Core's layout).
The rank executes its order (:func:`mtp.pipeline.get_pipeline_order`) step by step:

- forward ``(c, m)``: receive the activation from virtual stage ``v - 1`` (the first stage reads
  ``inputs[m]``), run the chunk, send the output to stage ``v + 1``; the last stage computes
  ``loss_func(output, m)`` instead.
- backward ``(c, m)``: receive the gradient of the output from stage ``v + 1`` (the last stage
  starts from ``loss / num_microbatches``), back-propagate, send the input's gradient to
  stage ``v - 1``.

Messages are ``torch.distributed.P2POp`` lists run by ``batch_isend_irecv`` (works with gloo and
NCCL); every message has its own tag (kind, chunk, microbatch), so matching never depends on
arrival order. Receives are waited for before the step that needs them, sends are waited for at
the end. Activation shapes and dtypes are given (``tensor_shape``/``dtype``) or sent once per
channel (the first message on it carries them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mtp.dtypes import FLOATS

from .schedules import check_schedule_args, get_pipeline_order, order_to_steps

__all__ = ["forward_backward_pipelining", "PipelineCommunicator"]

_META_LEN = 10  # dtype code, ndim, up to 8 dims
_DTYPES = FLOATS  # index = the dtype code in the metadata message
_KIND_META, _KIND_ACT, _KIND_GRAD = 0, 1, 2


class PipelineCommunicator:
    """Point-to-point messages between virtual pipeline stages (tags keep them apart).

    ``send(kind, chunk, mb, tensor, dst_rank)``/``recv(kind, chunk, mb, like, src_rank)``: ``chunk``
    is the receiver's local chunk; ranks are pipeline-group ranks. A message to oneself (one
    stage holding consecutive chunks) stays in a local mailbox.
    """

    def __init__(self, group: dist.ProcessGroup | None, num_microbatches: int, num_chunks: int):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.m, self.vpp = num_microbatches, num_chunks
        self.pending: list = []
        self.local: dict[int, torch.Tensor] = {}

    def _tag(self, kind: int, chunk: int, mb: int) -> int:
        return kind + 3 * (mb + self.m * chunk)

    def _global(self, peer: int) -> int:
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def send(self, kind: int, chunk: int, mb: int, tensor: torch.Tensor, dst: int) -> None:
        tag = self._tag(kind, chunk, mb)
        tensor = tensor.detach().contiguous()
        if dst == self.rank:
            self.local[tag] = tensor
            return
        op = dist.P2POp(dist.isend, tensor, self._global(dst), self.group, tag)
        # keep each sent tensor alive until its send completes, not until the end of the step
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]
        self.pending += [(w, tensor) for w in dist.batch_isend_irecv([op])]

    def recv(self, kind, chunk, mb, shape, dtype, device, src: int) -> torch.Tensor:
        tag = self._tag(kind, chunk, mb)
        if src == self.rank:
            return self.local.pop(tag)
        out = torch.empty(shape, dtype=dtype, device=device)
        op = dist.P2POp(dist.irecv, out, self._global(src), self.group, tag)
        for work in dist.batch_isend_irecv([op]):
            work.wait()
        return out

    def send_meta(self, chunk: int, tensor: torch.Tensor, dst: int) -> None:
        if tensor.dim() > _META_LEN - 2 or tensor.dtype not in _DTYPES:
            raise ValueError(
                f"stage outputs must have at most {_META_LEN - 2} dims and a dtype in {_DTYPES}, "
                f"got {tuple(tensor.shape)} {tensor.dtype} (or pass tensor_shape and dtype)"
            )
        meta = torch.zeros(_META_LEN, dtype=torch.int64)
        meta[0], meta[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        meta[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        self.send(_KIND_META, chunk, 0, meta.to(tensor.device), dst)

    def recv_meta(self, chunk: int, device, src: int) -> tuple[tuple[int, ...], torch.dtype]:
        meta = self.recv(_KIND_META, chunk, 0, (_META_LEN,), torch.int64, device, src).tolist()
        return tuple(meta[2 : 2 + meta[1]]), _DTYPES[meta[0]]

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def _device_of(chunks: Sequence[nn.Module], inputs) -> torch.device:
    for chunk in chunks:
        for p in chunk.parameters():
            return p.device
    if inputs:
        return inputs[0].device
    return torch.device("cpu")


def _check_args(model_chunks, inputs, num_microbatches, loss_func):
    if isinstance(model_chunks, nn.Module):
        model_chunks = [model_chunks]
    if not model_chunks or not all(isinstance(c, nn.Module) for c in model_chunks):
        raise TypeError("model_chunks must be an nn.Module or a non-empty list of nn.Modules")
    if not callable(loss_func):
        raise TypeError(f"loss_func must be callable, got {type(loss_func).__name__}")
    if inputs is not None and len(inputs) < num_microbatches:
        raise ValueError(f"inputs has {len(inputs)} microbatches, need num_microbatches="
                         f"{num_microbatches}")
    return list(model_chunks)


def forward_backward_pipelining(
    model_chunks: nn.Module | Sequence[nn.Module],
    inputs: Sequence[torch.Tensor] | None,
    loss_func: Callable[[torch.Tensor, int], torch.Tensor],
    *,
    num_microbatches: int,
    pp_group: dist.ProcessGroup | None = None,
    microbatch_group_size_per_vp_stage: int | None = None,
    tensor_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    forward_only: bool = False,
) -> list[torch.Tensor]:
    """One training step's forwards and backwards over a pipeline group.

    Args:
        model_chunks: this rank's chunks (one module: 1F1B; ``vpp > 1`` modules: interleaved).
            Chunk ``c`` is virtual stage ``c * pp + r``; each maps one tensor to one tensor.
        inputs: ``num_microbatches`` input tensors of the first stage (read on pipeline rank 0
            only; others may pass None).
        loss_func: ``(last_stage_output, microbatch) -> scalar loss``, on the last stage. The
            step back-propagates ``sum(losses) / num_microbatches``.
        num_microbatches: ``M``.
        pp_group: the pipeline group (None: the default group).
        microbatch_group_size_per_vp_stage: microbatches per chunk turn (default ``pp``).
        tensor_shape, dtype: of every activation between stages; None: exchanged once per
            channel.
        forward_only: no backwards (evaluation).

    Returns:
        The per-microbatch losses (detached) on the last pipeline rank, ``[]`` elsewhere.
        Gradients accumulate into the chunks' ``.grad``.
    """
    chunks = _check_args(model_chunks, inputs, num_microbatches, loss_func)
    comm = PipelineCommunicator(pp_group, num_microbatches, len(chunks))
    pp, rank, vpp = comm.size, comm.rank, len(chunks)
    group = check_schedule_args(pp, num_microbatches, vpp, microbatch_group_size_per_vp_stage)
    if rank == 0 and inputs is None:
        raise ValueError("inputs must be given on the first pipeline rank")
    if forward_only:
        steps = [s for s in order_to_steps(
            get_pipeline_order(pp, rank, num_microbatches, vpp, group), vpp) if s.forward]
    else:
        steps = order_to_steps(get_pipeline_order(pp, rank, num_microbatches, vpp, group), vpp)
    device = _device_of(chunks, inputs)
    state = _RunState(comm, chunks, inputs, loss_func, num_microbatches, device, tensor_shape,
                      dtype, forward_only)
    for step in steps:
        if step.forward:
            state.forward(step.chunk, step.microbatch)
        else:
            state.backward(step.chunk, step.microbatch)
    comm.wait_all()
    return state.losses if state.is_last(vpp - 1) and state.losses else []


class _RunState:
    def __init__(self, comm, chunks, inputs, loss_func, m, device, shape, dtype, forward_only):
        self.comm, self.chunks, self.inputs, self.loss_func = comm, chunks, inputs, loss_func
        self.m, self.device, self.forward_only = m, device, forward_only
        self.pp, self.rank, self.vpp = comm.size, comm.rank, len(chunks)
        self.shape = None if shape is None else tuple(shape)
        self.dtype = dtype
        self.recv_meta: dict[int, tuple] = {}
        self.sent_meta: set[int] = set()
        self.saved: dict[tuple[int, int], tuple] = {}
        self.losses: list[torch.Tensor] = []

    def is_first(self, chunk: int) -> bool:
        return chunk == 0 and self.rank == 0

    def is_last(self, chunk: int) -> bool:
        return chunk == self.vpp - 1 and self.rank == self.pp - 1

    def prev(self, chunk: int) -> tuple[int, int]:
        """(rank, chunk) of the previous virtual stage."""
        return (self.rank - 1, chunk) if self.rank > 0 else (self.pp - 1, chunk - 1)

    def next(self, chunk: int) -> tuple[int, int]:
        return (self.rank + 1, chunk) if self.rank < self.pp - 1 else (0, chunk + 1)

    def _act_meta(self, chunk: int, src: int):
        if self.shape is not None:
            return self.shape, self.dtype or torch.float32
        if chunk not in self.recv_meta:
            self.recv_meta[chunk] = self.comm.recv_meta(chunk, self.device, src)
        return self.recv_meta[chunk]

    def forward(self, chunk: int, mb: int) -> None:
        if self.is_first(chunk):
            x = self.inputs[mb]
        else:
            src, _ = self.prev(chunk)
            shape, dtype = self._act_meta(chunk, src)
            x = self.comm.recv(_KIND_ACT, chunk, mb, shape, dtype, self.device, src)
            x.requires_grad_(not self.forward_only)
        with torch.set_grad_enabled(not self.forward_only):
            y = self.chunks[chunk](x)
        if self.is_last(chunk):
            loss = self.loss_func(y, mb)
            self.losses.append(loss.detach())
            y = loss / self.m
        else:
            if not isinstance(y, torch.Tensor):
                raise TypeError(f"chunk {chunk} must return one tensor, got {type(y).__name__}")
            dst, dst_chunk = self.next(chunk)
            if self.shape is None and dst_chunk not in self.sent_meta:
                self.comm.send_meta(dst_chunk, y, dst)
                self.sent_meta.add(dst_chunk)
            self.comm.send(_KIND_ACT, dst_chunk, mb, y, dst)
        if not self.forward_only:
            self.saved[(chunk, mb)] = (x, y)

    def backward(self, chunk: int, mb: int) -> None:
        x, y = self.saved.pop((chunk, mb))
        if self.is_last(chunk):
            torch.autograd.backward(y)
        else:
            src, _ = self.next(chunk)
            grad = self.comm.recv(_KIND_GRAD, chunk, mb, y.shape, y.dtype, self.device, src)
            torch.autograd.backward(y, grad)
        if not self.is_first(chunk):
            dst, dst_chunk = self.prev(chunk)
            gx = x.grad if x.grad is not None else torch.zeros_like(x)
            self.comm.send(_KIND_GRAD, dst_chunk, mb, gx, dst)
