"""Error messages name what to change: ``parallelize`` names the module and its plan entry,
``parallelize_hf`` the vocab size, tp and how to pad the vocabulary (and the padding it
suggests works), the grouped GEMM the device ``tokens_per_expert`` must be on (said once)."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch
from torch import nn

from mtp.testing import run_distributed


def test_tokens_per_expert_device_is_said_once():
    from mtp.ops import grouped_gemm

    x, w = torch.randn(4, 8), torch.randn(2, 8, 3)
    with pytest.raises(ValueError) as info:
        grouped_gemm(x, w, torch.tensor([2, 2], device="meta"))
    assert str(info.value) == "tokens_per_expert must be on the CPU, like x, got meta"


def _messages_worker(rank: int, world: int) -> dict[str, str]:
    import transformers

    import mtp.parallel as mp
    import mtp.tensor_parallel as tp
    from mtp.integrations.hf import parallelize_hf

    mp.initialize_model_parallel(tensor_model_parallel_size=world)
    out = {}
    model = nn.Sequential(OrderedDict(embed=nn.Embedding(2 * world + 1, 4),
                                      proj=nn.Linear(4, 2 * world + 1)))
    for plan in ({"pro*": "column"}, {"emb*": "vocab"}, {"pro*": "vocab"}):
        try:
            tp.parallelize(model, plan)
        except (ValueError, TypeError) as exc:
            out[next(iter(plan))] = out.get(next(iter(plan)), "") + str(exc) + "\n"
    cfg = transformers.GPT2Config(vocab_size=101, n_embd=16, n_head=2, n_layer=1, n_positions=16,
                                  n_inner=32)  # fmt: skip
    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(cfg).float()
    try:
        parallelize_hf(gpt, tp=world)
    except ValueError as exc:
        out["vocab"] = str(exc)
    gpt.resize_token_embeddings(tp.pad_vocab_size(101, world))  # what the message says to do
    parallelize_hf(gpt, tp=world)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(1))
    out["loss"] = repr(float(gpt(input_ids=ids, labels=ids).loss))
    mp.destroy_model_parallel()
    return out


def test_parallelize_messages_name_the_module_the_plan_entry_and_the_fix():
    pytest.importorskip("transformers")
    out = run_distributed(_messages_worker, 2)[0]
    linear = out["pro*"].splitlines()
    assert linear[0].startswith("parallelize: 'proj' (plan entry 'pro*': 'column'): "), linear
    assert "output_size (5) must be divisible by the tensor parallel size (2)" in linear[0]
    assert linear[1] == ("parallelize: 'proj' (plan entry 'pro*': 'vocab') is a Linear; style "
                         "'vocab' needs an nn.Embedding")  # fmt: skip
    embedding = out["emb*"]
    assert embedding.startswith("parallelize: 'embed' (plan entry 'emb*': 'vocab'): "), embedding
    vocab = out["vocab"]
    assert vocab.startswith("parallelize_hf: config.vocab_size (101) must be divisible by tp (2)")
    assert "mtp.tensor_parallel.pad_vocab_size(101, 2) = 256" in vocab
    assert "model.resize_token_embeddings(256)" in vocab
    assert "key/value heads" not in vocab
    assert math.isfinite(float(out["loss"]))  # the padded model trains
