"""The package has no import cycles, and each layer imports only the layers that `docs/design.md`'s table allows:
every `import` of a ketch module, also one inside a function or under `TYPE_CHECKING`, is an edge."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ketch"

ALLOWED: dict[str, set[str]] = {
    "__init__": set(),
    "protocol": set(),
    "registry": set(),
    "architecture": set(),
    "determinism": set(),
    "disk": set(),
    "cache": set(),
    "user_code": set(),
    "tracking": set(),
    "algorithms": {"protocol", "registry"},
    "config": {"architecture", "registry"},
    "compiled": {"cache"},
    "models": {"architecture", "cache"},
    "controller": {"protocol"},
    "rewards": {"protocol", "user_code"},
    "data": {"cache", "config", "protocol"},
    "engine": {"architecture", "compiled", "config", "determinism", "disk", "models", "protocol"},
    "rollout": {"architecture", "compiled", "config", "models", "protocol"},
    "rollout/multi_turn": {"config", "data", "protocol", "rollout", "user_code"},
    "serve": {"rollout"},
    "report": {"tracking"},
    "workers": {"algorithms", "config", "controller", "data", "engine", "models", "protocol", "rollout"}
    | {"rollout/multi_turn"},
    "trainer": {"algorithms", "cache", "config", "controller", "data", "disk", "engine", "models", "protocol"}
    | {"report", "rewards", "rollout", "rollout/multi_turn", "tracking", "workers"},
    "doctor": {"architecture", "cache", "compiled", "config", "controller", "data", "disk", "models", "rewards"}
    | {"tracking", "trainer"},
    "cli": {"algorithms", "config", "controller", "data", "doctor", "engine", "models", "report", "rewards"}
    | {"rollout", "rollout/multi_turn", "serve", "tracking", "trainer"},
}
"""Layer -> the layers it may import: the last column of the module table in `docs/design.md`. A layer is a
subpackage (`engine/megatron/` is part of `engine`), a subpackage of one (`rollout/multi_turn`) or a root module,
`ketch/__init__.py` its own."""

SHARES_A_LAYER = {"__main__": "cli"}
"""Root modules that belong to another's layer (one row of the table)."""


def import_graph() -> dict[str, set[str]]:
    """Module -> the ketch modules it imports (`from a.b import c` imports module a.b.c when that is one)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def module_of(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {module_of(m) for m in imported if m.startswith("ketch.") or m == "ketch"} - {name}
    return graph


def layer(module: str) -> str:
    """The layer of `module` (`ketch.rollout.multi_turn.loop` -> `rollout/multi_turn`, `ketch.doctor.config_checks` ->
    `doctor`)."""
    parts = module.split(".")[1:] or ["__init__"]
    if "/".join(parts[:2]) in ALLOWED:
        return "/".join(parts[:2])
    return SHARES_A_LAYER.get(parts[0], parts[0])


def crossings(graph: dict[str, set[str]]) -> list[str]:
    """One line per import of `graph` that the allow-list does not allow, naming both modules and both layers."""
    found = []
    for module, imported in sorted(graph.items()):
        if layer(module) not in ALLOWED:
            found.append(f"{module} is in layer {layer(module)}, which the layer table does not list")
            continue
        for other in sorted(imported):
            if layer(other) != layer(module) and layer(other) not in ALLOWED[layer(module)]:
                found.append(
                    f"{module} (layer {layer(module)}) imports {other} (layer {layer(other)}), which layer "
                    f"{layer(module)} may not import"
                )
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_ketch_has_no_import_cycles():
    graph = import_graph()
    assert {"ketch.config.loader", "ketch.config.constraints", "ketch.doctor"} <= graph.keys()
    assert cycles(graph) == []


def test_an_import_the_layer_table_does_not_allow_is_a_crossing():
    graph = {"ketch.engine.heads": {"ketch.algorithms.router", "ketch.engine.packing"}, "ketch.algorithms": set()}
    graph |= {"ketch.engine.megatron.engine": {"ketch.engine.engine"}, "ketch.nowhere": set()}
    assert crossings(graph) == [
        "ketch.engine.heads (layer engine) imports ketch.algorithms.router (layer algorithms), which layer engine may "
        "not import",
        "ketch.nowhere is in layer nowhere, which the layer table does not list",
    ]


def test_the_layers_form_no_cycle():
    assert cycles(ALLOWED) == []
    assert set().union(*ALLOWED.values()) <= ALLOWED.keys()


def test_ketch_imports_only_what_the_layer_table_allows():
    assert crossings(import_graph()) == []
