"""No import circle in engine/ and deployments/ (issue 63, point 6).

Every .py file under engine/ and deployments/ that git tracks or does not ignore is
parsed (never imported: the test needs no torch), and each module's imports of other
engine. / deployments. modules form a graph, which must have no cycle. Two graphs are
checked.

The load-time graph: the imports that run while a module loads, i.e. its top-level
statements, including the bodies of top-level `if` / `try` / `with` blocks and of class
bodies (they run at import). A cycle there means some import order hands a module a
half-initialised one: an ImportError or a missing attribute that depends on which
module a process happened to import first. Left out of it:
- imports inside functions: they are deferred, run when the function is called, after
  every module it names has loaded, so they never see a half-initialised module;
- `if TYPE_CHECKING:` blocks (never run) and `if __name__ == "__main__":` blocks (run
  only when the file is the program, after its imports).

The whole graph: every import statement, those in functions and in TYPE_CHECKING blocks
too. Deferring an import makes a cycle safe to load, not gone: the two modules still
need each other (neither can be read, tested or moved alone), and a deferred import is
exactly how a circle is hidden from the load-time check. Every circle this test was
written for lived only here (attention <-> flex_paged through a function's import,
spec_decode's config -> proposers -> base -> config through a function's import and a
type-only one, and engine's lazy LLM -> ... -> engine_core -> engine's __version__);
they were broken by moving code to the module it belongs in, not by moving imports.
Deferred imports that only put off a cost (torch, transformers) point downwards and
make no cycle.

Which edges an import adds: `import a.b.c` and `from a.b.c import n` depend on a.b.c,
on n too where a.b.c.n is a module (`from pkg import submodule`), and on the packages
above a.b.c (a and a.b), whose __init__ Python runs first. The rule for those parent
edges: a module's own enclosing packages are left out of them, since they have begun
loading before the module runs (Python puts a package in sys.modules before its
__init__ runs, and importing a sibling of a half-loaded package is how every package's
__init__ imports its submodules). Counting them would call every package whose
__init__ imports a submodule that imports a sibling circular, though nothing can break.
An explicit import of an enclosing package (`import engine.x`, or `from engine.x import
name` in engine/x/y.py with name not a submodule) stays an edge: that name exists only
once engine/x/__init__.py has run past its definition. `from engine.x import y`, y a
submodule, depends on engine.x.y alone.
"""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "deployments")


