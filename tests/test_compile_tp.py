"""torch.compile(fullgraph=True) of tensor-parallel code under a real tp=2 gloo group: no graph
break (counted with torch._dynamo.explain), results equal to eager.

The ``aot_eager`` backend traces forward and backward (AOTAutograd, collectives included) and
keeps the test fast; the default inductor backend gives the same results (checked by hand, it
needs a C++ compile per graph)."""

from __future__ import annotations

import pytest
import torch

from mtp.testing import run_distributed

transformers = pytest.importorskip("transformers")


def _run_both(fn, params, *inputs):
    """[(output, input grads, param grads)] for eager and compiled ``fn``."""
    results = []
    # Dynamo does not guard on module hooks (skip_nnmodule_hook_guards): start each case afresh
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for f in (compiled, fn):  # compiled first: nothing may rely on an earlier eager call
        for p in params:
            p.grad = None
        xs = [x.clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
        out = f(*xs)
        (out * out).sum().backward()
        grads = [x.grad for x in xs if x.is_floating_point()]
        results.append((out.detach(), grads, [p.grad.clone() for p in params]))
    return results


def _max_diff(a, b) -> float:
    (ya, ga, pa), (yb, gb, pb) = a, b
    diffs = [(ya - yb).abs().max()] + [(x - y).abs().max() for x, y in zip(ga + pa, gb + pb)]
    return float(max(diffs))


def _breaks(fn, *inputs) -> int:
    torch._dynamo.reset()
    count = torch._dynamo.explain(fn)(*inputs).graph_break_count
    torch._dynamo.reset()
    return count


def _loss_and_layers(world, sp):
    from mtp.parallel import gather_from_sequence_parallel_region
    from mtp.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from mtp.tensor_parallel import vocab_parallel_cross_entropy

    torch.manual_seed(0)
    col = ColumnParallelLinear(16, 32, sequence_parallel=sp)
    row = RowParallelLinear(32, 16, sequence_parallel=sp)
    head = ColumnParallelLinear(16, 64, bias=False)

    def f(x, target):
        h = row(torch.relu(col(x)))
        if sp:
            h = gather_from_sequence_parallel_region(h, False)
        return vocab_parallel_cross_entropy(head(h), target)

    torch.manual_seed(5)
    x = torch.randn(8 // (world if sp else 1), 2, 16)
    target = torch.randint(0, 64, (8, 2))
    params = [p for m in (col, row, head) for p in m.parameters()]
    results = _run_both(f, params, x, target)
    return _max_diff(*results), _breaks(f, x.requires_grad_(), target)


def _llama_block(world, sp):
    from mtp.integrations.hf import parallelize_hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, intermediate_size=64, attn_implementation="eager",
    )
    model = parallelize_hf(transformers.LlamaForCausalLM(config), tp=world, sequence_parallel=sp)
    layer = model.model.layers[1]  # layers[0] also splits its input under sequence parallel
    torch.manual_seed(5)
    x = torch.randn(2, 8 // (world if sp else 1), 32)
    cos_sin = model.model.rotary_emb(x, torch.arange(8)[None].expand(2, -1))

    def f(h):
        out = layer(h, attention_mask=None, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out

    results = _run_both(f, list(layer.parameters()), x)
    return _max_diff(*results), _breaks(f, x.requires_grad_())


def _llama_model(world):
    """The whole parallelized HF model, forward and HF's own loss."""
    from mtp.integrations.hf import parallelize_hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, intermediate_size=64, attn_implementation="eager",
    )
    model = parallelize_hf(transformers.LlamaForCausalLM(config), tp=world)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))

    def f(ids):
        return model(input_ids=ids, labels=ids).loss

    results = _run_both(f, list(model.parameters()), ids)
    return _max_diff(*results), _breaks(f, ids)


def _worker(rank, world):
    from mtp.parallel import initialize_model_parallel

    initialize_model_parallel(tensor_model_parallel_size=world)
    out = {}
    for sp in (False, True):
        out[("loss", sp)] = _loss_and_layers(world, sp)
        out[("llama", sp)] = _llama_block(world, sp)
    out[("llama model + HF loss", False)] = _llama_model(world)
    return out


def test_compiled_tp_block_and_vocab_parallel_loss_fullgraph_equal_eager():
    for rank_result in run_distributed(_worker, 2, timeout=300):
        for case, (diff, breaks) in rank_result.items():
            assert breaks == 0, case
            assert diff <= 1e-6, (case, diff)
