"""No import cycle among meshpar's modules, and no import from a lower room into a higher one,
found statically with ``ast``.

Edges: every ``import`` / ``from ... import`` of a meshpar module, at module level and inside
functions alike (a deferred import hides a cycle, it does not remove it); ``from meshpar.a
import b`` is an edge to ``meshpar.a.b`` when that is a module, else to ``meshpar.a``. Imports
under ``if TYPE_CHECKING:`` never run and are not edges.

Packages: importing ``meshpar.a.b.c`` also runs the ``__init__`` of ``meshpar.a`` and
``meshpar.a.b``, so those are edges too, except for the importer's own enclosing packages,
which Python has already started by the time the importer runs: a package ``__init__``
importing its own submodules is not a cycle. A submodule naming its own package explicitly
(``from meshpar.models import Family`` inside meshpar/models/llama/) is an edge, because it
reads names the ``__init__`` may not have defined yet.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "meshpar"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: anywhere in the tree but under ``if TYPE_CHECKING``."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return found


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(meshpar module, line) for every import statement of module ``name`` that can run."""
    out = []
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target:
                    out.append((target, node.lineno))
            continue
        base = node.module or ""
        if node.level:  # relative: from the importer's package
            anchor = name if path.name == "__init__.py" else name.rpartition(".")[0]
            for _ in range(node.level - 1):
                anchor = anchor.rpartition(".")[0]
            base = f"{anchor}.{base}" if base else anchor
        if base == PACKAGE or base.startswith(PACKAGE + "."):
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in modules else base, node.lineno))
    return out


def import_graph() -> dict[str, dict[str, str]]:
    """module -> {imported module: "path:line" of the first import that makes the edge}."""
    modules = _modules()
    graph: dict[str, dict[str, str]] = {name: {} for name in modules}
    for name, path in modules.items():
        own = set(_ancestors(name)) | ({name} if path.name == "__init__.py" else set())
        for target, line in _targets(name, path, modules):
            where = f"{path.relative_to(ROOT)}:{line}"
            if target != name and target in modules:
                graph[name].setdefault(target, where)
            for package in _ancestors(target):  # their __init__ runs first
                if package not in own:
                    graph[name].setdefault(package, where)
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, iters = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph[nxt])))
    return None


def _describe(graph: dict[str, dict[str, str]], cycle: list[str]) -> str:
    return "\n".join(f"  {a} -> {b}   ({graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False))


def test_no_import_cycle_among_meshpar_modules():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle among meshpar's modules:\n" + _describe(graph, cycle)


def test_the_graph_sees_deferred_imports_and_packages():
    graph = import_graph()
    assert "meshpar.checkpoint.checkpointer" in graph["meshpar.checkpoint"]  # a package __init__ re-exporting
    assert "meshpar.models" in graph["meshpar.training.preflight"]
    # meshpar.planner.dry_run imports FakeStore from meshpar.distributed._torch inside a function
    assert "meshpar.distributed._torch" in graph["meshpar.planner.dry_run"]
    # importing meshpar.models.moe.model runs meshpar.models and meshpar.models.moe first ...
    assert {"meshpar.models", "meshpar.models.moe"} <= set(graph["meshpar.parallel.expert_parallel"])
    # ... but not for a module inside them, whose enclosing packages are already running
    assert "meshpar.models.llama" not in graph["meshpar.models.llama.convert"]


def test_leaf_modules_stay_leaves():
    """The modules everything may import import nothing of meshpar that could close a cycle."""
    graph = import_graph()
    assert graph["meshpar.config.errors"] == {}
    assert graph["meshpar.distributed._torch"] == {}
    assert set(graph["meshpar.config.recipe"]) == {"meshpar.config.errors", "meshpar.config.keys"}
    assert graph["meshpar.config.keys"] == {}
    for family in ("llama", "gpt2"):
        module = f"meshpar.models.{family}.parallelize"
        assert "meshpar.parallel.parallelize" not in graph[module], graph[module]
        assert "meshpar.config.recipe" not in graph[module], graph[module]


# The rooms of meshpar/ from the bottom up (docs/architecture.md, "Package map"): a module may import
# its own room and the rooms of lower layers, never a higher one. models/ and parallel/ share a layer
# on purpose: a family's tensor-parallel plan and layout checks live beside its model
# (models/<family>/parallelize.py, STYLE.md 2) and use parallel's styles, while context and expert
# parallelism fill slots that the model files define.
LAYERS = (
    ("config",),
    ("distributed",),
    ("fsdp", "runtime"),
    ("checkpoint",),
    ("profiling", "data", "corpus"),
    ("models", "parallel"),
    ("training",),
    ("planner", "convert", "inference"),
    ("train", "cli", "__main__", ""),
)


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _layer(module: str) -> int:
    room = _room(module)
    for i, rooms in enumerate(LAYERS):
        if room in rooms:
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: add its room ({room!r}) to tests/test_imports.py")


def upward_imports(graph: dict[str, dict[str, str]]) -> list[str]:
    return [f"  {a} -> {b}   ({where})" for a, deps in sorted(graph.items()) for b, where in sorted(deps.items())
            if _layer(b) > _layer(a)]


def test_no_module_imports_upward():
    upward = upward_imports(import_graph())
    assert not upward, "imports from a lower layer into a higher one (LAYERS):\n" + "\n".join(upward)


def test_a_planted_upward_import_is_found():
    graph = {"meshpar.fsdp.api": {"meshpar.training.step": "meshpar/fsdp/api.py:9"}, "meshpar.training.step": {}}
    assert upward_imports(graph) == ["  meshpar.fsdp.api -> meshpar.training.step   (meshpar/fsdp/api.py:9)"]


def test_a_planted_cycle_is_found_and_printed():
    graph = {"a": {"b": "a.py:1"}, "b": {"c": "b.py:2"}, "c": {"a": "c.py:3"}, "d": {"a": "d.py:1"}}
    cycle = find_cycle(graph)
    assert cycle == ["a", "b", "c", "a"]
    assert _describe(graph, cycle).splitlines()[-1] == "  c -> a   (c.py:3)"
    assert find_cycle({"a": {"b": ""}, "b": {}}) is None
