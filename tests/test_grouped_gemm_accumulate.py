"""Gradient-accumulation fusion of the grouped GEMM (``grouped_gemm(...,
gradient_accumulation_fusion=True)``, alias mtp.ops.grouped_gemm_accumulate_wgrad): the
weight gradient added to an fp32 ``main_grad`` in the wgrad kernels' epilogue (plain, TMA and
split-K under the interpreter), against float64; the op over several micro-batches and
backends; GroupedMLP with the option under DistributedDataParallel (gloo, dp=2) against the
unfused layer; the kernels' ACCUMULATE variants compiled for sm_90a / sm_100a."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from mtp import ops
from mtp.kernels.grouped_gemm_details import launch, pointer
from mtp.kernels.grouped_gemm_details import tma as tk
from mtp.ops.grouped_gemm.config import make_config
from mtp.moe import GroupedMLP
from mtp.testing import compile_for_targets, run_distributed
from test_grouped_gemm_tma import SIZES, K, M, N, _expected_wgrad, tma_config  # ragged, empty


def _data(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).to(dtype)
    dy = torch.randn(M, N, generator=g).to(dtype)
    w = (torch.randn(len(SIZES), K, N, generator=g) / K**0.5).to(dtype)
    init = torch.randn(len(SIZES), K, N, generator=g)  # fp32 main_grad already holding something
    return a, dy, w, init


def _wgrad64(a, dy):
    return _expected_wgrad(a, dy, SIZES)


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("path", ["plain", "tma", "tma-split3"])
def test_kernel_epilogue_adds_in_fp32(path):
    a, dy, _, init = _data(torch.bfloat16)
    main = init.clone()
    pointer_cfg = make_config(0, a.dtype, M, N, K, len(SIZES), gemm="wgrad")
    if path == "plain":
        launch.wgrad(a, dy, torch.tensor(SIZES), main, pointer_cfg, accumulate=True)
    else:
        cfg = tma_config(16, 16, 16, group_m=2, num_stages=3, warp_specialize=True,
                         split=3 if "split" in path else 1)  # fmt: skip
        launch.wgrad(a, dy, torch.tensor(SIZES), main, cfg, accumulate=True)
    want = init.double() + _wgrad64(a, dy)
    assert _rel(main, want) < 2e-6, _rel(main, want)  # fp32 accumulation, no bf16 rounding
    # the unfused way (bf16 wgrad, then added) loses ~3 significant digits more
    unfused = init + launch.wgrad(a, dy, torch.tensor(SIZES),
                                  torch.empty_like(init, dtype=torch.bfloat16), pointer_cfg).float()
    assert _rel(unfused, want) > 10 * _rel(main, want)
    for e, m in enumerate(SIZES):
        if m == 0:
            assert torch.equal(main[e], init[e]), f"empty expert {e} changed"


@pytest.mark.parametrize("backend", ["triton", "torch", "reference"])
def test_op_accumulates_over_micro_batches(backend):
    a, dy, w, init = _data(torch.bfloat16, seed=1)
    w = w.clone().requires_grad_()
    w.main_grad = init.clone()
    want = init.double()
    for step in range(2):
        x = (a * (step + 1)).requires_grad_()
        y = ops.grouped_gemm_accumulate_wgrad(x, w, torch.tensor(SIZES), backend=backend)
        ref_y = ops.grouped_gemm(x.detach(), w.detach(), torch.tensor(SIZES), backend="reference")
        torch.testing.assert_close(y, ref_y, rtol=1e-2, atol=1e-2)
        y.backward(dy)
        want = want + _wgrad64(x.detach(), dy)
        dx = ops.grouped_gemm(dy, w.detach(), torch.tensor(SIZES), trans_b=True,
                              backend="reference")  # fmt: skip
        torch.testing.assert_close(x.grad, dx, rtol=1e-2, atol=1e-2)
    assert w.grad is None  # no DDP flag: the gradient went to main_grad only
    limit = 2e-6 if backend == "triton" else 1e-2  # only Triton fuses (no bf16 rounding)
    assert _rel(w.main_grad, want) < limit, _rel(w.main_grad, want)


def test_placeholder_gradient_and_flag_for_ddp_hooks():
    a, dy, w, init = _data(torch.float32, seed=2)
    w = w.clone().requires_grad_()
    w.main_grad, w.grad_added_to_main_grad = init.clone(), False
    ops.grouped_gemm_accumulate_wgrad(a, w, torch.tensor(SIZES), backend="triton").backward(dy)
    assert w.grad_added_to_main_grad is True and w.grad.shape == w.shape
    assert _rel(w.main_grad, init.double() + _wgrad64(a, dy)) < 1e-6


def test_bad_inputs_name_the_problem():
    a, _, w, _ = _data(torch.bfloat16)
    w = w.clone().requires_grad_()
    with pytest.raises(ValueError, match="main_grad"):
        ops.grouped_gemm_accumulate_wgrad(a, w, torch.tensor(SIZES))
    w.main_grad = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="main_grad must be"):
        ops.grouped_gemm_accumulate_wgrad(a, w, torch.tensor(SIZES))
    with pytest.raises(TypeError, match="w"):
        ops.grouped_gemm_accumulate_wgrad(a, w.detach().float(), torch.tensor(SIZES))
    with pytest.raises(TypeError, match="gradient_accumulation_fusion"):
        GroupedMLP(2, 8, 8, gradient_accumulation_fusion="yes")
    mlp = GroupedMLP(2, 8, 8, gradient_accumulation_fusion=True)  # fp32 weights
    with pytest.raises(ValueError, match="activation dtype"):
        mlp(torch.randn(4, 8, dtype=torch.bfloat16), torch.tensor([1, 3]))


def _weight_casts(mlp, x, counts):
    """aten ``_to_copy`` calls whose input is one of ``mlp``'s weights, in one forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    weights = {id(p) for p in (mlp.weight1, mlp.weight2)}
    seen = []

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("_to_copy") and args and id(args[0]) in weights:
                seen.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    with Casts():
        mlp(x, counts, torch.rand(x.shape[0]))
    return seen


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_weights_are_not_cast_per_call(fused):
    """Weights held in the compute dtype: the forward casts none of them (fp32 weights: two)."""
    x, counts = torch.randn(12, 8).to(torch.bfloat16), torch.tensor([5, 7])
    mlp = GroupedMLP(2, 8, 6, activation="swiglu", params_dtype=torch.bfloat16,
                     gradient_accumulation_fusion=fused)  # fmt: skip
    for p in (mlp.weight1, mlp.weight2):
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    assert _weight_casts(mlp, x, counts) == []
    assert len(_weight_casts(GroupedMLP(2, 8, 6, activation="swiglu"), x, counts)) == 2


