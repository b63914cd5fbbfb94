"""MoELayer and GroupedMLP on one rank, against a float64 per-token oracle; graph safety, host
syncs and the host-side op count."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from test_moe_router import oracle_aux_loss, oracle_drop, oracle_route, oracle_z_loss
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mtp.moe import GroupedMLP, MoELayer
from mtp.testing import assert_close, assert_graph_safe, count_host_syncs
from mtp.utils import simulated_capture

# --- float64 oracle of the whole layer --------------------------------------------------------


def oracle_moe(layer, x, *, capacity_factor=None, drop_policy="probs"):
    """Forward of ``layer`` recomputed per (token, expert) pair in float64 from its parameters.

    Returns ``(out [T, H], loss_terms, params)``: the aux/z losses to add to the objective and
    the float64 leaves whose gradients the layer's must match."""
    params = {n: p.detach().double().requires_grad_(True) for n, p in layer.named_parameters()}
    x64 = x.detach().double().reshape(-1, layer.hidden_size).requires_grad_(True)
    T, E, k = x64.shape[0], layer.num_experts, layer.topk
    router = layer.router
    logits = x64 @ params["router.weight"].t()
    probs, chosen = oracle_route(logits, k, router.score_function, router.pre_softmax)
    kept = {(t, e) for t, idx in enumerate(chosen) for e in idx}
    if capacity_factor is not None:
        kept = oracle_drop(
            probs, chosen, min(math.ceil(T * k / E * capacity_factor), T), drop_policy
        )
    w1, w2 = params["experts.weight1"], params["experts.weight2"]
    b1, b2 = params.get("experts.bias1"), params.get("experts.bias2")
    rows = []
    for t in range(T):
        acc = x64.new_zeros(layer.hidden_size)
        for e in sorted(e for (tt, e) in kept if tt == t):
            h = x64[t] @ w1[e] + (0 if b1 is None else b1[e])
            if layer.experts.activation == "gelu":
                a = F.gelu(h)
            else:
                a = F.silu(h[: layer.ffn_hidden_size]) * h[layer.ffn_hidden_size :]
            acc = acc + (a * probs[t, e]) @ w2[e] + (0 if b2 is None else b2[e])
        rows.append(acc)
    loss = x64.new_zeros(())
    if router.aux_loss_coeff:
        loss = loss + oracle_aux_loss(logits, k, router.score_function, router.aux_loss_coeff)
    if router.z_loss_coeff:
        loss = loss + oracle_z_loss(logits, router.z_loss_coeff)
    return torch.stack(rows), loss, dict(params, input=x64)


def check_layer_against_oracle(layer, x, tol_grad=5e-5, **oracle_kw):
    x = x.detach().requires_grad_(True)
    out = layer(x)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    want, extra, leaves = oracle_moe(layer, x, **oracle_kw)
    ((want * g.double().reshape(want.shape)).sum() + extra).backward()
    assert out.shape == x.shape
    assert_close(out.reshape(want.shape), want, torch.float32, atol=2e-5)
    assert_close(x.grad.reshape(want.shape), leaves["input"].grad, torch.float32, atol=tol_grad)
    for name, p in layer.named_parameters():
        assert_close(p.grad, leaves[name].grad, torch.float32, atol=tol_grad, msg=name)
    if layer.router.aux_loss_coeff:
        assert layer.aux_loss is not None


def _block_expert(layer, x, expert):
    """Make ``expert`` lose every routing decision: feature 0 of x is >= 1 and the expert's
    router row is -20 there and 0 elsewhere."""
    with torch.no_grad():
        x[..., 0] = x[..., 0].abs() + 1
        layer.router.weight[expert] = 0
        layer.router.weight[expert, 0] = -20
    return x


# --- numerics ------------------------------------------------------------------------------------

