"""The layering of ``mapl_swarm``, read statically from its import graph (issue 9, "Done when").

The graph is built with :mod:`ast` from the source files alone (nothing is imported, so it is
fast and sees every branch). Its rules:

* Nodes are the modules of ``mapl_swarm``; a package is its ``__init__.py`` under the package's
  name (``mapl_swarm.wire``); ``__main__`` modules are nodes too.
* Every ``import`` and ``from ... import`` statement of a module counts, wherever it stands: top
  level, inside functions, under ``if TYPE_CHECKING:``, in ``try`` blocks. Relative imports are
  resolved against the importing module's package.
* ``import a.b.c`` and ``from a.b import c`` name the module ``a.b.c`` if it exists, else ``a.b``
  (``c`` is then a name defined in ``a.b``), else ``a``. Imports of other top-level packages are
  recorded by their top-level name (``torch``).
* Dynamic imports (``importlib.import_module``, the lazy ``__getattr__`` of ``compress`` and
  ``wire``) are not seen.

Two views of the edges:

* **cycles** (check a): an edge from each module to each module it names, except that a package's
  ``__init__`` importing or re-exporting its own submodules (``pkg`` -> ``pkg.*``) is no edge, and
  importing ``a.b.c`` is an edge to ``a.b.c`` only, not to the ``__init__`` of ``a`` or ``a.b``.
  So ``pkg.a`` importing a name that ``pkg`` re-exports from ``pkg.a`` makes no cycle.
* **reach** (checks b, c, d: what importing a module loads): every named module, plus the
  packages above it and above the importing module (Python runs their ``__init__`` first), with
  every edge of a package's ``__init__``, its own submodules included.

Checked: (a) no import cycle inside ``mapl_swarm``; (b) no module of ``mapl_swarm.peer`` reaches
``mapl_swarm.pipeline.trainer`` or ``mapl_swarm.pipeline.inprocess``; (c) nothing reachable from
any module of ``mapl_swarm.wire`` imports ``torch`` (tests/wire/test_wire_no_torch.py checks the
same at run time); (d) the runtime wire modules never reach the golden-vector tooling
``mapl_swarm.wire.golden``. Failures print each offending import chain as a path
``module:LINE -> module:LINE -> ...``, LINE being where that module imports the next one
(``pkg`` when the next one is a package above it).
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

PACKAGE = "mapl_swarm"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

Edges = dict[str, dict[str, int]]
"""Module -> {module it imports: line of the first such import (0: a package above it)}."""


@dataclass(frozen=True)
class ImportGraph:
    """Static imports of one top-level package."""

    modules: dict[str, Path]
    """Module name -> source file."""
    imports: Edges
    """Module -> {module of the package it names: line of the first such import}."""
    external: Edges
    """Module -> {top-level package outside it that it imports: line of the first such import}."""

    def cycle_edges(self) -> Edges:
        """The *cycles* view: named modules, minus a package's ``__init__`` -> its own submodules."""
        return {m: {t: line for t, line in targets.items() if not t.startswith(m + ".")}
                for m, targets in self.imports.items()}

    def reach_edges(self) -> Edges:
        """The *reach* view: named modules, the packages above them and above the importer."""
        out: Edges = {}
        for m, targets in self.imports.items():
            edges = out[m] = {parent: 0 for parent in _packages_above(m)}
            for t, line in targets.items():
                for parent in [*_packages_above(t), t]:
                    if parent != m:
                        edges.setdefault(parent, line)
        return out


def _packages_above(module: str) -> list[str]:
    """``a``, ``a.b`` for ``a.b.c``."""
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def _module_files(root: Path, package: str) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(dotted: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``dotted`` that is a module (None when none is)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in modules:
            return name
    return None


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Dotted names an import statement of ``module`` refers to (relative ones made absolute)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[: len(package) - (node.level - 1)])
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    return [base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names]


