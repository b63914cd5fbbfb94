"""Optional adapters to other libraries' models and trainers.

- :mod:`mtp.integrations.hf`: Hugging Face ``transformers`` (``pip install mtp[hf]``):
  :func:`~mtp.integrations.hf.apply_kernels` (mtp's kernels, and layers at tp > 1, in one call),
  :func:`~mtp.integrations.hf.parallelize_hf`, :func:`~mtp.integrations.hf.load_hf_state_dict`,
  :func:`~mtp.integrations.hf.hf_state_dict`, and :class:`~mtp.integrations.hf.Trainer` (a
  ``transformers.Trainer`` for models split by mtp).
- :mod:`mtp.integrations.megatron`: Megatron-Core's experts spec (``GroupedMLP``) and
  ``fused_vocab_parallel_cross_entropy``.
- :mod:`mtp.integrations.torchtitan`: torchtitan's ``GroupedExperts`` on mtp's grouped GEMMs.

Each adapter is imported on demand (``import mtp.integrations.hf``), so mtp never needs the
other library to be installed.
"""
