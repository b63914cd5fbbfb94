"""Tensor-parallel layers against the single-process PyTorch model built from the same seed:
forward outputs and every gradient (gathered over the ranks), with and without sequence
parallel and skip_bias_add; collective counts per forward and backward; bad configurations.
gloo process groups, world sizes 2 and 4, float64 (float32 for one smoke case)."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_tp_mappings import collective_names
from torch import nn

import mtp.parallel as mp
import mtp.tensor_parallel as tp
import mtp.testing
from mtp.parallel.agreement import set_abort_on_error
from mtp.testing import count_collectives, count_host_syncs, run_distributed

F64 = torch.float64
SEED = 1234


# --------------------------------------------------------------------------------------------
# Helpers (used by test_tp_parallelize.py too)
# --------------------------------------------------------------------------------------------


def gather_shards(t: torch.Tensor, dim: int, blocks=None, group=None) -> torch.Tensor:
    """Reassemble a tensor split over ``group`` along ``dim`` (each block split separately)."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    if blocks is None:
        return torch.cat(parts, dim)
    local = [b // world for b in blocks]
    split = [p.split(local, dim) for p in parts]
    return torch.cat([torch.cat([s[i] for s in split], dim) for i in range(len(blocks))], dim)


def assert_close(actual, expected, what, tol=1e-10):
    assert actual is not None, f"{what}: missing"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def chunk(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim)[rank]


def random_like_everywhere(shape, seed, dtype=F64):
    """The same random tensor on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype)


def run_pair(ref, par, x, dy, *, sp_dim=None, rank=0, world=1, unpack=None):
    """Forward/backward the reference on the full input and the parallel module on its input
    (the sequence chunk with ``sp_dim``). Returns ``(y_ref, y_par, dx_ref, dx_par, fwd, bwd)``
    where ``fwd``/``bwd`` are the parallel module's collectives."""
    x_ref = x.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    y_ref.backward(dy)
    x_par = x if sp_dim is None else chunk(x, sp_dim, rank, world)
    x_par = x_par.clone().requires_grad_(True)
    with count_collectives() as fwd:
        y_par = par(x_par)
        if unpack is not None:
            y_par = unpack(y_par)
    dy_par = dy if sp_dim is None else chunk(dy, sp_dim, rank, world)
    with count_collectives() as bwd:
        y_par.backward(dy_par)
    return y_ref, y_par, x_ref.grad, x_par.grad, collective_names(fwd), collective_names(bwd)


def add_skipped_bias(out):
    """``skip_bias_add=True`` layers return ``(output, bias)``: add it as the next op would."""
    assert isinstance(out, tuple) and len(out) == 2
    y, b = out
    return y if b is None else y + b


# --------------------------------------------------------------------------------------------
# Single-process references (plain PyTorch, written here)
# --------------------------------------------------------------------------------------------


class RefMLP(nn.Module):
    def __init__(self, h, ffn, activation, bias):
        super().__init__()
        gated = activation == "swiglu"
        self.fc1 = nn.Linear(h, ffn * (2 if gated else 1), bias=bias, dtype=F64)
        self.fc2 = nn.Linear(ffn, h, bias=bias, dtype=F64)
        self.activation = activation

    def forward(self, x):
        y = self.fc1(x)
        if self.activation == "swiglu":
            a, b = y.chunk(2, -1)
            y = F.silu(a) * b
        elif self.activation == "gelu_tanh":
            y = F.gelu(y, approximate="tanh")
        else:
            y = F.gelu(y)
        return self.fc2(y)


class RefAttention(nn.Module):
    """Explicit softmax attention (no SDPA) over ``[s, b, h]`` (seq_dim 0) or ``[b, s, h]``."""

    def __init__(self, h, nh, nkv, bias, seq_dim):
        super().__init__()
        self.d = h // nh
        self.nh, self.nkv, self.seq_dim = nh, nkv, seq_dim
        self.qkv = nn.Linear(h, (nh + 2 * nkv) * self.d, bias=bias, dtype=F64)
        self.proj = nn.Linear(nh * self.d, h, bias=bias, dtype=F64)

    def forward(self, x):
        if self.seq_dim == 0:
            x = x.transpose(0, 1)  # -> [b, s, h]
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.nh * self.d, self.nkv * self.d, self.nkv * self.d], -1)
        q = q.view(b, s, self.nh, self.d).transpose(1, 2)
        k = k.view(b, s, self.nkv, self.d).transpose(1, 2)
        v = v.view(b, s, self.nkv, self.d).transpose(1, 2)
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, 1)
        v = v.repeat_interleave(rep, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
        out = self.proj(out)
        return out.transpose(0, 1) if self.seq_dim == 0 else out


# --------------------------------------------------------------------------------------------
# Checks run inside the spawned ranks
# --------------------------------------------------------------------------------------------


def _check_linear_grads(ref_lin, par_lin, style, blocks, what, *, sp_bias=False):
    """Gather ``par_lin``'s weight/bias (and grads) and compare with ``ref_lin``'s."""
    dim = 0 if style == "column" else 1
    assert_close(
        gather_shards(par_lin.weight.detach(), dim, blocks),
        ref_lin.weight.detach(),
        f"{what} weight init",
    )
    assert_close(
        gather_shards(par_lin.weight.grad, dim, blocks), ref_lin.weight.grad, f"{what} weight grad"
    )
    if ref_lin.bias is None:
        assert par_lin.bias is None
        return
    if style == "column":
        assert_close(
            gather_shards(par_lin.bias.detach(), 0, blocks),
            ref_lin.bias.detach(),
            f"{what} bias init",
        )
        assert_close(
            gather_shards(par_lin.bias.grad, 0, blocks), ref_lin.bias.grad, f"{what} bias grad"
        )
    else:
        assert_close(par_lin.bias.detach(), ref_lin.bias.detach(), f"{what} bias init")
        assert getattr(par_lin.bias, "sequence_parallel", False) == sp_bias
        assert_close(par_lin.bias.grad, ref_lin.bias.grad, f"{what} bias grad")


def _expected_counts(sp):
    """(forward, backward) collectives of one column -> row block (MLP or attention): one
    agreement row per collective whose shape nothing checked before (sequence parallel: the
    forward's two; otherwise the row layer's forward and the column layer's backward)."""
    if sp:
        fwd = {"agreement": 2, "all_gather": 1, "reduce_scatter": 1}
        return fwd, {"all_gather": 2, "reduce_scatter": 1}
    return {"agreement": 1, "all_reduce": 1}, {"agreement": 1, "all_reduce": 1}


def _compare_block(rank, world, ref, par, shape, *, sp, seq_dim, skip_bias_add, what, linears):
    """Run ``ref`` and ``par`` on the same random input; compare the output, the input grad,
    every (gathered) weight and bias grad of ``linears`` = ``[(ref_lin, par_lin, style,
    blocks)]``, and the collectives of one column -> row block."""
    x, dy = random_like_everywhere(shape, 1), random_like_everywhere(shape, 2)
    y_ref, y, dx_ref, dx, fwd, bwd = run_pair(
        ref,
        par,
        x,
        dy,
        sp_dim=seq_dim if sp else None,
        rank=rank,
        world=world,
        unpack=add_skipped_bias if skip_bias_add else None,
    )
    if sp:
        y_ref, dx_ref = chunk(y_ref, seq_dim, rank, world), chunk(dx_ref, seq_dim, rank, world)
        has_bias = linears[-1][0].bias is not None
        assert tp.allreduce_sequence_parallel_grads(par) == (1 if has_bias else 0)
    assert_close(y, y_ref, f"{what} output")
    assert_close(dx, dx_ref, f"{what} input grad")
    for ref_lin, par_lin, style, blocks in linears:
        sp_bias = sp and style == "row" and ref_lin.bias is not None
        _check_linear_grads(ref_lin, par_lin, style, blocks, f"{what} {style}", sp_bias=sp_bias)
    assert (fwd, bwd) == _expected_counts(sp), (what, fwd, bwd)


def _check_mlp(rank, world, *, sp, skip_bias_add, activation, bias=True, seq_dim=0):
    s, b, h, ffn = 2 * world, 3, 8, 4 * world
    torch.manual_seed(SEED)
    ref = RefMLP(h, ffn, activation, bias)
    torch.manual_seed(SEED)
    par = tp.ParallelMLP(
        h,
        ffn,
        activation=activation,
        bias=bias,
        sequence_parallel=sp,
        seq_dim=seq_dim,
        skip_bias_add=skip_bias_add,
        dtype=F64,
    )
    fc1_blocks = [ffn, ffn] if activation == "swiglu" else None
    _compare_block(
        rank,
        world,
        ref,
        par,
        [s, b, h] if seq_dim == 0 else [b, s, h],
        sp=sp,
        seq_dim=seq_dim,
        skip_bias_add=skip_bias_add,
        what=f"MLP(sp={sp}, skip_bias_add={skip_bias_add}, {activation}, seq_dim={seq_dim})",
        linears=[
            (ref.fc1, par.linear_fc1, "column", fc1_blocks),
            (ref.fc2, par.linear_fc2, "row", None),
        ],
    )


def _check_attention(rank, world, *, sp, skip_bias_add, nh, nkv, seq_dim=0, bias=True):
    s, b, h = 2 * world, 2, 4 * nh
    d = h // nh
    torch.manual_seed(SEED)
    ref = RefAttention(h, nh, nkv, bias, seq_dim)
    torch.manual_seed(SEED)
    par = tp.ParallelSelfAttention(
        h,
        nh,
        num_kv_heads=nkv,
        bias=bias,
        sequence_parallel=sp,
        seq_dim=seq_dim,
        skip_bias_add=skip_bias_add,
        dtype=F64,
    )
    _compare_block(
        rank,
        world,
        ref,
        par,
        [s, b, h] if seq_dim == 0 else [b, s, h],
        sp=sp,
        seq_dim=seq_dim,
        skip_bias_add=skip_bias_add,
        what=f"attention(sp={sp}, skip={skip_bias_add}, nh={nh}, nkv={nkv}, seq_dim={seq_dim})",
        linears=[
            (ref.qkv, par.linear_qkv, "column", [nh * d, nkv * d, nkv * d]),
            (ref.proj, par.linear_proj, "row", None),
        ],
    )


def _check_attention_masks(rank, world):
    """attention_mask: a bool mask equal to the causal one gives the causal result; combined
    with causal=True an all-True mask changes nothing, a float mask is added to the scores."""
    s, b, h, nh = 2 * world, 2, 8 * world, 2 * world
    torch.manual_seed(SEED)
    causal = tp.ParallelSelfAttention(h, nh, dtype=F64)
    plain = tp.ParallelSelfAttention(h, nh, causal=False, dtype=F64)
    plain.load_state_dict(causal.state_dict())
    x = random_like_everywhere([s, b, h], 18)
    expected = causal(x)
    tril = torch.ones(s, s, dtype=torch.bool).tril()
    assert_close(plain(x, tril), expected, "bool mask = causal")
    assert_close(causal(x, torch.ones(b, 1, s, s, dtype=torch.bool)), expected, "all-True mask")
    additive = torch.zeros(s, s, dtype=F64).masked_fill(~tril, float("-inf"))
    assert_close(plain(x, additive), expected, "additive mask = causal")
    assert_close(causal(x, torch.zeros(s, s, dtype=F64)), expected, "zero additive + causal")
    assert not torch.allclose(plain(x), expected)  # without a mask it differs


def _check_embedding(rank, world, *, sp, seq_dim=0, padding_idx=None):
    vocab, h, s, b = 8 * world, 6, 2 * world, 3
    torch.manual_seed(SEED)
    ref = nn.Embedding(vocab, h, padding_idx=padding_idx, dtype=F64)
    torch.manual_seed(SEED)
    par = tp.VocabParallelEmbedding(
        vocab, h, padding_idx=padding_idx, sequence_parallel=sp, seq_dim=seq_dim, dtype=F64
    )
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (s, b) if seq_dim == 0 else (b, s), generator=g)
    ids[0, 0], ids[-1, -1] = 0, vocab - 1  # both ends of the vocabulary
    if padding_idx is not None:
        ids[1, 1] = padding_idx
    out_shape = list(ids.shape) + [h]
    dy = random_like_everywhere(out_shape, 6)
    y_ref = ref(ids)
    y_ref.backward(dy)
    with count_collectives() as fwd:
        y = par(ids)
    dy_par = chunk(dy, seq_dim, rank, world) if sp else dy
    with count_collectives() as bwd:
        y.backward(dy_par)
    what = f"embedding(sp={sp}, seq_dim={seq_dim}, padding_idx={padding_idx})"
    assert_close(y, chunk(y_ref, seq_dim, rank, world) if sp else y_ref, f"{what} output")
    assert_close(gather_shards(par.weight.detach(), 0), ref.weight.detach(), f"{what} init")
    assert_close(gather_shards(par.weight.grad, 0), ref.weight.grad, f"{what} grad")
    if sp:
        expected = ({"agreement": 1, "reduce_scatter": 1}, {"all_gather": 1})
    else:
        expected = ({"agreement": 1, "all_reduce": 1}, {})
    assert (collective_names(fwd), collective_names(bwd)) == expected, (what, fwd, bwd)


