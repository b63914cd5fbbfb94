"""The op layer: each op is a ``torch.library`` custom op (``torch.ops.mtp.*``) with a fake
implementation, autograd, argument checks, backend choice and a plain-PyTorch reference.

Backends are chosen by argument (``backend="auto"|"triton"|"reference"|...``) or, when the
argument is ``"auto"``, by the ``MTP_BACKEND`` environment variable; ``auto`` means the fused
kernel on CUDA and the reference on CPU (see :func:`mtp.ops._backend.resolve_backend`).
"""

from .bias_act import bias_gelu, bias_swiglu  # noqa: E402,F401
from .cross_entropy import vocab_parallel_cross_entropy  # noqa: E402,F401
from .linear_cross_entropy import linear_cross_entropy  # noqa: E402,F401
from .moe_permute import permute, unpermute  # noqa: E402,F401
from .grouped_gemm import (  # noqa: E402,F401
    grouped_gemm,
    grouped_gemm_accumulate_wgrad,
    grouped_gemm_reference,
)
from .grouped_mlp import grouped_mlp  # noqa: E402,F401
