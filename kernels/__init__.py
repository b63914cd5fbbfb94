"""Triton device code for mtp, installed as ``mtp.kernels``.

One module per op family. Each holds ``@triton.jit`` kernels and a launcher that takes tensors and
preallocated outputs; nothing here does autograd or torch.distributed, and nothing here imports
the rest of mtp (imports only go downward: ``mtp.ops`` imports ``mtp.kernels``).
"""
