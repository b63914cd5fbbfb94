"""Tensor-parallel layers (Megatron-Core names)."""

from .cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy

__all__ = ["VocabParallelCrossEntropy", "vocab_parallel_cross_entropy"]
