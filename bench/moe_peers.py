"""The ``moe_layer`` family's peers: other projects' whole MoE layers, built with the case's E,
top-k, H, F and dtype, SwiGLU experts without biases, softmax over the top-k router logits, and
the weights of mtp's layer copied in (so every peer is checked against the same float64
reference as mtp's backends; its gradients are mapped back to mtp's layout for that check).

- ``megatron-core``: Megatron-Core's ``MoELayer`` (its ``TopKRouter``, fp32 router logits,
  ``MoEAlltoAllTokenDispatcher``) with ``TEGroupedMLP`` when Transformer Engine is installed,
  else ``SequentialMLP`` (the local spec: one ``ColumnParallelLinear``/``RowParallelLinear``
  pair per expert). Megatron-Core's parallel state on one rank (gloo on CPU, NCCL on a GPU).
  Two things it needs on a CUDA-less CPU are supplied while it runs there
  (:func:`_cuda_stand_in`): the dispatcher's side stream and the router's
  ``torch.cuda.current_device()`` (the event wait it makes on a GPU before reading the split
  sizes is counted as one host sync); and without Transformer Engine megatron-core 0.16.1
  leaves ``te_general_gemm`` undefined in ``moe_utils`` (a NameError in the router's
  ``RouterGatingLinearFunction``), so it is set to None, which selects its own ``torch.mm``
  path.
- ``torchtitan``: torchtitan's ``MoE`` (``TokenChoiceTopKRouter`` with softmax and
  ``route_norm``: the same probabilities; ``LocalTokenDispatcher``; ``GroupedExperts`` on
  ``torch._grouped_mm``, ``load_balance_coeff=None``). Its experts compute in bf16 whatever the
  input dtype, so it is checked with the bf16 limit. Input ``[1, T, H]``.
- ``liger``: Liger-Kernel's ``LigerFusedMoEFunction`` (``liger_kernel.ops.fused_moe``; HF v5
  layout: ``gate_up [E, 2F, H]``, gate first, ``down [E, H, F]``) behind a plain-PyTorch router
  (fp32 logits, top-k, softmax over them). Skipped with the reason when Liger-Kernel is not
  installed; not exercised where this was written (no Liger-Kernel there).

Timed on a GPU only, like mtp's providers; on CPU they run in the smoke check and in
:func:`structure`: device ops of a forward and of forward+backward, host syncs, activation
bytes saved per token, next to mtp's ``triton`` layer at the same shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .core import Provider, Skip, check_limit, import_peer, needs_cuda

MEGATRON, TORCHTITAN, LIGER = "megatron-core", "torchtitan", "liger"
PEERS = (MEGATRON, TORCHTITAN, LIGER)
_LIGER = ("liger_kernel.ops.fused_moe", "LigerFusedMoEFunction")


@dataclasses.dataclass
class PeerLayer:
    """A peer built with mtp's weights.

    Attributes:
        forward: ``x [T, H] -> y [T, H]``.
        params: the leaves a forward+backward differentiates (besides the input).
        to_mtp: their gradients -> mtp's ``[router [E, H], weight1 [E, H, 2F],
            weight2 [E, F, H]]``.
        scope: entered around every call (and its backward).
        note: which implementation it is.
    """

    forward: Callable[[torch.Tensor], torch.Tensor]
    params: list[torch.Tensor]
    to_mtp: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    note: str = ""


# --------------------------------------------------------------------------------------------
# Availability
# --------------------------------------------------------------------------------------------


def _megatron_ready(device: torch.device) -> str | None:
    reason = import_peer("megatron.core.transformer.moe.moe_layer", "MoELayer")
    return reason or megatron_single_rank(device)


#: What :func:`megatron_single_rank` set up itself (and :func:`release` undoes).
_OWNED: dict[str, bool] = {"process_group": False, "parallel_state": False}


def megatron_single_rank(device: torch.device) -> str | None:
    """A one-rank process group (gloo on CPU, NCCL on a GPU) and Megatron-Core's parallel
    state on it, once per process (until :func:`release`); None, or why not."""
    import os
    import tempfile

    import torch.distributed as dist

    try:
        from megatron.core import parallel_state

        if not dist.is_initialized():
            store = os.path.join(tempfile.mkdtemp(prefix="mtp-bench-"), "store")
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
            _OWNED["process_group"] = True
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
            _OWNED["parallel_state"] = True
    except Exception as exc:
        return f"Megatron-Core parallel state not available ({type(exc).__name__}: {exc})"
    return None


def release() -> None:
    """Undo what :func:`megatron_single_rank` set up (Megatron-Core's parallel state, the
    process group), so that the process is left as it was (the CLI runs inside pytest)."""
    import torch.distributed as dist

    if _OWNED["parallel_state"]:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        _OWNED["parallel_state"] = False
    if _OWNED["process_group"] and dist.is_initialized():
        dist.destroy_process_group()
    _OWNED["process_group"] = False


def _liger_ready(device: torch.device) -> str | None:
    return import_peer(*_LIGER) or needs_cuda(device)


def peer_providers() -> list[Provider]:
    bf16 = check_limit(torch.bfloat16)
    return [
        Provider(MEGATRON, "peer", needs=_megatron_ready),
        Provider(TORCHTITAN, "peer", tolerance=bf16, note="experts in bf16 (torchtitan)",
                 needs=lambda d: import_peer("torchtitan.models.common.moe", "MoE")),
        Provider(LIGER, "peer", cpu=False, needs=_liger_ready),
    ]  # fmt: skip


def available(device: torch.device) -> list[str]:
    """The peers that can run on ``device``."""
    return [p.name for p in peer_providers() if p.unavailable(device) is None]


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------


def peer_run(peer: PeerLayer, x: torch.Tensor, dy: torch.Tensor, grad: bool):
    """``(fn, for_check)`` of a Run: the forward, or the forward and the gradients of the input
    and every weight (mapped to mtp's layout for the check only)."""
    if not grad:
        def fwd():
            with peer.scope():
                return (peer.forward(x),)

        return fwd, None

    def fwd_bwd():
        with peer.scope():
            y = peer.forward(x)
            return (y, *torch.autograd.grad(y, [x, *peer.params], dy))

    return fwd_bwd, lambda out: (out[0], out[1], *peer.to_mtp(list(out[2:])))


def _mtp_weights(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(router [E, H], weight1 [E, H, 2F] (gate | up), weight2 [E, F, H])``, detached."""
    return (layer.router.weight.detach(), layer.experts.weight1.detach(),
            layer.experts.weight2.detach())  # fmt: skip


def build(name: str, layer, device: torch.device, dtype: torch.dtype) -> PeerLayer:
    """Peer ``name`` with the weights of mtp's ``layer`` (an ``mtp.moe.MoELayer``)."""
    builders = {MEGATRON: _megatron, TORCHTITAN: _torchtitan, LIGER: _liger}
    return builders[name](layer, device, dtype)


@contextlib.contextmanager
def _cuda_stand_in():
    """What Megatron-Core's alltoall dispatcher and router call in ``torch.cuda`` on a CPU:
    a side stream that is the current one, events whose wait is logged as a host read, and
    ``current_device()`` -> ``"cpu"``."""

    class Event:
        def synchronize(self):
            torch.empty(0).tolist()  # the host waits for the split sizes (count_host_syncs)

    class Stream:
        def wait_stream(self, other):
            pass

        def record_event(self):
            return Event()

    stream = Stream()
    patches = {"Stream": lambda *a, **k: stream, "current_stream": lambda *a, **k: stream,
               "stream": lambda s: contextlib.nullcontext(), "current_device": lambda: "cpu"}
    saved = {name: getattr(torch.cuda, name) for name in patches}
    for name, value in patches.items():
        setattr(torch.cuda, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


def _megatron_spec(E: int):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    te = importlib.util.find_spec("transformer_engine") is not None
    return get_moe_module_spec(use_te=te, num_experts=E, moe_grouped_gemm=te), te


def _megatron_config(H: int, F_: int, E: int, k: int, dtype: torch.dtype, device):
    """SwiGLU experts without biases, fp32 router logits, no load-balancing loss; weights
    left uninitialised (mtp's are copied in) and made on ``device``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=E,
        moe_ffn_hidden_size=F_, moe_router_topk=k, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,
        moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
    )  # fmt: skip


def _megatron_experts(module) -> tuple[list, list]:
    """Per expert: fc1 ``[2F, H]`` and fc2 ``[H, F]`` weights (SequentialMLP or TEGroupedMLP)."""
    experts = module.experts
    if hasattr(experts, "local_experts"):
        return ([e.linear_fc1.weight for e in experts.local_experts],
                [e.linear_fc2.weight for e in experts.local_experts])  # fmt: skip
    n = experts.num_local_experts
    return ([getattr(experts.linear_fc1, f"weight{i}") for i in range(n)],
            [getattr(experts.linear_fc2, f"weight{i}") for i in range(n)])  # fmt: skip


def _define_te_general_gemm(router) -> None:
    """megatron-core 0.16.1 without Transformer Engine leaves ``te_general_gemm`` undefined in
    ``moe_utils``, where the router's gating function reads it: None (its torch.mm path), in
    the module that function was defined in."""
    gating = sys.modules[type(router).__module__].router_gating_linear
    gating.__globals__.setdefault("te_general_gemm", None)


def _megatron(layer, device, dtype) -> PeerLayer:
    from megatron.core.transformer.spec_utils import build_module

    reason = megatron_single_rank(device)
    if reason:
        raise Skip(reason)
    E, k, H, F_ = layer.num_experts, layer.topk, layer.hidden_size, layer.ffn_hidden_size
    spec, te = _megatron_spec(E)
    scope = _cuda_stand_in if device.type == "cpu" else contextlib.nullcontext
    with scope():
        module = build_module(spec, config=_megatron_config(H, F_, E, k, dtype, device))
    _define_te_general_gemm(module.router)
    fc1, fc2 = _megatron_experts(module)
    router, w1, w2 = _mtp_weights(layer)
    with torch.no_grad():
        module.router.weight.copy_(router)
        for e in range(E):
            fc1[e].copy_(w1[e].t())
            fc2[e].copy_(w2[e].t())

    def forward(x):
        return module(x.view(x.shape[0], 1, H))[0].view(x.shape)

    def to_mtp(g):
        return [g[0], torch.stack([t.t() for t in g[1:E + 1]]),
                torch.stack([t.t() for t in g[E + 1:]])]  # fmt: skip

    note = "TEGroupedMLP" if te else "SequentialMLP (no Transformer Engine)"
    return PeerLayer(forward, [module.router.weight, *fc1, *fc2], to_mtp, scope,
                     f"MoELayer, alltoall dispatcher, {note}")  # fmt: skip


def _torchtitan(layer, device, dtype) -> PeerLayer:
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import MoE, GroupedExperts, RoutedExperts
    from torchtitan.models.common.moe import TokenChoiceTopKRouter as Router
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    E, k, H, F_ = layer.num_experts, layer.topk, layer.hidden_size, layer.ffn_hidden_size
    config = MoE.Config(
        num_experts=E, load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=H, hidden_dim=F_, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=k)),
        router=Router.Config(num_experts=E, gate=Linear.Config(in_features=H, out_features=E),
                             top_k=k, score_func="softmax", route_norm=True),
    )  # fmt: skip
    with torch.device(device):  # the weights made where they run (mtp's copied in)
        module = config.build().to(dtype=dtype)
    experts = module.routed_experts.inner_experts
    router, w1, w2 = _mtp_weights(layer)
    with torch.no_grad():
        module.router.gate.weight.copy_(router)
        experts.w1_EFD.copy_(w1[:, :, :F_].transpose(1, 2))
        experts.w3_EFD.copy_(w1[:, :, F_:].transpose(1, 2))
        experts.w2_EDF.copy_(w2.transpose(1, 2))

    def to_mtp(g):
        return [g[0], torch.cat([g[1].transpose(1, 2), g[2].transpose(1, 2)], 2),
                g[3].transpose(1, 2)]  # fmt: skip

    params = [module.router.gate.weight, experts.w1_EFD, experts.w3_EFD, experts.w2_EDF]
    return PeerLayer(lambda x: module(x.unsqueeze(0)).squeeze(0), params, to_mtp,
                     note="MoE, LocalTokenDispatcher, GroupedExperts on torch._grouped_mm")


def _liger(layer, device, dtype) -> PeerLayer:
    fused_moe = importlib.import_module(_LIGER[0])
    apply = getattr(fused_moe, _LIGER[1]).apply
    router, w1, w2 = _mtp_weights(layer)
    k = layer.topk
    leaves = [router.to(device, dtype).clone(), w1.transpose(1, 2).to(device, dtype).contiguous(),
              w2.transpose(1, 2).to(device, dtype).contiguous()]  # fmt: skip
    for t in leaves:
        t.requires_grad_(True)

    def forward(x):
        logits = x.float() @ leaves[0].float().t()
        top = logits.topk(k, dim=-1)
        probs = torch.softmax(top.values, dim=-1).to(x.dtype)
        return apply(x, leaves[1], leaves[2], top.indices.to(torch.int32), probs)

    def to_mtp(g):
        return [g[0], g[1].transpose(1, 2), g[2].transpose(1, 2)]

    return PeerLayer(forward, leaves, to_mtp,
                     note="LigerFusedMoEFunction behind a PyTorch top-k softmax router")
