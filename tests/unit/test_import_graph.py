"""The modules of `dilocox` import each other without a cycle.

The graph is read from the source (no import runs): an edge A -> B for every `import B` or `from B import x` in
module A, at its top level, inside a function or class, and under `if TYPE_CHECKING:` alike (a type-only import is
still a dependency of the design: the two modules cannot be understood or moved apart). `from P import x` where
`P.x` is a module counts as an edge to `P.x`; relative imports are resolved. The implicit import of a parent
package's `__init__` is not an edge: the package's `__init__` re-exports its modules (a facade), so counting it
would tie every submodule to all of its siblings. Modules outside `dilocox` are left out.
"""

import ast
from pathlib import Path

import dilocox

PACKAGE = Path(dilocox.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_graph_sees_every_kind_of_import():
    """The reader is not blind: known edges of each kind are found, and a cycle is found where there is one."""
    graph = import_graph()
    assert "dilocox.sync.base" in graph["dilocox.sync.reducers"]  # from-import at the top level
    assert "dilocox.elastic.membership" in graph["dilocox.trainer"]  # inside a function
    assert "dilocox.sync.outer" in graph["dilocox.sync"]  # a package's __init__
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