def _ddp_worker(rank, world):
    from mtp.optim import DistributedDataParallel

    grads = []
    for fused in (False, True):
        torch.manual_seed(0)
        mlp = GroupedMLP(3, 16, 24, activation="swiglu", bias=True, backend="triton",
                         params_dtype=torch.bfloat16, gradient_accumulation_fusion=fused)  # fmt: skip
        model = DistributedDataParallel(
            mlp, accumulate_allreduce_grads_in_fp32=True, bucket_size=None,
            data_parallel_group=dist.group.WORLD, expert_data_parallel_group=dist.group.WORLD,
        )  # fmt: skip
        g = torch.Generator().manual_seed(10 + rank)
        counts = torch.tensor([5, 0, 9])
        for step in range(2):  # two micro-batches accumulate, then one reduction
            x = torch.randn(16, 16, generator=g).to(torch.bfloat16)
            probs = torch.rand(16, generator=g)
            with model.no_sync() if step == 0 else contextlib.nullcontext():
                model(x, counts, probs).float().square().sum().backward()
        model.finish_grad_sync()
        grads.append({n: p.main_grad.clone() for n, p in mlp.named_parameters()})
        assert not any(p.grad_added_to_main_grad for p in mlp.parameters())  # flags consumed
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=2e-2, atol=2e-2,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip
    return True


def test_grouped_mlp_fused_under_ddp_equals_unfused():
    assert all(run_distributed(_ddp_worker, 2, timeout=180))


@pytest.mark.parametrize("which", ["plain", "tma"])
def test_accumulate_variants_compile_without_spills(which):
    if which == "plain":
        signature = {
            "a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "counts_ptr": "*i32",
            "g_ptr": "*i32", "M": "i32", "P": "i32", "Q": "i32", "E": "i32", "stride_am": "i32",
            "stride_bm": "i32", "stride_ce": "i32", "stride_cp": "i32",
        }
        constexprs = {
            "stride_ap": 1, "stride_bq": 1, "stride_cq": 1, "BLOCK_P": 128, "BLOCK_Q": 128,
            "BLOCK_R": 64, "BLOCK_E": 64, "GROUP_P": 8, "UPCAST_DOT": False,
            "DOT_PRECISION": "ieee", "ACCUMULATE": True, "GATHER_A": False,
        }
        kernel, warps = pointer.grouped_wgrad_kernel, 8
    else:
        signature = {
            "a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "rows_ptr": "*i32",
            "M": "i32", "P": "i32", "Q": "i32", "E": "i32", "stride_am": "i32",
            "stride_bm": "i32", "stride_ce": "i32", "stride_cp": "i32", "stride_cs": "i32",
        }
        constexprs = {
            "BLOCK_P": 128, "BLOCK_Q": 128, "BLOCK_R": 64, "GROUP_P": 8, "SPLIT": 1,
            "WARP_SPECIALIZE": False, "UPCAST_DOT": False, "ACCUMULATE": True,
        }
        kernel, warps = tk.grouped_wgrad_tma_kernel, 8
    divisible = [k for k in signature if k.startswith("stride")] + ["P", "Q"]
    builds = compile_for_targets(kernel, signature, constexprs, num_warps=warps, num_stages=3,
                                 divisible_by_16=divisible)  # fmt: skip
    for cc, build in builds.items():
        assert build.arch == f"sm_{cc}a" and build.fits_shared_memory, (cc, build.shared)
        info = build.ptxas()
        assert info is None or not info.spills, f"sm_{cc} spills:\n{info.output}"


@pytest.mark.gpu
def test_gpu_accumulates_into_fp32_main_grad():
    """On the GPU (TMA kernels on sm_90/sm_100): Mixtral-like expert sizes, two micro-batches."""
    g = torch.Generator(device="cuda").manual_seed(3)
    sizes = torch.tensor([700, 0, 1500, 37, 900, 1, 0, 2000], device="cuda")
    m, k, n = int(sizes.sum()) + 64, 512, 768
    w = (torch.randn(8, k, n, device="cuda", generator=g) / k**0.5).bfloat16().requires_grad_()
    w.main_grad = torch.randn(8, k, n, device="cuda", generator=g)
    want = w.main_grad.double()
    for _ in range(2):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        dy = torch.randn(m, n, device="cuda", generator=g).bfloat16()
        ops.grouped_gemm_accumulate_wgrad(x, w, sizes, backend="triton").backward(dy)
        row = 0
        for e, rows in enumerate(sizes.tolist()):
            want[e] += x[row : row + rows].double().T @ dy[row : row + rows].double()
            row += rows
    assert _rel(w.main_grad, want) < 1e-5, _rel(w.main_grad, want)
