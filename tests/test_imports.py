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
        ("memupdate.names", ("memupdate",)),
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


#: The package's layers, lowest first: a module may import its own layer and those below, never one above.
#: The bottom is what every layer shares and what imports nothing of the package's logic (names, prompts,
#: chat templates, typed config, the Slurm resource table); the settings read it; the memory core reads the
#: settings; data, models and serving stand on the memory core; the agent loops on those; tools and rewards
#: on the loops' fields; rollouts and verl's extensions put tools, rewards and loops together; training,
#: evaluation and the benchmarks use rollouts; the command line and the workflow's helpers use everything.
LAYERS: list[tuple[str, ...]] = [
    (
        "memupdate.names",
        "memupdate.utils",
        "memupdate.typed_config",
        "memupdate.metrics",
        "memupdate.prompts",
        "memupdate.chat_templates",
        "memupdate.workflow_dag",
        "memupdate.rehearsal",
        "memupdate.cluster",
    ),
    ("memupdate.settings",),
    ("memupdate.memory",),
    ("memupdate.data", "memupdate.models", "memupdate.serving"),
    ("memupdate.agents",),
    ("memupdate.tools", "memupdate.rewards"),
    ("memupdate.rollout", "memupdate.verl_ext"),
    ("memupdate.training", "memupdate.eval", "memupdate.bench"),
    (
        "memupdate",
        "memupdate.cli",
        "memupdate.plan",
        "memupdate.dvc_stages",
        "memupdate.preflight",
        "memupdate.verl_plugin",
    ),
]


def layer_of(module: str) -> int:
    """The layer of ``module``: that of the longest prefix :data:`LAYERS` names."""
    best = None
    for number, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (number, prefix)
    if best is None:
        raise KeyError(f"{module} is in no layer of LAYERS: give it one")
    return best[0]


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import of a module from a higher layer than its own."""
    return sorted((module, dep) for module, deps in graph.items() for dep in deps if layer_of(dep) > layer_of(module))


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)


def test_no_module_imports_from_a_layer_above_its_own():
    assert upward_imports(import_graph()) == []


def test_a_module_is_in_the_layer_of_its_longest_prefix():
    assert (layer_of("memupdate.memory.store"), layer_of("memupdate.settings"), layer_of("memupdate")) == (2, 1, 8)
    with pytest.raises(KeyError, match="memupdate_other is in no layer"):
        layer_of("memupdate_other")


def test_an_upward_import_is_found():
    graph = {"memupdate.memory.store": {"memupdate.rewards.memory"}, "memupdate.rewards.memory": {"memupdate.memory"}}
    assert upward_imports(graph) == [("memupdate.memory.store", "memupdate.rewards.memory")]
