"""The package's import graph, read from the source: layers run one way, and no two modules need each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "memupdate").rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, wherever the import sits (a function-level import is a
    dependency too: it only hides a cycle from the interpreter)."""
    known = modules()

    def owner(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in known.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges |= {owner(a.name) for a in node.names if a.name.startswith("memupdate")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("memupdate"):
                # `from memupdate.memory import store` names a module; `from memupdate.memory import BaseStore`
                # the package's __init__.
                edges |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else owner(node.module)
                    for a in node.names
                }
        graph[name] = edges - {name, ""}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_modules_import_each_other():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        # The memory core knows nothing of LLMs, serving, training or rewards.
        (
            "memupdate.memory",
            (
                "memupdate.training",
                "memupdate.serving",
                "memupdate.agents",
                "memupdate.rewards",
                "memupdate.tools",
                "memupdate.eval",
                "memupdate.bench",
            ),
        ),
        # Data preparation and the metrics stand alone.
        ("memupdate.data", ("memupdate.training", "memupdate.serving", "memupdate.eval", "memupdate.agents")),
        ("memupdate.metrics", ("memupdate.training", "memupdate.serving", "memupdate.eval", "memupdate.agents")),
        # Training never reaches into evaluation or the benchmarks; they reach the agent loops through the
        # rollout configuration, not through training.
        ("memupdate.training", ("memupdate.eval", "memupdate.bench")),
        ("memupdate.eval", ("memupdate.training",)),
        ("memupdate.bench", ("memupdate.training",)),
        ("memupdate.rollout", ("memupdate.training", "memupdate.eval", "memupdate.bench")),
        # What agent loops, tools and rewards share is verl-free and imports none of them.
        ("memupdate.agents.fields", ("memupdate.agents.memory_loop", "memupdate.tools", "memupdate.rewards")),
        ("memupdate.data.rows", ("memupdate",)),
    ],
)
def test_layers_run_one_way(layer, forbidden):
    graph = import_graph()
    wrong = {
        (m, d)
        for m, deps in graph.items()
        if m == layer or m.startswith(layer + ".")
        for d in deps
        if any(d == f or d.startswith(f + ".") for f in forbidden)
    }
    assert not wrong, sorted(wrong)
