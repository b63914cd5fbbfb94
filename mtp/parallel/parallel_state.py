"""Process groups for tensor, pipeline, data, context and expert parallelism.

:func:`initialize_model_parallel` builds the dense and expert rank generators
(:func:`mtp.parallel.make_rank_generators`) and creates one ``torch.distributed`` group per rank
set of each kind below. Every rank creates every group, in the same order (a torch.distributed
requirement), and keeps the one it belongs to. Getter names follow Megatron-Core.

======== ============ =====================================================================
kind     generator    getters
======== ============ =====================================================================
tp       dense tp     ``get_tensor_model_parallel_{group,rank,world_size}``
pp       dense pp     ``get_pipeline_model_parallel_{group,rank,world_size}``
dp       dense dp     ``get_data_parallel_{group,rank,world_size}()``
cp       dense cp     ``get_context_parallel_{group,rank,world_size}``
dp-cp    dense dp-cp  ``get_data_parallel_*(with_context_parallel=True)``
tp-pp    dense tp-pp  ``get_model_parallel_{group,rank,world_size}``
tp-cp    dense tp-cp  ``get_tensor_and_context_parallel_{group,rank,world_size}``
tp-dp    dense tp-dp  ``get_tensor_and_data_parallel_*()``
tp-dp-cp dense        ``get_tensor_and_data_parallel_*(with_context_parallel=True)``
ep       expert ep    ``get_expert_model_parallel_{group,rank,world_size}``
etp      expert tp    ``get_expert_tensor_parallel_{group,rank,world_size}``
edp      expert dp    ``get_expert_data_parallel_{group,rank,world_size}``
tp-ep    expert tp-ep ``get_expert_tensor_and_model_parallel_{group,rank,world_size}``
tp-ep-pp expert       ``get_expert_tensor_model_pipeline_parallel_{group,rank,world_size}``
======== ============ =====================================================================
"""

from __future__ import annotations

import dataclasses
import datetime
import logging

import torch.distributed as dist

from .aborted import any_aborted, forget_aborted, is_aborted
from .agree import agree, argument_field
from .errors import CollectiveAbortedError
from .rank_generator import (
    DEFAULT_ORDER,
    GROUP_DESCRIPTIONS as _DESCRIPTIONS,
    GROUP_KINDS,
    ParallelSizes,
    RankGenerator,
    make_rank_generators,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "GROUP_KINDS",
    "ParallelStateError",
    "initialize_model_parallel",
    "destroy_model_parallel",
    "model_parallel_is_initialized",
    "get_parallel_sizes",
    "get_rank_generators",
    "get_process_group_ranks",
    "get_group_rank",
    "get_group_world_size",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "get_process_group",
    "get_context_parallel_group", "get_context_parallel_rank", "get_context_parallel_world_size",
    "get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
    "get_expert_data_parallel_group", "get_expert_data_parallel_rank",
    "get_expert_data_parallel_world_size",
    "get_expert_model_parallel_group", "get_expert_model_parallel_rank",
    "get_expert_model_parallel_world_size",
    "get_expert_tensor_and_model_parallel_group", "get_expert_tensor_and_model_parallel_rank",
    "get_expert_tensor_and_model_parallel_world_size",
    "get_expert_tensor_model_pipeline_parallel_group",
    "get_expert_tensor_model_pipeline_parallel_rank",
    "get_expert_tensor_model_pipeline_parallel_world_size",
    "get_expert_tensor_parallel_group", "get_expert_tensor_parallel_rank",
    "get_expert_tensor_parallel_world_size",
    "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
    "get_pipeline_model_parallel_group", "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_tensor_and_context_parallel_group", "get_tensor_and_context_parallel_rank",
    "get_tensor_and_context_parallel_world_size",
    "get_tensor_and_data_parallel_group", "get_tensor_and_data_parallel_rank",
    "get_tensor_and_data_parallel_world_size",
    "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_src_rank",
]  # fmt: skip

logger = logging.getLogger("mtp")

#: Collective timeout of the groups :func:`initialize_model_parallel` creates: a rank whose peer
#: never joins a collective fails after this long instead of torch.distributed's default 30 min.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)

class ParallelStateError(RuntimeError):
    """Model parallel state used before :func:`initialize_model_parallel` (or twice)."""


