"""parallelize() / from_linear() / from_embedding() on a plain nanoGPT-like model written here:
the parallelized block and GPT equal the unmodified model (outputs, every gradient, a few
optimizer steps), with and without sequence parallel; four all-reduces per transformer layer
(Megatron-LM figure 4); bad plans raise. gloo, world sizes 2 and 4, float64."""

import copy

import pytest
import torch
import torch.nn.functional as F
from test_tp_layers import assert_close, chunk, gather_shards, random_like_everywhere
from test_tp_mappings import collective_names
from torch import nn

import mtp.parallel as mp
import mtp.tensor_parallel as tp
from mtp.testing import count_collectives, run_distributed

F64 = torch.float64


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, written to take per-rank sizes from the tensors."""

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, dtype=F64)
        self.c_proj = nn.Linear(n_embd, n_embd, dtype=F64)
        self.head_dim = n_embd // n_head

    def forward(self, x):  # [B, T, C]
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        B, T = q.shape[:2]
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, dtype=F64)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, dtype=F64)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, dtype=F64)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd, dtype=F64)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab, block_size, n_embd, n_head, n_layer):
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, n_embd, dtype=F64),
                "wpe": nn.Embedding(block_size, n_embd, dtype=F64),
                "h": nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
                "ln_f": nn.LayerNorm(n_embd, dtype=F64),
            }
        )
        self.lm_head = nn.Linear(n_embd, vocab, bias=False, dtype=F64)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1))
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


BLOCK_PLAN = {
    "*attn.c_attn": {"style": "column", "stride": 3},
    "*attn.c_proj": "row",
    "*mlp.c_fc": "column",
    "*mlp.c_proj": "row",
}
GPT_PLAN = {
    "transformer.wte": "vocab",
    **BLOCK_PLAN,
    "lm_head": {"style": "column", "gather_output": True},
}


def _layout(name: str, n_embd: int):
    """(dim, blocks) of a parameter's shard in the parallelized model; None when replicated."""
    if "c_attn" in name:
        return 0, [n_embd] * 3
    if "c_fc" in name or name.endswith(("wte.weight", "lm_head.weight")):
        return 0, None
    if name.endswith("c_proj.weight"):
        return 1, None
    return None


def _compare_params(ref: nn.Module, par: nn.Module, n_embd: int, what: str, grads=True):
    ref_params = dict(ref.named_parameters())
    par_params = dict(par.named_parameters())
    assert ref_params.keys() == par_params.keys(), (what, ref_params.keys(), par_params.keys())
    for name, p_ref in ref_params.items():
        p = par_params[name]
        layout = _layout(name, n_embd)
        for attr in ("data", "grad") if grads else ("data",):
            a, e = getattr(p, attr), getattr(p_ref, attr)
            if layout is not None:
                a = gather_shards(a, layout[0], layout[1])
            assert_close(a, e, f"{what}: {name}.{attr}")


def _check_block(rank, world, *, sp):
    n_embd, n_head, B, T = 8 * world, 2 * world, 2, 2 * world
    torch.manual_seed(0)
    ref = Block(n_embd, n_head)
    par = tp.parallelize(copy.deepcopy(ref), BLOCK_PLAN, sequence_parallel=sp, seq_dim=1)
    assert isinstance(par.attn.c_attn, tp.ColumnParallelLinear)
    assert isinstance(par.mlp.c_proj, tp.RowParallelLinear)
    _compare_params(ref, par, n_embd, f"block(sp={sp}) init", grads=False)
    x, dy = random_like_everywhere([B, T, n_embd], 1), random_like_everywhere([B, T, n_embd], 2)
    x_ref = x.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    y_ref.backward(dy)
    x_par = (chunk(x, 1, rank, world) if sp else x).clone().requires_grad_(True)
    with count_collectives() as fwd:
        y = par(x_par)
    with count_collectives() as bwd:
        y.backward(chunk(dy, 1, rank, world) if sp else dy)
    what = f"block(sp={sp})"
    if sp:
        # ln_1, ln_2 (weight + bias) and the two row-parallel biases see a sequence chunk
        assert tp.allreduce_sequence_parallel_grads(par) == 6
        assert_close(y, chunk(y_ref, 1, rank, world), f"{what} output")
        assert_close(x_par.grad, chunk(x_ref.grad, 1, rank, world), f"{what} input grad")
    else:
        assert_close(y, y_ref, f"{what} output")
        assert_close(x_par.grad, x_ref.grad, f"{what} input grad")
    _compare_params(ref, par, n_embd, what)
    # and one agreement row before each collective whose shape nothing checked before
    if sp:
        assert collective_names(fwd) == {"agreement": 4, "all_gather": 2, "reduce_scatter": 2}
        assert collective_names(bwd) == {"all_gather": 4, "reduce_scatter": 2}
    else:  # Megatron-LM figure 4: two all-reduces forward, two backward per layer
        assert collective_names(fwd) == {"agreement": 2, "all_reduce": 2}
        assert collective_names(bwd) == {"agreement": 2, "all_reduce": 2}
        activation_bytes = B * T * n_embd * 8  # each one moves a whole [B, T, C] activation
        data = [log.nbytes() - log.nbytes("agreement") for log in (fwd, bwd)]
        assert data == [2 * activation_bytes] * 2


