"""The shape of the product code (issue 24): no import cycle inside ``moelab/engine`` and no
function over 100 lines in ``backend/``, ``frontend/``, ``moelab/`` or ``workers/``.

Both checks read the source with :mod:`ast`; nothing is imported. The import graph counts every
import, at module level and inside functions (a lazy import hides a cycle, it does not remove it),
except those under ``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Mapping

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "moelab" / "engine"
PRODUCT_DIRS = ("backend", "frontend", "moelab", "workers")
MAX_FUNCTION_LINES = 100


def _sources(directory: Path) -> Iterator[Path]:
    for path in sorted(directory.rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path


def module_name(path: Path, root: Path = ROOT) -> str:
    """``moelab/engine/core/fitting.py`` -> ``moelab.engine.core.fitting``; a package's
    ``__init__.py`` is the package itself."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, in functions too, skipping ``if TYPE_CHECKING:`` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports_in(other)
        else:
            yield from _imports(child)


def _imports_in(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node)


def _targets(stmt: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
             modules: set[str]) -> Iterator[str]:
    """The known modules one import statement loads (absolute or relative)."""
    if isinstance(stmt, ast.Import):
        for alias in stmt.names:
            name = alias.name
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                yield name
        return
    if stmt.level:
        package = importer if is_package else importer.rpartition(".")[0]
        for _ in range(stmt.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{stmt.module}" if stmt.module else package
    else:
        base = stmt.module or ""
    for alias in stmt.names:
        submodule = f"{base}.{alias.name}"
        if submodule in modules:  # ``from .x import y`` with ``y`` a module imports that module
            yield submodule
        elif base in modules:
            yield base


def import_graph(package_dir: Path = ENGINE, root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: {module it imports}}`` over the modules under ``package_dir`` (edges to other
    modules under it only; a module importing itself is not an edge)."""
    paths = {module_name(p, root): p for p in _sources(package_dir)}
    modules = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[name] = {t for stmt in _imports(tree) for t in _targets(stmt, name, is_package, modules)
                       if t != name}
    return graph


def find_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The cycles (``[a, b, ..., a]``) a depth-first walk of ``graph`` closes with a back edge, one
    per set of modules; ``[]`` exactly when the graph is acyclic."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path: list[str] = [start]
        stack = [iter(sorted(graph.get(start, ())))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    # the same loop may be found from several edges: keep one per set of modules
    unique: dict[frozenset[str], list[str]] = {}
    for cycle in cycles:
        unique.setdefault(frozenset(cycle), cycle)
    return list(unique.values())


def long_functions(dirs: tuple[str, ...] = PRODUCT_DIRS, limit: int = MAX_FUNCTION_LINES
                   ) -> list[tuple[str, str, int]]:
    """``(qualified name, file, lines)`` of every function or method longer than ``limit`` lines,
    counted from its ``def`` line (decorators excluded) to its last line."""
    found = []
    for directory in dirs:
        for path in _sources(ROOT / directory):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            found.extend((name, str(path.relative_to(ROOT)), n) for name, n in _function_lengths(tree)
                         if n > limit)
    return found


def _function_lengths(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{child.name}"
            yield name, child.end_lineno - child.lineno + 1
            yield from _function_lengths(child, f"{name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _function_lengths(child, f"{prefix}{child.name}.")
        else:
            yield from _function_lengths(child, prefix)


def test_cycle_finder_detects_a_hand_made_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"a"}}) == [["a", "a"]]
    two = find_cycles({"a": {"b"}, "b": {"a"}, "x": {"y"}, "y": {"x", "a"}})
    assert sorted(map(frozenset, two)) == sorted([frozenset("ab"), frozenset("xy")])


def test_import_graph_resolves_relative_and_lazy_imports(tmp_path):
    code = {
        "pkg/__init__.py": "from . import sub\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import X\n"
                        "def f():\n    from ..other import thing\n",
        "pkg/sub/b.py": "from . import a\nimport pkg.other\n",
        "pkg/other.py": "from .sub.b import Y\n",
    }
    for name, text in code.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path / "pkg", root=tmp_path)
    assert graph == {"pkg": {"pkg.sub"}, "pkg.sub": set(), "pkg.sub.a": {"pkg.other"},
                     "pkg.sub.b": {"pkg.sub.a", "pkg.other"}, "pkg.other": {"pkg.sub.b"}}
    assert find_cycles(graph) == [["pkg.other", "pkg.sub.b", "pkg.other"],
                                  ["pkg.other", "pkg.sub.b", "pkg.sub.a", "pkg.other"]]


def test_no_import_cycle_inside_the_engine():
    graph = import_graph()
    assert len(graph) > 50 and "moelab.engine.runs" in graph, sorted(graph)[:5]  # it reads the engine, not an empty folder
    cycles = find_cycles(graph)
    assert not cycles, "import cycles inside moelab/engine:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_function_over_100_lines():
    long = long_functions()
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(
        f"{name} ({path}): {n} lines" for name, path, n in long)
