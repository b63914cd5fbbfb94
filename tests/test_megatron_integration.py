"""mtp.integrations.megatron against Megatron-Core (gloo, one rank; megatron-core 0.16.1):
GroupedMLP built from a ModuleSpec the way Megatron's MoELayer builds its experts equals
Megatron's SequentialMLP forward and backward (its errors against float64 within a small
multiple of SequentialMLP's own), returns (out, None), and its sharded_state_dict has
SequentialMLP's checkpoint keys and global shapes; fused_vocab_parallel_cross_entropy takes
Megatron's signature and group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtp.testing import run_distributed

pytest.importorskip("megatron.core")

H, FFN, E = 16, 12, 4


def _config(dtype=torch.float32, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=H, num_attention_heads=2, moe_ffn_hidden_size=FFN,
                num_moe_experts=E, gated_linear_unit=True, activation_func=F.silu,
                add_bias_linear=False, use_cpu_initialization=True, params_dtype=dtype)
    base.update(kw)
    return TransformerConfig(**base)


def _sequential(config, pg):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    subs = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return SequentialMLP(E, config, subs, pg_collection=pg)


def _copy_from_sequential(ours, seq):
    """Expert l of SequentialMLP (fc1 [2F, H], fc2 [H, F]) -> the [L, H, 2F] / [L, F, H] views."""
    w1, w2 = ours._views()
    with torch.no_grad():
        for i, expert in enumerate(seq.local_experts):
            w1[i].copy_(expert.linear_fc1.weight.t())
            w2[i].copy_(expert.linear_fc2.weight.t())


def _run(module, x, counts, probs, dy):
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    y, bias = module(x, counts, probs)
    y.backward(dy)
    return y, bias, x.grad, probs.grad


def _err(a, b):
    return float((a.double() - b.double()).abs().max())


def _worker(rank, world):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from mtp.integrations.megatron import GroupedMLP, fused_vocab_parallel_cross_entropy

    parallel_state.initialize_model_parallel()
    pg = ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["ep", "expt_tp", "expt_dp", "tp"])
    torch.manual_seed(0)
    seq32 = _sequential(_config(), pg)
    seq64 = _sequential(_config(torch.float64), pg)
    seq64.load_state_dict({k: v.double() if v.is_floating_point() else v
                           for k, v in seq32.state_dict().items() if v is not None}, strict=False)
    ours = build_module(ModuleSpec(module=GroupedMLP), E, _config(), pg_collection=pg)
    _copy_from_sequential(ours, seq32)
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 6, 4])  # an empty expert
    x = torch.randn(13, H, generator=g)
    probs = torch.rand(13, generator=g)
    dy = torch.randn(13, H, generator=g)
    got = _run(ours, x, counts, probs, dy)
    ref32 = _run(seq32, x, counts, probs, dy)
    ref64 = _run(seq64, x.double(), counts, probs.double(), dy.double())
    result = {"bias_none": got[1] is None and ref32[1] is None}
    for i, name in ((0, "y"), (2, "dx"), (3, "dprobs")):
        result[name] = (_err(got[i], ref64[i]), _err(ref32[i], ref64[i]))
    w1g, w2g = ours.weight1.grad.view(E, H, -1), ours.weight2.grad.view(E, -1, H)
    result["dw"] = (
        max(max(_err(w1g[i], e.linear_fc1.weight.grad.t()),
                _err(w2g[i], e.linear_fc2.weight.grad.t()))
            for i, e in enumerate(seq64.local_experts)),
        max(max(_err(a.linear_fc1.weight.grad, b.linear_fc1.weight.grad),
                _err(a.linear_fc2.weight.grad, b.linear_fc2.weight.grad))
            for a, b in zip(seq32.local_experts, seq64.local_experts)),
    )
    # distributed-checkpoint layout: SequentialMLP's keys and global shapes
    def layout(module):
        out = {}
        for item in module.sharded_state_dict(prefix="experts.").values():
            built = item.build() if hasattr(item, "build") else item
            for t in (built.values() if isinstance(built, dict) else [built]):
                if hasattr(t, "global_shape") and not t.key.endswith("_extra_state"):
                    out[t.key] = tuple(t.global_shape)
        return out

    result["layout"] = (layout(ours), layout(seq32))
    # cross-entropy: Megatron's positional signature; tp_group=None reads Megatron's group
    logits = torch.randn(5, 2, 32, generator=g)
    target = torch.randint(0, 32, (5, 2), generator=g)
    want = F.cross_entropy(logits.reshape(-1, 32), target.reshape(-1), reduction="none")
    from mtp.integrations import megatron as adapter

    result["reads_megatron_group"] = (
        adapter._megatron_tp_group() is parallel_state.get_tensor_model_parallel_group())
    for group in (None, parallel_state.get_tensor_model_parallel_group()):
        loss = fused_vocab_parallel_cross_entropy(logits, target, group)
        result[f"ce_{group is None}"] = _err(loss.reshape(-1), want)
    try:
        fused_vocab_parallel_cross_entropy(logits, target, "tp")
    except TypeError as e:
        result["ce_bad_group"] = str(e)
    for kw, cls in ((dict(add_bias_linear=True), ValueError),
                    (dict(activation_func=F.relu), ValueError)):
        try:
            GroupedMLP(E, _config(**kw), pg)
        except cls as e:
            result[f"error_{sorted(kw)[0]}"] = str(e)
    return result


def test_megatron_grouped_mlp_equals_sequential_mlp():
    (r,) = run_distributed(_worker, 1, timeout=180)
    assert r["bias_none"]
    for name in ("y", "dx", "dprobs", "dw"):
        ours, megatron = r[name]
        assert ours <= 4 * megatron + 1e-6, (name, ours, megatron)
    ours, seq = r["layout"]
    assert ours and ours == seq, (ours, seq)
    assert r["reads_megatron_group"]
    assert r["ce_True"] <= 1e-5 and r["ce_False"] <= 1e-5, r
    assert "torch.distributed.ProcessGroup" in r["ce_bad_group"]
    assert "builtins.str" in r["ce_bad_group"]
    assert "add_bias_linear" in r["error_add_bias_linear"]
    assert "torch.nn.functional.relu" in r["error_activation_func"]