@dataclasses.dataclass
class _Group:
    group: dist.ProcessGroup
    ranks: list[int]
    rank: int


@dataclasses.dataclass
class _State:
    sizes: ParallelSizes
    dense: RankGenerator
    expert: RankGenerator
    groups: dict[str, _Group]


_STATE: _State | None = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    order: str = DEFAULT_ORDER,
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
) -> None:
    """Create every parallel group (see the module table) for the current process group.

    Args:
        tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size:
            dense-part sizes; the data parallel size is what is left of the world size.
        expert_model_parallel_size: experts are split over this many ranks.
        expert_tensor_parallel_size: tensor parallel size inside experts (default: tp).
        order: rank order, fastest dimension first (default ``tp-cp-ep-dp-pp``).
        backend: backend of the new groups (default: that of the default process group).
        timeout: collective timeout of every new group (a ``datetime.timedelta`` or seconds;
            default :data:`DEFAULT_TIMEOUT`, 10 minutes): a collective whose peer never joins
            fails after this long instead of hanging.

    Every rank must call it with the same arguments: they are all-gathered once over the default
    group first, so that ranks that disagree all fail with the same error instead of creating
    mismatched groups (which hangs).

    Raises:
        ParallelStateError: torch.distributed is not initialized, or groups already exist.
        RankMismatchError: the ranks passed different arguments (on every rank; a
            ``RuntimeError``).
        ParallelConfigError: the sizes do not fit the world size (a ``ValueError``).
        TypeError: ``timeout`` is not a timedelta or a positive number of seconds.
    """
    global _STATE
    if not dist.is_available() or not dist.is_initialized():
        raise ParallelStateError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group() "
            "(or run under torchrun) before initialize_model_parallel()"
        )
    if _STATE is not None:
        raise ParallelStateError(
            "model parallel groups are already initialized; call destroy_model_parallel() first"
        )
    _agree_on_arguments(
        {
            "tensor_model_parallel_size": tensor_model_parallel_size,
            "pipeline_model_parallel_size": pipeline_model_parallel_size,
            "context_parallel_size": context_parallel_size,
            "expert_model_parallel_size": expert_model_parallel_size,
            "expert_tensor_parallel_size": expert_tensor_parallel_size,
            "order": order,
            "backend": backend,
            "timeout": (
                timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
            ),
        }
    )
    timeout = _check_timeout(timeout)
    world_size, me = dist.get_world_size(), dist.get_rank()
    dense, expert = make_rank_generators(
        world_size,
        tp=tensor_model_parallel_size,
        pp=pipeline_model_parallel_size,
        cp=context_parallel_size,
        ep=expert_model_parallel_size,
        etp=expert_tensor_parallel_size,
        order=order,
    )
    generators = {"dense": dense, "expert": expert}
    kwargs = {"backend": backend, "timeout": timeout}
    groups: dict[str, _Group] = {}
    for kind, (which, token) in GROUP_KINDS.items():
        for ranks in generators[which].get_ranks(token):
            group = dist.new_group(ranks, **kwargs)
            if me in ranks:
                groups[kind] = _Group(group, ranks, ranks.index(me))
    sizes = ParallelSizes(
        world_size,
        tp=dense.tp,
        pp=dense.pp,
        cp=dense.cp,
        dp=dense.dp,
        ep=expert.ep,
        etp=expert.tp,
        edp=expert.dp,
    )
    _STATE = _State(sizes, dense, expert, groups)
    if me == 0:
        logger.info("initialized model parallel groups: %s", sizes)


def _check_timeout(timeout) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = datetime.timedelta(seconds=timeout)
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(
            f"timeout must be a datetime.timedelta or a number of seconds, got "
            f"{type(timeout).__name__} {timeout!r}"
        )
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return timeout


def _agree_on_arguments(arguments: dict[str, object]) -> None:
    """All-gather the arguments once; the same RankMismatchError on every rank if they differ."""
    fields = {name: argument_field(name, value) for name, value in arguments.items()}
    agree(None, "initialize_model_parallel", **fields)