def _check_gpt(rank, world):
    vocab, n_embd, n_head, n_layer, B, T = 8 * world, 8 * world, 2 * world, 2, 2, 6
    torch.manual_seed(0)
    ref = GPT(vocab, T, n_embd, n_head, n_layer)
    par = tp.parallelize(copy.deepcopy(ref), GPT_PLAN)
    assert par.lm_head.weight is par.transformer.wte.weight, "weight tying lost"
    assert isinstance(par.transformer.wte, tp.VocabParallelEmbedding)
    assert isinstance(par.transformer.wpe, nn.Embedding)  # not in the plan: untouched
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_par = torch.optim.AdamW(par.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    for step in range(3):
        idx = torch.randint(0, vocab, (B, T), generator=g)
        targets = torch.randint(0, vocab, (B, T), generator=g)
        loss_ref = ref(idx, targets)
        loss_ref.backward()
        with count_collectives() as fwd:
            loss = par(idx, targets)
        with count_collectives() as bwd:
            loss.backward()
        assert_close(loss.detach(), loss_ref.detach(), f"GPT loss at step {step}")
        _compare_params(ref, par, n_embd, f"GPT step {step}")
        # embedding: 1 all-reduce; 2 per layer; lm_head gathers its logits; one agreement row
        # before each
        fwd_ops = 1 + 2 * n_layer + 1
        assert collective_names(fwd) == {"agreement": fwd_ops, "all_reduce": fwd_ops - 1,
                                         "all_gather": 1}  # fmt: skip
        # 2 per layer; lm_head's input grad (the embedding's backward needs none)
        bwd_ops = 2 * n_layer + 1
        assert collective_names(bwd) == {"agreement": bwd_ops, "all_reduce": bwd_ops}
        opt_ref.step()
        opt_par.step()
        opt_ref.zero_grad()
        opt_par.zero_grad()


def _check_from_helpers(rank, world):
    torch.manual_seed(3)
    lin = nn.Linear(4 * world, 6, dtype=F64)
    row = tp.from_linear(lin, "row", input_is_parallel=False)
    x = random_like_everywhere([5, 4 * world], 4)
    assert_close(row(x), lin(x), "from_linear row forward")
    lin2 = nn.Linear(3, 2 * world, dtype=F64)
    lin2.weight.requires_grad_(False)
    col = tp.from_linear(lin2, "column")
    assert not col.weight.requires_grad
    assert_close(col(x[:, :3]), chunk(lin2(x[:, :3]), -1, rank, world), "from_linear column")
    emb = nn.Embedding(4 * world, 3, padding_idx=1, dtype=F64)
    vemb = tp.from_embedding(emb)
    ids = torch.tensor([[0, 1, 4 * world - 1]])
    assert_close(vemb(ids), emb(ids), "from_embedding forward")
    assert vemb.padding_idx == 1


def _check_bad_plans(rank, world):
    block = Block(8 * world, 2 * world)
    with pytest.raises(ValueError, match="matches no submodule"):
        tp.parallelize(copy.deepcopy(block), {"*.c_fcc": "column"})
    with pytest.raises(TypeError, match="needs an nn.Linear"):
        tp.parallelize(copy.deepcopy(block), {"ln_1": "column"})
    with pytest.raises(TypeError, match="needs an nn.Embedding"):
        tp.parallelize(copy.deepcopy(block), {"mlp.c_fc": "vocab"})
    with pytest.raises(ValueError, match="style must be one of"):
        tp.parallelize(copy.deepcopy(block), {"mlp.c_fc": "colum"})
    with pytest.raises(TypeError, match="unknown option"):
        tp.parallelize(copy.deepcopy(block), {"mlp.c_fc": {"style": "column", "gather": True}})
    with pytest.raises(ValueError, match="different styles"):
        tp.parallelize(copy.deepcopy(block), {"mlp.c_fc": "column", "*.c_fc": "row"})
    with pytest.raises(ValueError, match="must be divisible by the tensor parallel size"):
        tp.parallelize(nn.Sequential(nn.Linear(4, 4 * world + 1)), {"0": "column"})
    with pytest.raises(ValueError, match="not supported"):
        tp.from_embedding(nn.Embedding(4 * world, 2, max_norm=1.0))
    with pytest.raises(ValueError, match="pad_vocab_size"):
        tp.from_embedding(nn.Embedding(4 * world + 1, 2))
    with pytest.raises(TypeError, match="expects an nn.Linear"):
        tp.from_linear(nn.Embedding(4, 2))


def _parallelize_main(rank: int, world: int) -> str:
    with pytest.raises(mp.ParallelStateError, match="initialize_model_parallel"):
        tp.parallelize(Block(8, 2), BLOCK_PLAN)
    mp.initialize_model_parallel(tensor_model_parallel_size=world)
    _check_block(rank, world, sp=False)
    _check_block(rank, world, sp=True)
    _check_gpt(rank, world)
    _check_from_helpers(rank, world)
    _check_bad_plans(rank, world)
    mp.destroy_model_parallel()
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_parallelize_nanogpt_matches_single_process(world):
    assert run_distributed(_parallelize_main, world) == ["ok"] * world
