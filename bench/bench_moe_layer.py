"""The whole MoE layer (``mtp.moe.MoELayer``, EP=1, dropless, SwiGLU experts) per grouped GEMM
backend, eager and replayed from a CUDA graph.

Router (fp32 logits, ``router_dtype=torch.float32``) -> preprocess -> permute -> two grouped
GEMMs around the SwiGLU -> unpermute. On ``triton`` the SwiGLU, its bias and the probability
scaling live in the grouped GEMMs' epilogues (:func:`mtp.ops.grouped_mlp`); ``triton-unfused``
is the same backend with them as separate kernels. Each backend of :func:`mtp.ops.grouped_gemm`
is timed eagerly, forward and forward+backward; the graph-safe ones (``triton``, ``torch``, ``cutlass``:
no host sync) are also captured in one CUDA graph (forward, no autograd) and timed by replay:
the eager-vs-graph gap is the CPU launch overhead that seed 003 is about. ``triton-fp8`` and
``triton-mxfp8`` run the experts' GEMMs in FP8 (``fp8_recipe``; weights quantised once and
reused between optimizer steps, :mod:`mtp.bench.fp8_providers`), checked with the recipes'
tolerance, their floor at the FP8 rate.

Shapes (``T`` tokens; the DeepSeek-like layer is narrowed to H=4096, F=1024 so that the
float32 reference of all 256 experts fits next to it in 80 GB):

- Mixtral-like: E=8, top-2, H=4096, F=14336;
- DeepSeek-like: E=256, top-8, H=4096, F=1024;
- Qwen3-MoE-like: E=128, top-8, H=4096, F=1536;
- fine-grained experts: Qwen3-30B-A3B-like (E=128, top-8, H=2048, F=768) and OLMoE-like (E=64,
  top-8, H=2048, F=1024): many small GEMMs, where the dispatch, the combine and the launches
  weigh the most.

FLOPs (``M = T*k``, ``F1 = 2F`` for SwiGLU): forward ``2*T*H*E + 2*M*H*F1 + 2*M*F*H``
(router and the two expert GEMMs; the elementwise work is left out); forward+backward three
times that. Bytes (fewest: a fully fused layer reads its input and weights once and writes its
output; ``s`` = element size, weights in the activation dtype): forward
``2*T*H*s + E*H*s + E*(H*F1 + F*H)*s``; the backward adds the output gradient, the input and
the weights read again, and the input and weight gradients written:
``3*T*H*s + 2*E*H*s + 2*E*(H*F1 + F*H)*s``.

Structure (CPU, :func:`structure`): aten ops, device ops, Triton launches and host syncs of one
forward, the device ops of forward+backward and the activation bytes autograd saves per token
(the input included), by backend and number of experts (kernels recorded, not executed), and
whether :func:`mtp.testing.assert_graph_safe` accepts the forward; and :func:`peer_structure`:
mtp's ``triton`` layer next to each installed peer (:mod:`mtp.bench.moe_peers`: Megatron-Core's
``MoELayer``, torchtitan's ``MoE``, Liger-Kernel's fused MoE; same weights, checked against the
same float64 reference, timed on a GPU only) at the same shape in bf16: device ops of a forward
and of forward+backward, host syncs, activation bytes saved per token.
"""

from __future__ import annotations

import torch

from mtp.moe import MoELayer
from mtp.ops.grouped_gemm import GROUPED_GEMM_BACKENDS

from . import fp8_providers as fp8
from . import moe_peers
from .bench_grouped_gemm import backend_ready
from .core import FLOAT64, Case, Provider, Run, Skip, needs_cuda, randn, seeded

FAMILY = "moe_layer"
OPS = ("moe_layer",)
BACKENDS = tuple(GROUPED_GEMM_BACKENDS)
GRAPH_BACKENDS = ("triton", "torch", "cutlass")  # read the counts on the device: capturable
GRAPH = "+cudagraph"
#: The Triton backend with the experts' bias/activation/probability as separate kernels.
UNFUSED = "triton-unfused"

#: name -> (E, k, H, F)
MODELS = {
    "Mixtral-like": (8, 2, 4096, 14336),
    "DeepSeek-like": (256, 8, 4096, 1024),
    "Qwen3-MoE-like": (128, 8, 4096, 1536),
    "Qwen3-30B-A3B-like": (128, 8, 2048, 768),
    "OLMoE-like": (64, 8, 2048, 1024),
}
_TOKENS = {"quick": 4096, "full": 8192}
_SMOKE = (24, 32, 16)  # T, H, F for the CPU check at E=8
_STRUCTURE = (64, 32, 16)  # T, H, F for the structural counts
STRUCTURE_EXPERTS = ((8, 2), (64, 8), (128, 8), (256, 8))
#: E, top-k of the peer comparison: Mixtral-like and fine-grained (OLMoE-, Qwen3-30B-A3B-like)
PEER_STRUCTURE_EXPERTS = ((8, 2), (64, 8), (128, 8))


