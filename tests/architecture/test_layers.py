"""The package layering (docs/ARCHITECTURE.md, "Layers"), checked on the source with ``ast``.

- Packages by concern, in layers (:data:`LAYERS`, lowest first): a module imports only modules of
  its own layer or of layers below it, counting every import (module level, inside functions,
  under ``TYPE_CHECKING``). The ``harness`` root holds at most :data:`MAX_ROOT_MODULES` modules.

- No import cycles among the project's modules, counting every import: module level, inside
  functions and under ``TYPE_CHECKING`` (a cycle hidden in a function is still a cycle).
- The planning library (``harness.planning``), the systems and the baselines never import a
  backend (``harness.backends``): scoring a plan is planning's job.
- Baselines never import ``systems`` (a baseline must not depend on the system it is compared
  against), and systems never import baselines.
- The harness core (``harness`` outside ``planning``/``backends``/``figures``) never imports
  systems or baselines by name; they are discovered.
- The real-model runtime (``harness.real``: models, PPO math, model parallelism) never imports a
  backend or Ray.
- Backends decide nothing about when a unit may start: they never read the plan's dependency
  graph (``Plan.dependencies``), the input of the one readiness rule in
  ``harness.planning.scheduler``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("harness", "systems", "baselines", "conf")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported_names(path: Path, name: str) -> set[str]:
    """Every module named by an import statement anywhere in the file (relative ones resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{alias.name}" for alias in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        deps = set()
        for imported in imported_names(path, name):
            # an import of a.b.c depends on module a.b.c if it exists, else on the package a.b
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                deps.add(imported)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


# Lowest first. A module belongs to the longest prefix that names it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("harness.errors", "harness.compiled"),          # leaves
    ("harness.schedule",),                            # the pipeline-schedule IR
    ("harness.core",),                                # configs, plan, units, trace, workload, metrics
    ("harness.real",),                                # models, PPO math, the model-parallel runtime
    ("harness.costmodel",),                           # op, memory and engine costs; the engine fit
    ("harness.system",),                              # the System interface and system discovery
    ("harness.planning", "systems", "baselines"),     # planning library and the systems built on it
    ("harness.backends",),                            # sim and ray: execute a plan
    ("harness.checks",),                              # checks of input before any work
    ("harness.run",),                                 # the run pipeline, results, loggers
    ("harness.cli", "harness.figures"),               # command-line tools and paper figures
    ("harness",),                                     # entry points and harness.testing
)
MAX_ROOT_MODULES = 10


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    if best is None:
        raise KeyError(f"{module} belongs to no layer: add its package to LAYERS")
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{mod} (layer {layer_of(mod)}) imports {dep} (layer {layer_of(dep)})"
                  for mod, deps in graph.items() if not mod.startswith("conf")
                  for dep in deps if not dep.startswith("conf") and layer_of(dep) > layer_of(mod))


def test_no_import_reaches_a_higher_layer():
    assert upward_imports(import_graph()) == []


def test_layer_checker_sees_an_upward_import():
    assert upward_imports({"harness.core.plan": {"harness.run.runner"}, "harness.run.runner": set()}) == [
        "harness.core.plan (layer 2) imports harness.run.runner (layer 9)"]
    assert upward_imports({"harness.run.runner": {"harness.core.plan"}}) == []


def test_every_module_has_a_layer():
    for module in project_modules():
        if not module.startswith("conf"):
            layer_of(module)


def test_harness_root_is_small():
    root_modules = sorted(p.name for p in (ROOT / "harness").glob("*.py"))
    assert len(root_modules) <= MAX_ROOT_MODULES, root_modules


def test_graph_sees_imports():
    """The checker itself: it finds known edges, and it finds a planted cycle."""
    graph = import_graph()
    assert "harness.core.plan" in graph["harness.run.runner"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def offenders(prefixes: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    graph = import_graph()
    return sorted(f"{mod} imports {dep}" for mod, deps in graph.items()
                  if mod.startswith(prefixes) for dep in deps if dep.startswith(forbidden))


def test_planners_never_import_backends():
    assert offenders(("harness.planning", "systems", "baselines"), ("harness.backends",)) == []


def test_real_model_runtime_is_independent_of_the_launcher():
    """harness.real (models, PPO math, the model-parallel runtime) never imports a backend or Ray:
    the Ray backend drives it, another launcher could."""
    assert offenders(("harness.real",), ("harness.backends",)) == []
    tree_imports = [f"{p.relative_to(ROOT)} imports {name}" for p in sorted((ROOT / "harness" / "real").rglob("*.py"))
                    for name in imported_names(p, module_name(p)) if name == "ray" or name.startswith("ray.")]
    assert tree_imports == []


def test_baselines_and_systems_are_independent():
    assert offenders(("baselines",), ("systems",)) == []
    assert offenders(("systems",), ("baselines",)) == []


def test_harness_core_never_names_a_system():
    assert offenders(("harness",), ("systems", "baselines")) == []


@pytest.mark.parametrize("prefix", ["harness.planning", "harness.backends"])
def test_layer_exists(prefix):
    assert any(m.startswith(prefix) for m in project_modules())


def test_backends_define_no_readiness_rule():
    """Only harness.planning.scheduler reads the dependency graph to decide what may start."""
    readers = []
    for path in sorted((ROOT / "harness" / "backends").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "dependencies":
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert readers == []
