"""Print the parallel groups of a layout: ``python -m mtp.parallel --world-size 16 --tp 4 --pp 2``.

Shows every group kind of the dense (``tp, cp, dp, pp``) and expert (``etp, ep, edp, pp``)
generators as a table and the ranks as a grid; ``--json`` prints
``{"dense": {"tp": [[...]], ...}, "expert": {"ep": [[...]], ...}}`` instead. With
``--gpus-per-node`` it warns (on stderr) about tp, cp, ep or etp groups that span nodes, since
those carry the most traffic and belong inside a node (seed 001's bandwidth priority).
Above ``--full-limit`` ranks (default 1024) the text report shows the first and last groups of
each kind and no grid (``--full-limit 0`` prints everything); a world of 10^6 ranks answers in
about a second. Bad arguments exit with code 2 and a one-line error.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

import numpy as np

from .rank_generator import (
    DEFAULT_ORDER,
    GROUP_KINDS,
    ParallelConfigError,
    RankGenerator,
    make_rank_generators,
)

# Group kinds that should stay inside a node, most bandwidth-hungry first.
_INTRA_NODE_KINDS = ("tp", "cp", "etp", "ep")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m mtp.parallel",
        description="Show Megatron-style parallel groups for a world size and parallel sizes.",
    )
    p.add_argument("--world-size", "--world_size", type=int, required=True, dest="world_size")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--cp", type=int, default=1, help="context parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size")
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default tp)")
    p.add_argument("--order", default=DEFAULT_ORDER, help=f"rank order (default {DEFAULT_ORDER})")
    p.add_argument("--gpus-per-node", type=int, default=None, help="warn about groups that span nodes")
    p.add_argument("--json", action="store_true", help="print the groups as JSON")
    p.add_argument("--full-limit", type=int, default=1024,
                   help="above this many ranks, summarise the groups and skip the grid "
                   "(0: always print everything; default 1024)")  # fmt: skip
    return p


def layout_arrays(dense: RankGenerator, expert: RankGenerator) -> dict[str, dict[str, np.ndarray]]:
    """``{"dense": {kind: groups}, "expert": {kind: groups}}`` as int64 arrays
    ``[groups, group_size]`` for every kind in GROUP_KINDS."""
    gens = {"dense": dense, "expert": expert}
    out: dict[str, dict[str, np.ndarray]] = {"dense": {}, "expert": {}}
    for kind, (which, token) in GROUP_KINDS.items():
        out[which][kind] = gens[which].get_ranks_array(token)
    out["expert"]["pp"] = expert.get_ranks_array("pp")
    return out


def layout_groups(dense: RankGenerator, expert: RankGenerator) -> dict[str, dict[str, list]]:
    """:func:`layout_arrays` as lists of lists (what ``--json`` prints)."""
    arrays = layout_arrays(dense, expert)
    return {which: {k: a.tolist() for k, a in kinds.items()} for which, kinds in arrays.items()}


_SHOWN = 3  # groups shown at each end of a summarised kind


def _format_groups(kind: str, groups, width: int = 100, summary: bool = False) -> str:
    head = f"  {kind:<9}{len(groups):>4} x {len(groups[0]):<4}"

    def text(g) -> str:
        if summary and len(g) > 2 * _SHOWN:
            g = [*g[:_SHOWN].tolist(), "...", *g[-1:].tolist()]
        return "[" + ",".join(map(str, g)) + "]"

    if summary and len(groups) > 2 * _SHOWN:
        body = " ".join([*(text(g) for g in groups[:_SHOWN]), "...", text(groups[-1])])
    else:
        body = " ".join(text(g) for g in groups)
    lines = textwrap.wrap(body, width=width - len(head) - 1) or [""]
    pad = " " * (len(head) + 1)
    return "\n".join([f"{head} {lines[0]}"] + [pad + line for line in lines[1:]])


def _grid(gen: RankGenerator, row: str, cols: tuple[str, str], labels: dict[str, str]) -> str:
    """Ranks drawn per pipeline stage: one row per ``row`` index, columns over ``cols``."""
    where = {}
    for rank in range(gen.world_size):
        c = gen.coordinates(rank)
        where[(c["pp"], c[row], c[cols[0]], c[cols[1]])] = rank
    n_outer, n_inner = gen.name_to_size[cols[0]], gen.name_to_size[cols[1]]
    width = max(4, len(str(gen.world_size - 1)) + 1)
    header_cells = [
        (f"{labels[cols[0]]}{o}." if n_outer > 1 else "") + f"{labels[cols[1]]}{i}"
        for o in range(n_outer)
        for i in range(n_inner)
    ]
    width = max(width, max(len(h) for h in header_cells) + 1)
    lines = []
    for stage in range(gen.pp):
        lines.append(f"  pp {stage}".ljust(12) + "".join(h.rjust(width) for h in header_cells))
        for r in range(gen.name_to_size[row]):
            cells = [
                str(where[(stage, r, o, i)]).rjust(width)
                for o in range(n_outer)
                for i in range(n_inner)
            ]
            lines.append(f"    {labels[row]} {r}".ljust(12) + "".join(cells))
    return "\n".join(lines)


def _report(dense: RankGenerator, expert: RankGenerator, groups: dict, summary: bool) -> str:
    out = [
        f"Dense layout, order {dense.order}: world {dense.world_size} = "
        f"tp {dense.tp} x cp {dense.cp} x dp {dense.dp} x pp {dense.pp}",
        "  kind     groups x size  ranks",
    ]
    out += [_format_groups(k, g, summary=summary) for k, g in groups["dense"].items()]
    out.append(
        f"\nExpert layout, order {expert.order}: world {expert.world_size} = "
        f"etp {expert.tp} x ep {expert.ep} x edp {expert.dp} x pp {expert.pp}"
    )
    out.append("  kind     groups x size  ranks")
    out += [_format_groups(k, g, summary=summary) for k, g in groups["expert"].items()]
    if summary:
        out.append(
            f"\n(world of {dense.world_size} ranks: groups summarised and no rank grid; "
            "--full-limit 0 prints everything, --json every group)"
        )
        return "\n".join(out)
    out.append("\nDense rank grid: rows dp, columns cp.tp, one block per pipeline stage")
    out.append(_grid(dense, "dp", ("cp", "tp"), {"dp": "dp", "cp": "cp", "tp": "tp"}))
    out.append("\nExpert rank grid: rows edp, columns ep.etp, one block per pipeline stage")
    out.append(_grid(expert, "dp", ("ep", "tp"), {"dp": "edp", "ep": "ep", "tp": "etp"}))
    return "\n".join(out)


def node_span_warnings(groups: dict, gpus_per_node: int) -> list[str]:
    """One warning per intra-node group kind whose groups span more than one node."""
    warnings = []
    flat = {**groups["dense"], **groups["expert"]}
    for kind in _INTRA_NODE_KINDS:
        node = np.asarray(flat[kind]) // gpus_per_node
        spanning = np.flatnonzero(node.min(axis=1) != node.max(axis=1))
        if spanning.size:
            g = np.asarray(flat[kind])[spanning[0]].tolist()
            nodes = sorted({r // gpus_per_node for r in g})
            warnings.append(
                f"warning: {spanning.size} {kind} group(s) span nodes, e.g. {g} on nodes {nodes} "
                f"({gpus_per_node} GPUs per node); keep {kind} inside a node (tp innermost, "
                f"then cp, ep) or it runs over the slower inter-node network"
            )
    return warnings


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.gpus_per_node is not None and args.gpus_per_node < 1:
            raise ParallelConfigError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
        dense, expert = make_rank_generators(
            args.world_size, args.tp, args.pp, args.cp, args.ep, args.etp, args.order
        )
    except (ParallelConfigError, TypeError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    if args.json:
        groups = layout_groups(dense, expert)
        print(json.dumps(groups))
    else:
        groups = layout_arrays(dense, expert)
        summary = 0 < args.full_limit < dense.world_size
        print(_report(dense, expert, groups, summary))
    if args.gpus_per_node:
        for line in node_span_warnings(groups, args.gpus_per_node):
            sys.stderr.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
