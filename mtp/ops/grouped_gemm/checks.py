"""Argument checks of :func:`mtp.ops.grouped_gemm` (shapes, dtypes, devices, ``out`` buffers,
``main_grad``: free, always on) and the data-dependent check of the token counts (the
project's ``validate`` rule: on the device by default, typed host errors with ``"sync"``)."""

from __future__ import annotations

import torch

from mtp.utils import check_tensor, check_values, data_checks_enabled, is_fake, validation_mode

__all__ = [
    "ACTIVATIONS",
    "GATED",
    "check_arguments",
    "check_backend",
    "check_count_values",
    "check_fp8_arguments",
    "check_fp8_device",
    "check_gather",
    "check_index_values",
    "check_rows",
    "check_inputs",
    "check_main_grad",
    "check_out_memory",
    "check_probs",
    "count_message",
    "fp8_data",
    "n_of",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
COUNT_DTYPES = (torch.int32, torch.int64)
#: Activations of the epilogue (``"gelu"``: exact erf GeLU; the gated ones read ``2F`` columns).
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "clamped_swiglu")
GATED = ("swiglu", "clamped_swiglu")


def n_of(w: torch.Tensor, trans_b: bool) -> int:
    """``N``: the output columns of ``x @ w[e]`` (``w [E, K, N]``, or ``[E, N, K]``)."""
    return w.shape[1] if trans_b else w.shape[2]


