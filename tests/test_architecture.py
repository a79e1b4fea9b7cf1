"""The import rules of docs/architecture.md, read from the code's own import statements.

* inside the package (``fairseq_agg``, its root included): no import cycle; every module on a
  floor, importing only from its own floor or the floors below it (:data:`FLOORS`, the table "The
  floors"); no fairseq in the modules that promise none (:data:`FAIRSEQ_FREE`), and on the bottom
  floors no package beyond the standard library but those their row names (:data:`THIRD_PARTY`);
* outside it, each folder of the checkout has one row of the second table and imports only the
  parts of the checkout that row allows (:data:`ROLES`): the package never imports the command
  line, the plugin directory or any folder; examples/ and study/ import the package, study/ also
  examples/; tests import nothing from ``scripts/``, and ``scripts/`` nothing from ``study/`` or
  ``examples/``.

Each rule is a function of a tree and its tables; a probe tree that breaks each rule shows the
function finds the break (the ``probe`` tests at the end).
"""
import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "fairseq_agg"

# floor of each part of the package, bottom up (docs/architecture.md, "The floors"); the longest
# matching prefix decides, and the package root (a name without a dot) is matched only by itself
FLOORS = {
    "fairseq_agg.errors": 0, "fairseq_agg.files": 0, "fairseq_agg.requirements": 0,
    "fairseq_agg.fairseq_facts": 1,
    "fairseq_agg.stats.metrics": 1,
    "fairseq_agg.ops": 2,
    "fairseq_agg.modules": 2,
    "fairseq_agg.stats": 2,
    "fairseq_agg.analysis": 3, "fairseq_agg.registration": 3, "fairseq_agg.tasks": 3,
    "fairseq_agg.models": 3, "fairseq_agg.optim": 3, "fairseq_agg.criterions": 3, "fairseq_agg.hf": 3,
    "fairseq_agg.tools": 4, "fairseq_agg.flags": 4,
    "fairseq_agg": 5,
}
# the modules that import no fairseq (the "imports" column): a name, or NAME.* for all below it
FAIRSEQ_FREE = ("fairseq_agg", "fairseq_agg.errors", "fairseq_agg.files", "fairseq_agg.stats.metrics",
                "fairseq_agg.ops", "fairseq_agg.ops.*", "fairseq_agg.optim", "fairseq_agg.optim.coupled_adam",
                "fairseq_agg.hf", "fairseq_agg.hf.*")
FAIRSEQ = ("fairseq", "fairseq_cli")
# the one part of the package that imports Hugging Face's libraries (the floors' table, hf/)
HF_PART, HF_LIBRARIES = "fairseq_agg.hf", ("transformers", "accelerate")
# the only packages beyond the standard library that these modules import (the "imports" column)
THIRD_PARTY = {"fairseq_agg.errors": set(), "fairseq_agg.files": set(), "fairseq_agg.stats.metrics": {"torch"},
               "fairseq_agg.requirements": {"torch", "fairseq"}}

# each part of the checkout outside the package (docs/architecture.md, second table) -> the parts
# it may import. A part is a top-level folder or module; a bare name on a pythonpath entry (the
# tests' support modules, the commands of scripts/) counts as the folder that holds it.
ROLES = {
    PACKAGE: {PACKAGE},
    "fairseq_agg_cli.py": set(),  # the package only by name (importlib), once the arguments parse
    "fairseq_agg_plugin": {PACKAGE},
    "examples": {PACKAGE, "examples", "study/harness"},
    "study/harness": {PACKAGE, "study/harness"},  # a folder's row holds for its files, a sub-folder's row for its own
    "study": {PACKAGE, "study", "study/harness", "examples"},
    "benchmarks": {PACKAGE, "benchmarks", "tests"},
    "scripts": {PACKAGE, "scripts", "benchmarks", "tests"},
    "tests": {PACKAGE, "fairseq_agg_cli", "fairseq_agg_plugin", "examples", "study", "study/harness", "benchmarks", "tests"},
}
BARE_NAMES_OF = ("tests/support", "scripts")  # folders whose modules are also imported by bare name


# ----------------------------------------------------------------------------------------------
# reading a tree


def module_files(root, folder):
    """The .py files under ``folder`` (or the file itself)."""
    path = os.path.join(root, folder)
    if path.endswith(".py"):
        yield from [path] if os.path.isfile(path) else []
        return
    for base, _, names in sorted(os.walk(path)):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(base, name)