CONFIGS = [
    dict(activation="gelu"),
    dict(activation="swiglu", bias=True),
    dict(
        activation="gelu",
        bias=True,
        score_function="sigmoid",
        aux_loss_coeff=0.1,
        z_loss_coeff=0.01,
    ),
    dict(activation="swiglu", pre_softmax=True, aux_loss_coeff=0.05),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_dropless_layer_matches_oracle(cfg):
    torch.manual_seed(10)
    layer = MoELayer(8, 12, 5, 2, backend="reference", **cfg)
    x = torch.randn(3, 4, 8)  # [s, b, h]
    check_layer_against_oracle(layer, x)


@pytest.mark.parametrize("drop_policy", ["probs", "position"])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.25])
def test_capacity_layer_matches_oracle(capacity_factor, drop_policy):
    torch.manual_seed(11)
    layer = MoELayer(
        8,
        12,
        4,
        2,
        backend="reference",
        capacity_factor=capacity_factor,
        drop_policy=drop_policy,
        aux_loss_coeff=0.1,
        bias=True,
    )
    x = torch.randn(16, 8)
    check_layer_against_oracle(layer, x, capacity_factor=capacity_factor, drop_policy=drop_policy)
    ws = layer.workspace
    assert ws.capacity == min(math.ceil(16 * 2 / 4 * capacity_factor), 16)
    with torch.no_grad(), simulated_capture():  # the workspace is written while capturing
        layer(x)
    assert int((ws.row_id_map < 0).sum()) > 0 or capacity_factor < 1


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_expert_with_zero_tokens(capacity_factor):
    torch.manual_seed(12)
    layer = MoELayer(8, 6, 4, 2, backend="torch", capacity_factor=capacity_factor, bias=True)
    x = _block_expert(layer, torch.randn(2, 5, 8), expert=2)
    check_layer_against_oracle(layer, x, capacity_factor=capacity_factor)
    assert int(layer.router(x)[1][:, 2].sum()) == 0
    # The idle expert's gradients are exactly zero (even its bias: no padded row leaks in).
    for name in ("weight1", "weight2", "bias1", "bias2"):
        assert not getattr(layer.experts, name).grad[2].any(), name


def test_bf16_layer_close_to_fp32():
    torch.manual_seed(13)
    layer = MoELayer(16, 32, 4, 2, backend="reference")
    x = torch.randn(24, 16)
    want = layer(x)
    layer16 = MoELayer(16, 32, 4, 2, backend="reference", params_dtype=torch.bfloat16)
    layer16.load_state_dict(layer.state_dict())
    got = layer16(x.bfloat16())
    assert got.dtype == torch.bfloat16
    # Same routing decisions are not guaranteed in bf16; compare where the routing agrees.
    same = (layer16.router(x.bfloat16())[1] == layer.router(x)[1]).all(dim=1)
    assert same.sum() >= 20
    assert_close(got[same].float(), want[same].detach(), torch.bfloat16, atol=3e-2)


# --- GroupedMLP ---------------------------------------------------------------------------------


@pytest.mark.parametrize("activation,bias", [("gelu", False), ("swiglu", True)])
def test_grouped_mlp_init_equals_linear_pairs(activation, bias):
    H, F_, L = 6, 5, 3
    f1 = 2 * F_ if activation == "swiglu" else F_
    torch.manual_seed(14)
    mlp = GroupedMLP(L, H, F_, activation=activation, bias=bias, backend="reference")
    torch.manual_seed(14)
    pairs = [(nn.Linear(H, f1, bias=bias), nn.Linear(F_, H, bias=bias)) for _ in range(L)]
    for e, (fc1, fc2) in enumerate(pairs):
        assert torch.equal(mlp.weight1[e], fc1.weight.t())
        assert torch.equal(mlp.weight2[e], fc2.weight.t())
        if bias:
            assert torch.equal(mlp.bias1[e], fc1.bias) and torch.equal(mlp.bias2[e], fc2.bias)
    # The grouped forward equals the pairs applied per expert.
    counts = torch.tensor([3, 0, 4])
    x = torch.randn(7, H)
    p = torch.rand(7)
    y = mlp(x, counts, p)
    rows = []
    for i, e in enumerate([0, 0, 0, 2, 2, 2, 2]):
        h = pairs[e][0](x[i])
        a = F.gelu(h) if activation == "gelu" else F.silu(h[:F_]) * h[F_:]
        rows.append(pairs[e][1](a * p[i]))
    assert_close(y, torch.stack(rows).detach(), torch.float32)
    # Offsets: experts [2, 5) of a 6-expert draw.
    torch.manual_seed(14)
    part = GroupedMLP(L, H, F_, activation=activation, bias=bias, perform_initialization=False)
    part.reset_parameters(expert_offset=2, num_experts=6)
    torch.manual_seed(14)
    six = GroupedMLP(6, H, F_, activation=activation, bias=bias)
    assert torch.equal(part.weight1, six.weight1[2:5]) and torch.equal(
        part.weight2, six.weight2[2:5]
    )
    loaded = GroupedMLP(L, H, F_, activation=activation, bias=bias, perform_initialization=False)
    loaded.load_linears(pairs)
    assert torch.equal(loaded.weight1, mlp.weight1)
    assert all(getattr(p, "allreduce", True) is False for p in mlp.parameters())


