"""The package layers hold and no project modules import each other in a circle (read with ``ast``, nothing run).

Layers (DESIGN.md "Packages and who may import whom"): ``costmodel`` imports the standard library, numpy and
itself; ``planner`` never imports ``runtime`` or ``cli``; ``runtime`` never imports ``cli`` and takes from
``planner`` only the plan data types (``planner.plan``) and the public planning entry (``planner.plan_model``).
Every import counts: module level, inside functions, under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from costmodel.profiles import PROFILES_DIR

ROOT = PROFILES_DIR.parent
PACKAGES = ("cli", "planner", "costmodel", "runtime")

COSTMODEL_THIRD_PARTY = {"numpy"}
RUNTIME_FROM_PLANNER = {"planner.plan", "planner"}
"""``planner`` itself only for its public entry, ``from planner import plan_model``."""
PLANNER_PUBLIC = {"plan_model"}

KNOWN_CIRCLES: dict[frozenset[str], str] = {}
"""Circles still there, each with the issue that removes it; a listed circle that is gone fails the test too."""


@dataclass(frozen=True)
class Import:
    source: str
    """The importing module (dotted name)."""
    target: str
    """The imported module: a project module resolved to its file, or the top-level name of another package."""
    names: tuple[str, ...]
    """For ``from X import a, b``: the names taken (empty for ``import X``)."""
    line: int

    def where(self) -> str:
        return f"{self.source.replace('.', '/')}.py:{self.line}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _project_files() -> dict[str, Path]:
    files = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            files[_module_name(path)] = path
    return files


FILES = _project_files()


def _is_package(module: str) -> bool:
    return FILES.get(module, Path()).name == "__init__.py"


def _resolve(module: str) -> str:
    """The longest prefix of ``module`` that is a project file (``planner.plan.Plan`` -> ``planner.plan``)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in FILES:
            return name
    return parts[0]


def imports_of(module: str) -> list[Import]:
    """Every import statement in ``module``'s file, resolved to modules."""
    tree = ast.parse(FILES[module].read_text(), filename=str(FILES[module]))
    package = module if _is_package(module) else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [Import(module, _resolve(a.name), (), node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                sub = f"{base}.{a.name}"
                target = sub if sub in FILES else _resolve(base)  # `from planner import plot` names a module
                out.append(Import(module, target, () if sub in FILES else (a.name,), node.lineno))
    return out


ALL_IMPORTS = [imp for module in FILES for imp in imports_of(module)]


def _top(name: str) -> str:
    return name.split(".")[0]


def layer_break(imp: Import) -> str | None:
    """Why ``imp`` breaks a layer rule, or None."""
    src, dst = _top(imp.source), _top(imp.target)
    if src == "costmodel" and dst != "costmodel":
        if dst not in sys.stdlib_module_names and dst not in COSTMODEL_THIRD_PARTY:
            return f"costmodel is pure (stdlib, numpy, itself): {imp.where()} imports {imp.target}"
    if src == "planner" and dst in ("runtime", "cli"):
        return f"planner never imports {dst}: {imp.where()} imports {imp.target}"
    if src == "runtime" and dst == "cli":
        return f"runtime never imports cli: {imp.where()} imports {imp.target}"
    if src == "runtime" and dst == "planner":
        if imp.target not in RUNTIME_FROM_PLANNER or (imp.target == "planner" and set(imp.names) - PLANNER_PUBLIC):
            what = f"{imp.target} ({', '.join(imp.names)})" if imp.names else imp.target
            return (f"runtime takes from planner only planner.plan and planner.plan_model: {imp.where()} "
                    f"imports {what}")
    return None


def project_graph(imports: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in FILES}
    for imp in imports:
        if imp.target in FILES and imp.target != imp.source:
            graph[imp.source].add(imp.target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (~100)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_every_package_and_both_kinds_of_import():
    """The walk reads what it claims: each package's files, imports inside functions, relative imports."""
    assert {_top(m) for m in FILES} == set(PACKAGES)
    assert len(FILES) > 50
    targets = {(i.source, i.target) for i in ALL_IMPORTS}
    assert ("cli.commands.calibrate", "runtime.measure.calibrate") in targets  # an import inside run()
    assert ("costmodel.comm", "costmodel.collectives") in targets  # a module-level one


def test_no_layer_breaks():
    breaks = [msg for imp in ALL_IMPORTS if (msg := layer_break(imp))]
    assert not breaks, "\n".join(breaks)


def test_no_import_circles():
    found = circles(project_graph(ALL_IMPORTS))
    new = [c for c in found if frozenset(c) not in KNOWN_CIRCLES]
    assert not new, "import circles among project modules:\n" + "\n".join(" <-> ".join(c) for c in new)
    gone = [sorted(c) for c in KNOWN_CIRCLES if list(sorted(c)) not in found]
    assert not gone, f"circles no longer there: remove them from KNOWN_CIRCLES: {gone}"


# --- the checks themselves catch what they are for ----------------------------------------------------------


@pytest.mark.parametrize("source,target,names,broken", [
    ("costmodel.step", "torch", (), True),
    ("costmodel.step", "planner.plan", (), True),
    ("costmodel.step", "numpy", (), False),
    ("costmodel.step", "math", (), False),
    ("planner.plots", "runtime.wrap", (), True),
    ("planner.plots", "cli.main", (), True),
    ("runtime.wrap", "cli.main", (), True),
    ("runtime.wrap", "planner.search.driver", (), True),
    ("runtime.wrap", "planner", ("plan_model",), False),
    ("runtime.wrap", "planner", ("whatif",), True),
    ("runtime.wrap", "planner.plan", ("Plan",), False),
    ("cli.main", "runtime.wrap", (), False),
])
def test_layer_rule_cases(source, target, names, broken):
    assert (layer_break(Import(source, target, names, 1)) is not None) == broken


def test_circle_finder_finds_a_three_module_loop_and_ignores_a_chain():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
