"""mtp.ops.vocab_parallel_cross_entropy on one process (group=None): Triton kernels under the
interpreter against ``F.cross_entropy`` in float64. The multi-rank cases are in
test_tp_cross_entropy.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtp import settings
import mtp.tensor_parallel
from mtp.kernels import cross_entropy as kernels
from mtp.ops.cross_entropy import (
    TargetOutOfRangeError,
    vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_reference,
)
from mtp.testing import (
    _find_ptxas,
    assert_close,
    assert_graph_safe,
    compile_for_targets,
    count_host_syncs,
)
from test_ops_bias_act import capture_graph, ptxas_table

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference_loss(logits, target, *, label_smoothing=0.0, ignore_index=-100, reduction="none",
                   z_loss_weight=0.0):
    """float64 ``F.cross_entropy`` (+ z-loss) on ``logits`` (a float64 autograd leaf is made)."""
    x = logits.detach().double().requires_grad_(True)
    v = x.shape[-1]
    flat, t = x.reshape(-1, v), target.reshape(-1).long()
    loss = F.cross_entropy(flat, t, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction="none")
    valid = t != ignore_index
    if z_loss_weight:
        lse = torch.logsumexp(flat, dim=-1)
        loss = loss + z_loss_weight * torch.where(valid, lse * lse, torch.zeros_like(lse))
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / valid.sum()
    else:
        loss = loss.reshape(target.shape)
    return loss, x


def check(logits, target, backend="triton", dloss=None, **kwargs):
    """Loss and logits gradient of the op against the float64 reference."""
    x = logits.detach().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, target, backend=backend, **kwargs)
    ref, x64 = reference_loss(logits, target, **kwargs)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_close(loss, ref, torch.float32, msg="loss")
    if dloss is None:
        dloss = torch.randn(loss.shape, device=loss.device)
    loss.backward(dloss)
    ref.backward(dloss.double())
    assert x.grad.dtype == logits.dtype and x.grad.shape == logits.shape
    assert_close(x.grad, x64.grad, logits.dtype, msg="grad")
    return loss, x.grad


def make_inputs(shape, vocab, dtype, device, scale=3.0, ignore_every=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=gen) * scale).to(dtype).to(device)
    target = torch.randint(0, vocab, shape, generator=gen).to(device)
    if ignore_every:
        target.view(-1)[::ignore_every] = -100
    return logits, target


CASES = [  # (label_smoothing, z_loss_weight, reduction)
    (0.0, 0.0, "none"),
    (0.1, 0.0, "mean"),
    (0.0, 1e-2, "sum"),
    (0.3, 1e-3, "none"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"ls{c[0]}-z{c[1]}-{c[2]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64(dtype, case, device):
    label_smoothing, z_loss_weight, reduction = case
    logits, target = make_inputs((3, 4), 300, dtype, device)
    check(logits, target, label_smoothing=label_smoothing, z_loss_weight=z_loss_weight,
          reduction=reduction)


@pytest.mark.parametrize("dtype, scale", [(torch.float32, 30.0), (torch.float32, 1.0),
                                          (torch.bfloat16, 1.0), (torch.bfloat16, 30.0)])
def test_gradient_is_as_precise_as_pytorchs(dtype, scale, device):
    """The gradient's error against float64 is PyTorch's own (``F.cross_entropy`` in ``dtype``
    on the same logits) within 3x, large logits included. Computed as
    ``exp(x - lse)``, the fp32 gradient at x30 logits would be 20x PyTorch's error (lse rounds at
    ulp(lse)); ``exp(x - max) / sum``, PyTorch's order, rounds once."""
    worst = 0.0
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        logits = (torch.randn(64, 1000, generator=gen) * scale).to(dtype).to(device)
        target = torch.randint(0, 1000, (64,), generator=gen).to(device)
        errors = []
        for fn in (lambda x: vocab_parallel_cross_entropy(x, target, reduction="mean",
                                                           backend="triton"),
                   lambda x: F.cross_entropy(x, target)):  # fmt: skip
            x = logits.clone().requires_grad_(True)
            fn(x).backward()
            ref = logits.double().requires_grad_(True)
            F.cross_entropy(ref, target).backward()
            errors.append((x.grad.double() - ref.grad).abs().max().item())
        worst = max(worst, errors[0] / errors[1])
    assert worst <= 3.0, worst


