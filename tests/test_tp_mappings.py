"""Tensor/sequence-parallel communication mappings: forward and backward against hand-computed
results, collective counts (each mapping call exchanges one agreement row, in the direction
whose collective its other direction has not checked), identity at group size 1, and bad inputs
(gloo, world 2 and 4)."""

import pytest
import torch
import torch.distributed as dist

import mtp.parallel as mp
from mtp.parallel.agreement import set_abort_on_error
from mtp.testing import count_collectives, run_distributed

# torch 2.13 renamed the flat collectives: compare counts under one name per kind.
_CANONICAL = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
}


def collective_names(log) -> dict:
    """``{canonical name: count}`` of the calls in a :func:`count_collectives` log."""
    out: dict = {}
    for call in log.calls:
        name = _CANONICAL.get(call.name, call.name)
        out[name] = out.get(name, 0) + 1
    return out


def _inputs(world: int, shape, seed: int):
    """Per-rank tensors every rank can compute: ``[x_0, ..., x_{world-1}]``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(world)]


def _close(actual, expected, what):
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12, msg=what)


def _run_mapping(fn, x, grad):
    x = x.clone().requires_grad_(True)
    with count_collectives() as fwd:
        y = fn(x)
    with count_collectives() as bwd:
        y.backward(grad)
    return y.detach(), x.grad, collective_names(fwd), collective_names(bwd)


def _check_mappings(rank: int, world: int, seq_dim: int) -> None:
    shape = [2 * world, 3 * world, 2 * world]  # every dim divides by world
    xs = _inputs(world, shape, seed=10 + seq_dim)
    gs_full = _inputs(world, shape, seed=20 + seq_dim)
    chunk = lambda t, d, r: t.chunk(world, d)[r]
    last = len(shape) - 1
    total_x, total_g = sum(xs), sum(gs_full)

    # f: identity forward, all-reduce backward
    y, gx, fwd, bwd = _run_mapping(mp.copy_to_tensor_model_parallel_region, xs[rank], gs_full[rank])
    _close(y, xs[rank], "copy_to fwd")
    _close(gx, total_g, "copy_to bwd")
    assert (fwd, bwd) == ({}, {"agreement": 1, "all_reduce": 1})

    # g: all-reduce forward, identity backward
    y, gx, fwd, bwd = _run_mapping(
        mp.reduce_from_tensor_model_parallel_region, xs[rank], gs_full[rank]
    )
    _close(y, total_x, "reduce_from fwd")
    _close(gx, gs_full[rank], "reduce_from bwd")
    assert (fwd, bwd) == ({"agreement": 1, "all_reduce": 1}, {})
    # in place: the result is the input's storage
    z = xs[rank].clone()
    out = mp.reduce_from_tensor_model_parallel_region(z, inplace=True)
    assert out.data_ptr() == z.data_ptr()
    _close(out, total_x, "reduce_from inplace")

    # scatter last dim (input replicated: xs[0] on every rank)
    local_g = [chunk(g, last, r) for r, g in enumerate(gs_full)]
    y, gx, fwd, bwd = _run_mapping(mp.scatter_to_tensor_model_parallel_region, xs[0], local_g[rank])
    _close(y, chunk(xs[0], last, rank), "scatter fwd")
    _close(gx, torch.cat(local_g, last), "scatter bwd")
    assert y.is_contiguous()
    assert (fwd, bwd) == ({}, {"agreement": 1, "all_gather": 1})

    # gather last dim; backward keeps this rank's chunk of its own gradient
    wide_g = _inputs(world, shape[:-1] + [shape[-1] * world], seed=40 + seq_dim)
    y, gx, fwd, bwd = _run_mapping(
        mp.gather_from_tensor_model_parallel_region, xs[rank], wide_g[rank]
    )
    _close(y, torch.cat(xs, last), "gather fwd")
    _close(gx, chunk(wide_g[rank], last, rank), "gather bwd")
    assert (fwd, bwd) == ({"agreement": 1, "all_gather": 1}, {})

    # sequence parallel along seq_dim
    local_g = [chunk(g, seq_dim, r) for r, g in enumerate(gs_full)]
    y, gx, fwd, bwd = _run_mapping(
        lambda t: mp.scatter_to_sequence_parallel_region(t, seq_dim=seq_dim), xs[0], local_g[rank]
    )
    _close(y, chunk(xs[0], seq_dim, rank), "scatter seq fwd")
    _close(gx, torch.cat(local_g, seq_dim), "scatter seq bwd")
    assert (fwd, bwd) == ({}, {"agreement": 1, "all_gather": 1})

    big_g = _inputs(world, [s * (world if i == seq_dim else 1) for i, s in enumerate(shape)], 30)
    y, gx, fwd, bwd = _run_mapping(
        lambda t: mp.gather_from_sequence_parallel_region(t, seq_dim=seq_dim),
        xs[rank],
        big_g[rank],
    )
    _close(y, torch.cat(xs, seq_dim), "gather seq fwd")
    _close(gx, chunk(sum(big_g), seq_dim, rank), "gather seq bwd = reduce-scatter")
    assert (fwd, bwd) == ({"agreement": 1, "all_gather": 1}, {"reduce_scatter": 1})

    y, gx, fwd, bwd = _run_mapping(
        lambda t: mp.gather_from_sequence_parallel_region(
            t, tensor_parallel_output_grad=False, seq_dim=seq_dim
        ),
        xs[rank],
        big_g[rank],
    )
    _close(gx, chunk(big_g[rank], seq_dim, rank), "gather seq bwd without reduction")
    assert bwd == {}

    y, gx, fwd, bwd = _run_mapping(
        lambda t: mp.reduce_scatter_to_sequence_parallel_region(t, seq_dim=seq_dim),
        xs[rank],
        local_g[rank],
    )
    _close(y, chunk(total_x, seq_dim, rank), "reduce-scatter fwd")
    _close(gx, torch.cat(local_g, seq_dim), "reduce-scatter bwd = all-gather")
    assert (fwd, bwd) == ({"agreement": 1, "reduce_scatter": 1}, {"all_gather": 1})


def _check_errors(rank: int, world: int) -> None:
    # every rank raises the same errors and goes on using the group: no abort-on-error
    set_abort_on_error(False)
    try:
        _errors(rank, world)
    finally:
        set_abort_on_error(None)


def _errors(rank: int, world: int) -> None:
    odd = torch.randn(world + 1, 2, world + 1)
    with pytest.raises(ValueError, match="does not divide by the group size"):
        mp.scatter_to_tensor_model_parallel_region(odd)
    with pytest.raises(ValueError, match="dimension 0 .* does not divide"):
        mp.scatter_to_sequence_parallel_region(odd)
    with pytest.raises(ValueError, match="does not divide"):
        mp.reduce_scatter_to_sequence_parallel_region(odd, seq_dim=0)
    with pytest.raises(ValueError, match="out of range"):
        mp.gather_from_sequence_parallel_region(torch.randn(2, 2), seq_dim=2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        mp.copy_to_tensor_model_parallel_region([1.0])


def _check_group_of_one(rank: int, world: int) -> None:
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    group = singles[rank]
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    fns = [
        mp.copy_to_tensor_model_parallel_region,
        mp.reduce_from_tensor_model_parallel_region,
        mp.scatter_to_tensor_model_parallel_region,
        mp.gather_from_tensor_model_parallel_region,
        mp.scatter_to_sequence_parallel_region,
        mp.gather_from_sequence_parallel_region,
        mp.reduce_scatter_to_sequence_parallel_region,
    ]
    with count_collectives() as log:
        for fn in fns:
            y = fn(x, group=group)
            _close(y, x.detach(), f"{fn.__name__} at group size 1")
            (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
            _close(g, torch.ones_like(x), f"{fn.__name__} backward at group size 1")
    assert log.count() == 0


def _mappings_main(rank: int, world: int) -> str:
    with pytest.raises(mp.ParallelStateError, match="initialize_model_parallel"):
        mp.copy_to_tensor_model_parallel_region(torch.ones(2))
    mp.initialize_model_parallel(tensor_model_parallel_size=world)
    for seq_dim in (0, 1):
        _check_mappings(rank, world, seq_dim)
    _check_errors(rank, world)
    _check_group_of_one(rank, world)
    mp.destroy_model_parallel()
    if world == 4:
        _check_subgroup(rank)
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_mappings_forward_backward_and_counts(world):
    assert run_distributed(_mappings_main, world) == ["ok"] * world


def _check_subgroup(rank: int) -> None:
    """tp=2 inside world 4: the mappings reduce within the tp group ([0, 1] and [2, 3]) only."""
    mp.initialize_model_parallel(tensor_model_parallel_size=2)
    x = torch.full((2, 2), float(rank), dtype=torch.float64)
    base = 2 * (rank // 2)
    assert mp.reduce_from_tensor_model_parallel_region(x)[0, 0].item() == 2 * base + 1
    gathered = mp.gather_from_tensor_model_parallel_region(x)[0].tolist()
    assert gathered == [base, base, base + 1, base + 1]
    mp.destroy_model_parallel()


def test_missing_group_init_single_process():
    with pytest.raises(
        mp.ParallelStateError, match="init_process_group.*initialize_model_parallel"
    ):
        mp.reduce_from_tensor_model_parallel_region(torch.ones(2))
