"""Tensor-parallel Hugging Face ``transformers`` models in one call (needs the ``hf`` extra).

::

    model = AutoModelForCausalLM.from_config(config)     # same weights on every rank
    parallelize_hf(model, tp=2)                           # after initialize_model_parallel(...)
    load_hf_state_dict(model, "checkpoint_dir/")          # optional: each rank reads its slices
    loss = model(input_ids, labels=labels).loss           # the model's own code keeps running
    ...
    full = model.state_dict()                             # HF names, full tensors (collective)
    model.save_pretrained(path)                           # every rank; from_pretrained loads it

Supported families (``config.model_type``): ``llama``, ``mistral``, ``qwen2``, ``qwen3``
(q/k/v and gate/up column-parallel, o/down row-parallel, embedding vocab-parallel, ``lm_head``
column-parallel with gathered logits), ``mixtral``, ``qwen2_moe`` and ``qwen3_moe`` (the same
attention; each sparse MoE block swapped for :class:`mtp.moe.MoELayer` with the family's routing
and shared expert, experts split over the group or, ``ep`` a multiple of tp, over mtp.parallel's
expert group: :mod:`mtp.integrations.hf_moe`),
``deepseek_v3`` (the MoE blocks and dense MLPs as above; multi-head latent attention split by
heads: ``q_proj``/``q_b_proj`` and ``kv_b_proj`` column-parallel, ``o_proj`` row-parallel, the
latent down-projections and norms replicated with their gradients summed over tp) and ``gpt2`` (its ``Conv1D``
modules become linear layers; the fused ``c_attn`` is split per q/k/v block; ``split_size`` and
head counts are patched on the attention modules). Sibling
projections share one entry into the tensor-parallel region
(:mod:`mtp.tensor_parallel.siblings`), so a transformer layer costs two all-reduces forward and
two backward. ``sequence_parallel=True`` (Llama-like families):
activations between blocks are sequence chunks (``[b, s/tp, h]``); call
:func:`mtp.tensor_parallel.allreduce_sequence_parallel_grads` after each backward.
"""

from __future__ import annotations

from .hf_kernels import apply_kernels
from .hf_parallel import SUPPORTED_FAMILIES, parallelize_hf
from .hf_state import hf_state_dict, load_hf_state_dict
from .hf_trainer import Trainer

__all__ = [
    "SUPPORTED_FAMILIES",
    "Trainer",
    "apply_kernels",
    "hf_state_dict",
    "load_hf_state_dict",
    "parallelize_hf",
]