def test_grouped_mlp_bad_inputs():
    mlp = GroupedMLP(2, 4, 6)
    with pytest.raises(ValueError, match="activation"):
        GroupedMLP(2, 4, 6, activation="relu")
    with pytest.raises(ValueError, match=r"\[M, 4\]"):
        mlp(torch.randn(3, 5), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"tokens_per_expert must be \[2\]"):
        mlp(torch.randn(3, 4), torch.tensor([3]))
    with pytest.raises(ValueError, match="permuted_probs"):
        mlp(torch.randn(3, 4), torch.tensor([1, 2]), torch.rand(2))
    with pytest.raises(ValueError, match="pairs"):
        mlp.load_linears([])


# --- graph safety, host syncs, workspace -------------------------------------------------------


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_layer_forward_is_graph_safe(capacity_factor):
    torch.manual_seed(15)
    layer = MoELayer(
        8,
        8,
        4,
        2,
        backend="triton",
        capacity_factor=capacity_factor,
        aux_loss_coeff=0.01,
        z_loss_coeff=0.01,
        expert_bias=True,
    )
    x = torch.randn(2, 6, 8)
    out = assert_graph_safe(layer, x)
    assert out.data_ptr() == layer.workspace.output.data_ptr()
    # Outside a capture the output is an ordinary fresh tensor.
    assert layer(x).data_ptr() != layer.workspace.output.data_ptr()


def test_sync_counts_single_rank_default_backend():
    torch.manual_seed(16)
    for cf in (None, 1.0):
        layer = MoELayer(8, 8, 4, 2, capacity_factor=cf, aux_loss_coeff=0.01)
        assert layer.experts.gemm_backend(torch.device("cpu")) == "torch"
        x = torch.randn(12, 8, requires_grad=True)
        with count_host_syncs() as syncs:
            layer(x).sum().backward()
        assert syncs.count == 0, (cf, syncs)
        assert_graph_safe(layer, x.detach())
    # The Triton path (interpreted kernels: row map, permute, grouped GEMM, unpermute) with the
    # default device-side checks: no sync either, and the result is the reference's.
    for cf in (None, 1.0):
        torch.manual_seed(18)
        layer = MoELayer(8, 8, 4, 2, capacity_factor=cf, aux_loss_coeff=0.01, backend="triton")
        torch.manual_seed(18)
        ref = MoELayer(8, 8, 4, 2, capacity_factor=cf, aux_loss_coeff=0.01, backend="reference")
        x = torch.randn(12, 8, requires_grad=True)
        with count_host_syncs() as syncs:
            out = layer(x)
            out.sum().backward()
        assert syncs.count == 0, (cf, syncs)
        x_ref = x.detach().clone().requires_grad_(True)
        expected = ref(x_ref)
        expected.sum().backward()
        assert_close(out, expected)
        assert_close(x.grad, x_ref.grad)
    # A loop backend reads the counts on the host (once per grouped GEMM).
    layer = MoELayer(8, 8, 4, 2, backend="sequential")
    with count_host_syncs() as syncs:
        layer(torch.randn(12, 8))
    assert syncs.count == 2