def moe_layer_flops(T: int, H: int, F: int, E: int, k: int, pass_: str) -> int:
    """FLOPs of the router and the two expert GEMMs (SwiGLU: fc1 has ``2F`` outputs)."""
    M, F1 = T * k, 2 * F
    fwd = 2 * T * H * E + 2 * M * H * F1 + 2 * M * F * H
    return fwd if pass_ == "fwd" else 3 * fwd


def moe_layer_bytes(T: int, H: int, F: int, E: int, s: int, pass_: str) -> int:
    """Fewest HBM bytes of a fully fused layer (see the module doc)."""
    weights = E * (H * 2 * F + F * H) * s
    fwd = 2 * T * H * s + E * H * s + weights
    bwd = 3 * T * H * s + 2 * E * H * s + 2 * weights
    return fwd if pass_ == "fwd" else fwd + bwd


def _case(name, E, k, T, H, F, dtype, pass_, check=True, execute=True) -> Case:
    s = torch.empty((), dtype=dtype).element_size()
    params = {"model": name, "E": E, "k": k, "T": T, "H": H, "F": F}
    return Case(
        "moe_layer", f"{name} E={E} top{k} T={T} H={H} F={F}", params, dtype, pass_,
        bytes=moe_layer_bytes(T, H, F, E, s, pass_), flops=moe_layer_flops(T, H, F, E, k, pass_),
        group=name, check=check, execute=execute,
    )  # fmt: skip


def cases(size: str, dtype: torch.dtype) -> list[Case]:
    if size == "smoke":
        T, H, F = _SMOKE
        return [_case("Mixtral-like", 8, 2, T, H, F, dtype, p) for p in ("fwd", "fwd+bwd")]
    T = _TOKENS[size]
    # The cheaper case first, so that its rows land even if the family's time share runs out
    # during the DeepSeek-like case.
    quick = ("Mixtral-like", "Qwen3-30B-A3B-like", "DeepSeek-like")
    models = MODELS if size == "full" else {k: MODELS[k] for k in quick}
    return [
        _case(name, E, k, T, H, F, dtype, pass_)
        for name, (E, k, H, F) in models.items()
        for pass_ in ("fwd", "fwd+bwd")
    ]


def _graph_needs(backend: str):
    ready = backend_ready(backend)
    return lambda device: needs_cuda(device) or ready(device)


def providers(op: str = "moe_layer") -> list[Provider]:
    out = []
    for name in BACKENDS:
        kind = "baseline" if name == "reference" else "mtp"
        out.append(Provider(name, kind, cpu=name != "cutlass", needs=backend_ready(name)))
    out.append(Provider(UNFUSED, "mtp", cpu=True, needs=backend_ready("triton")))
    for name in GRAPH_BACKENDS:
        out.append(Provider(name + GRAPH, "mtp", cpu=False, needs=_graph_needs(name)))
    out += fp8.mtp_providers(backend_ready("triton"), fp8.LAYER_TOLERANCE)
    return out + moe_peers.peer_providers()


def build_layer(case: Case, backend: str, device: torch.device, dtype: torch.dtype) -> MoELayer:
    """The case's layer with ``backend`` (or :data:`UNFUSED`); the same weights for every
    backend, drawn on ``device`` from a seeded generator (fp32, rounded to the case dtype, then
    held in ``dtype``).

    Not the layer's own initialisation: that draws every expert's ``nn.Linear`` on the CPU
    (the single-process equivalence it promises), minutes for the DeepSeek-like layer's 3.2 G
    weights and once per provider. The scales are
    the same: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` for the experts, ``N(0, 0.02)`` for the
    router."""
    p = case.params
    fused = backend != UNFUSED
    recipe = fp8.MTP_FP8.get(backend)
    backend = "triton" if backend == UNFUSED or recipe else backend
    layer = MoELayer(
        p["H"], p["F"], p["E"], p["k"], activation="swiglu", backend=backend,
        bias_activation_fusion=fused, router_dtype=torch.float32, fp8_recipe=recipe,
        params_dtype=torch.float32, device=device, perform_initialization=False,
    )  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(1234)
    with torch.no_grad():
        for name, param in sorted(layer.named_parameters()):
            if name.startswith("router."):
                param.normal_(0.0, 0.02, generator=gen)
            else:  # [E, fan_in, out] weights, [E, out] biases (fan_in: the hidden size)
                fan_in = param.shape[1] if param.dim() == 3 else p["H"]
                param.uniform_(-(fan_in**-0.5), fan_in**-0.5, generator=gen)
            param.copy_(param.to(case.dtype))
    return layer.to(dtype)