FP32_BLOCK = kernels.LANES * kernels.vector_width(torch.float32)


@pytest.mark.parametrize("vocab", [1, 2, 37, FP32_BLOCK + 1, 2 * FP32_BLOCK + 3])
def test_vocab_sizes_around_the_block(vocab, device):
    # + 1 / + 3: one or two aligned tiles, then a ragged tile (head + tail) per row.
    logits, target = make_inputs((3,), vocab, torch.float32, device, ignore_every=0, seed=vocab)
    check(logits, target, label_smoothing=0.1, z_loss_weight=1e-3)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy in the interpreter: inf - inf
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_of_minus_inf_except_the_target(dtype, device):
    logits, target = make_inputs((6,), 50, dtype, device, ignore_every=0)
    rows = torch.arange(6, device=device)
    masked = torch.full_like(logits, float("-inf"))
    masked[rows, target] = logits[rows, target]
    masked[3:, 7] = 1.0  # rows 3..5: one more finite logit
    masked[5] = logits[5]  # an ordinary row
    loss, grad = check(masked, target)
    assert torch.equal(loss[:3], torch.zeros(3, device=device))
    assert torch.equal(grad[:3], torch.zeros_like(grad[:3]))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_huge_fp16_logits(label_smoothing, device):
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(4, 3, 130, generator=gen) * 3e4).clamp(-65000, 65000).half().to(device)
    target = torch.randint(0, 130, (4, 3), generator=gen).to(device)
    target[0, 0] = logits[0, 0].float().argmax()  # a row whose target is the max: loss ~ 0
    check(logits, target, label_smoothing=label_smoothing)


def test_int32_targets_and_custom_ignore_index(device):
    logits, target = make_inputs((2, 5), 40, torch.float32, device, ignore_every=0)
    target = target.int()
    target[0, :2] = 3  # ignore_index inside the vocab: those rows are ignored, not scored
    check(logits, target, ignore_index=3, reduction="mean")


