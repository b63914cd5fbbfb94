"""The routing metadata of one counts tensor, derived on the device once and shared by every
grouped GEMM launch of an op call (host side only).

What the kernels derive from ``counts`` (the experts' first rows and rows, the tile -> expert
maps of the TMA kernels, the status word of the counts' data check) depends on nothing else but
``M`` and, for a map, its row-tile height. A :class:`Routing` holds it for one call of
``grouped_gemm`` or ``grouped_mlp``: the first launch that needs it runs
:func:`.tiles.tile_map_kernel` (head and the map of that launch's tiles in one buffer, which the
kernels take whole: no views); later
launches of the same call, forward and backward, reuse it; a map for another tile height costs
one more launch. Nothing is read on the host (graph-safe), and a new call builds a new
:class:`Routing`, so counts that change between calls are always seen.

With ``check`` (a message), the status word is asserted on the device
(``torch._assert_async``) right after the head is written, or by :meth:`Routing.validate` when
no launch needed the head.
"""

from __future__ import annotations

import torch

from mtp.kernels._common import next_power_of_2
from mtp.kernels._launch import Launch, Plans
from mtp.kernels.grouped_gemm_details.tiles import head_size, tile_map_kernel, tile_map_size

__all__ = ["Routing"]

_PLANS = Plans()


class Routing:
    """Routing metadata of ``counts`` (``[E]`` int32/int64 on the kernels' device) for ``M``
    rows. :meth:`tile_map` and :meth:`rows` launch what is missing and return int32 tensors."""

    __slots__ = ("counts", "M", "E", "check", "head", "block", "more")

    def __init__(self, counts: torch.Tensor, M: int, E: int, check: str | None = None):
        self.counts, self.M, self.E, self.check = counts, M, E, check
        self.head = None  # the first routing buffer: its head serves every launch
        self.block = -1  # the row-tile height of its map (0: the head only)
        self.more = None  # {row-tile height: routing buffer} for other heights

    def tile_map(self, block_m: int) -> torch.Tensor:
        """The routing buffer (head, then the tile map, :func:`.tiles.routing_map`) of
        ``block_m``-row tiles: what the TMA kernels' ``map_ptr`` takes."""
        if block_m == self.block:
            return self.head
        found = None if self.more is None else self.more.get(block_m)
        return found if found is not None else self._build(block_m)

    def rows(self) -> torch.Tensor:
        """``[first row of each expert (E), its rows (E), status, ...]`` int32 (a routing
        buffer: its head)."""
        return self.head if self.head is not None else self._build(0)

    def validate(self) -> None:
        """Assert the status word on the device (when ``check``), launching the head if no
        launch has needed it yet."""
        if self.check is not None and self.head is None:
            self._build(0)

    def _build(self, block_m: int) -> torch.Tensor:
        counts = self.counts
        key = (self.M, self.E, block_m, counts.dtype, counts.data_ptr() & 15, counts.device)
        plan = _PLANS.get(key)
        if plan is None:
            plan = _PLANS.add(key, _plan(counts, self.M, self.E, block_m))
        launch, size, row_tiles = plan
        buf = torch.empty(size, dtype=torch.int32, device=counts.device)
        launch(counts, buf, self.M, self.E, row_tiles)
        if self.head is None:
            self.head, self.block = buf, block_m
            if self.check is not None:
                torch._assert_async(buf[2 * self.E], self.check)
        elif self.more is None:
            self.more = {block_m: buf}
        else:
            self.more[block_m] = buf
        return buf


def _plan(counts, M: int, E: int, block_m: int) -> tuple:
    """``(launch, buffer size, row tiles)`` of the tile-map kernel."""
    row_tiles = (M + block_m - 1) // block_m + E if block_m else 0
    size = head_size(E) + (tile_map_size(M, E, block_m) if block_m else 0)
    block_e = next_power_of_2(E)
    block_t = max(2, min(32, 4096 // block_e))  # [BLOCK_T, BLOCK_E] compares without spills
    buf = torch.empty(size, dtype=torch.int32, device=counts.device)
    grid = (max(1, (row_tiles + block_t - 1) // block_t),)
    launch = Launch(tile_map_kernel, grid, (counts, buf, M, E, row_tiles),
                    dict(BLOCK_M=block_m or 16, BLOCK_E=block_e, BLOCK_T=block_t))
    return launch, size, row_tiles