def _capture(layer: MoELayer, x: torch.Tensor):
    """Capture ``layer(x)`` (no autograd) in a CUDA graph; returns ``(replay, output)``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: compilation, workspace, allocator
            layer(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y = layer(x)
    return graph.replay, y


def setup_moe_layer(case: Case, provider: str, device: torch.device) -> Run:
    """``MoELayer(x)`` eagerly (forward, or forward+backward into the input and every weight),
    or, for ``<backend>+cudagraph``, the replay of the captured forward."""
    if provider in moe_peers.PEERS:
        return _setup_peer(case, provider, device)
    p = case.params
    reference = provider == FLOAT64  # the MoE layer takes fp32/fp16/bf16: fp32 math reference
    backend = "reference" if reference else provider.removesuffix(GRAPH)
    dtype = torch.float32 if reference else case.dtype
    layer = build_layer(case, backend, device, dtype)
    gen = seeded(case, device)
    grad = case.pass_ != "fwd"
    x = randn((p["T"], p["H"]), case.dtype, device, gen).to(dtype).requires_grad_(grad)
    dy = randn((p["T"], p["H"]), case.dtype, device, gen).to(dtype)
    params = list(layer.parameters())
    if provider.endswith(GRAPH):
        if grad:
            raise Skip("CUDA-graph replay is benchmarked for the forward only")
        replay, y = _capture(layer, x)
        return Run(lambda: (replay(), y)[1:], inputs=[x, *params])
    if not grad:
        return Run(lambda: (layer(x),), inputs=[x, *params])

    def fwd_bwd():
        y = layer(x)
        return (y, *torch.autograd.grad(y, [x, *params], dy))

    return Run(fwd_bwd, grad_to_none=[], inputs=[x, dy, *params])


def _setup_peer(case: Case, provider: str, device: torch.device) -> Run:
    """A peer (:mod:`mtp.bench.moe_peers`) with the weights of mtp's layer, the same inputs."""
    p = case.params
    layer = build_layer(case, "reference", device, case.dtype)
    peer = moe_peers.build(provider, layer, device, case.dtype)
    gen = seeded(case, device)
    grad = case.pass_ != "fwd"
    x = randn((p["T"], p["H"]), case.dtype, device, gen).requires_grad_(grad)
    dy = randn((p["T"], p["H"]), case.dtype, device, gen)
    fn, for_check = moe_peers.peer_run(peer, x, dy, grad)
    return Run(fn, inputs=[x, dy, *peer.params], for_check=for_check)


SETUP = {"moe_layer": setup_moe_layer}
#: Called by the runner after the CPU pass: the one-rank process group the peers set up goes.
release = moe_peers.release


# --------------------------------------------------------------------------------------------
# Structure: what one forward issues, by backend and number of experts (CPU)
# --------------------------------------------------------------------------------------------


def _graph_safety(layer: MoELayer, x: torch.Tensor) -> str:
    from mtp.testing import GraphSafetyError, assert_graph_safe

    try:
        with torch.no_grad():
            assert_graph_safe(layer, x)
    except GraphSafetyError as exc:
        return "no: " + str(exc).removeprefix("not graph-safe: ")[:120]
    return "yes"


def _counts(layer, x: torch.Tensor, params=None):
    """``(forward counts, forward+backward counts, saved bytes)`` of one call of ``layer``
    (kernels recorded, not executed); ``params``: its weights (default: its parameters)."""
    from mtp.testing import saved_activation_bytes

    from .counting import count_ops

    params = list(layer.parameters()) if params is None else params
    with torch.no_grad(), count_ops(execute_kernels=False) as fwd:
        layer(x)
    xg = x.detach().requires_grad_(True)
    saved = saved_activation_bytes(layer, xg, skip=params)
    with count_ops(execute_kernels=False) as step:
        y = layer(xg)
        torch.autograd.grad(y, [xg, *params], torch.ones_like(y), allow_unused=True)
    return fwd, step, saved