def _check_linear_options(rank, world):
    """gather_output, input_is_parallel=False, no bias, init_method, float32."""
    torch.manual_seed(SEED)
    ref = nn.Linear(6, 4 * world, dtype=F64)
    torch.manual_seed(SEED)
    col = tp.ColumnParallelLinear(6, 4 * world, gather_output=True, dtype=F64)
    x, dy = random_like_everywhere([5, 2, 6], 7), random_like_everywhere([5, 2, 4 * world], 8)
    y_ref, y, dx_ref, dx, fwd, bwd = run_pair(ref, col, x, dy)
    assert_close(y, y_ref, "column gather_output")
    assert_close(dx, dx_ref, "column gather_output dx")
    _check_linear_grads(ref, col, "column", None, "column gather_output")
    assert (fwd, bwd) == ({"agreement": 1, "all_gather": 1}, {"agreement": 1, "all_reduce": 1})

    torch.manual_seed(SEED)
    ref = nn.Linear(4 * world, 6, dtype=F64)
    torch.manual_seed(SEED)
    row = tp.RowParallelLinear(4 * world, 6, input_is_parallel=False, dtype=F64)
    x, dy = random_like_everywhere([5, 4 * world], 9), random_like_everywhere([5, 6], 10)
    y_ref, y, dx_ref, dx, fwd, bwd = run_pair(ref, row, x, dy)
    assert_close(y, y_ref, "row input_is_parallel=False")
    assert_close(dx, dx_ref, "row input_is_parallel=False dx")
    _check_linear_grads(ref, row, "row", None, "row input_is_parallel=False")
    assert (fwd, bwd) == ({"agreement": 1, "all_reduce": 1}, {"agreement": 1, "all_gather": 1})

    # gather_output on a fused [a; b; c] weight, with skip_bias_add: the full layout comes back
    torch.manual_seed(SEED)
    ref = nn.Linear(6, 6 * world, dtype=F64)
    torch.manual_seed(SEED)
    col = tp.ColumnParallelLinear(
        6, 6 * world, gather_output=True, skip_bias_add=True, stride=3, dtype=F64
    )
    x, dy = random_like_everywhere([3, 6], 16), random_like_everywhere([3, 6 * world], 17)
    y_ref, y, dx_ref, dx, fwd, bwd = run_pair(ref, col, x, dy, unpack=add_skipped_bias)
    assert_close(y, y_ref, "column gather_output stride=3")
    assert_close(dx, dx_ref, "column gather_output stride=3 dx")
    _check_linear_grads(ref, col, "column", [2 * world] * 3, "column gather_output stride=3")

    # explicit init_method: weight from it (same RNG draws as on one device), bias zero
    def init(w):
        nn.init.normal_(w, std=0.02)

    torch.manual_seed(SEED)
    full = torch.empty(4 * world, 6, dtype=F64)
    init(full)
    torch.manual_seed(SEED)
    col = tp.ColumnParallelLinear(6, 4 * world, init_method=init, dtype=F64)
    assert_close(gather_shards(col.weight.detach(), 0), full, "init_method weight")
    assert torch.count_nonzero(col.bias) == 0

    # no bias, float32, [b, s, h] sequence-parallel column + row with skip_bias_add
    torch.manual_seed(SEED)
    r1 = nn.Linear(8, 4 * world, bias=False)
    r2 = nn.Linear(4 * world, 8, bias=False)
    torch.manual_seed(SEED)
    c = tp.ColumnParallelLinear(8, 4 * world, bias=False, sequence_parallel=True, seq_dim=1)
    r = tp.RowParallelLinear(
        4 * world, 8, bias=False, sequence_parallel=True, seq_dim=1, skip_bias_add=True
    )
    x, dy = (
        random_like_everywhere([3, 2 * world, 8], 11, torch.float32),
        random_like_everywhere([3, 2 * world, 8], 12, torch.float32),
    )
    y_ref, y, dx_ref, dx, _, _ = run_pair(
        lambda t: r2(r1(t)),
        lambda t: r(c(t)),
        x,
        dy,
        sp_dim=1,
        rank=rank,
        world=world,
        unpack=add_skipped_bias,
    )
    assert_close(y, chunk(y_ref, 1, rank, world), "fp32 sp [b, s, h] output", tol=1e-5)
    assert_close(dx, chunk(dx_ref, 1, rank, world), "fp32 sp [b, s, h] dx", tol=1e-5)
    assert_close(gather_shards(c.weight.grad, 0), r1.weight.grad, "fp32 column grad", tol=1e-5)
    assert_close(gather_shards(r.weight.grad, 1), r2.weight.grad, "fp32 row grad", tol=1e-5)