def destroy_model_parallel() -> None:
    """Forget (and destroy) the groups made by :func:`initialize_model_parallel`."""
    global _STATE
    state, _STATE = _STATE, None
    if state is None or not dist.is_initialized():
        return
    for entry in state.groups.values():
        try:
            dist.destroy_process_group(entry.group)
        except (RuntimeError, ValueError):  # already gone with the default group, or aborted
            pass
        forget_aborted(entry.group)


def model_parallel_is_initialized() -> bool:
    """True between :func:`initialize_model_parallel` and :func:`destroy_model_parallel`."""
    return _STATE is not None


def _state(kind: str) -> _State:
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown group kind {kind!r}; known: {list(GROUP_KINDS)}")
    if _STATE is None:
        raise ParallelStateError(
            f"the {_DESCRIPTIONS[kind]} group ({kind!r}) is not initialized: call "
            "mtp.parallel.initialize_model_parallel(...) after "
            "torch.distributed.init_process_group()"
        )
    return _STATE


def get_parallel_sizes() -> ParallelSizes:
    """The sizes the groups were built with (``tp, pp, cp, dp, ep, etp, edp``)."""
    return _state("tp").sizes


def get_rank_generators() -> tuple[RankGenerator, RankGenerator]:
    """The ``(dense, expert)`` rank generators the groups were built from."""
    state = _state("tp")
    return state.dense, state.expert


def get_process_group(kind: str) -> dist.ProcessGroup:
    """This rank's group of ``kind`` (``"tp"``, ``"dp-cp"``, ``"ep"``... see the module table).

    Raises ``CollectiveAbortedError`` when an error in a collective region aborted it.
    """
    group = _state(kind).groups[kind].group
    if any_aborted() and is_aborted(group):
        raise CollectiveAbortedError(
            f"the {_DESCRIPTIONS[kind]} group ({kind!r}) was aborted after an error on this "
            "rank; call mtp.parallel.destroy_model_parallel() and initialize_model_parallel() "
            "again on every rank (or restart)"
        )
    return group


def get_process_group_ranks(kind: str) -> list[int]:
    """Global ranks in this rank's group of ``kind``."""
    return list(_state(kind).groups[kind].ranks)


def get_group_rank(kind: str) -> int:
    """This rank's index in its group of ``kind``."""
    return _state(kind).groups[kind].rank


def get_group_world_size(kind: str) -> int:
    """Number of ranks in this rank's group of ``kind``."""
    return len(_state(kind).groups[kind].ranks)


# Megatron-Core getters (written out: one group kind each, see the module table) ----------

def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    """This rank's tensor model parallel group (``'tp'``)."""
    return get_process_group('tp')


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor model parallel group (``'tp'``)."""
    return get_group_rank('tp')


def get_tensor_model_parallel_world_size() -> int:
    """Size of the tensor model parallel group (``'tp'``)."""
    return get_group_world_size('tp')


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    """This rank's pipeline model parallel group (``'pp'``)."""
    return get_process_group('pp')


def get_pipeline_model_parallel_rank() -> int:
    """This rank's index in its pipeline model parallel group (``'pp'``)."""
    return get_group_rank('pp')


def get_pipeline_model_parallel_world_size() -> int:
    """Size of the pipeline model parallel group (``'pp'``)."""
    return get_group_world_size('pp')


def get_context_parallel_group() -> dist.ProcessGroup:
    """This rank's context parallel group (``'cp'``)."""
    return get_process_group('cp')


def get_context_parallel_rank() -> int:
    """This rank's index in its context parallel group (``'cp'``)."""
    return get_group_rank('cp')


def get_context_parallel_world_size() -> int:
    """Size of the context parallel group (``'cp'``)."""
    return get_group_world_size('cp')


def get_model_parallel_group() -> dist.ProcessGroup:
    """This rank's model parallel group (``'tp-pp'``)."""
    return get_process_group('tp-pp')


def get_model_parallel_rank() -> int:
    """This rank's index in its model parallel group (``'tp-pp'``)."""
    return get_group_rank('tp-pp')


def get_model_parallel_world_size() -> int:
    """Size of the model parallel group (``'tp-pp'``)."""
    return get_group_world_size('tp-pp')


def get_tensor_and_context_parallel_group() -> dist.ProcessGroup:
    """This rank's tensor and context parallel group (``'tp-cp'``)."""
    return get_process_group('tp-cp')


