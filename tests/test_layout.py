"""The package's layout: imports flow one way (see DESIGN.md, "Import direction").

Every module of `offload_compiler` is parsed with `ast` (nothing is imported); an import of a package module
is an edge of the intra-package import graph. Imports executed when the module loads (module level, class
bodies, ``try``/``if`` blocks included) are *module-level*; imports inside a function body are
*function-level* and listed separately: they defer loading, but still say which way the code depends.

Run ``python tests/test_layout.py`` to print both graphs and every cycle in them.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "offload_compiler"

# Cycles tolerated for now (none): add nothing to it.
KNOWN_CYCLES: set[frozenset[str]] = set()

# Layers, lowest first: a module may import modules of its own layer or of lower layers, never higher ones.
# A module belongs to the first layer with a prefix equal to its name or to a package above it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("policy", ("offload_compiler.policy", "offload_compiler.errors", "offload_compiler.gc_during_capture")),
    ("support", ("offload_compiler._tree", "offload_compiler._registry", "offload_compiler._torch_private",
                 "offload_compiler._transformers_private", "offload_compiler.distributed",
                 "offload_compiler.subclasses", "offload_compiler.components", "offload_compiler.config",
                 "offload_compiler.storage", "offload_compiler.host_masters")),
    ("grouping", ("offload_compiler.grouping",)),
    ("passes", ("offload_compiler.passes",)),
    ("runtime", ("offload_compiler.runtime", "offload_compiler.ops")),
    ("backend", ("offload_compiler.backend", "offload_compiler.lowering", "offload_compiler.checkpoint",
                 "offload_compiler.savings")),
    ("planning", ("offload_compiler.planning",)),
    ("api", ("offload_compiler.offloaded", "offload_compiler.api", "offload_compiler")),
    ("top", ("offload_compiler.cli", "offload_compiler.__main__", "offload_compiler.testing")),
]
# the runtime package's modules, lowest first: each imports only modules before it (its __init__ re-exports them)
RUNTIME_ORDER = ["device", "copier", "layout", "disk", "slots", "pinning", "host", "stats", "transfers", "facade"]
# the entry layer's modules (the offloaded package), lowest first, the same rule: `state` below every module that
# reads or changes the state, the entry routes on top
OFFLOADED_ORDER = ["hooks", "outside", "pipeline", "call_io", "kept", "state", "auto_plan", "targets", "forwards", "module",
                   "install", "backend_route"]
# modules that import nothing of the package
LEAVES = {"offload_compiler.policy", "offload_compiler.errors", "offload_compiler.gc_during_capture"}
# the only modules allowed to import offload_compiler.testing (demo models, hypothesis helpers)
TESTING_USERS = ("offload_compiler.testing", "offload_compiler.cli")


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported package module
    line: int
    function_level: bool

    def __str__(self) -> str:
        where = "function-level" if self.function_level else "module-level"
        return f"{self.source} imports {self.target} ({where}, {_path(self.source)}:{self.line})"


def _path(module: str) -> str:
    return os.path.relpath(MODULES[module], ROOT)


def _modules() -> dict[str, str]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for directory, dirs, files in os.walk(os.path.join(ROOT, PACKAGE)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                parts = os.path.relpath(os.path.join(directory, name), ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts.pop()
                found[".".join(parts)] = os.path.join(directory, name)
    return found


MODULES = _modules()


def _resolve(name: str) -> list[str]:
    """The package modules that loading ``name`` executes: the module itself (or the nearest package above it
    that exists) and the packages between it and the root package (the root's ``__init__`` is left out: every
    module would depend on it)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1)] or ([PACKAGE] if parts else [])