def test_strided_leading_dims(device):
    big, target_big = make_inputs((6, 8), 70, torch.bfloat16, device, ignore_every=3)
    # rows with two leading strides, read in place
    for logits, target in [
        (big[:, ::2], target_big[:, ::2]),
        (big.transpose(0, 1), target_big.transpose(0, 1)),
        (big[1:5, 2:7], target_big[1:5, 2:7]),
    ]:
        assert kernels.row_layout(logits) is not None
        check(logits, target, label_smoothing=0.1)
    # three non-mergeable leading strides and a strided vocab dim: copied first
    big4, target4 = make_inputs((4, 3, 4), 20, torch.float16, device)
    assert kernels.row_layout(big4[::2, ::2, ::2]) is None
    check(big4[::2, ::2, ::2], target4[::2, ::2, ::2])
    check(big4[..., ::2], target4 % 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inplace_backward_writes_the_gradient_into_the_logits(dtype, device):
    logits, target = make_inputs((4, 5), 33, dtype, device)
    ref, x64 = reference_loss(logits, target, label_smoothing=0.1, reduction="mean")
    ref.backward()
    # contiguous logits produced by an op that does not save its output
    leaf = logits.detach().requires_grad_(True)
    produced = leaf + 0
    loss = vocab_parallel_cross_entropy(produced, target, label_smoothing=0.1, reduction="mean",
                                        inplace_backward=True, backend="triton")
    loss.backward()
    assert_close(loss, ref, torch.float32)
    assert_close(leaf.grad, x64.grad, dtype)
    assert_close(produced.detach(), x64.grad, dtype)  # the logits buffer now holds the gradient
    # strided logits: a view of every other row of a larger buffer, written with its strides
    big_leaf = torch.zeros(4, 10, 33, dtype=dtype, device=device)
    big_leaf[:, ::2] = logits
    big_leaf.requires_grad_(True)
    big = big_leaf + 0
    loss = vocab_parallel_cross_entropy(big[:, ::2], target, label_smoothing=0.1,
                                        reduction="mean", inplace_backward=True, backend="triton")
    loss.backward()
    assert_close(big_leaf.grad[:, ::2], x64.grad, dtype)
    assert not big_leaf.grad[:, 1::2].any()
    assert_close(big.detach()[:, ::2], x64.grad, dtype)
    assert torch.equal(big.detach()[:, 1::2], torch.zeros_like(big[:, 1::2]))


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_autograd_saves_only_the_gradient(reduction, inplace, device):
    """The gradient is computed in the forward: autograd keeps that one buffer (logits-sized;
    the logits themselves with inplace_backward) and nothing per row."""
    logits, target = make_inputs((4, 6), 1000, torch.bfloat16, device)
    leaf = logits.clone().requires_grad_(True)
    x = leaf * 1 if inplace else leaf
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = vocab_parallel_cross_entropy(x, target, reduction=reduction, label_smoothing=0.1,
                                            z_loss_weight=1e-3, inplace_backward=inplace,
                                            backend="triton")
    assert len(saved) == 1, [(t.shape, t.dtype) for t in saved]
    assert saved[0].shape == x.shape and saved[0].dtype == x.dtype
    same = saved[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert same == inplace
    loss.backward(torch.ones_like(loss))
    ref, x64 = reference_loss(logits, target, reduction=reduction, label_smoothing=0.1,
                              z_loss_weight=1e-3)
    ref.backward(torch.ones_like(ref))
    assert_close(leaf.grad, x64.grad, torch.bfloat16)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_target_validation(backend, device):
    logits, target = make_inputs((2, 3), 10, torch.float32, device)
    for bad_value in (10, -1, 12345):
        bad = target.clone()
        bad[1, 2] = bad_value
        with pytest.raises(TargetOutOfRangeError, match=rf"outside \[0, 10\).*e\.g\. {bad_value}"):
            vocab_parallel_cross_entropy(logits, bad, backend=backend, validate="sync")
        with pytest.raises(IndexError):  # what F.cross_entropy raises for the same mistake
            vocab_parallel_cross_entropy(logits, bad, backend=backend, validate="sync")
        # default: checked on the device (on CPU, torch._assert_async raises at once)
        with count_host_syncs() as syncs, pytest.raises(RuntimeError, match=r"target holds ids"
                                                                         r" outside \[0, 10\)"):
            vocab_parallel_cross_entropy(logits.requires_grad_(bad_value == 10), bad,
                                         backend=backend)
        assert syncs.count == 0, syncs.events
        logits.requires_grad_(False)
    with count_host_syncs() as syncs:
        vocab_parallel_cross_entropy(logits, bad, validate=False, backend=backend)
    assert syncs.count == 0, syncs.events
    with settings.override(validate="off"):  # MTP_VALIDATE=off: validate=True checks nothing
        vocab_parallel_cross_entropy(logits, bad, backend=backend)
        with pytest.raises(TargetOutOfRangeError):  # an explicit mode still checks
            vocab_parallel_cross_entropy(logits, bad, backend=backend, validate="sync")
    with count_host_syncs() as syncs:
        vocab_parallel_cross_entropy(logits, target, backend=backend, reduction="mean")
    assert syncs.count == 0, syncs.events
    with count_host_syncs() as syncs:
        vocab_parallel_cross_entropy(logits, target, backend=backend, validate="sync")
    assert syncs.count >= 1  # validate="sync" reads the check on the host
    with pytest.raises(ValueError, match="validate must be"):
        vocab_parallel_cross_entropy(logits, target, backend=backend, validate="always")


def test_bad_inputs(device):
    logits, target = make_inputs((2, 3), 10, torch.float32, device)
    ce = vocab_parallel_cross_entropy
    with pytest.raises(ValueError, match=r"target must have shape \(2, 3\)"):
        ce(logits, target[:, :2])
    with pytest.raises(ValueError, match=r"target must have shape \(2, 3\)"):
        ce(logits, target.reshape(-1))
    with pytest.raises(TypeError, match="class indices"):
        ce(logits, target.float())
    with pytest.raises(TypeError, match="target must have dtype"):
        ce(logits, target.to(torch.int16))
    with pytest.raises(TypeError, match="logits must have dtype"):
        ce(logits.double(), target)
    with pytest.raises(ValueError, match="logits must be"):
        ce(torch.tensor(1.0, device=device), torch.tensor(0, device=device))
    with pytest.raises(ValueError, match="non-empty last"):
        ce(logits[..., :0], target)
    with pytest.raises(ValueError, match="target must be on"):
        ce(logits, target.to("meta"))
    with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
        ce(logits.tolist(), target)
    with pytest.raises(ValueError, match="label_smoothing"):
        ce(logits, target, label_smoothing=1.5)
    with pytest.raises(ValueError, match="z_loss_weight"):
        ce(logits, target, z_loss_weight=-1.0)
    with pytest.raises(ValueError, match="reduction must be one of"):
        ce(logits, target, reduction="avg")
    with pytest.raises(TypeError, match="group must be"):
        ce(logits, target, group="tp")
    with pytest.raises(ValueError, match="unknown backend"):
        ce(logits, target, backend="cuda")


def test_one_row_and_empty(device):
    logits, target = make_inputs((), 29, torch.float32, device, ignore_every=0)
    check(logits, target, reduction="none", dloss=torch.tensor(2.0, device=device))
    empty_logits = torch.randn(0, 4, 29, device=device, requires_grad=True)
    empty_target = torch.zeros(0, 4, dtype=torch.long, device=device)
    loss = vocab_parallel_cross_entropy(empty_logits, empty_target, backend="triton")
    assert loss.shape == (0, 4)
    loss.sum().backward()
    assert empty_logits.grad.shape == empty_logits.shape
    mean = vocab_parallel_cross_entropy(empty_logits, empty_target, reduction="mean",
                                        backend="triton")
    assert torch.isnan(mean)  # as F.cross_entropy: 0 / 0


def test_all_rows_ignored(device):
    logits, target = make_inputs((3,), 12, torch.float32, device, ignore_every=0)
    target[:] = -100
    loss, grad = check(logits, target, reduction="sum")
    assert loss.item() == 0.0 and not grad.any()
    assert torch.isnan(vocab_parallel_cross_entropy(logits, target, reduction="mean"))


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_reference_and_auto_backends(backend, device, monkeypatch):
    settings.configure(backend=None)
    logits, target = make_inputs((2, 3), 77, torch.bfloat16, device)
    check(logits, target, backend=backend, label_smoothing=0.2, z_loss_weight=1e-2)
    assert torch.equal(
        vocab_parallel_cross_entropy_reference(logits, target, label_smoothing=0.2),
        vocab_parallel_cross_entropy(logits, target, label_smoothing=0.2, backend="reference"),
    )
    for inplace in (False, True):
        x = logits.clone().requires_grad_(True)
        y = x * 1
        loss = vocab_parallel_cross_entropy(y, target, backend=backend, inplace_backward=inplace)
        loss.sum().backward()
        ref, x64 = reference_loss(logits, target, reduction="sum")
        ref.backward()
        assert_close(x.grad, x64.grad, torch.bfloat16)


def test_megatron_names(device):
    logits, target = make_inputs((3, 2), 64, torch.float32, device)
    target[target == -100] = 0  # Megatron has no ignore_index
    expected, x64 = reference_loss(logits, target, label_smoothing=0.1)
    loss = mtp.tensor_parallel.vocab_parallel_cross_entropy(logits, target, 0.1)
    assert loss.shape == target.shape and loss.dtype == torch.float32
    assert_close(loss, expected, torch.float32)
    module = mtp.tensor_parallel.VocabParallelCrossEntropy(label_smoothing=0.1, backend="triton")
    x = logits.clone().requires_grad_(True)
    module(x, target).sum().backward()
    expected.sum().backward()
    assert_close(x.grad, x64.grad)
    mean = mtp.tensor_parallel.VocabParallelCrossEntropy(0.1, reduction="mean")(logits, target)
    assert_close(mean, expected.mean(), torch.float32)


def test_opcheck_and_compile(device):
    logits, target = make_inputs((2, 3), 40, torch.float32, device)
    for compute_grad in (False, True):
        torch.library.opcheck(
            torch.ops.mtp.vocab_parallel_cross_entropy.default,
            (logits, target, 0.1, -100, 1e-3, 0, 40, "", 1, "mean", compute_grad, True, "triton"),
        )
    torch.library.opcheck(
        torch.ops.mtp.vocab_parallel_cross_entropy_.default,
        (logits.clone(), target, 0.1, -100, 1e-3, 0, 40, "", 1, "none", True, "triton"),
    )
    torch.library.opcheck(
        torch.ops.mtp.vocab_parallel_cross_entropy_scale_.default,
        (logits.clone(), torch.randn(2, 3, device=device), "triton"),
    )

    def fn(x, target):
        return vocab_parallel_cross_entropy(x, target, label_smoothing=0.1, reduction="mean",
                                            backend="triton")

    x = logits.clone().requires_grad_(True)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    (grad,) = torch.autograd.grad(compiled(x, target), (x,))
    ref, x64 = reference_loss(logits, target, label_smoothing=0.1, reduction="mean")
    ref.backward()
    assert_close(grad, x64.grad)


def test_graph_safe(device):
    logits, target = make_inputs((2, 4), 24, torch.float32, device, ignore_every=3)
    out = torch.empty((), device=device)

    def step(logits, target):
        out.copy_(vocab_parallel_cross_entropy(logits, target, reduction="mean", backend="triton"))
        return out

    assert_graph_safe(step, logits, target)


def _cap(grad: bool) -> dict:
    """The GPU launch's options (``kernels._register_cap`` is empty under the interpreter)."""
    return {"maxnreg": kernels.GRAD_MAX_REGISTERS} if grad else {}


def aot_cases(dtype: str = "bf16"):
    """``(name, kernel, signature, constexprs, num_warps[, launch options])`` of every kernel
    variant (logits of ``dtype``, int64 targets); the options are the launch's (``maxnreg``)."""
    rows = dict(n_inner="i64", stride_outer="i64", stride_inner="i64")
    grows = dict(g_n_inner="i64", g_stride_outer="i64", g_stride_inner="i64")
    coefs = dict(ignore_index="i32", coef_target="fp32", coef_uniform="fp32")
    vec = kernels.VECTOR_BYTES // (4 if dtype == "fp32" else 2)
    tile = dict(NT=kernels.LANES, VEC=vec)
    out = dict(loss_ptr="*fp32", partial_ptr="*fp32", counter_ptr="*i32", info_ptr="*i32")
    cases = [
        (f"ce_fused[smoothing={sm},grad={grad},reduce={red}]",
         kernels._ce_fused_kernel,
         dict(logits_ptr=f"*{dtype}", grad_ptr=f"*{dtype}", target_ptr="*i64", **out,
              n_rows="i32", **rows, **grows, V="i32", **coefs, z_loss_weight="fp32"),
         dict(SMOOTHING=sm, GRAD=grad, REDUCE=red, MEAN=red, CHECK=True, SAME_LAYOUT=True,
              MAX_G=kernels.MAX_PROGRAMS, **tile),
         kernels.NUM_WARPS, _cap(grad))
        for sm in (False, True) for grad in (False, True) for red in (False, True)
    ]
    cases.append((
        "ce_stats[smoothing=True]",
        kernels._ce_stats_kernel,
        dict(logits_ptr=f"*{dtype}", target_ptr="*i64", stats_ptr="*fp32", n_rows="i32", **rows,
             V_local="i32", vocab_start="i32", vocab_size="i32", **coefs),
        dict(SMOOTHING=True, **tile),
        kernels.NUM_WARPS,
    ))
    cases.append((
        "ce_finish[grad=True,reduce=True]",
        kernels._ce_finish_kernel,
        dict(gathered_ptr="*fp32", logits_ptr=f"*{dtype}", grad_ptr=f"*{dtype}",
             target_ptr="*i64", **out, n_rows="i32", world="i32", rank="i32", **rows, **grows,
             V_local="i32", vocab_start="i32", **coefs, z_loss_weight="fp32"),
        dict(GRAD=True, REDUCE=True, MEAN=True, SAME_LAYOUT=True, MAX_G=kernels.MAX_PROGRAMS,
             WB=8, **tile),
        kernels.NUM_WARPS, _cap(True),
    ))
    cases.append((
        "ce_scale",
        kernels._ce_scale_kernel,
        dict(grad_ptr=f"*{dtype}", dloss_ptr="*fp32", dloss_stride="i64", n_rows="i32", **rows,
             V="i32"),
        dict(BLOCK=kernels.SCALE_BLOCK),
        kernels.NUM_WARPS,
    ))
    return cases


def _old_triton() -> bool:
    import triton

    return tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 7)


def test_compiles_for_sm90_and_sm100_without_spills():
    """bf16 logits, for sm_90a and sm_100a. Triton 3.6 (the minimum, checked in CI for the
    H100/H200 machines, which are sm_90a) spills 4 B in one sm_100a variant that newer Triton
    compiles without spills: there, sm_100a may spill at most a register's worth.

    The kernels that write the gradient fit two 8-warp programs per SM (at most
    ``GRAD_MAX_REGISTERS`` = 128 registers). On the H200 (triton 3.6) they used 251: one program
    per SM, 12.5 % occupancy, 36 % of the DRAM bandwidth (Nsight Compute, bench/results/
    H200-SXM/gpu-check/ncu). The int64 column index of every element of the gradient tile was
    the cost (now one int32 scalar per tile)."""
    for name, arch, registers, stores, loads in ptxas_table(aot_cases()):
        limit = 4 if ("100" in str(arch) and _old_triton()) else 0
        assert stores <= limit and loads <= limit, (
            f"{name} spills on {arch}: {stores} B stored, {loads} B loaded"
        )
        if "grad=True" in name:
            assert registers <= kernels.GRAD_MAX_REGISTERS, (name, arch, registers)


# --- bytes, launches, host syncs (the structural floor) ----------------------------------------


def ce_floor(rows, vocab, elem, target_elem, grad=True):
    """Fewest bytes: the logits once, the targets, the loss out; with grad the gradient out and
    the upstream gradient in (as bench_cross_entropy.cross_entropy_bytes)."""
    if not grad:
        return rows * vocab * elem + rows * target_elem + 4 * rows
    return 2 * rows * vocab * elem + rows * target_elem + 8 * rows


@pytest.mark.parametrize("rows,vocab,dtype,reduction,inplace", [
    pytest.param(64, 8192, torch.float32, "none", False, marks=pytest.mark.slow),
    (64, 8192, torch.bfloat16, "mean", True),
    (4, 50257, torch.bfloat16, "mean", False),  # rows not 16-byte aligned: head + tail apart
])  # fmt: skip
def test_bytes_launches_and_syncs(rows, vocab, dtype, reduction, inplace, monkeypatch):
    from mtp.testing.traffic import count_traffic

    settings.configure(poison_outputs=False)  # the NaN fill of outputs is a test extra
    logits, target = make_inputs((rows,), vocab, dtype, "cpu", ignore_every=7)
    kwargs = dict(reduction=reduction, label_smoothing=0.1, inplace_backward=inplace,
                  backend="triton")
    vocab_parallel_cross_entropy(logits[:1], target[:1], **kwargs)  # warm-up (reduction counter)
    leaf = logits.clone().requires_grad_(True)
    x = leaf.view_as(leaf) if inplace else leaf  # a view: its backward moves no data
    with count_traffic() as fwd:
        loss = vocab_parallel_cross_entropy(x, target, **kwargs)
    upstream = torch.ones_like(loss)
    with count_traffic() as bwd:
        loss.backward(upstream)
    ref, x64 = reference_loss(logits, target, reduction=reduction, label_smoothing=0.1)
    ref.backward(upstream.double())
    assert_close(leaf.grad, x64.grad, dtype)
    floor = ce_floor(rows, vocab, logits.element_size(), 8)
    ratio = (fwd.bytes_program + bwd.bytes_program) / floor
    assert ratio <= 1.10, (ratio, fwd.by_kernel(), bwd.by_kernel())
    assert ratio >= 0.99, ratio  # the logits are read once and the gradient written once
    assert fwd.num_launches == 1 and [a.name for a in fwd.aten] == ["aten::_assert_async"]
    assert bwd.device_ops == 1, bwd.by_kernel()
    assert fwd.num_host_syncs == bwd.num_host_syncs == 0, (fwd.host_syncs, bwd.host_syncs)
    # a non-unit upstream gradient: one scaled pass over the gradient (read + write)
    leaf.grad = None
    if inplace:
        leaf = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(leaf.view_as(leaf), target, **kwargs)
    with count_traffic() as scaled:
        loss.backward(upstream * 3)
    grad_bytes = rows * vocab * logits.element_size()
    assert 2 * grad_bytes <= scaled.bytes_program <= 2.02 * grad_bytes, scaled.by_kernel()
    assert_close(leaf.grad, 3 * x64.grad, dtype)


def test_forward_without_grad_reads_the_logits_once(monkeypatch):
    from mtp.testing.traffic import count_traffic

    settings.configure(poison_outputs=False)
    logits, target = make_inputs((32,), 4099, torch.float32, "cpu")
    with count_traffic() as t:
        loss = vocab_parallel_cross_entropy(logits, target, backend="triton", validate=False)
    assert_close(loss, reference_loss(logits, target)[0], torch.float32)
    ratio = t.ratio(ce_floor(32, 4099, 4, 8, grad=False))
    assert 0.99 <= ratio <= 1.10 and t.device_ops == 1 and t.num_host_syncs == 0, t.summary()


def test_unsupported_uses_fail_clearly(device):
    logits, target = make_inputs((3,), 16, torch.float32, device)
    # expanded logits cannot take the gradient in place
    row = logits[:1].clone().requires_grad_(True)
    with pytest.raises(ValueError, match="inplace_backward.*overlapping"):
        vocab_parallel_cross_entropy(row.expand(3, 16), target, inplace_backward=True,
                                     backend="triton")
    # ... but are fine otherwise
    check(logits[:1].expand(3, 16), target, label_smoothing=0.1)
    # torch.func transforms: a clear error naming the limitation
    with pytest.raises(NotImplementedError, match="torch.func"):
        torch.func.grad(lambda x: vocab_parallel_cross_entropy(x, target, reduction="sum"))(
            logits)
    # the precomputed gradient is scaled in place: one backward per forward (autograd's version
    # counter of the saved gradient says so)
    x = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, target, reduction="sum", backend="triton")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_main_loads_are_16_bytes_in_sass():
    """sm_90a SASS of the forward (bf16 and fp32 logits): the aligned tiles load and store
    128 bits (``LDG.E.128`` / ``STG.E.128``); the row split makes this independent of V."""
    import os
    import shutil
    import subprocess
    import tempfile

    cuobjdump = shutil.which("cuobjdump") or os.path.join(
        os.path.dirname(os.path.dirname(torch.__file__)), "nvidia", "cu13", "bin", "cuobjdump")
    ptxas = _find_ptxas("sm_90a")
    if not os.path.exists(cuobjdump) or ptxas is None:
        pytest.skip("needs ptxas and cuobjdump (pip install nvidia-cuda-cuobjdump)")
    for dtype in ("bf16", "fp32"):
        name, kernel, sig, constexprs, warps, options = next(
            c for c in aot_cases(dtype) if c[0] == "ce_fused[smoothing=True,grad=True,reduce=True]")
        build = compile_for_targets(kernel, sig, constexprs, targets=(90,), num_warps=warps,
                                    **options)[90]  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
            with open(src, "w") as f:
                f.write(build.ptx)
            subprocess.run([ptxas, f"--gpu-name={build.arch}", src, "-o", cubin], check=True)
            sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                                  check=True).stdout
        # two tiles per thread in pass 1 and in the gradient pass
        assert sass.count("LDG.E.128") >= 4, (dtype, sass.count("LDG.E.128"))
        assert sass.count("STG.E.128") >= 2, (dtype, sass.count("STG.E.128"))


# --- on a GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_large_vocab(dtype):
    logits, target = make_inputs((2, 256), 50257, dtype, "cuda", ignore_every=7)
    check(logits, target, label_smoothing=0.1, z_loss_weight=1e-4, reduction="mean")


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    logits, target = make_inputs((4, 128), 32000, torch.bfloat16, "cuda", ignore_every=5)
    x = logits.clone().requires_grad_(True)
    static_target = target.clone()

    def step():
        loss = vocab_parallel_cross_entropy(x, static_target, label_smoothing=0.1,
                                            reduction="mean")
        return loss.detach(), torch.autograd.grad(loss, x)[0]

    graph, outs = capture_graph(step)  # the target range check is skipped while capturing
    new_logits, new_target = make_inputs((4, 128), 32000, torch.bfloat16, "cuda", seed=1)
    with torch.no_grad():
        x.copy_(new_logits)
        static_target.copy_(new_target)
    graph.replay()
    for got, expected in zip(outs, step()):
        assert torch.equal(got, expected)
