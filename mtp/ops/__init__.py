"""The op layer: each op is a ``torch.library`` custom op (``torch.ops.mtp.*``) with a fake
implementation, autograd, argument checks, backend choice and a plain-PyTorch reference.

Backends are chosen by argument (``backend="auto"|"triton"|"reference"|...``) or, when the
argument is ``"auto"``, by the ``MTP_BACKEND`` environment variable; ``auto`` means the fused
kernel on CUDA and the reference on CPU (see :func:`mtp.ops._backend.resolve_backend`).

One home per op: the API, its autograd, its custom ops and its config are in the op's module or
package here; its device code is in ``mtp.kernels`` (the top-level ``kernels/`` folder) under the
same name. Each op's path, API and autograd -> config -> kernel:

- ``bias_gelu``, ``bias_swiglu``: :mod:`.bias_act` -> ``tile_shape``/``row_programs`` ->
  :mod:`mtp.kernels.bias_act`.
- ``vocab_parallel_cross_entropy``: :mod:`.cross_entropy` (``.checks``: arguments and the
  data check; its PyTorch reference in ``.reference``) -> ``vector_width``/``num_programs`` ->
  :mod:`mtp.kernels.cross_entropy` (row helpers in ``cross_entropy_rows``).
- ``linear_cross_entropy``: :mod:`.linear_cross_entropy` (``.checks``: arguments and backend;
  ``.call``: a call's setup, chunks and collectives; ``.bodies``: the chunked forward and
  backward; ``.maths``: the per-chunk PyTorch maths and GEMMs) -> the same launch config ->
  :mod:`mtp.kernels.linear_cross_entropy` and ``linear_cross_entropy_gemm``.
- ``permute``, ``unpermute``: :mod:`.moe_permute` (``.paths``: eager and general paths;
  ``.checks``, ``.row_map``, ``.token_map``, ``.invert``, ``.rows``, ``.row_ops``,
  ``.reference``) -> ``map_config``/``block_config`` -> :mod:`mtp.kernels.moe_row_map`,
  :mod:`mtp.kernels.moe_token_major` and :mod:`mtp.kernels.moe_permute`.
- ``grouped_gemm``: :mod:`.grouped_gemm` (``.checks``, ``.eager_path``, ``.ops``: custom ops
  and autograd, ``.backends``, ``.plans``: the triton backend's launch plans, ``.fp8``: FP8
  operands' custom ops and autograd, ``.cutlass``) -> ``.config.make_config`` ->
  :mod:`mtp.kernels.grouped_gemm_details` (``launch``, ``routing``, ``pointer``, ``tma``,
  ``fp8``, ``epilogue``, ``tiles``, ``fill``); the CUTLASS kernels in ``csrc/``.
- ``grouped_mlp``: :mod:`.grouped_mlp` -> two ``grouped_gemm`` calls with chained epilogues;
  with ``fp8_recipe`` :mod:`.grouped_mlp_fp8` (autograd, the call) and
  :mod:`.grouped_mlp_fp8_ops` (``mtp::grouped_mlp_fp8_fc1`` / ``_dact``, the FP8 kernels of
  ``kernels/grouped_gemm_details/fp8_act.py``).
- ``quantize`` (FP8 e4m3 with block scales, the grouped GEMM's FP8 operands): :mod:`.quantize`
  (``.tensor``: ``Fp8Tensor``, ``Fp8Recipe``; ``.cache``: ``Fp8WeightCache``; ``.reference``: the PyTorch definition; ``.ops``:
  the custom op, its bodies and plans) -> ``tile_shape`` -> :mod:`mtp.kernels.quantize`.
- ``moe_router``: :mod:`.moe_router` (``.checks``, ``.reference``: the aten path) ->
  ``tile_config``/``rows_per_program`` -> :mod:`mtp.kernels.moe_router` (row helpers in
  ``moe_router_rows``).
"""

from .bias_act import bias_gelu, bias_swiglu  # noqa: E402,F401
from .cross_entropy import vocab_parallel_cross_entropy  # noqa: E402,F401
from .linear_cross_entropy import linear_cross_entropy  # noqa: E402,F401
from .moe_permute import permute, unpermute  # noqa: E402,F401
from .quantize import Fp8Recipe, Fp8Tensor, Fp8WeightCache, dequantize, quantize  # noqa: E402,F401
from .grouped_gemm import (  # noqa: E402,F401
    grouped_gemm,
    grouped_gemm_accumulate_wgrad,
    grouped_gemm_reference,
)
from .grouped_mlp import grouped_mlp  # noqa: E402,F401
from .moe_router import moe_router  # noqa: E402,F401
