"""The package's modules form a DAG: no import cycle, lazy (function-level) imports included.

Reads every module of ``tq_redis`` and ``tq_redis.backends`` with ``ast`` (nothing is imported),
collects each ``import``/``from ... import`` of a ``tq_redis`` module anywhere in the file
(except under ``if TYPE_CHECKING:``), and fails naming every strongly connected group.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"tq_redis": ROOT / "tq_redis", "tq_redis.backends": ROOT / "backends"}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that ``name`` (a module or a module.attribute) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(sub) for sub in ast.walk(node))
    return inside


def _imported_names(module: str, path: Path, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = node.module or ""
        return [base] + [f"{base}.{alias.name}" for alias in node.names]
    return []


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (the package ``tq_redis`` itself left out: its
    ``__init__`` only re-exports lazily)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            for name in _imported_names(module, path, node):
                owner = _owner(name, modules) if name.startswith("tq_redis") else None
                if owner and owner not in (module, "tq_redis"):
                    graph[module].add(owner)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_cycle_finder_sees_a_cycle_through_a_lazy_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_reads_function_level_imports():
    graph = import_graph()
    assert "tq_redis.runtime" in graph["tq_redis.interface"]
    assert "tq_redis.ops" in graph["tq_redis.kv"]


def test_package_modules_form_a_dag():
    found = cycles(import_graph())
    assert found == [], "import cycles (lazy imports included): " + "; ".join(" <-> ".join(g) for g in found)