def structure(size: str, backends=(*BACKENDS, UNFUSED)) -> dict:
    """Per backend and E: ops, launches and host syncs of one forward (and the device ops of
    forward+backward, the activation bytes autograd saves per token), and graph safety."""
    from mtp import settings

    with settings.override(poison_outputs=False):  # a test extra (NaN fills), not the layer's
        return {**_structure(backends), "moe_layer_peers": peer_structure()}


def _structure(backends) -> dict:
    from .counting import triton_launch_hook

    device = torch.device("cpu")
    T, H, F = _STRUCTURE
    rows = []
    for E, k in STRUCTURE_EXPERTS:
        for backend in backends:
            if backend == "cutlass":
                continue
            case = _case("structure", E, k, T, H, F, torch.float32, "fwd", check=False)
            layer = build_layer(case, backend, device, torch.float32)
            x = randn((T, H), torch.float32, device, seeded(case, device))
            with triton_launch_hook(lambda *a: None, execute=False):
                with torch.no_grad():
                    layer(x)  # builds the workspace
                counted, step, saved = _counts(layer, x)
                with torch.no_grad():
                    safe = _graph_safety(layer, x)
            summary = counted.summary()
            summary.pop("sync_events")
            rows.append({"E": E, "topk": k, "T": T, "H": H, "F": F, "backend": backend,
                         **summary, "fwd_bwd_device_ops": step.device_ops,
                         "saved_bytes_per_token": saved / T, "graph_safe": safe})  # fmt: skip
    return {"moe_layer_forward": rows}


# --------------------------------------------------------------------------------------------
# Structure: mtp's triton layer next to the peers (CPU)
# --------------------------------------------------------------------------------------------


def _sync_names(events) -> str:
    names = {}
    for e in events:
        names[e] = names.get(e, 0) + 1
    return ", ".join(f"{n.removeprefix('aten::')}×{c}" for n, c in names.items())


def _peer_row(case: Case, provider: str, forward, x, params, note: str) -> dict:
    fwd, step, saved = _counts(forward, x, params)
    p = case.params
    return {"E": p["E"], "topk": p["k"], "T": p["T"], "H": p["H"], "F": p["F"],
            "dtype": str(case.dtype).removeprefix("torch."), "provider": provider, "impl": note,
            "device_ops": fwd.device_ops, "fwd_bwd_device_ops": step.device_ops,
            "host_syncs": len(fwd.host_syncs), "fwd_bwd_host_syncs": len(step.host_syncs),
            "sync_events": _sync_names(step.host_syncs),
            "saved_bytes_per_token": saved / p["T"]}  # fmt: skip


def _peer_rows(case: Case, layer: MoELayer, x: torch.Tensor) -> list[dict]:
    device = torch.device("cpu")
    rows = [_peer_row(case, "triton", layer, x, list(layer.parameters()), "mtp MoELayer")]
    for name in moe_peers.available(device):
        try:
            peer = moe_peers.build(name, layer, device, case.dtype)
            with peer.scope():
                rows.append(_peer_row(case, name, peer.forward, x, peer.params, peer.note))
        except Exception as exc:  # one broken peer must not hide the others
            rows.append({"E": case.params["E"], "topk": case.params["k"], "provider": name,
                         "error": f"{type(exc).__name__}: {exc}"[:200]})  # fmt: skip
    return rows


def peer_structure(dtype: torch.dtype = torch.bfloat16, experts=PEER_STRUCTURE_EXPERTS) -> list:
    """mtp's ``triton`` layer and each peer installed, at the structural shape in ``dtype``:
    device ops of a forward and of forward+backward, host syncs (counted on CPU: host reads of
    CPU tensors count too, see ``sync_events``), activation bytes autograd saves per token (the
    input included, the weights not)."""
    from mtp import settings

    with settings.override(poison_outputs=False):  # a test extra (NaN fills), not the layer's
        return _peer_structure(dtype, experts)


def _peer_structure(dtype: torch.dtype, experts) -> list:
    from .counting import triton_launch_hook

    device = torch.device("cpu")
    T, H, F = _STRUCTURE
    rows = []
    for E, k in experts:
        case = _case("structure", E, k, T, H, F, dtype, "fwd", check=False)
        layer = build_layer(case, "triton", device, dtype)
        x = randn((T, H), dtype, device, seeded(case, device))
        with triton_launch_hook(lambda *a: None, execute=False):
            with torch.no_grad():
                layer(x)  # builds the workspace
            rows += _peer_rows(case, layer, x)
    return rows
