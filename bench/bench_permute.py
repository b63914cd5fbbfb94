"""MoE token permutation: ``mtp.ops.permute`` and ``mtp.ops.unpermute`` (Megatron-Core order).

``permute`` groups ``tokens [T, H]`` by expert (``N = T * k`` rows, top-k routing, dropless);
``unpermute`` merges ``[N, H]`` expert outputs back, weighted by the routing probabilities.
Both run with ``validate=False`` (the count checks are host syncs; the MoE layer turns them off
as well). Compared with: mtp's backends, ``torch.compile`` of the reference, Megatron-Core's
``moe_utils.permute``/``unpermute`` (unfused) and Transformer Engine's ``moe_permute`` /
``moe_unpermute`` (mask map) when installed.

Bytes (``N = T*k`` rows, ``s`` = element size of the tokens, ``sp`` of the probabilities,
row map int64, routing map bool ``[T, E]``):

- permute forward: read tokens ``T*H*s`` and the routing map ``T*E``; write the rows
  ``N*H*s`` and the row map ``8*N``. Backward: read the row gradients ``N*H*s`` and the row map
  ``8*N``; write the token gradient ``T*H*s``.
- unpermute forward: read the rows ``N*H*s``, the row map ``8*N``, the routing map ``T*E`` and
  the routed probabilities ``N*sp``; write ``T*H*s``. Backward: read the output gradient
  ``T*H*s``, the rows ``N*H*s`` (for the probability gradient), the row map, routing map and
  probabilities again; write the row gradients ``N*H*s`` and ``dprobs [T, E]`` (``T*E*sp``).
"""

from __future__ import annotations

import torch

import mtp.ops as ops
from mtp.ops.moe_permute import permute_reference, unpermute_reference

from .core import (
    FLOAT64,
    Case,
    Provider,
    Run,
    compiled,
    import_peer,
    needs_compile,
    peer_attr,
    randn,
    seeded,
    upcast,
)

FAMILY = "permute"
OPS = ("permute", "unpermute")
BACKENDS = ("triton", "reference")

_MEGATRON = "megatron.core.transformer.moe.moe_utils"
#: Index of the row map (``sorted_indices``) in Megatron-Core's ``permute`` outputs (0.16 to
#: 0.19: tokens, probs, sorted_indices, pad_offsets, tokens_per_expert).
MEGATRON_MAP_OUTPUT = 2
_TE = "transformer_engine.pytorch"

#: (name, T tokens, H hidden, E experts, k)
_SHAPES = {
    "smoke": [("tiny", 13, 24, 4, 2), ("tiny-topk8", 16, 40, 16, 8)],
    "quick": [("Mixtral-like", 8192, 4096, 8, 2), ("DeepSeek-like", 8192, 7168, 256, 8)],
    "full": [
        ("Mixtral-like", 8192, 4096, 8, 2),
        ("DeepSeek-like", 8192, 7168, 256, 8),
        ("Qwen3-MoE-like", 8192, 4096, 128, 8),
    ],
}


def permute_bytes(T: int, H: int, E: int, k: int, s: int, pass_: str) -> int:
    """Fewest HBM bytes of ``permute`` (see the module doc)."""
    N = T * k
    fwd = T * H * s + T * E + N * H * s + 8 * N
    bwd = N * H * s + 8 * N + T * H * s
    return fwd if pass_ == "fwd" else fwd + bwd


def unpermute_bytes(T: int, H: int, E: int, k: int, s: int, sp: int, pass_: str) -> int:
    """Fewest HBM bytes of ``unpermute`` with probabilities (see the module doc)."""
    N = T * k
    fwd = N * H * s + 8 * N + T * E + N * sp + T * H * s
    bwd = T * H * s + N * H * s + 8 * N + T * E + N * sp + N * H * s + T * E * sp
    return fwd if pass_ == "fwd" else fwd + bwd


def cases(size: str, dtype: torch.dtype) -> list[Case]:
    s = torch.empty((), dtype=dtype).element_size()
    out = []
    for name, T, H, E, k in _SHAPES[size]:
        params = {"T": T, "H": H, "E": E, "k": k}
        label = f"{name} T={T} H={H} E={E} top{k}"
        for pass_ in ("fwd", "fwd+bwd"):
            out.append(Case("permute", label, params, dtype, pass_,
                            bytes=permute_bytes(T, H, E, k, s, pass_), group=name))
            out.append(Case("unpermute", label, params, dtype, pass_,
                            bytes=unpermute_bytes(T, H, E, k, s, 4, pass_), group=name))
    return out  # fmt: skip


def traffic_cases(dtype: torch.dtype) -> list[Case]:
    """Mid-size shape for the CPU bytes / floor figures (T=256, k=4, E=16, with a
    hidden size where the token rows, not the indices, dominate)."""
    s = torch.empty((), dtype=dtype).element_size()
    T, H, E, k = 256, 512, 16, 4
    params = {"T": T, "H": H, "E": E, "k": k}
    label = f"T={T} H={H} E={E} top{k}"
    out = []
    for pass_ in ("fwd", "fwd+bwd"):
        out.append(Case("permute", label, params, dtype, pass_,
                        bytes=permute_bytes(T, H, E, k, s, pass_)))
        out.append(Case("unpermute", label, params, dtype, pass_,
                        bytes=unpermute_bytes(T, H, E, k, s, 4, pass_)))
    return out  # fmt: skip


def providers(op: str) -> list[Provider]:
    te_fn = "moe_permute" if op == "permute" else "moe_unpermute"
    return [
        Provider("triton", "mtp"),
        Provider("reference", "baseline"),
        Provider("torch.compile", "baseline", cpu=False, needs=needs_compile),
        Provider("megatron", "peer", cpu=False, needs=lambda d: import_peer(_MEGATRON, op)),
        Provider("te", "peer", cpu=False, needs=lambda d: import_peer(_TE, te_fn)),
    ]