def check_arguments(x, w, tokens_per_expert, trans_b, out, bias, activation) -> None:
    """The free checks of :func:`mtp.ops.grouped_gemm`'s tensors and options (shapes, dtypes,
    devices, the activation, ``out``)."""
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS} or None, got {activation!r}")
    n = n_of(w, trans_b) if w.dim() == 3 else 0
    if activation in GATED and n % 2:
        raise ValueError(f"w holds the gate and up columns for {activation!r}: its N ({n}) must "
                         f"be even, got w of shape {tuple(w.shape)}")  # fmt: skip
    check_inputs(x, w, tokens_per_expert, trans_b, out,
                 out_cols=n // 2 if activation in GATED else n)  # fmt: skip
    if bias is not None:
        check_tensor("bias", bias, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
        if tuple(bias.shape) != (w.shape[0], n):
            raise ValueError(f"bias must be [{w.shape[0]}, {n}] (experts, N), "
                             f"got {tuple(bias.shape)}")  # fmt: skip


def check_probs(probs, x, activation) -> None:
    if probs is None:
        return
    if activation is None:
        raise ValueError("probs multiplies the activation's output: pass activation=... "
                         "(or scale the result yourself)")  # fmt: skip
    check_tensor("probs", probs, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    if probs.shape[0] != x.shape[0]:
        raise ValueError(f"probs must be [{x.shape[0]}] (one per row of x), got "
                         f"{tuple(probs.shape)}")  # fmt: skip


def check_backend(name: str, impl, x, w, tokens_per_expert) -> None:
    """What backend ``name`` (``impl``, a ``GroupedGemmBackend``) needs of the arguments."""
    if impl.check is not None:
        impl.check(x, w)
    if not impl.device_counts and tokens_per_expert.device.type == "meta":
        raise ValueError(
            f"grouped_gemm: backend={name!r} reads tokens_per_expert on the host, but it is a "
            "meta tensor (no values); pass the counts on the CPU, or use a backend that reads "
            "them on the device ('triton', 'torch')"
        )


def check_inputs(x, w, tokens_per_expert, trans_b, out, dtypes=FLOAT_DTYPES, out_cols=None) -> None:
    check_tensor("x", x, ndim=2, dtypes=dtypes)
    check_tensor("w", w, ndim=3, dtypes=(x.dtype,), device=x.device)
    _check_shapes(x, w, tokens_per_expert, trans_b)
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=(x.dtype,), device=x.device)
        shape = (x.shape[0], n_of(w, trans_b) if out_cols is None else out_cols)
        if tuple(out.shape) != shape:
            raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
        check_out_memory(out, x, w, tokens_per_expert)


def _check_shapes(x, w, tokens_per_expert, trans_b) -> None:
    """The counts and how ``x [M, K]`` and ``w`` fit together (experts, K)."""
    check_tensor("tokens_per_expert", tokens_per_expert, ndim=1, dtypes=COUNT_DTYPES)
    if not isinstance(trans_b, bool):
        raise TypeError(f"trans_b must be a bool, got {type(trans_b).__name__}")
    if tokens_per_expert.device not in (x.device, torch.device("cpu")):
        where = "the CPU, like x" if x.device.type == "cpu" else f"{x.device} (like x) or the CPU"
        raise ValueError(f"tokens_per_expert must be on {where}, got {tokens_per_expert.device}")
    E = w.shape[0]
    if tokens_per_expert.shape[0] != E:
        raise ValueError(
            f"w has {E} experts (w.shape[0]) but tokens_per_expert has "
            f"{tokens_per_expert.shape[0]} entries; they must match"
        )
    k_dim = 2 if trans_b else 1
    if w.shape[k_dim] != x.shape[1]:
        layout = "[E, N, K] (trans_b=True)" if trans_b else "[E, K, N] (trans_b=False)"
        raise ValueError(
            f"w of shape {tuple(w.shape)} read as {layout} has K={w.shape[k_dim]}, but x of "
            f"shape {tuple(x.shape)} has K={x.shape[1]}"
        )


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` byte addresses a (non-empty) strided tensor can touch."""
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (extent + 1) * t.element_size()


def _shares_memory(a: torch.Tensor, b: torch.Tensor, plain: bool) -> bool:
    """True when ``a`` and ``b`` may overlap in memory (same storage, intersecting spans)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False
    if not plain and (is_fake(a) or is_fake(b)):
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def check_out_memory(out: torch.Tensor, x, w, tokens_per_expert, plain: bool = False) -> None:
    """``out`` must be written without clobbering an input or itself, and with autograd (the
    part of the checks that depends on addresses and flags: every call). ``plain``: the
    tensors are known to be plain (the eager path), never fake."""
    for name, t in (("x", x), ("w", w), ("tokens_per_expert", tokens_per_expert)):
        if _shares_memory(out, t, plain):
            raise ValueError(
                f"out shares memory with {name}; grouped_gemm cannot write its result over an "
                "input (the rows of one expert would overwrite what the others still read): "
                "pass a separate buffer"
            )
    if (plain or not is_fake(out)) and torch._debug_has_internal_overlap(out) == 1:
        raise ValueError(
            f"out (shape {tuple(out.shape)}, strides {out.stride()}) has elements that share "
            "memory (an expanded or broadcast tensor); pass a dense buffer"
        )
    if torch.is_grad_enabled() and out.requires_grad and out.is_leaf:
        raise ValueError(
            "out is a leaf tensor that requires grad; autograd cannot record an in-place write "
            "into it. Pass a buffer with requires_grad=False (the result is differentiable in "
            "x and w either way), or call under torch.no_grad()"
        )


def _count_errors_sync(tokens_per_expert: torch.Tensor, M: int) -> None:
    """``validate="sync"``: typed errors with the values (one host read of two numbers)."""
    if tokens_per_expert.numel() == 0:
        return
    low, total = torch.stack([tokens_per_expert.min(), tokens_per_expert.sum()]).tolist()
    if low < 0:
        raise ValueError(f"tokens_per_expert must be non-negative, got a count of {low}")
    if total > M:
        raise ValueError(
            f"tokens_per_expert sums to {total} rows but x has only {M} rows (x.shape[0]); "
            "size x for the routed tokens (rows past the sum are written as zeros)"
        )


def check_count_values(tokens_per_expert: torch.Tensor, M: int, validate: bool | str) -> None:
    """The counts must be non-negative and sum to at most ``M``: on the device by default
    (``torch._assert_async``, no host sync), typed errors with ``validate="sync"``, nothing
    with ``validate=False``; skipped while tracing or capturing."""
    mode = validation_mode(validate)
    if mode == "off" or tokens_per_expert.numel() == 0:
        return
    if mode == "sync":
        if data_checks_enabled(True, tokens_per_expert):
            _count_errors_sync(tokens_per_expert, M)
        return
    if not data_checks_enabled(True, tokens_per_expert):
        return
    ok = (tokens_per_expert.min() >= 0) & (tokens_per_expert.sum() <= M)
    check_values(ok, count_message(M), validate=mode, tensors=(tokens_per_expert,))


def check_rows(x, weight1, probs, gather_index, token_map) -> None:
    """:func:`mtp.ops.grouped_mlp`'s rows: with ``gather_index`` its map, token map and
    probabilities (:func:`check_gather`); without, no ``token_map`` and ``probs`` ``[M]``."""
    if gather_index is not None:
        check_gather(x, weight1, gather_index, token_map, probs)
    elif token_map is not None:
        raise ValueError("token_map goes with gather_index (the map of its rows); pass both")
    elif probs is not None:
        check_tensor("probs", probs, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
        if probs.shape[0] != x.shape[0]:
            raise ValueError(f"probs must be [{x.shape[0]}] (one per row of x), got "
                             f"{tuple(probs.shape)}")  # fmt: skip


def check_index_values(gather, sources: int, scatter, rows: int, validate: bool | str) -> None:
    """:func:`mtp.ops.grouped_mlp`'s row maps: ``gather_index`` in ``[-1, sources)``,
    ``scatter_index`` in ``[-1, rows)`` with no row twice (two rows stored at one place race).
    Under :func:`check_values`' rule: on the device by default (no host sync), typed errors
    with ``validate="sync"``, nothing with ``validate=False``."""
    mode = validation_mode(validate)
    if mode == "off":
        return
    for name, index, size in (("gather_index", gather, sources), ("scatter_index", scatter, rows)):
        if index is None or index.numel() == 0 or not data_checks_enabled(True, index):
            continue
        ok = ((index >= -1) & (index < size)).all()
        message = f"{name} must hold rows in [0, {size}) or -1 (none)"
        if name == "scatter_index":  # each target once (index_add: no host sync, unlike bincount)
            slot = (index.long() + 1).clamp(0, size + 1)
            hits = torch.zeros(size + 2, dtype=torch.int32, device=index.device).index_add_(
                0, slot, torch.ones_like(slot, dtype=torch.int32))
            ok = ok & (hits[1 : size + 1] <= 1).all()
            message += ", each at most once (a permutation of the output's rows)"
        check_values(ok, message, validate=mode, tensors=(index,))


def count_message(M: int) -> str:
    """The message of the counts' device-side check."""
    return (f"tokens_per_expert must be non-negative and sum to at most x.shape[0] = {M} rows "
            "(validate='sync' reports the values)")


def check_main_grad(w: torch.Tensor) -> None:
    main = getattr(w, "main_grad", None)
    if not isinstance(main, torch.Tensor):
        raise ValueError(
            "w has no main_grad: gradient-accumulation fusion adds the weight gradient to "
            "w.main_grad (wrap the model in mtp.optim.DistributedDataParallel, or set "
            "w.main_grad = torch.zeros_like(w, dtype=torch.float32))"
        )
    if main.shape != w.shape or main.device != w.device or not main.dtype.is_floating_point:
        raise ValueError(
            f"w.main_grad must be a floating tensor of w's shape {tuple(w.shape)} on "
            f"{w.device}, got {main.dtype} {tuple(main.shape)} on {main.device}"
        )


def check_gather(x, weight1, gather_index, token_map, probs) -> None:
    """:func:`mtp.ops.grouped_mlp`'s row gather: ``gather_index`` ``[M]`` int32/int64 on ``x``'s
    device, ``token_map`` the :class:`~mtp.ops.moe_permute.TokenMap` of its source rows (``x``'s
    ``S`` rows), ``probs`` None, ``[S, E]`` (``E = weight1.shape[0]``) or ``[S]``."""
    from mtp.ops.moe_permute.token_map import TokenMap

    check_tensor("gather_index", gather_index, ndim=1, dtypes=COUNT_DTYPES, device=x.device)
    if not isinstance(token_map, TokenMap):
        raise TypeError("gather_index needs token_map=, the TokenMap of its rows (the one "
                        "moe_permute_row_map(..., token_map=True) built with the index), got "
                        f"{type(token_map).__name__}")  # fmt: skip
    S = x.shape[0]
    for name in ("rows", "experts", "count"):
        t = getattr(token_map, name)
        check_tensor(f"token_map.{name}", t, ndim=1 if name == "count" else 2,
                     dtypes=(torch.int32,), device=x.device)  # fmt: skip
        if t.shape[0] != S:
            raise ValueError(f"token_map.{name} must have x's {S} rows (one per source row), "
                             f"got {tuple(t.shape)}")  # fmt: skip
    if token_map.rows.shape != token_map.experts.shape:
        raise ValueError(f"token_map.rows and .experts must have one shape, got "
                         f"{tuple(token_map.rows.shape)} and {tuple(token_map.experts.shape)}")
    if probs is not None:
        check_tensor("probs", probs, dtypes=FLOAT_DTYPES, device=x.device)
        if tuple(probs.shape) not in ((S, weight1.shape[0]), (S,)):
            raise ValueError(f"with gather_index, probs must be [{S}, {weight1.shape[0]}] (each "
                             f"source row's probability per expert) or [{S}] (one per source "
                             f"row), got {tuple(probs.shape)}")  # fmt: skip


# --------------------------------------------------------------------------------------------
# FP8 operands (fp8_recipe=, Fp8Tensor inputs)
# --------------------------------------------------------------------------------------------


def fp8_data(t):
    """The data tensor of an :class:`~mtp.ops.quantize.Fp8Tensor` (a NamedTuple with ``data``
    and ``scales``), else ``t`` itself (a tensor's ``.data`` is another tensor)."""
    return t.data if isinstance(t, tuple) and hasattr(t, "scales") else t


def _fp8_part(name: str, t, ndim: int) -> None:
    """An :class:`~mtp.ops.quantize.Fp8Tensor` operand (anything with ``data`` and ``scales``)."""
    check_tensor(f"{name}.data", t.data, ndim=ndim, dtypes=(torch.float8_e4m3fn,))
    want = torch.float8_e8m0fnu if t.recipe == "mxfp8" else torch.float32
    check_tensor(f"{name}.scales", t.scales, ndim=ndim, dtypes=(want,), device=t.data.device)


def check_fp8_arguments(x, w, tokens_per_expert, trans_b, out, recipe, options) -> None:
    """The free checks of an FP8 call: ``x`` a float ``[M, K]`` or a row-wise
    :class:`~mtp.ops.quantize.Fp8Tensor`, ``w`` a float ``[E, K, N]`` (``[E, N, K]``) or an
    ``Fp8Tensor`` quantised along K, one recipe, no epilogue ``options`` (names of the options
    given)."""
    if options:
        raise ValueError(f"grouped_gemm: {', '.join(options)} cannot be combined with FP8 "
                         "operands yet; run the epilogue after the GEMM")  # fmt: skip
    xt, wt = fp8_data(x), fp8_data(w)
    if xt is not x:
        _fp8_part("x", x, 2)
        if x.layout != "rowwise" or x.recipe != recipe:
            raise ValueError(f"x must be quantised row-wise (blocks along K) with the "
                             f"{recipe!r} recipe, got {x.layout!r} / {x.recipe!r}")  # fmt: skip
    if wt is not w:
        _fp8_part("w", w, 3)
        along_k = ("block", "rowwise") if trans_b else ("block", "colwise")
        if w.layout not in along_k or w.recipe != recipe:
            raise ValueError(f"w must be quantised along K ({' or '.join(along_k)} for "
                             f"trans_b={trans_b}) with the {recipe!r} recipe, got "
                             f"{w.layout!r} / {w.recipe!r}")  # fmt: skip
    floats = FLOAT_DTYPES + (torch.float8_e4m3fn,)
    check_tensor("x", xt, ndim=2, dtypes=floats)
    check_tensor("w", wt, ndim=3, dtypes=floats, device=xt.device)
    _check_shapes(xt, wt, tokens_per_expert, trans_b)
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=FLOAT_DTYPES, device=xt.device)
        shape = (xt.shape[0], n_of(wt, trans_b))
        if tuple(out.shape) != shape:
            raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
        check_out_memory(out, xt, wt, tokens_per_expert)


def check_fp8_device(recipe: str, device: torch.device, arch: int) -> None:
    """``"mxfp8"`` needs the block-scaled MMA of sm_100 (Blackwell) on a GPU."""
    if recipe == "mxfp8" and device.type == "cuda" and arch < 10:
        raise ValueError(
            f"fp8_recipe='mxfp8' needs an sm_100 (Blackwell) GPU or newer for its block-scaled "
            f"MMA; this {device} is sm_{arch}x. Use fp8_recipe='blockwise' (Hopper's recipe)"
        )