def test_workspace_fixed_across_calls_and_rebuilt_on_new_token_count(caplog):
    torch.manual_seed(17)
    layer = MoELayer(8, 8, 4, 2, backend="torch")
    layer(torch.randn(10, 8))
    ws = layer.workspace
    ws.static_output()  # what the first captured call allocates
    ptrs = ws.data_ptrs()
    maps = set()
    for i in range(10):
        x = torch.randn(5, 2, 8) * (i + 1)
        before = ws.row_id_map.clone()
        layer(x)  # eager: the preprocess stays in fresh tensors, the workspace is left alone
        assert torch.equal(ws.row_id_map, before)
        with torch.no_grad(), simulated_capture():  # while capturing it is written in place
            layer(x)
        assert layer.workspace is ws and ws.data_ptrs() == ptrs
        maps.add(tuple(ws.row_id_map.tolist()))
    assert len(maps) > 5  # the routings differed
    with caplog.at_level(logging.INFO, logger="mtp"):
        layer(torch.randn(7, 8))
    assert layer.workspace is not ws and layer.workspace.num_tokens == 7
    assert "rebuilding the workspace for 7 tokens" in caplog.text


class _CountOps(TorchDispatchMode):
    """Counts every op dispatched, including the aten ops inside mtp's custom ops (their CPU
    kernel is re-dispatched with the mode active, so a per-expert loop inside shows up)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        if func.namespace == "mtp":
            with self:
                keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
                return func.redispatch(keys, *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def aten_ops_per_forward(num_experts, backend, capacity_factor=None):
    torch.manual_seed(18)
    layer = MoELayer(
        8, 8, num_experts, 2, backend=backend, capacity_factor=capacity_factor, aux_loss_coeff=0.01
    )
    x = torch.randn(16, 8, requires_grad=True)
    layer.token_dispatcher.get_workspace(16, 8, x.dtype, x.dtype, x.device)  # built beforehand
    with _CountOps() as mode:
        layer(x)
    return mode.count


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_host_side_op_count_does_not_grow_with_experts(capacity_factor):
    single = [aten_ops_per_forward(e, "triton", capacity_factor) for e in (8, 64)]
    loop = [aten_ops_per_forward(e, "sequential", capacity_factor) for e in (8, 64)]
    assert single[0] == single[1], single
    assert loop[1] > loop[0] * 1.4, loop  # one GEMM per (non-empty) expert: grows with E


# --- bad configurations ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(topk=5), "topk=5 must be <= num_experts=4"),
        (dict(capacity_factor=-1.0), "capacity_factor must be a finite number > 0"),
        (dict(activation="relu"), "activation"),
    ],
)
def test_bad_layer_configs(kwargs, match):
    args = dict(topk=2)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        MoELayer(8, 8, 4, **args)


def test_bad_layer_inputs():
    layer = MoELayer(8, 8, 4, 2, backend="reference")
    with pytest.raises(ValueError, match="hidden_size=8"):
        layer(torch.randn(3, 4))
    with pytest.raises(TypeError, match="float32/float16/bfloat16"):
        layer(torch.randn(3, 8).double())
    with pytest.raises(ValueError, match="expected 4 experts"):
        layer.load_full_state_dict({"experts.weight1": torch.zeros(3, 8, 8)}, strict=False)


def test_layer_refuses_input_dtype_unlike_its_parameters():
    """As nn.Linear: outside autocast the input's dtype must be the parameters' (it used to run
    in the input's dtype and return it without a word)."""
    layer = MoELayer(8, 8, 4, 2, backend="reference")
    msg = (r"hidden_states is bfloat16 but the layer's parameters are float32; call "
           r"layer\.to\(torch\.bfloat16\) or cast the input")  # fmt: skip
    with pytest.raises(TypeError, match=msg):
        layer(torch.randn(3, 8).bfloat16())
    with pytest.raises(TypeError, match="hidden_states is float32 but .* are bfloat16"):
        layer.to(torch.bfloat16)(torch.randn(3, 8))


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_layer_under_autocast_runs_as_before(input_dtype):
    """Under torch.autocast any input dtype is taken, as nn.Linear takes it; the output keeps
    the input's dtype and equals the float64 oracle where the (autocast bf16) routing agrees."""
    torch.manual_seed(4)
    layer = MoELayer(16, 32, 4, 2, activation="swiglu", backend="reference")
    x = torch.randn(24, 16).to(input_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x)
        routed = layer.router(x)[1]
    assert got.dtype == input_dtype
    want, _, _ = oracle_moe(layer, x)
    same = (routed == layer.router(x.float())[1]).all(dim=1)
    assert same.sum() >= 16
    assert_close(got[same].float(), want[same].float(), torch.bfloat16, atol=3e-2)


def test_layer_padding_mask_errors_name_it():
    layer = MoELayer(8, 8, 4, 2, backend="reference")
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"padding_mask must have hidden_states' leading shape "
                                         r"\(2, 3\) .*got \(3, 2\)"):  # fmt: skip
        layer(x, torch.zeros(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"padding_mask .*\(2, 3\).*got \(5,\)"):
        layer(x, torch.zeros(5, dtype=torch.bool))
    with pytest.raises(TypeError, match="padding_mask must be a bool tensor.*torch.int64"):
        layer(x, torch.zeros(2, 3, dtype=torch.int64))


# --- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_gpu_triton_layer_matches_oracle(dtype, capacity_factor):
    torch.manual_seed(20)
    kw = dict(capacity_factor=capacity_factor, activation="swiglu", bias=True, device="cuda")
    x = torch.randn(4, 32, 64, device="cuda")
    if dtype == torch.float32:
        layer = MoELayer(64, 96, 8, 2, backend="triton", aux_loss_coeff=0.01, **kw)
        check_layer_against_oracle(layer, x, tol_grad=1e-4, capacity_factor=capacity_factor)
        return
    # bf16: the single-launch kernels against the per-expert cuBLAS loop, same routing.
    ref = MoELayer(64, 96, 8, 2, backend="sequential", params_dtype=dtype, **kw)
    layer = MoELayer(64, 96, 8, 2, backend="triton", params_dtype=dtype, **kw)
    layer.load_state_dict(ref.state_dict())
    xb = x.to(dtype).requires_grad_(True)
    xr = x.to(dtype).requires_grad_(True)
    out, want = layer(xb), ref(xr)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (want * g).sum().backward()
    assert_close(out.float(), want.double(), dtype, atol=2e-2)
    assert_close(xb.grad.float(), xr.grad.double(), dtype, atol=2e-2)
    assert_close(
        layer.experts.weight1.grad.float(), ref.experts.weight1.grad.double(), dtype, atol=5e-2
    )


@pytest.mark.gpu
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_gpu_cuda_graph_replay_and_no_sync(capacity_factor):
    torch.manual_seed(21)
    layer = MoELayer(
        64,
        128,
        8,
        2,
        backend="triton",
        capacity_factor=capacity_factor,
        aux_loss_coeff=0.01,
        device="cuda",
        params_dtype=torch.bfloat16,
    )
    x_static = torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16)
    # No host sync in a training forward + backward (CUDA's own sync detector).
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x_static.requires_grad_(True)).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    x_static = x_static.detach()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            layer(x_static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y_static = layer(x_static)
    assert y_static.data_ptr() == layer.workspace.output.data_ptr()
    for i in range(3):
        x_new = torch.randn_like(x_static) * (i + 1)
        x_static.copy_(x_new)
        graph.replay()
        with torch.no_grad():
            want = layer(x_new)
        torch.cuda.synchronize()
        assert_close(y_static.float(), want.double(), torch.bfloat16)
