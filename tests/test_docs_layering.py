"""The package layering stays true: who may import whom, stage order inside analysis/, no cycles.

Read from the source (every `import`, including those inside functions), so a violation fails here
before anyone notices it at run time. docs/ARCHITECTURE.md states the same rules in words.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "launcher", "trainer", "traces", "analysis")

MAY_IMPORT = {
    "traces": set(),
    "trainer": {"traces"},
    "analysis": {"traces"},
    "launcher": {"traces", "trainer"},
    "cli": {"traces", "trainer", "analysis", "launcher"},
}
"""Top-level packages each package may import besides itself (data flows launcher -> trainer -> traces
-> analysis; only the CLI composes them)."""

ANALYSIS_STAGES = {"quantities": -1, "inputs": 0, "per_rank": 1, "cross_rank": 2, "whatif": 2.5, "report": 3, "render": 4,
                   "merge": 4}
"""Stage order inside analysis/: a stage imports only earlier stages (render and merge are peers and do
not import each other); whatif (the dependency model and its replay) builds on the cross-rank matching and
comes before the report; quantities.py, the one definition of every printed quantity, comes before them all;
the top-level modules (analyze, compare, synthetic) may import every stage."""


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["fleetscope", *parts])


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """(imported fleetscope module or name, at module level?) for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            names = [base]
        else:
            continue
        found += [(name, id(node) in top_level) for name in names if name.startswith("fleetscope.")]
    return found


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def test_top_level_packages_import_only_what_the_data_flow_allows():
    violations = []
    for module, path in all_modules().items():
        own = module.split(".")[1]
        for imported, _ in imports_of(path):
            other = imported.split(".")[1]
            if other != own and other not in MAY_IMPORT[own]:
                violations.append(f"{module} imports {imported}")
    assert not violations, "\n".join(violations)


def test_analysis_stages_import_only_earlier_stages():
    violations = []
    for module, path in all_modules().items():
        stage = _stage_of(module)
        if stage is None:
            continue  # the top-level analysis modules compose the stages
        for imported, _ in imports_of(path):
            if imported.startswith("fleetscope.analysis") and _stage_of(imported) is None:
                violations.append(f"{module} imports the top level: {imported}")
                continue
            target = _stage_of(imported)
            if target is None or target == stage:
                continue
            if ANALYSIS_STAGES[target] >= ANALYSIS_STAGES[stage]:
                violations.append(f"{module} ({stage}) imports {imported} ({target})")
    assert not violations, "\n".join(violations)


def _stage_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "analysis" and parts[2] in ANALYSIS_STAGES:
        return parts[2]
    return None


def test_the_perfetto_protocol_layer_knows_nothing_of_kineto_or_analysis():
    layer = ROOT / "analysis" / "merge" / "perfetto"
    violations = [f"{module_name(path)} imports {imported}"
                  for path in layer.rglob("*.py") for imported, _ in imports_of(path)
                  if not imported.startswith("fleetscope.analysis.merge.perfetto")]
    assert not violations, "\n".join(violations)


def test_no_import_cycles_between_modules():
    """Imports inside functions count too: a cycle hidden in a function is still a cycle of design."""
    modules = all_modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for imported, _ in imports_of(path):
            target = _known(imported, modules)
            if target and target != module:
                graph[module].add(target)
    cycles = _cycles(graph)
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module an import refers to (`from a.b import c` may name a module a.b.c or a name in a.b)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found