def _imports_of(module: str) -> list[Import]:
    tree = ast.parse(open(MODULES[module]).read(), MODULES[module])
    is_package = MODULES[module].endswith("__init__.py")
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".")[:len(module.split(".")) - (child.level - 1) - (0 if is_package else 1)]
                    stem = ".".join(base + ([child.module] if child.module else []))
                else:
                    stem = child.module or ""
                # ``from pkg import name``: name may be a module of pkg
                names = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in MODULES else stem for alias in child.names]
            for name in names:
                if name == PACKAGE or name.startswith(PACKAGE + "."):
                    loaded = _resolve(name)
                    for target in loaded:
                        # a package enclosing ``module`` on the way to a sibling is loaded already while
                        # ``module`` runs (importing ``.device`` from ``runtime/host.py`` does not run
                        # ``runtime/__init__`` again); importing a name from that package itself still counts
                        if target != module and not (target != loaded[-1] and module.startswith(target + ".")):
                            found.append(Import(module, target, child.lineno, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return list(dict.fromkeys(found))


IMPORTS = [imp for module in MODULES for imp in _imports_of(module)]


def _graph(function_level: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        if function_level or not imp.function_level:
            graph[imp.source].add(imp.target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _cycle_message(component: frozenset[str], function_level: bool) -> str:
    inside = [str(imp) for imp in IMPORTS if imp.source in component and imp.target in component
              and (function_level or not imp.function_level)]
    return f"import cycle among {sorted(component)}:\n  " + "\n  ".join(inside)


def layer_of(module: str) -> int | None:
    """The rank in LAYERS of the longest prefix that covers ``module``; None when none does."""
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix != PACKAGE and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    return None if best is None else best[0]


def test_every_module_is_found_and_parsed():
    for name in ("offload_compiler", "offload_compiler.passes.schedule", "offload_compiler.planning.planner",
                 "offload_compiler.testing", "offload_compiler.testing.models", "offload_compiler.runtime",
                 "offload_compiler.offloaded", "offload_compiler.offloaded.state"):
        assert name in MODULES
    assert any(imp.source == "offload_compiler.backend" and imp.target == "offload_compiler.passes.insert"
               for imp in IMPORTS)
    # function-level imports are seen, and kept apart
    assert any(imp.source == "offload_compiler.cli" and imp.target == "offload_compiler.testing.models"
               and imp.function_level for imp in IMPORTS)


def test_no_module_level_import_cycles():
    found = [c for c in cycles(_graph(function_level=False)) if c not in KNOWN_CYCLES]
    assert not found, "\n".join(_cycle_message(c, False) for c in found)


def test_no_import_cycles_counting_function_level_imports():
    found = [c for c in cycles(_graph(function_level=True)) if c not in KNOWN_CYCLES]
    assert not found, "\n".join(_cycle_message(c, True) for c in found)


def test_known_cycles_still_exist():
    """An allowance that no longer matches a cycle is stale: remove it from KNOWN_CYCLES."""
    current = set(cycles(_graph(function_level=True)))
    stale = [sorted(c) for c in KNOWN_CYCLES if c not in current]
    assert not stale, f"KNOWN_CYCLES lists cycles that are gone (empty those entries): {stale}"


def test_runtime_package_never_imports_testing():
    bad = [str(imp) for imp in IMPORTS
           if imp.target.startswith("offload_compiler.testing")
           and not any(imp.source == m or imp.source.startswith(m + ".") for m in TESTING_USERS)]
    assert not bad, "the runtime package must not import offload_compiler.testing:\n  " + "\n  ".join(bad)


def test_policy_imports_nothing_of_the_package():
    bad = [str(imp) for imp in IMPORTS if imp.source in LEAVES]
    assert not bad, "\n  ".join(["these modules must import nothing of the package:"] + bad)


def test_every_module_has_a_layer():
    missing = [f"{m} ({_path(m)})" for m in MODULES if layer_of(m) is None]
    assert not missing, f"modules with no layer in tests/test_layout.py LAYERS (add them): {missing}"


def test_module_level_imports_flow_down_the_layers():
    bad = []
    for imp in IMPORTS:
        if None in (layer_of(imp.source), layer_of(imp.target)):
            continue  # test_every_module_has_a_layer names it
        if not imp.function_level and layer_of(imp.target) > layer_of(imp.source):
            bad.append(f"{imp}: layer {LAYERS[layer_of(imp.source)][0]!r} imports the higher layer "
                       f"{LAYERS[layer_of(imp.target)][0]!r}")
    assert not bad, "imports must flow " + " -> ".join(name for name, _ in reversed(LAYERS)) + ":\n  " + \
        "\n  ".join(bad)


@pytest.mark.parametrize("package, order", [("offload_compiler.runtime", RUNTIME_ORDER),
                                            ("offload_compiler.offloaded", OFFLOADED_ORDER)],
                         ids=["runtime", "offloaded"])
def test_subpackage_modules_import_down_their_order(package, order):
    members = [m for m in MODULES if m.startswith(package + ".")]
    assert sorted(m.rsplit(".", 1)[1] for m in members) == sorted(order), f"list every {package} module"
    rank = {f"{package}.{name}": i for i, name in enumerate(order)}
    bad = [str(imp) for imp in IMPORTS if imp.source in rank and imp.target in rank
           and rank[imp.target] >= rank[imp.source]]
    bad += [str(imp) for imp in IMPORTS if imp.source in rank and imp.target == package]
    assert not bad, f"{package} modules import only those before them in its order:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("lower, higher", [("offload_compiler.passes.insert", "offload_compiler.backend"),
                                           ("offload_compiler.runtime", "offload_compiler.api"),
                                           ("offload_compiler.policy", "offload_compiler.grouping"),
                                           ("offload_compiler.grouping", "offload_compiler.passes.schedule"),
                                           ("offload_compiler.passes.verify", "offload_compiler.runtime")])
def test_the_layer_order(lower, higher):
    assert layer_of(lower) < layer_of(higher)


def main() -> int:
    for function_level in (False, True):
        label = "module-level and function-level" if function_level else "module-level"
        print(f"== {label} imports")
        for imp in IMPORTS:
            if imp.function_level == function_level:
                print(" ", imp)
        found = cycles(_graph(function_level))
        print(f"== cycles ({label}): {len(found)}")
        for component in found:
            note = " (KNOWN_CYCLES)" if component in KNOWN_CYCLES else ""
            print(" ", _cycle_message(component, function_level).replace("\n", "\n  ") + note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