def _check_bf16(rank, world):
    """bf16 parameters, activations and collectives (sequence-parallel MLP) against the
    float64 model holding the same bf16-representable weights and inputs."""
    s, b, h, ffn = 2 * world, 2, 16, 8 * world
    torch.manual_seed(SEED)
    ref = RefMLP(h, ffn, "gelu", True)
    torch.manual_seed(SEED)
    par = tp.ParallelMLP(h, ffn, sequence_parallel=True, dtype=F64).to(torch.bfloat16)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).to(F64))
    x = random_like_everywhere([s, b, h], 14).to(torch.bfloat16)
    dy = random_like_everywhere([s, b, h], 15).to(torch.bfloat16)
    x_ref = x.to(F64).requires_grad_(True)
    ref(x_ref).backward(dy.to(F64))
    x_par = chunk(x, 0, rank, world).clone().requires_grad_(True)
    y = par(x_par)
    y.backward(chunk(dy, 0, rank, world))
    assert y.dtype == x_par.grad.dtype == par.linear_fc1.weight.grad.dtype == torch.bfloat16
    # three bf16 roundings in a row (fc1 output, GeLU, partial sums before the reduction):
    # twice the single-op bf16 tolerance
    tol = {"rtol": 3.2e-2, "atol": 2e-2}
    mtp.testing.assert_close(
        y, chunk(ref(x_ref), 0, rank, world), torch.bfloat16, **tol, msg="bf16 MLP output"
    )
    mtp.testing.assert_close(
        x_par.grad,
        chunk(x_ref.grad, 0, rank, world),
        torch.bfloat16,
        **tol,
        msg="bf16 MLP input grad",
    )
    mtp.testing.assert_close(
        gather_shards(par.linear_fc1.weight.grad, 0),
        ref.fc1.weight.grad,
        torch.bfloat16,
        **tol,
        msg="bf16 fc1 weight grad",
    )