def _routing(case: Case, device: torch.device):
    """Top-k routing of ``T`` tokens over ``E`` experts: bool map and fp32 probabilities."""
    T, E, k = case.params["T"], case.params["E"], case.params["k"]
    gen = seeded(case, device, "routing")
    scores = torch.rand((T, E), generator=gen, device=device)
    top, idx = scores.topk(k, dim=1)
    routing_map = torch.zeros((T, E), dtype=torch.bool, device=device).scatter_(1, idx, True)
    probs = torch.zeros((T, E), device=device).scatter_(1, idx, top / top.sum(1, keepdim=True))
    return routing_map, probs


def _permute_fn(provider: str, N: int):
    """``f(tokens, routing_map) -> (rows [N, H], row map[, token map (mtp)])``."""
    if provider in (FLOAT64, "reference"):
        return lambda x, rm: permute_reference(x, rm, None, N)[::2]
    if provider == "torch.compile":
        ref = compiled(permute_reference)
        return lambda x, rm: ref(x, rm, None, N)[::2]
    if provider == "megatron":
        mg = peer_attr(_MEGATRON, "permute")
        # (permuted tokens, permuted probs, sorted indices, ...): the map is the third output
        return lambda x, rm: (lambda out: (out[0], out[MEGATRON_MAP_OUTPUT]))(
            mg(x, rm, num_out_tokens=N)
        )
    if provider == "te":
        te = peer_attr(_TE, "moe_permute")
        return lambda x, rm: te(x, rm, num_out_tokens=N, map_type="mask")
    # (permuted tokens, row map, the token-major map unpermute reuses)
    return lambda x, rm: (lambda out: (out[0], out[2], out[3]))(ops.permute(
        x, rm, num_out_tokens=N, validate=False, backend=provider, return_token_map=True
    ))


def _unpermute_fn(provider: str, shape, token_map=None):
    """``f(rows, row map, probs, routing_map) -> tokens [T, H]`` (mtp: with the token map its
    permute built)."""
    if provider in (FLOAT64, "reference"):
        return lambda y, m, p, rm: unpermute_reference(y, m, shape, p, rm)
    if provider == "torch.compile":
        ref = compiled(unpermute_reference)
        return lambda y, m, p, rm: ref(y, m, shape, p, rm)
    if provider == "megatron":
        mg = peer_attr(_MEGATRON, "unpermute")
        return lambda y, m, p, rm: mg(y, m, torch.Size(shape), probs=p, routing_map=rm)
    if provider == "te":
        te = peer_attr(_TE, "moe_unpermute")
        return lambda y, m, p, rm: te(y, m, merging_probs=p, restore_shape=torch.Size(shape),
                                      map_type="mask")  # fmt: skip
    return lambda y, m, p, rm: ops.unpermute(
        y, m, shape, probs=p, routing_map=rm, validate=False, backend=provider,
        token_map=token_map,
    )


def setup_permute(case: Case, provider: str, device: torch.device) -> Run:
    """``permute(tokens, routing_map)``: forward, or forward+backward into the tokens."""
    T, H, k = case.params["T"], case.params["H"], case.params["k"]
    routing_map, _ = _routing(case, device)
    gen = seeded(case, device, "tokens")
    tokens = randn((T, H), case.dtype, device, gen).requires_grad_(case.pass_ != "fwd")
    dy = randn((T * k, H), case.dtype, device, gen)
    tokens, dy = upcast(tokens, provider), upcast(dy, provider)
    f = _permute_fn(provider, T * k)
    if case.pass_ == "fwd":
        return Run(lambda: (f(tokens, routing_map)[0],), inputs=[tokens, routing_map])

    def fwd_bwd():
        rows = f(tokens, routing_map)[0]
        return (rows, *torch.autograd.grad(rows, (tokens,), dy))

    return Run(fwd_bwd, inputs=[tokens, routing_map, dy])


def setup_unpermute(case: Case, provider: str, device: torch.device) -> Run:
    """``unpermute(rows, row_map, probs=...)`` of routed rows: forward or forward+backward.

    The row map comes from the same provider's permute (peers use their own map formats)."""
    T, H, k = case.params["T"], case.params["H"], case.params["k"]
    routing_map, probs = _routing(case, device)
    gen = seeded(case, device, "rows")
    rows = randn((T * k, H), case.dtype, device, gen)
    dy = randn((T, H), case.dtype, device, gen)
    probs = probs.to(torch.float64 if provider == FLOAT64 else torch.float32)
    with torch.no_grad():
        # Any tokens give the row map; the rows themselves are fresh random values.
        mapped = _permute_fn(provider, T * k)(torch.zeros_like(rows[:T]), routing_map)
    row_map, token_map = mapped[1], (mapped[2] if len(mapped) > 2 else None)
    rows = upcast(rows, provider).requires_grad_(case.pass_ != "fwd")
    probs.requires_grad_(case.pass_ != "fwd")
    dy = upcast(dy, provider)
    f = _unpermute_fn(provider, (T, H), token_map)
    if case.pass_ == "fwd":
        return Run(lambda: (f(rows, row_map, probs, routing_map),), inputs=[rows, probs, row_map])

    def fwd_bwd():
        out = f(rows, row_map, probs, routing_map)
        return (out, *torch.autograd.grad(out, (rows, probs), dy))

    return Run(fwd_bwd, inputs=[rows, probs, row_map, dy])


SETUP = {"permute": setup_permute, "unpermute": setup_unpermute}
