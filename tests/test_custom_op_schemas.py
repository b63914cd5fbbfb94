"""Every ``mtp::`` custom op that writes into an argument keeps that argument where any torch
version finds it.

torch 2.11's in-place kernel of a ``torch.library.custom_op`` (its ADInplaceOrView
registration) bumps a mutated argument's version by its *position* in the argument list it is
handed, and the dispatcher drops trailing arguments equal to their defaults before that: a
mutated argument after a defaulted one is out of range whenever the call leaves the defaults
alone. On the first H200 run of the one grouped GEMM entry point that was ``h`` (index 7, after
``bias=None``) in ``mtp::grouped_gemm_out``: ``IndexError: tuple index out of range`` on every
forward. torch 2.13 (here) fills the defaults first, so only the schema rule below shows it on
CPU.
"""

from __future__ import annotations

import torch

import mtp.ops  # noqa: F401 - registers the ops
import mtp.ops.grouped_gemm.cutlass  # noqa: F401 - its ops register even without the CUDA module


def _mtp_schemas():
    names = sorted({n for n in torch._C._dispatch_get_all_op_names() if n.startswith("mtp::")})
    out = []
    for name in names:
        packet = getattr(torch.ops.mtp, name.split("::", 1)[1])
        for overload in packet.overloads():
            out.append(getattr(packet, overload)._schema)
    return out


def test_the_ops_are_found():
    names = {s.name for s in _mtp_schemas()}
    for expected in ("mtp::grouped_gemm_out", "mtp::grouped_gemm_wgrad",
                     "mtp::vocab_parallel_cross_entropy_"):  # fmt: skip
        assert expected in names, sorted(names)


def test_no_mutated_argument_follows_a_defaulted_one():
    bad = []
    for schema in _mtp_schemas():
        args = schema.arguments
        first_default = next((i for i, a in enumerate(args) if a.has_default_value()), len(args))
        for i, a in enumerate(args):
            if a.alias_info is not None and a.alias_info.is_write and i >= first_default:
                bad.append(f"{schema.name}: {a.name} (argument {i}) follows a defaulted argument "
                           f"({args[first_default].name})")  # fmt: skip
    assert not bad, "\n".join(bad)