def _check_frozen_input(rank, world):
    """No input gradient wanted: the column layer skips its backward all-reduce."""
    torch.manual_seed(SEED)
    mlp = tp.ParallelMLP(8, 4 * world, dtype=F64)
    x = random_like_everywhere([4, 2, 8], 13)  # requires_grad=False
    y = mlp(x)
    with count_collectives() as bwd:
        y.sum().backward()
    assert collective_names(bwd) == {}
    assert mlp.linear_fc1.weight.grad is not None


def _check_bad_configurations(rank, world):
    # every rank raises the same errors and goes on using the group: no abort-on-error
    set_abort_on_error(False)
    try:
        _bad_configurations(rank, world)
    finally:
        set_abort_on_error(None)


def _bad_configurations(rank, world):
    with pytest.raises(
        ValueError, match=r"num_heads \(3\) must be divisible by the tensor parallel"
    ):
        tp.ParallelSelfAttention(12, 3)
    with pytest.raises(ValueError, match=r"num_kv_heads \(1\) must be divisible by the tensor"):
        tp.ParallelSelfAttention(8 * world, 2 * world, num_kv_heads=1)
    with pytest.raises(
        ValueError, match=r"hidden_size \(10\) must be divisible by num_heads \(4\)"
    ):
        tp.ParallelSelfAttention(10, 4)
    with pytest.raises(
        ValueError, match=r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"
    ):
        tp.ParallelSelfAttention(12, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"output_size \(5\) must be divisible by the tensor"):
        tp.ColumnParallelLinear(4, 5)
    with pytest.raises(ValueError, match=r"input_size \(5\) must be divisible by the tensor"):
        tp.RowParallelLinear(5, 4)
    with pytest.raises(ValueError, match=r"ffn_hidden_size \(5\) must be divisible"):
        tp.ParallelMLP(8, 5)
    with pytest.raises(ValueError, match="each block must be divisible"):
        tp.ColumnParallelLinear(4, 6 * world, stride=[world + 1, 6 * world - world - 1])
    with pytest.raises(ValueError, match="pad_vocab_size"):
        tp.VocabParallelEmbedding(4 * world + 1, 4)
    with pytest.raises(ValueError, match="gather_output=True cannot be combined"):
        tp.ColumnParallelLinear(4, 4 * world, gather_output=True, sequence_parallel=True)
    with pytest.raises(ValueError, match="needs input_is_parallel=True"):
        tp.RowParallelLinear(4 * world, 4, input_is_parallel=False, sequence_parallel=True)
    with pytest.raises(ValueError, match="activation must be one of"):
        tp.ParallelMLP(8, 4 * world, activation="tanhh")
    col = tp.ColumnParallelLinear(4, 4 * world)
    with pytest.raises(ValueError, match="must have 4 features"):
        col(torch.randn(2, 5))
    row = tp.RowParallelLinear(4 * world, 4, sequence_parallel=True)
    with pytest.raises(ValueError, match="does not divide by the group size"):
        row(torch.randn(world + 1, 2, 4))  # sequence not divisible by tp
    # validate="sync": the typed error naming the values (one host sync)
    emb = tp.VocabParallelEmbedding(4 * world, 3, validate="sync")
    with pytest.raises(
        ValueError, match=rf"ids must be in \[0, {4 * world}\), got values in \[-1,"
    ):
        emb(torch.tensor([[0, -1]]))
    with pytest.raises(ValueError, match=r"got values in \[0, 99\]"):
        emb(torch.tensor([[0, 99]]))
    with pytest.raises(TypeError, match="input_ must have dtype"):
        emb(torch.tensor([[0.0, 1.0]]))
    # the default: a device-side check, no host sync (on CPU it raises at once)
    with count_host_syncs() as syncs:
        with pytest.raises(RuntimeError, match=rf"ids must be in \[0, {4 * world}\)"):
            tp.VocabParallelEmbedding(4 * world, 3)(torch.tensor([[0, 99]]))
    assert syncs.count == 0, syncs.events
    # validate=False skips the range check (in-range ids still work)
    quiet = tp.VocabParallelEmbedding(4 * world, 3, validate=False)
    assert quiet(torch.tensor([[1, 2]])).shape == (1, 2, 3)


