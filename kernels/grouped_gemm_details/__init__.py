"""Device code of the grouped GEMM (``mtp.ops.grouped_gemm``), installed as
``mtp.kernels.grouped_gemm_details``.

Rows of ``a`` are grouped by expert: expert ``e`` owns rows ``[start_e, start_e + m_e)`` with
``m_e = counts[e]``; the counts stay on the device and every kernel turns them into its tiles,
so grids are static (worst-case bounds) and nothing waits for the host (CUDA-graph safe).

Modules, bottom to top:

- :mod:`.tiles`: the tile maps written once for every kernel: the masked MMA loop, the in-kernel
  expert tile map of the pointer kernels, the tile-map kernel of the TMA kernels, the zero tail
  past the routed rows and the weight-gradient tile order.
- :mod:`.epilogue`: the fused epilogues (activation forward, activation backward with the
  routing-probability gradient, the zero tail of both).
- :mod:`.pointer`: kernels that address memory with pointers (any strides, fp32, the
  interpreter, GPUs before sm_90).
- :mod:`.tma`: the same contracts through TMA tensor descriptors (sm_90a / sm_100a,
  fp16/bf16, 16-byte aligned operands).
- :mod:`.fp8`: FP8 e4m3 operands with block scales (the blockwise recipe's fp32 scales per
  128-deep K block, MXFP8's e8m0 scales through ``tl.dot_scaled``), pointer loads, the forward
  (and data gradient) and the weight gradient from expert-padded column-wise operands.
- :mod:`.routing`: the routing metadata of one op call (the experts' rows, the counts' status
  word, the TMA kernels' tile maps), written once by the tile-map kernel and shared by the
  call's launches.
- :mod:`.launch`: launchers that take tensors, preallocated outputs and a config object (tiles,
  pointer or TMA, persistent grid, split), as plans compiled once per key. They decide nothing:
  the config does (:func:`mtp.ops.grouped_gemm.config.make_config`).
- :mod:`.fill`: the zeros that ``torch.nn.functional.grouped_mm`` leaves unwritten (the rows
  past the routed ones, the weight gradient of an empty group), for the ``torch`` backend.

Nothing here imports the rest of mtp above ``mtp.kernels``.
"""
