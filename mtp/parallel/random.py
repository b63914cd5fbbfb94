"""Model-parallel random number generation (Megatron-LM appendix B.2, seed 002).

Dropout *outside* a tensor-parallel region acts on replicated activations, so every rank of the
tensor-parallel group must draw the same mask: the default generator is seeded identically on
all ranks. Dropout *inside* a region acts on this rank's shard (e.g. its attention heads), so
each rank needs its own stream: :class:`RNGStatesTracker` keeps named generator states and
:meth:`RNGStatesTracker.fork` swaps one in for the duration of a ``with`` block::

    model_parallel_manual_seed(1234)          # after initialize_model_parallel()
    x = dropout(x)                            # same mask on every tp rank
    with get_cuda_rng_tracker().fork():       # "model-parallel-rng": a stream per tp rank
        probs = dropout(probs)                # a different mask on each tp rank

The tracker swaps the CPU default generator and, when CUDA is available, the current CUDA
device's default generator, so it works the same on CPU (gloo) and GPU runs.
:func:`checkpoint` recomputes a function in backward with the RNG states (default and tracked)
that its forward saw, so dropout masks repeat exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from . import parallel_state

__all__ = [
    "DATA_PARALLEL_RNG_TRACKER_NAME",
    "EXPERT_PARALLEL_RNG_TRACKER_NAME",
    "MODEL_PARALLEL_RNG_TRACKER_NAME",
    "RNGStatesTracker",
    "checkpoint",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "model_parallel_manual_seed",
]

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"

#: Offsets Megatron-Core uses, so seeds (and masks) line up with it.
_TP_SEED_OFFSET = 2718
_EXPERT_SEED_OFFSET = 1024

RNGState = dict[str, torch.Tensor]


def _capture() -> RNGState:
    """The default generators' states: ``{"cpu": ..., "cuda": ...}`` (CUDA when available)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore(state: RNGState) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _seed_defaults(seed: int) -> None:
    """Seed the CPU generator and the current CUDA device's generator."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


class RNGStatesTracker:
    """Named random streams that can be swapped in with :meth:`fork` (Megatron-Core API).

    Each stream holds the state of the CPU default generator and, when CUDA is available, of
    the current CUDA device's default generator.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every stream."""
        self.states_: dict[str, RNGState] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        """True when at least one stream was added."""
        return bool(self.states_)

    def get_states(self) -> dict[str, RNGState]:
        """A copy of the streams' states (``name -> {"cpu": ..., "cuda": ...}``)."""
        return {name: dict(state) for name, state in self.states_.items()}

    def set_states(self, states: dict[str, RNGState]) -> None:
        """Replace the streams' states (e.g. with what :meth:`get_states` returned)."""
        self.states_ = {name: dict(state) for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Add a stream ``name`` seeded with ``seed``; the default generators are untouched.

        Raises:
            ValueError: ``name`` or ``seed`` is already used by another stream.
        """
        if name in self.states_:
            raise ValueError(f"RNG stream {name!r} already exists")
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        self.seeds_.add(seed)
        saved = _capture()
        try:
            _seed_defaults(seed)
            self.states_[name] = _capture()
        finally:
            _restore(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Use stream ``name`` as the default generators inside the block, then advance it."""
        if name not in self.states_:
            raise KeyError(
                f"RNG stream {name!r} was not added: call "
                "mtp.parallel.model_parallel_manual_seed(seed) (or tracker.add(name, seed)) first"
            )
        saved = _capture()
        _restore(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _capture()
            _restore(saved)


_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (Megatron-Core's name; it tracks CPU streams as well)."""
    return _TRACKER


get_rng_tracker = get_cuda_rng_tracker


def _rank(getter: Callable[[], int], given: int | None, name: str) -> int:
    if given is not None:
        return given
    if parallel_state.model_parallel_is_initialized():
        return getter()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise parallel_state.ParallelStateError(
            f"model_parallel_manual_seed needs the {name}: call "
            "mtp.parallel.initialize_model_parallel(...) first, or pass it explicitly"
        )
    return 0  # a single process: every rank index is 0


def model_parallel_manual_seed(
    seed: int,
    *,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
) -> None:
    """Seed the default generators and the tracker's streams (Megatron-Core's seeds).

    - default generators (CPU and CUDA): ``seed``, the same on every rank that passes the same
      ``seed``; also kept as the ``"data-parallel-rng"`` stream.
    - ``"model-parallel-rng"``: ``seed + 2718 + tp_rank``, distinct per tensor-parallel rank and
      equal across data-parallel replicas.
    - ``"expert-parallel-rng"``: ``seed + 1024 + 100 * ep_rank + etp_rank``, distinct per
      expert-parallel / expert-tensor-parallel rank.

    The ranks default to this process's ranks in the groups of
    :func:`mtp.parallel.initialize_model_parallel` (0 in a single process).
    """
    tp_rank = _rank(parallel_state.get_tensor_model_parallel_rank, tp_rank, "tensor parallel rank")
    ep_rank = _rank(parallel_state.get_expert_model_parallel_rank, ep_rank, "expert parallel rank")
    etp_rank = _rank(
        parallel_state.get_expert_tensor_parallel_rank, etp_rank, "expert tensor parallel rank"
    )
    _TRACKER.reset()
    _seed_defaults(seed)
    _TRACKER.add(DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    _TRACKER.add(MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _TP_SEED_OFFSET + tp_rank)
    _TRACKER.add(
        EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + _EXPERT_SEED_OFFSET + 100 * ep_rank + etp_rank
    )


model_parallel_cuda_manual_seed = model_parallel_manual_seed


@contextlib.contextmanager
def _tracker_states(states: dict[str, RNGState]) -> Iterator[None]:
    """Run the block with the tracker holding ``states``; put the current ones back after."""
    current = _TRACKER.get_states()
    _TRACKER.set_states(states)
    try:
        yield
    finally:
        _TRACKER.set_states(current)


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Activation checkpointing that repeats dropout masks, tracked streams included.

    Runs ``function(*args, **kwargs)`` without keeping its intermediate activations; backward
    recomputes it with the default generators *and* the tracker's streams as they were when the
    forward ran, so masks drawn inside :meth:`RNGStatesTracker.fork` repeat as well. After the
    recompute the RNG states are put back, so the training run's randomness is the same as
    without checkpointing. Built on ``torch.utils.checkpoint`` (non-reentrant).
    """
    saved = _TRACKER.get_states()

    def context_fn():
        return contextlib.nullcontext(), _tracker_states(saved)

    return torch.utils.checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=context_fn,
        **kwargs,
    )
