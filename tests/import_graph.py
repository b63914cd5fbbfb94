"""The import-graph tests' helpers: the one cycle finder (tests/test_packaging.py: the whole
package; tests/test_parallel_imports.py: the parallel and MoE layers) and the modules a command
imports (``python -X importtime``)."""

from __future__ import annotations

import subprocess
import sys


def run_importing(*args: str) -> tuple[str, set[str]]:
    """Run ``python -X importtime *args``: its stdout and every module the run imported."""
    run = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    return run.stdout, {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(out)