def module_name(root, path):
    rel = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def import_statements(tree, in_functions):
    """The import statements of a module's tree; without ``in_functions``, only those that run
    when the module is imported (not inside a function's body)."""
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif in_functions or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))


def imported_modules(root, path, in_functions=True):
    """Every module an ``import`` / ``from ... import`` statement of the file names, at any depth
    (imports inside functions count, unless ``in_functions`` is false), relative imports resolved;
    ``from P import name`` counts as ``P.name`` when that is a module of the tree, else as ``P``."""
    name = module_name(root, path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in import_statements(tree, in_functions):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module
        for alias in node.names:
            candidate = f"{source}.{alias.name}"
            is_module = any(os.path.exists(os.path.join(root, *candidate.split(".")) + ext)
                            for ext in (".py", os.sep + "__init__.py"))
            out.add(candidate if is_module else source)
    return out


def package_graph(root, package):
    """{module: the package's modules it imports} over every module of ``package``, its root included."""
    modules = {module_name(root, p): p for p in module_files(root, package)}
    return {m: {i for i in imported_modules(root, p) if i in modules} for m, p in modules.items()}


# ----------------------------------------------------------------------------------------------
# the rules, each a list of what breaks it


def import_cycles(graph):
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
    return cycles


def floor_of(module, floors=FLOORS):
    prefixes = [p for p in floors if module == p or ("." in p and module.startswith(p + "."))]
    return floors[max(prefixes, key=len)] if prefixes else None


def unplaced_modules(graph, floors):
    return sorted(m for m in graph if floor_of(m, floors) is None)


def upward_imports(graph, floors):
    return sorted((m, i) for m, targets in graph.items() for i in targets
                  if None not in (floor_of(m, floors), floor_of(i, floors)) and floor_of(i, floors) > floor_of(m, floors))


def fairseq_imports(root, package, free):
    """(module, fairseq module) for each module of ``free`` (names, or NAME.* for all below NAME)
    whose own statements import fairseq (inside a function too), or whose import loads a module of
    the package that does (its module-level imports, followed through the package, parents included)."""
    paths = {module_name(root, p): p for p in module_files(root, package)}

    def promised(module):
        return any(module == p or (p.endswith(".*") and module.startswith(p[:-1])) for p in free)

    def loaded_by(module):
        seen, pending = set(), [module]
        while pending:
            current = pending.pop()
            if current in seen or current not in paths:
                continue
            seen.add(current)
            for imported in imported_modules(root, paths[current], in_functions=False):
                parts = imported.split(".")
                pending += [".".join(parts[:n]) for n in range(1, len(parts) + 1)]
        return seen

    found = set()
    for module in filter(promised, paths):
        found.update((module, i) for i in imported_modules(root, paths[module]) if i.split(".")[0] in FAIRSEQ)
        found.update((module, i) for loaded in loaded_by(module) - {module}
                     for i in imported_modules(root, paths[loaded], in_functions=False) if i.split(".")[0] in FAIRSEQ)
    return sorted(found)


def hf_imports_outside(root, package, part=HF_PART):
    """(module, imported name) for each import of transformers or accelerate (inside a function too)
    by a module of ``package`` outside ``part``."""
    return sorted((module_name(root, path), i) for path in module_files(root, package)
                  if not (module_name(root, path) + ".").startswith(part + ".")
                  for i in imported_modules(root, path) if i.split(".")[0] in HF_LIBRARIES)


def third_party_breaks(root, package, allowed):
    """(module, imported top-level name) for each import, by a module named in ``allowed``, of a
    package that is neither the standard library, nor ``package``, nor one ``allowed`` names for it."""
    return sorted((module_name(root, path), top) for path in module_files(root, package)
                  if module_name(root, path) in allowed
                  for top in {i.split(".")[0] for i in imported_modules(root, path)}
                  if top not in sys.stdlib_module_names and top != package
                  and top not in allowed[module_name(root, path)])


def part_of(root, imported, roles):
    """The part of the checkout an imported name belongs to, or None (the standard library, a
    third-party package)."""
    top = imported.split(".")[0]
    dotted = {os.path.splitext(part)[0].replace("/", "."): os.path.splitext(part)[0] for part in roles}
    for name in sorted(dotted, key=len, reverse=True):  # the most specific row: study.harness before study
        if imported == name or imported.startswith(name + "."):
            return dotted[name]
    for folder in BARE_NAMES_OF:
        if os.path.exists(os.path.join(root, folder, top + ".py")):
            return folder.split("/")[0]
    return None


def own_files(root, part, roles):
    """The files of ``part`` that no more specific row (a sub-folder's) covers."""
    inner = [other for other in roles if other != part and other.startswith(part + "/")]
    return [path for path in module_files(root, part)
            if not any(os.path.relpath(path, root).startswith(other + "/") for other in inner)]


def role_breaks(root, roles):
    """(file, imported name) for each import of a part of the checkout that its part's row does not allow."""
    breaks = []
    for part, allowed in roles.items():
        for path in own_files(root, part, roles):
            for imported in imported_modules(root, path):
                target = part_of(root, imported, roles)
                if target is not None and target not in allowed:
                    breaks.append((os.path.relpath(path, root), imported))
    return sorted(breaks)


NOT_PARTS = ("build", "dist")  # what building a wheel in place leaves


def parts_without_a_row(root, roles):
    """Top-level folders holding Python code that the second table does not name."""
    return sorted(name for name in os.listdir(root)
                  if os.path.isdir(os.path.join(root, name)) and not name.startswith(".")
                  and name not in roles and name not in NOT_PARTS and any(module_files(root, name)))


# ----------------------------------------------------------------------------------------------
# the checkout

needs_stdlib_names = pytest.mark.skipif(not hasattr(sys, "stdlib_module_names"),
                                        reason="the standard library's module names need Python >= 3.10")


def test_the_package_has_no_import_cycle():
    assert not import_cycles(package_graph(ROOT, PACKAGE))


def test_every_module_has_a_floor_and_imports_only_at_or_below_it():
    graph = package_graph(ROOT, PACKAGE)
    assert PACKAGE in graph  # the root is covered like any module
    assert not unplaced_modules(graph, FLOORS), "add these to FLOORS and docs/architecture.md"
    assert not upward_imports(graph, FLOORS)


def test_the_core_imports_no_fairseq():
    assert not fairseq_imports(ROOT, PACKAGE, FAIRSEQ_FREE)


def test_only_hf_imports_hugging_faces_libraries():
    assert not hf_imports_outside(ROOT, PACKAGE)


@needs_stdlib_names
def test_the_bottom_floors_import_only_what_their_row_names():
    assert not third_party_breaks(ROOT, PACKAGE, THIRD_PARTY)


def test_each_part_imports_only_what_its_role_allows():
    assert not role_breaks(ROOT, ROLES)


def test_every_folder_has_a_role():
    assert not parts_without_a_row(ROOT, ROLES), "add a row to ROLES and docs/architecture.md"


# ----------------------------------------------------------------------------------------------
# probes: a tree that breaks one rule, and the rule's function finds it


def write_tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


PROBE_FLOORS = {"probe.low": 0, "probe.high": 1, "probe.glue": 1, "probe": 2}


def test_probe_an_upward_import_breaks_the_floors(tmp_path):
    root = write_tree(tmp_path, {"probe/__init__.py": "", "probe/high.py": "from probe import low\n",
                                 "probe/low.py": "def f():\n    from . import high\n"})
    graph = package_graph(root, "probe")
    assert graph["probe.low"] == {"probe.high"} and graph["probe.high"] == {"probe.low"}
    assert upward_imports(graph, PROBE_FLOORS) == [("probe.low", "probe.high")]


def test_probe_the_root_imported_back_is_a_cycle_and_an_upward_import(tmp_path):
    # the shape this package had: the root loads the glue, the glue imports a helper from the root
    root = write_tree(tmp_path, {"probe/__init__.py": "from probe.glue import register\n",
                                 "probe/glue.py": "from probe import require\n"})
    graph = package_graph(root, "probe")
    assert import_cycles(graph) == [["probe", "probe.glue", "probe"]]
    assert upward_imports(graph, PROBE_FLOORS) == [("probe.glue", "probe")]


def test_probe_a_module_without_a_floor(tmp_path):
    root = write_tree(tmp_path, {"probe/__init__.py": "", "probe/low.py": "", "probe/stray.py": ""})
    assert unplaced_modules(package_graph(root, "probe"), PROBE_FLOORS) == ["probe.stray"]
    # the root's floor is its own, not a default for every module below it
    assert floor_of("probe.stray", PROBE_FLOORS) is None and floor_of("probe", PROBE_FLOORS) == 2


def test_probe_fairseq_in_a_fairseq_free_part(tmp_path):
    root = write_tree(tmp_path, {"probe/__init__.py": "", "probe/low.py": "def f():\n    import fairseq.options\n",
                                 "probe/high.py": "from fairseq_cli import train\n"})
    assert fairseq_imports(root, "probe", ("probe.low",)) == [("probe.low", "fairseq.options")]
    assert fairseq_imports(root, "probe", ("probe",)) == []  # the root alone, not what is below it
    assert fairseq_imports(root, "probe", ("probe.*",)) == [("probe.high", "fairseq_cli"),
                                                           ("probe.low", "fairseq.options")]


def test_probe_transformers_outside_hf(tmp_path):
    root = write_tree(tmp_path, {"probe/__init__.py": "", "probe/hf/__init__.py": "import transformers\n",
                                 "probe/ops.py": "def f():\n    from accelerate import Accelerator\n"})
    assert hf_imports_outside(root, "probe", "probe.hf") == [("probe.ops", "accelerate")]


@needs_stdlib_names
def test_probe_a_third_party_import_on_a_floor_that_names_none(tmp_path):
    root = write_tree(tmp_path, {"probe/__init__.py": "", "probe/low.py": "import os, json\nimport numpy\n"
                                                                         "from probe import high\n",
                                 "probe/high.py": "import torch\n"})
    assert third_party_breaks(root, "probe", {"probe.low": set(), "probe.high": {"torch"}}) == [("probe.low", "numpy")]


def test_probe_fairseq_loaded_through_a_module_a_fairseq_free_part_imports(tmp_path):
    root = write_tree(tmp_path, {"probe/__init__.py": "", "probe/sub/__init__.py": "from probe import glue\n",
                                 "probe/sub/low.py": "X = 1\n", "probe/glue.py": "import fairseq\n",
                                 "probe/core.py": "from probe.sub.low import X\n\ndef f():\n    from probe import high\n",
                                 "probe/high.py": "import fairseq_cli\n"})
    # importing probe.core runs probe/sub/__init__.py, which imports glue; high is imported only
    # inside a function
    assert fairseq_imports(root, "probe", ("probe.core",)) == [("probe.core", "fairseq")]


@pytest.mark.parametrize("path, text", [
    ("fairseq_agg/x.py", "import fairseq_agg_cli\n"),  # the package never imports the command line
    ("fairseq_agg/x.py", "from fairseq_agg_plugin import y\n"),
    ("fairseq_agg/x.py", "from study import store\n"),
    ("fairseq_agg_cli.py", "import fairseq_agg\n"),  # no import statement of the package
    ("fairseq_agg_plugin/__init__.py", "from examples import demo_common\n"),
    ("examples/x.py", "from study import store\n"),
    ("study/harness/x.py", "from study import store\n"),
    ("study/harness/x.py", "from examples import demo_common\n"),
    ("study/x.py", "from scripts import gpu_check\n"),
    ("study/x.py", "import fairseq_runs\n"),  # tests/support, by its bare name
    ("scripts/x.py", "from examples import demo_common\n"),
    ("benchmarks/x.py", "from study import store\n"),
    ("benchmarks/x.py", "from scripts import gpu_check\n"),
    ("tests/test_x.py", "import gpu_check\n"),  # scripts/, by its bare name
    ("tests/test_x.py", "from scripts.gpu_check import main\n"),
])
def test_probe_an_import_a_role_does_not_allow(tmp_path, path, text):
    files = {"tests/support/fairseq_runs.py": "", "scripts/gpu_check.py": "", "fairseq_agg/__init__.py": ""}
    root = write_tree(tmp_path, {**files, path: text})
    assert len(role_breaks(root, ROLES)) == 1


def test_probe_a_folder_without_a_role(tmp_path):
    root = write_tree(tmp_path, {"examples/x.py": "", "benches/y.py": "", "docs/readme.md": ""})
    assert parts_without_a_row(root, ROLES) == ["benches"]


def test_probe_the_tree_reader_sees_every_kind_of_import(tmp_path):
    root = write_tree(tmp_path, {"probe/__init__.py": "", "probe/low.py": "",
                                 "probe/sub/__init__.py": "from .. import low\nfrom ..low import f\n"
                                                          "import probe.high as h\nfrom probe import name\n"})
    found = imported_modules(root, os.path.join(root, "probe", "sub", "__init__.py"))
    assert found == {"probe.low", "probe.high", "probe"}
