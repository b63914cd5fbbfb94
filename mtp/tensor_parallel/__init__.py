"""Tensor-parallel layers (Megatron-LM section 3) that drop into an existing model.

- :class:`ColumnParallelLinear`, :class:`RowParallelLinear`, :class:`VocabParallelEmbedding`:
  the split GEMMs and embedding, with Megatron-Core's argument names (``gather_output``,
  ``input_is_parallel``, ``skip_bias_add``, ``sequence_parallel``, ``init_method``...).
- :class:`ParallelMLP` and :class:`ParallelSelfAttention`: the transformer blocks of figure 3,
  one all-reduce forward and one backward each.
- :func:`from_linear`, :func:`from_embedding`, :func:`parallelize`: shard an existing model's
  ``nn.Linear`` / ``nn.Embedding`` modules by name pattern.
- :class:`VocabParallelCrossEntropy` / :func:`vocab_parallel_cross_entropy`: the loss on
  vocab-parallel logits (fused kernel, one small all-gather), Megatron-Core's argument names.
- :class:`VocabParallelLinearCrossEntropy`: the LM head fused with the loss (the logits are
  never materialised; :func:`mtp.ops.linear_cross_entropy`).
- :func:`allreduce_sequence_parallel_grads`: sum the partial gradients of replicated
  parameters under sequence parallelism (call after backward).

``group=None`` everywhere means the tensor-model-parallel group of
:func:`mtp.parallel.initialize_model_parallel`. The communication mappings and the
model-parallel RNG live in :mod:`mtp.parallel` (re-exported here for Megatron-Core users).
"""

from mtp.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from mtp.parallel.random import (
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
)

from .attention import ParallelSelfAttention
from .cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from .linear_cross_entropy import VocabParallelLinearCrossEntropy
from .embedding import VocabParallelEmbedding, VocabRangeError
from .layers import ColumnParallelLinear, RowParallelLinear, linear_with_grad_reduction
from .mlp import ACTIVATIONS, ParallelMLP, apply_bias_activation
from .parallelize import STYLES, from_embedding, from_linear, parallelize
from .siblings import enter_tensor_parallel_region, scatter_module_input, share_module_input
from .utils import (
    VocabUtility,
    allreduce_sequence_parallel_grads,
    divide,
    mark_sequence_parallel_parameters,
    pad_vocab_size,
    param_is_tensor_parallel,
    set_tensor_model_parallel_attributes,
)

__all__ = [
    "ACTIVATIONS",
    "STYLES",
    "ColumnParallelLinear",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "VocabParallelLinearCrossEntropy",
    "VocabRangeError",
    "VocabUtility",
    "allreduce_sequence_parallel_grads",
    "apply_bias_activation",
    "checkpoint",
    "copy_to_tensor_model_parallel_region",
    "divide",
    "enter_tensor_parallel_region",
    "from_embedding",
    "from_linear",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_cuda_rng_tracker",
    "linear_with_grad_reduction",
    "mark_sequence_parallel_parameters",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
    "pad_vocab_size",
    "parallelize",
    "param_is_tensor_parallel",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_module_input",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_tensor_model_parallel_attributes",
    "share_module_input",
    "vocab_parallel_cross_entropy",
]