def _layers_main(rank: int, world: int) -> str:
    with pytest.raises(mp.ParallelStateError, match="initialize_model_parallel"):
        tp.ColumnParallelLinear(4, 4)
    with pytest.raises(mp.ParallelStateError, match="initialize_model_parallel"):
        tp.ParallelSelfAttention(8, 2)
    mp.initialize_model_parallel(tensor_model_parallel_size=world)
    for sp in (False, True):
        for skip in (False, True):
            _check_mlp(rank, world, sp=sp, skip_bias_add=skip, activation="gelu")
            _check_attention(rank, world, sp=sp, skip_bias_add=skip, nh=2 * world, nkv=world)
        _check_embedding(rank, world, sp=sp)
    _check_mlp(rank, world, sp=True, skip_bias_add=False, activation="swiglu", seq_dim=1)
    _check_mlp(rank, world, sp=False, skip_bias_add=False, activation="gelu_tanh", bias=False)
    _check_attention(rank, world, sp=True, skip_bias_add=False, nh=world, nkv=world, seq_dim=1)
    _check_attention(
        rank, world, sp=False, skip_bias_add=False, nh=2 * world, nkv=2 * world, bias=False
    )
    _check_embedding(rank, world, sp=True, seq_dim=1, padding_idx=3)
    _check_embedding(rank, world, sp=False, padding_idx=8 * world - 1)
    _check_attention_masks(rank, world)
    _check_linear_options(rank, world)
    _check_bf16(rank, world)
    _check_frozen_input(rank, world)
    _check_bad_configurations(rank, world)
    mp.destroy_model_parallel()
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_layers_match_single_process(world):
    assert run_distributed(_layers_main, world) == ["ok"] * world