def _module_files() -> dict[str, Path]:
    """Module name -> its file, for every .py file of PACKAGES that git does not ignore."""
    # tracked, and new files not yet added (a new module is part of the code that runs)
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                          *(f"{p}/*.py" for p in PACKAGES)], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    modules = {}
    for rel in out.split():
        path = ROOT / rel
        if not path.exists():  # deleted in the work tree, not yet in the index
            continue
        parts = list(Path(rel).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_main_guard(test: ast.expr) -> bool:
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and len(test.comparators) == 1
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def _every_import(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement among `body`, however deep."""
    return [node for stmt in body for node in ast.walk(stmt)
            if isinstance(node, (ast.Import, ast.ImportFrom))]


def _load_time_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements among `body` that run when the module loads."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if _is_type_checking(node.test) or _is_main_guard(node.test):
                found += _load_time_imports(node.orelse)
            else:
                found += _load_time_imports(node.body) + _load_time_imports(node.orelse)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            found += _load_time_imports(node.body) + _load_time_imports(node.orelse)
            found += _load_time_imports(node.finalbody)
            for handler in node.handlers:
                found += _load_time_imports(handler.body)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            found += _load_time_imports(node.body)
    return found


def _parents(name: str) -> list[str]:
    """a.b.c -> [a, a.b]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _dependencies(module: str, path: Path, modules: set[str], deferred: bool) -> set[str]:
    """The modules of `modules` that `module` makes Python load while it loads, or
    (deferred) that any of its imports names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()  # what the imports name, a package only where explicit
    collect = _every_import if deferred else _load_time_imports
    for node in collect(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        if node.level:
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module
        submodules = {f"{source}.{alias.name}" for alias in node.names} & modules
        if len(submodules) < len(node.names):  # a name (or *) from source's own body
            targets.add(source)
        targets.update(submodules)  # source runs first too: a parent of theirs
    enclosing = set(_parents(module)) | ({module} if package == module else set())
    implicit = {p for t in targets for p in _parents(t)} - enclosing
    deps = (targets | implicit) & modules
    deps.discard(module)
    return deps


def import_graph(deferred: bool = False) -> dict[str, set[str]]:
    """Module -> the engine / deployments modules it loads while loading (deferred:
    that it imports anywhere, functions and TYPE_CHECKING blocks included)."""
    files = _module_files()
    names = set(files)
    return {m: _dependencies(m, p, names, deferred) for m, p in sorted(files.items())}


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module: each module of one
    reaches every other (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return components


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) per tangle."""
    return [_cycle_in(graph, c) for c in tangles(graph)]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for step in sorted(graph[node] & component):
                if step == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if step not in previous:
                    previous[step] = node
                    following.append(step)
        frontier = following
    raise AssertionError(f"no cycle in the component {sorted(component)}")


def _report(graph: dict[str, set[str]]) -> str:
    """Each tangle's shortest cycle through its first module, and its other modules."""
    lines = []
    for component in tangles(graph):
        cycle = _cycle_in(graph, component)
        lines.append(" -> ".join(cycle))
        rest = sorted(component - set(cycle))
        if rest:
            lines.append(f"    (the same tangle also holds {', '.join(rest)})")
    return "\n".join(lines)


def test_no_import_cycle_at_load() -> None:
    graph = import_graph()
    assert not tangles(graph), "import cycles at load:\n" + _report(graph)


def test_no_import_cycle_behind_deferred_imports() -> None:
    graph = import_graph(deferred=True)
    assert not tangles(graph), ("import cycles through deferred or type-only imports:\n"
                                + _report(graph))


def test_dependencies_follow_the_rule(tmp_path: Path) -> None:
    """The edges the module docstring's rule names (a check on the checker: a graph
    without edges has no cycle either)."""
    source = """
from __future__ import annotations
import os
from typing import TYPE_CHECKING
from . import sib
from .. import helper
from pkg.other import thing
import pkg.deep.leaf
if TYPE_CHECKING:
    from pkg.typed import T
try:
    from pkg import name_in_init
except ImportError:
    pass
class C:
    from pkg.in_class import x
def f():
    from pkg.deferred import y
if __name__ == "__main__":
    from pkg.main_only import z
"""
    path = tmp_path / "mod.py"
    path.write_text(source)
    modules = {"pkg", "pkg.sub", "pkg.sub.mod", "pkg.sub.sib", "pkg.helper", "pkg.other",
               "pkg.deep", "pkg.deep.leaf", "pkg.typed", "pkg.in_class", "pkg.deferred",
               "pkg.main_only"}
    at_load = _dependencies("pkg.sub.mod", path, modules, deferred=False)
    # pkg and pkg.sub enclose the module: only the explicit `from pkg import name_in_init`
    # names pkg; pkg.deep runs before its leaf
    assert at_load == {"pkg", "pkg.sub.sib", "pkg.helper", "pkg.other", "pkg.deep",
                       "pkg.deep.leaf", "pkg.in_class"}
    assert _dependencies("pkg.sub.mod", path, modules, deferred=True) == at_load | {
        "pkg.typed", "pkg.deferred", "pkg.main_only"}


def test_graph_of_the_tree_has_edges() -> None:
    graph = import_graph()
    assert "engine.executor.step_inputs" in graph["engine.spec_decode.proposers.eagle3"]
    assert sum(len(deps) for deps in graph.values()) > 200


def test_find_cycles_reports_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]  # a self-import is no circle
    assert find_cycles({"a": {"b"}, "b": set()}) == []