def get_tensor_and_context_parallel_rank() -> int:
    """This rank's index in its tensor and context parallel group (``'tp-cp'``)."""
    return get_group_rank('tp-cp')


def get_tensor_and_context_parallel_world_size() -> int:
    """Size of the tensor and context parallel group (``'tp-cp'``)."""
    return get_group_world_size('tp-cp')


def get_expert_model_parallel_group() -> dist.ProcessGroup:
    """This rank's expert model parallel group (``'ep'``)."""
    return get_process_group('ep')


def get_expert_model_parallel_rank() -> int:
    """This rank's index in its expert model parallel group (``'ep'``)."""
    return get_group_rank('ep')


def get_expert_model_parallel_world_size() -> int:
    """Size of the expert model parallel group (``'ep'``)."""
    return get_group_world_size('ep')


def get_expert_tensor_parallel_group() -> dist.ProcessGroup:
    """This rank's expert tensor parallel group (``'etp'``)."""
    return get_process_group('etp')


def get_expert_tensor_parallel_rank() -> int:
    """This rank's index in its expert tensor parallel group (``'etp'``)."""
    return get_group_rank('etp')


def get_expert_tensor_parallel_world_size() -> int:
    """Size of the expert tensor parallel group (``'etp'``)."""
    return get_group_world_size('etp')


def get_expert_data_parallel_group() -> dist.ProcessGroup:
    """This rank's expert data parallel group (``'edp'``)."""
    return get_process_group('edp')


def get_expert_data_parallel_rank() -> int:
    """This rank's index in its expert data parallel group (``'edp'``)."""
    return get_group_rank('edp')


def get_expert_data_parallel_world_size() -> int:
    """Size of the expert data parallel group (``'edp'``)."""
    return get_group_world_size('edp')


def get_expert_tensor_and_model_parallel_group() -> dist.ProcessGroup:
    """This rank's expert tensor and model parallel group (``'tp-ep'``)."""
    return get_process_group('tp-ep')


def get_expert_tensor_and_model_parallel_rank() -> int:
    """This rank's index in its expert tensor and model parallel group (``'tp-ep'``)."""
    return get_group_rank('tp-ep')


def get_expert_tensor_and_model_parallel_world_size() -> int:
    """Size of the expert tensor and model parallel group (``'tp-ep'``)."""
    return get_group_world_size('tp-ep')


def get_expert_tensor_model_pipeline_parallel_group() -> dist.ProcessGroup:
    """This rank's expert tensor, model and pipeline parallel group (``'tp-ep-pp'``)."""
    return get_process_group('tp-ep-pp')


def get_expert_tensor_model_pipeline_parallel_rank() -> int:
    """This rank's index in its expert tensor, model and pipeline parallel group."""
    return get_group_rank('tp-ep-pp')


def get_expert_tensor_model_pipeline_parallel_world_size() -> int:
    """Size of the expert tensor, model and pipeline parallel group (``'tp-ep-pp'``)."""
    return get_group_world_size('tp-ep-pp')


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first rank in this rank's tensor parallel group."""
    return get_process_group_ranks("tp")[0]


def is_pipeline_first_stage() -> bool:
    """True on the first pipeline stage."""
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    """True on the last pipeline stage."""
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_data_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """This rank's data parallel group (``dp``, or ``dp-cp`` with context parallel)."""
    return get_process_group("dp-cp" if with_context_parallel else "dp")


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """This rank's index in its data parallel group (``dp`` or ``dp-cp``)."""
    return get_group_rank("dp-cp" if with_context_parallel else "dp")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Size of the data parallel group (``dp`` or ``dp-cp``)."""
    return get_group_world_size("dp-cp" if with_context_parallel else "dp")


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """This rank's ``tp-dp`` group (``tp-dp-cp`` with context parallel)."""
    return get_process_group("tp-dp-cp" if with_context_parallel else "tp-dp")


def get_tensor_and_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """This rank's index in its ``tp-dp`` (or ``tp-dp-cp``) group."""
    return get_group_rank("tp-dp-cp" if with_context_parallel else "tp-dp")


def get_tensor_and_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Size of the ``tp-dp`` (or ``tp-dp-cp``) group."""
    return get_group_world_size("tp-dp-cp" if with_context_parallel else "tp-dp")