# --------------------------------------------------------------------------------------------
# Single process (no spawn)
# --------------------------------------------------------------------------------------------


def test_pad_vocab_size():
    assert tp.pad_vocab_size(50257, 1) == 50304
    assert tp.pad_vocab_size(50257, 8) == 51200
    assert tp.pad_vocab_size(256, 2) == 256
    assert tp.pad_vocab_size(257, 2, multiple=64) == 384
    for vocab in (1, 127, 128, 129, 1000):
        for world in (1, 2, 3, 8):
            padded = tp.pad_vocab_size(vocab, world)
            assert padded >= vocab and padded % (128 * world) == 0
            assert padded - vocab < 128 * world
    with pytest.raises(ValueError, match="positive"):
        tp.pad_vocab_size(0, 2)


def test_layers_need_group_init():
    for make in (
        lambda: tp.ColumnParallelLinear(4, 4),
        lambda: tp.RowParallelLinear(4, 4),
        lambda: tp.VocabParallelEmbedding(8, 4),
        lambda: tp.ParallelMLP(4, 8),
        lambda: tp.ParallelSelfAttention(8, 2),
    ):
        with pytest.raises(mp.ParallelStateError, match="initialize_model_parallel"):
            make()


def test_bias_activation_uses_fused_ops_when_present(monkeypatch):
    import mtp.ops

    calls = []

    def spy_gelu(x, bias, approximate="none"):
        calls.append(("gelu", approximate))
        return F.gelu(x + bias, approximate=approximate)

    def spy_swiglu(x, bias):
        calls.append(("swiglu",))
        a, b = (x + bias).chunk(2, -1)
        return F.silu(a) * b

    monkeypatch.setattr(mtp.ops, "bias_gelu", spy_gelu, raising=False)
    monkeypatch.setattr(mtp.ops, "bias_swiglu", spy_swiglu, raising=False)
    x, bias = torch.randn(3, 8), torch.randn(8)
    expected = F.gelu(x + bias, approximate="tanh")
    assert_close(tp.apply_bias_activation(x, bias, "gelu_tanh"), expected, "fused gelu")
    tp.apply_bias_activation(x, bias, "gelu")
    tp.apply_bias_activation(x, bias, "swiglu")
    tp.apply_bias_activation(x.double(), bias.double(), "gelu")  # float64: plain PyTorch
    tp.apply_bias_activation(x, None, "gelu")  # no bias: plain PyTorch
    assert calls == [("gelu", "tanh"), ("gelu", "none"), ("swiglu",)]
    with pytest.raises(ValueError, match="activation must be one of"):
        tp.apply_bias_activation(x, bias, "tanh")
