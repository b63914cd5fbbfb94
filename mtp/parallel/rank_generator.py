"""The Megatron rank generator: which global ranks form each parallel group.

Ranks are laid out on a grid whose axes are the parallel dimensions in ``order`` (default
``tp-cp-ep-dp-pp``), the first axis varying fastest:

    global_rank = i_0 + i_1 * s_0 + i_2 * s_0 * s_1 + ...      (s_k: size of the k-th axis)

so ``tp`` is innermost (neighbouring ranks, same node: highest bandwidth) and ``pp`` outermost.
A group for a token such as ``"dp"`` or ``"tp-pp"`` is the set of ranks that differ only in the
token's axes (the *masked* axes); the other axes pick which group. Results are identical to
Megatron-Core's ``RankGenerator`` (same groups, same order), so this is a drop-in replacement.

MoE folding: attention layers use the dense generator (``tp, cp, dp, pp``) and expert layers the
expert generator (``etp, ep, edp, pp``) over the same ranks, with
``world = tp*cp*dp*pp = etp*ep*edp*pp``; :func:`make_rank_generators` builds both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = [
    "ParallelConfigError",
    "DIMENSIONS",
    "DEFAULT_ORDER",
    "GROUP_DESCRIPTIONS",
    "GROUP_KINDS",
    "MAX_WORLD_SIZE",
    "generate_masked_orthogonal_groups",
    "RankGenerator",
    "ParallelSizes",
    "derive_parallel_sizes",
    "make_rank_generators",
]

DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
#: Largest world size the generator accepts (4 Mi ranks): far past any machine, small enough
#: that every group list fits in memory and is built in well under a second per kind.
MAX_WORLD_SIZE = 1 << 22


#: kind -> (generator, token), in the order the groups are created on every rank.
GROUP_KINDS: dict[str, tuple[str, str]] = {
    "tp": ("dense", "tp"),
    "pp": ("dense", "pp"),
    "dp": ("dense", "dp"),
    "cp": ("dense", "cp"),
    "dp-cp": ("dense", "dp-cp"),
    "tp-pp": ("dense", "tp-pp"),
    "tp-cp": ("dense", "tp-cp"),
    "tp-dp": ("dense", "tp-dp"),
    "tp-dp-cp": ("dense", "tp-dp-cp"),
    "ep": ("expert", "ep"),
    "etp": ("expert", "tp"),
    "edp": ("expert", "dp"),
    "tp-ep": ("expert", "tp-ep"),
    "tp-ep-pp": ("expert", "tp-ep-pp"),
}
#: kind -> what Megatron-Core calls the group (for messages and docstrings).
GROUP_DESCRIPTIONS: dict[str, str] = {
    "tp": "tensor model parallel",
    "pp": "pipeline model parallel",
    "dp": "data parallel",
    "cp": "context parallel",
    "dp-cp": "data parallel (with context parallel)",
    "tp-pp": "model parallel",
    "tp-cp": "tensor and context parallel",
    "tp-dp": "tensor and data parallel",
    "tp-dp-cp": "tensor and data parallel (with context parallel)",
    "ep": "expert model parallel",
    "etp": "expert tensor parallel",
    "edp": "expert data parallel",
    "tp-ep": "expert tensor and model parallel",
    "tp-ep-pp": "expert tensor, model and pipeline parallel",
}


class ParallelConfigError(ValueError, RuntimeError):
    """An inconsistent parallel configuration.

    A ``ValueError``; also a ``RuntimeError`` so code written against Megatron-Core, which raises
    ``RuntimeError`` for some of these, keeps catching it.
    """


def _prefix_products(sizes: Sequence[int]) -> list[int]:
    """``[1, s0, s0*s1, ...]``: the stride of each axis, plus the total at the end."""
    out = [1]
    for s in sizes:
        out.append(out[-1] * s)
    return out


def _coordinates(index: int, sizes: Sequence[int]) -> list[int]:
    """Mixed-radix digits of ``index`` with the first digit varying fastest."""
    digits = []
    for s in sizes:
        digits.append(index % s)
        index //= s
    return digits


def generate_masked_orthogonal_groups(
    world_size: int, parallel_size: Sequence[int], mask: Sequence[bool]
) -> list[list[int]]:
    """Groups of ranks that vary only along the masked axes.

    Args:
        world_size: number of ranks; must equal the product of ``parallel_size``.
        parallel_size: size of each axis, fastest first (e.g. ``[tp, cp, ep, dp, pp]``).
        mask: ``mask[k]`` True puts axis ``k`` inside a group.

    Returns:
        ``world_size // prod(masked sizes)`` groups. Group ``g`` holds the ranks whose unmasked
        coordinates are the mixed-radix digits of ``g`` (first unmasked axis fastest); within a
        group, ranks are listed by their masked coordinates (first masked axis fastest).

    Construction (seed 001): with strides ``stride = prefix_product(parallel_size)``, a rank is
    ``sum(coord[k] * stride[k])``. Splitting the axes by the mask gives
    ``rank = inner(masked_coords, masked_strides) + inner(unmasked_coords, unmasked_strides)``;
    the unmasked part names the group, the masked part the position in it.

    Example: ``[tp, dp, pp] = [2, 2, 2]`` and mask ``[False, True, False]`` (dp groups) gives
    ``[[0, 2], [1, 3], [4, 6], [5, 7]]``.
    """
    if len(parallel_size) != len(mask):
        raise ParallelConfigError(
            f"mask has {len(mask)} entries but parallel_size has {len(parallel_size)}"
        )
    return masked_orthogonal_groups_array(world_size, parallel_size, mask).tolist()


def masked_orthogonal_groups_array(
    world_size: int, parallel_size: Sequence[int], mask: Sequence[bool]
) -> np.ndarray:
    """:func:`generate_masked_orthogonal_groups` as an int64 array ``[groups, group_size]``
    (vectorised: a reshape and a transpose of ``arange(world_size)``)."""
    if len(parallel_size) != len(mask):
        raise ParallelConfigError(
            f"mask has {len(mask)} entries but parallel_size has {len(parallel_size)}"
        )
    if any(int(s) < 1 for s in parallel_size):
        raise ParallelConfigError(f"every parallel size must be >= 1, got {list(parallel_size)}")
    strides = _prefix_products(parallel_size)
    if strides[-1] != world_size:
        raise ParallelConfigError(
            f"world_size {world_size} != product of parallel sizes {list(parallel_size)} "
            f"(= {strides[-1]})"
        )
    _check_world_size(world_size)
    # numpy axis j is parallel axis n-1-j (C order: the last numpy axis varies fastest).
    n = len(parallel_size)
    grid = np.arange(world_size, dtype=np.int64).reshape([int(s) for s in parallel_size][::-1])
    numpy_axes = list(range(n))
    outside = [j for j in numpy_axes if not mask[n - 1 - j]]
    inside = [j for j in numpy_axes if mask[n - 1 - j]]
    group_size = _prefix_products([parallel_size[n - 1 - j] for j in inside])[-1]
    return grid.transpose(outside + inside).reshape(world_size // group_size, group_size)


def _check_world_size(world_size: int) -> None:
    if world_size > MAX_WORLD_SIZE:
        raise ParallelConfigError(
            f"world_size {world_size} exceeds the supported maximum of {MAX_WORLD_SIZE} ranks "
            "(mtp.parallel.MAX_WORLD_SIZE); check the sizes"
        )


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ParallelConfigError(f"{name} must be >= 1, got {value}")
    return value


def _parse_tokens(text: str, what: str) -> list[str]:
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a string like 'tp-dp', got {type(text).__name__}")
    tokens = text.lower().split("-")
    unknown = [t for t in tokens if t not in DIMENSIONS]
    if unknown:
        raise ParallelConfigError(
            f"{what} {text!r} names unknown dimension(s) {unknown}; known: {'-'.join(DIMENSIONS)}"
        )
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise ParallelConfigError(f"{what} {text!r} names {repeated} more than once")
    return tokens


class RankGenerator:
    """Rank groups for one set of parallel sizes (drop-in for Megatron-Core's).

    Args:
        tp, ep, dp, pp, cp: sizes of tensor, expert, data, pipeline and context parallelism
            (positional order as in Megatron-Core). At most one of ``ep`` and ``cp`` may exceed
            1: the dense generator carries ``cp`` and the expert generator ``ep``.
        order: the axes from fastest to slowest, joined by ``-``. Every dimension of size > 1
            must appear; dimensions of size 1 that are left out are appended at the end.
        rank_offset: added to every rank (for a generator covering ranks
            ``[offset, offset + world_size)``).

    Attributes:
        world_size: ``tp * cp * ep * dp * pp``.
        order: the full order including appended size-1 dimensions.
        ordered_size: the sizes in that order.
    """

    def __init__(
        self,
        tp: int,
        ep: int,
        dp: int,
        pp: int,
        cp: int,
        order: str = DEFAULT_ORDER,
        rank_offset: int = 0,
    ) -> None:
        # Key order as in Megatron-Core: size-1 dimensions missing from ``order`` are appended
        # in this order, so ``self.order`` is the same string Megatron-Core would hold.
        sizes = {
            "tp": _check_size("tp", tp),
            "pp": _check_size("pp", pp),
            "dp": _check_size("dp", dp),
            "ep": _check_size("ep", ep),
            "cp": _check_size("cp", cp),
        }
        if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 0:
            raise ParallelConfigError(f"rank_offset must be an int >= 0, got {rank_offset!r}")
        if ep > 1 and cp > 1:
            raise ParallelConfigError(
                f"ep={ep} and cp={cp} cannot both exceed 1 in one generator: cp belongs to the "
                "dense generator and ep to the expert generator (MoE folding); build both with "
                "make_rank_generators(world_size, tp=..., cp=..., ep=..., ...)"
            )
        tokens = _parse_tokens(order, "order")
        missing = [t for t in DIMENSIONS if t not in tokens and sizes[t] > 1]
        if missing:
            sized = ", ".join(f"{t}={sizes[t]}" for t in missing)
            raise ParallelConfigError(
                f"order {order!r} lacks {missing} although {sized}; add them to the order, e.g. "
                f"{DEFAULT_ORDER!r}"
            )
        tokens += [t for t in sizes if t not in tokens]
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * ep * dp * pp * cp
        _check_world_size(self.world_size)
        self.name_to_size = sizes
        self.order = "-".join(tokens)
        self.ordered_size = [sizes[t] for t in tokens]

    def get_mask(self, order: str, token: str) -> list[bool]:
        """Which axes of ``order`` the ``token`` (``"tp-dp"``...) selects."""
        axes = order.split("-")
        chosen = _parse_tokens(token, "token")
        return [a in chosen for a in axes]

    def get_ranks(self, token: str) -> list[list[int]]:
        """All groups for ``token`` (one or more dimensions joined by ``-``, any order).

        Returns ``world_size // group_size`` lists of global ranks (plus ``rank_offset``).
        """
        return self.get_ranks_array(token).tolist()

    def get_ranks_array(self, token: str) -> np.ndarray:
        """:meth:`get_ranks` as an int64 array ``[groups, group_size]`` (no Python lists)."""
        mask = self.get_mask(self.order, token)
        groups = masked_orthogonal_groups_array(self.world_size, self.ordered_size, mask)
        return groups + self.rank_offset if self.rank_offset else groups

    def coordinates(self, rank: int) -> dict[str, int]:
        """The position of global ``rank`` along each dimension, e.g. ``{"tp": 1, "dp": 0, ...}``."""
        local = rank - self.rank_offset
        if not 0 <= local < self.world_size:
            raise ParallelConfigError(
                f"rank {rank} is outside [{self.rank_offset}, {self.rank_offset + self.world_size})"
            )
        return dict(zip(self.order.split("-"), _coordinates(local, self.ordered_size)))

    def __repr__(self) -> str:
        sizes = " ".join(f"{t}={self.name_to_size[t]}" for t in self.order.split("-"))
        return f"RankGenerator({sizes}, order={self.order!r}, rank_offset={self.rank_offset})"


@dataclasses.dataclass(frozen=True)
class ParallelSizes:
    """Dense and expert sizes derived from one configuration (MoE folding).

    ``world = tp*cp*dp*pp = etp*ep*edp*pp``.
    """

    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int


def derive_parallel_sizes(
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    order: str = DEFAULT_ORDER,
) -> ParallelSizes:
    """Derive ``dp`` and ``edp`` from the world size and check the configuration.

    Args:
        world_size: total number of ranks.
        tp, pp, cp: tensor, pipeline and context parallel sizes (dense part).
        ep: expert parallel size.
        etp: expert tensor parallel size (default: ``tp``).
        order: rank order; when it does not end with ``pp`` and ``pp > 1``, attention and expert
            layers must have the same data parallel size (as in Megatron-Core).
    """
    world_size = _check_size("world_size", world_size)
    _check_world_size(world_size)
    tp, pp, cp, ep = (_check_size(n, v) for n, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)))
    etp = tp if etp is None else _check_size("etp", etp)
    dense = tp * cp * pp
    if world_size % dense:
        raise ParallelConfigError(
            f"world_size {world_size} is not divisible by tp*cp*pp = {tp}*{cp}*{pp} = {dense}; "
            f"choose sizes whose product divides {world_size}"
        )
    expert = etp * ep * pp
    if world_size % expert:
        raise ParallelConfigError(
            f"world_size {world_size} is not divisible by etp*ep*pp = {etp}*{ep}*{pp} = {expert}; "
            f"choose etp and ep so that their product with pp divides {world_size}"
        )
    dp, edp = world_size // dense, world_size // expert
    _parse_tokens(order, "order")
    if pp > 1 and not order.lower().endswith("pp") and dp != edp:
        raise ParallelConfigError(
            f"with order {order!r} (pp not last) and pp={pp}, attention dp ({dp}) and expert dp "
            f"({edp}) must be equal; put pp last or make tp*cp equal etp*ep"
        )
    return ParallelSizes(world_size, tp, pp, cp, dp, ep, etp, edp)


def make_rank_generators(
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    order: str = DEFAULT_ORDER,
) -> tuple[RankGenerator, RankGenerator]:
    """Build the dense (``tp, cp, dp, pp``) and expert (``etp, ep, edp, pp``) generators.

    Both use ``order``; the dense one has ``ep=1`` and the expert one ``cp=1``, as in
    Megatron-Core's ``initialize_model_parallel``. Their pipeline groups must agree.
    """
    s = derive_parallel_sizes(world_size, tp, pp, cp, ep, etp, order)
    dense = RankGenerator(tp=s.tp, ep=1, dp=s.dp, pp=s.pp, cp=s.cp, order=order)
    expert = RankGenerator(tp=s.etp, ep=s.ep, dp=s.edp, pp=s.pp, cp=1, order=order)
    if not np.array_equal(dense.get_ranks_array("pp"), expert.get_ranks_array("pp")):
        raise ParallelConfigError(
            f"pipeline groups differ between the dense ({s.tp=}, {s.cp=}, {s.dp=}) and expert "
            f"({s.etp=}, {s.ep=}, {s.edp=}) layouts under order {order!r}; put pp last"
        )
    return dense, expert