def build_graph(root: Path = ROOT, package: str = PACKAGE) -> ImportGraph:
    """Parse every module under ``root`` (the directory of ``package``) and collect its imports."""
    modules = _module_files(root, package)
    imports: Edges = {m: {} for m in modules}
    external: Edges = {m: {} for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for dotted in _imported_names(node, module, is_package):
                top = dotted.split(".")[0]
                if top != package:
                    external[module].setdefault(top, node.lineno)
                    continue
                target = _resolve(dotted, modules)
                if target is not None and target != module:
                    imports[module].setdefault(target, node.lineno)
    return ImportGraph(modules=modules, imports=imports, external=external)


def path_text(edges: Edges, chain: list[str]) -> str:
    """``a:LINE -> b:LINE -> c`` for an import chain (LINE: where the module imports the next)."""
    hops = [f"{a}:{edges[a][b] or 'pkg'}" for a, b in zip(chain, chain[1:])]
    return " -> ".join([*hops, chain[-1]])


def strongly_connected(edges: Edges) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (each component's modules sorted)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)

    for start in sorted(edges):
        if start in index:
            continue
        visit(start)
        work = [(start, iter(sorted(edges[start])))]
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    visit(succ)
                    work.append((succ, iter(sorted(edges[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    components.append(sorted(component))
    return components


def shortest_chain(edges: Edges, start: str, goal: Callable[[str], bool],
                   within: set[str] | None = None) -> list[str] | None:
    """Shortest import chain from ``start`` to a module where ``goal(m)`` (``start`` itself only
    as the end of a cycle); only through modules ``within`` when given."""
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in sorted(edges[node]):
            if within is not None and succ not in within:
                continue
            if goal(succ):
                chain = [succ, node]
                while parent[chain[-1]] is not None:
                    chain.append(parent[chain[-1]])
                return chain[::-1]
            if succ not in parent:
                parent[succ] = node
                queue.append(succ)
    return None


def find_cycles(edges: Edges) -> list[tuple[list[str], list[str]]]:
    """(a shortest cycle, the modules of its group) for each group of mutually importing modules."""
    cycles = []
    for group in strongly_connected(edges):
        if len(group) > 1:
            first = group[0]
            cycles.append((shortest_chain(edges, first, lambda m: m == first, within=set(group)), group))
    return cycles


def _in(package: str) -> Callable[[str], bool]:
    return lambda m: m == package or m.startswith(package + ".")


GRAPH = build_graph()
REACH = GRAPH.reach_edges()


def _fail_with_chains(title: str, starts: list[str], goal: Callable[[str], bool]) -> None:
    chains = [c for s in starts if (c := shortest_chain(REACH, s, goal)) is not None]
    if chains:
        pytest.fail(title + ":\n" + "\n".join(path_text(REACH, c) for c in chains), pytrace=False)


def package_of(module: str) -> str:
    """The first-level package (or top-level module) of ``module``: ``mapl_swarm.peer`` for
    ``mapl_swarm.peer.link``; ``mapl_swarm`` itself for the package root."""
    return ".".join(module.split(".")[:2])


def package_edges(graph: ImportGraph) -> Edges:
    """The *packages* view: an edge between two first-level packages wherever a module of one
    imports a module of the other (the root package ``mapl_swarm`` and its ``__init__`` aside)."""
    out: Edges = {}
    for m, targets in graph.imports.items():
        src = package_of(m)
        out.setdefault(src, {})
        for t, line in targets.items():
            dst = package_of(t)
            if dst != src and PACKAGE not in (src, dst):
                out[src].setdefault(dst, line)
    for targets in list(out.values()):
        for t in targets:
            out.setdefault(t, {})
    return out


def test_no_import_cycles_between_packages():
    """The folders are layers: no two first-level packages import each other, however indirectly."""
    edges = package_edges(GRAPH)
    cycles = find_cycles(edges)
    if cycles:
        pytest.fail("import cycles between mapl_swarm's packages:\n" + "\n".join(
            f"{' -> '.join(cycle)}   [group: {', '.join(group)}]" for cycle, group in cycles), pytrace=False)


def test_config_and_wire_are_the_bottom_layer():
    """``config`` and ``wire`` import no other package of mapl_swarm but each other's bottom layer
    (and the package root's errors and helpers)."""
    edges = package_edges(GRAPH)
    bottom = {f"{PACKAGE}.config", f"{PACKAGE}.wire", f"{PACKAGE}.errors", f"{PACKAGE}.lazy", f"{PACKAGE}.files"}
    above = {pkg: sorted(t for t in edges[pkg] if t not in bottom) for pkg in (f"{PACKAGE}.config", f"{PACKAGE}.wire")}
    assert above == {f"{PACKAGE}.config": [], f"{PACKAGE}.wire": []}


def test_package_cycles_are_found_on_a_small_package(tmp_path):
    files = {"__init__.py": "", "a/__init__.py": "", "a/x.py": "from pkg.b import y\n",
             "b/__init__.py": "", "b/y.py": "from pkg.a import x\n", "c.py": "import pkg.a.x\n"}
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    edges = package_edges(build_graph(tmp_path / "pkg", "pkg"))
    assert [group for _, group in find_cycles(edges)] == [["pkg.a", "pkg.b"]]


def test_no_import_cycles():
    edges = GRAPH.cycle_edges()
    cycles = find_cycles(edges)
    if cycles:
        pytest.fail("import cycles in mapl_swarm (one per group of mutually importing modules):\n" + "\n".join(
            f"{path_text(edges, cycle)}   [group: {', '.join(group)}]" for cycle, group in cycles), pytrace=False)


def test_peer_does_not_import_the_in_process_drivers():
    forbidden = {"mapl_swarm.pipeline.trainer", "mapl_swarm.pipeline.inprocess"}
    _fail_with_chains("mapl_swarm.peer imports an in-process driver",
                      sorted(filter(_in("mapl_swarm.peer"), GRAPH.modules)), forbidden.__contains__)


def test_wire_imports_no_torch():
    wire = sorted(filter(_in("mapl_swarm.wire"), GRAPH.modules))
    direct = [f"{m}:{GRAPH.external[m]['torch']} imports torch" for m in wire if "torch" in GRAPH.external[m]]
    if direct:
        pytest.fail("mapl_swarm.wire imports torch:\n" + "\n".join(direct), pytrace=False)
    _fail_with_chains("mapl_swarm.wire reaches a module that imports torch", wire,
                      lambda m: "torch" in GRAPH.external[m])


@pytest.mark.parametrize("io", ["torch", "asyncio", "zmq", "hivemind"])
def test_the_step_core_is_pure(io):
    """The step protocol's core (``mapl_swarm.step``) reaches no tensor, event loop, socket or DHT:
    a state machine its tests drive in memory."""
    step = sorted(m for m in GRAPH.modules if _in("mapl_swarm.step")(m))
    _fail_with_chains(f"mapl_swarm.step reaches a module that imports {io}", step,
                      lambda m: io in GRAPH.external[m])


def test_runtime_wire_does_not_import_the_golden_vector_tooling():
    golden = _in("mapl_swarm.wire.golden")
    runtime = sorted(m for m in GRAPH.modules if _in("mapl_swarm.wire")(m) and not golden(m))
    _fail_with_chains("runtime wire modules import mapl_swarm.wire.golden", runtime, golden)


def test_graph_rules_on_a_small_package(tmp_path):
    """The rules of the module docstring, on a package written for the purpose."""
    files = {
        "__init__.py": "from .a import A\nfrom . import b\n",  # re-exports
        "a.py": "from typing import TYPE_CHECKING\nimport torch\nif TYPE_CHECKING:\n    from .sub import deep\n",
        "b.py": "def f():\n    from pkg import A\n    import pkg.sub.deep\n",  # a name of pkg; a module
        "sub/__init__.py": "from ..a import A\nfrom .. import b\n",
        "sub/deep.py": "from . import missing\nfrom .. import a\n",
    }
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    g = build_graph(tmp_path / "pkg", "pkg")
    assert g.imports == {
        "pkg": {"pkg.a": 1, "pkg.b": 2},
        "pkg.a": {"pkg.sub.deep": 4},
        "pkg.b": {"pkg": 2, "pkg.sub.deep": 3},
        "pkg.sub": {"pkg.a": 1, "pkg.b": 2},
        "pkg.sub.deep": {"pkg.sub": 1, "pkg.a": 2},
    }
    assert g.external["pkg.a"] == {"typing": 1, "torch": 2}
    cycle_edges = g.cycle_edges()
    assert cycle_edges["pkg"] == {} and cycle_edges["pkg.b"] == {"pkg": 2, "pkg.sub.deep": 3}
    assert find_cycles(cycle_edges) == [(["pkg.a", "pkg.sub.deep", "pkg.a"],
                                         ["pkg.a", "pkg.b", "pkg.sub", "pkg.sub.deep"])]
    assert path_text(cycle_edges, ["pkg.a", "pkg.sub.deep", "pkg.a"]) == "pkg.a:4 -> pkg.sub.deep:2 -> pkg.a"
    reach = g.reach_edges()
    assert reach["pkg.a"] == {"pkg": 0, "pkg.sub": 4, "pkg.sub.deep": 4}  # packages above run first
    assert reach["pkg"] == {"pkg.a": 1, "pkg.b": 2}  # an __init__ loads what it imports
    assert path_text(reach, ["pkg.a", "pkg", "pkg.b"]) == "pkg.a:pkg -> pkg:2 -> pkg.b"
