"""The import rules of docs/architecture.md, read from the code's own import statements.

* no import cycle between the package's modules, and no import of the command line
  (``fairseq_agg_cli``) from the package: the CLI calls the package, never the reverse;
* the floors: a module imports only from its own floor or the floors below it
  (:data:`FLOORS`, the table of docs/architecture.md);
* tests import nothing from ``scripts/`` (commands only), and ``scripts/`` nothing from
  ``study/`` or ``examples/``.
"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "fairseq_agg"

# floor of each part of the package, bottom up (docs/architecture.md, "The floors"); the longest
# matching prefix decides. The package's __init__ registers everything and is left out: it loads
# the fairseq glue by name (importlib), which draws no import arrow.
FLOORS = {
    "fairseq_agg.errors": 0, "fairseq_agg.files": 0,
    "fairseq_agg.fairseq_facts": 1,
    "fairseq_agg.stats.metrics": 1,
    "fairseq_agg.ops": 2,
    "fairseq_agg.modules": 2,
    "fairseq_agg.stats": 2,
    "fairseq_agg.analysis": 3,
    "fairseq_agg.models": 3, "fairseq_agg.optim": 3, "fairseq_agg.criterions": 3,
    "fairseq_agg.tools": 4, "fairseq_agg.flags": 4,
}


def module_files(folder):
    for base, _, names in os.walk(os.path.join(ROOT, folder)):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(base, name)


def module_name(path):
    rel = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def imported_modules(path):
    """Every module an ``import`` / ``from ... import`` statement of the file names, at any depth
    (imports inside functions count), relative imports resolved; ``from P import name`` counts as
    ``P.name`` when that is a module of the tree, else as ``P``."""
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                is_module = any(os.path.exists(os.path.join(ROOT, *candidate.split(".")) + ext)
                                for ext in (".py", os.sep + "__init__.py"))
                out.add(candidate if is_module else source)
    return out


def package_graph():
    modules = {module_name(p): p for p in module_files(PACKAGE)}
    return {m: {i for i in imported_modules(p) if i in modules} for m, p in modules.items()}, modules


def floor_of(module):
    prefixes = [p for p in FLOORS if module == p or module.startswith(p + ".")]
    return FLOORS[max(prefixes, key=len)] if prefixes else None


def test_the_package_has_no_import_cycle():
    graph, _ = package_graph()
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_the_package_never_imports_the_command_line():
    _, modules = package_graph()
    offenders = [m for m, p in modules.items() if "fairseq_agg_cli" in imported_modules(p)]
    assert not offenders


def test_every_module_has_a_floor_and_imports_only_at_or_below_it():
    graph, _ = package_graph()
    unplaced = sorted(m for m in graph if m != PACKAGE and floor_of(m) is None)
    assert not unplaced, f"add these to FLOORS and docs/architecture.md: {unplaced}"
    upward = [(m, i) for m, targets in graph.items() if m != PACKAGE
              for i in targets if i != PACKAGE and floor_of(i) > floor_of(m)]
    assert not upward, upward


def script_modules():
    """The top-level names of scripts/: the folder, and each command's module (as a pythonpath
    entry would expose it)."""
    return {"scripts"} | {os.path.basename(p)[: -len(".py")] for p in module_files("scripts")}


@pytest.mark.parametrize("folder, forbidden", [
    ("tests", script_modules()),
    ("scripts", {"study", "examples"}),
])
def test_folders_import_only_what_their_role_allows(folder, forbidden):
    offenders = [(os.path.relpath(p, ROOT), i) for p in module_files(folder) for i in imported_modules(p)
                 if i.split(".")[0] in forbidden - {"__init__"}]
    assert not offenders, offenders


def test_the_floor_rules_would_catch_an_upward_import(tmp_path):
    """The rule above is not vacuous: ops importing a criterion is an upward arrow."""
    assert floor_of("fairseq_agg.ops.agg") < floor_of("fairseq_agg.criterions.agg")
    assert floor_of("fairseq_agg.errors") < floor_of("fairseq_agg.ops.agg") < floor_of("fairseq_agg.flags")
    probe = tmp_path / "probe.py"
    probe.write_text("from fairseq_agg.criterions import agg\nimport fairseq_agg_cli\n")
    found = imported_modules(str(probe))
    assert "fairseq_agg.criterions.agg" in found and "fairseq_agg_cli" in found
