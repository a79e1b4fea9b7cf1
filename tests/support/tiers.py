"""The suite's two tiers: ``e2e``, every test that starts a process (fairseq-train, fairseq-generate,
a demo, the study, a recipe script, a fairseq-agg command) itself, in a helper of its module or of
tests/support, or in a fixture it uses; and the rest, the fast tier of unit and contract tests
(``pytest -m "not e2e"``; README, "The two commands").

The mark is found, not written by hand: the source of a test, of the fixtures it requests and of
the functions of the tests' own code that these call, read as Python (``ast``), starts a process
where it calls one of :data:`PROCESS_HELPERS` or a process-starting function of
:data:`PROCESS_MODULES`. Session fixtures that only prepare data once
(``lm_data_bin``, ``mt_data_bin``: one fairseq-preprocess each) do not make a test e2e.
"""
import ast
import inspect
import os
import textwrap

# calls that start a process: the tests' helpers by name (run_cli(...), fr.run_cli(...)), and the
# standard library's by module (subprocess.run(...), os.system(...), mp.spawn(...))
PROCESS_HELPERS = {"run_cli", "study", "run_study", "run_demo", "run_script"}
PROCESS_MODULES = {"subprocess": {"run", "Popen", "check_call", "check_output", "call"},
                   "os": {"system", "fork", "execv", "execvp"}, "mp": {"spawn", "Process"},
                   "multiprocessing": {"Process"}}
# prepared once per session for every test that needs them; not what makes a test slow
DATA_FIXTURES = {"lm_data_bin", "mt_data_bin", "repo_root"}
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _calls(function):
    """(the calls in ``function``'s body, whether one of them starts a process): ``f(...)`` -> ``f``,
    ``m.f(...)`` -> ``("m", "f")``, ``a.b.f(...)`` -> ``f``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return set(), False
    names, starts = set(), False
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target = node.func
        if isinstance(target, ast.Attribute):
            module = getattr(target.value, "id", None)
            names.add((module, target.attr) if module else target.attr)
            starts = starts or target.attr in PROCESS_HELPERS or target.attr in PROCESS_MODULES.get(module, ())
        elif isinstance(target, ast.Name):
            names.add(target.id)
            starts = starts or target.id in PROCESS_HELPERS
    return names, starts


def _own_code(function):
    """Whether ``function`` is the tests' own code (a test module or tests/support), whose calls
    are followed; a library's are not."""
    try:
        return os.path.abspath(inspect.getsourcefile(function)).startswith(TESTS_DIR)
    except TypeError:
        return False


_found = {}  # function -> whether it starts a process (False while it is being looked at: a cycle)


def starts_processes(function) -> bool:
    """Whether ``function``, or the tests' own functions it calls (transitively), start a process."""
    if function not in _found:
        _found[function] = False
        if _own_code(function):
            names, starts = _calls(function)
            scope = getattr(function, "__globals__", {})
            _found[function] = starts or any(starts_processes(callee) for callee in (_resolve(scope, n) for n in names)
                                             if inspect.isfunction(callee))
    return _found[function]


def _resolve(scope, name):
    """The function a call names in ``scope`` (a module's globals), or None."""
    if isinstance(name, tuple):  # m.f: a function of a module the tests import
        module = scope.get(name[0])
        return getattr(module, name[1], None) if inspect.ismodule(module) else None
    return scope.get(name)


def is_e2e(item) -> bool:
    """Whether the collected test ``item`` starts a process (itself, or a fixture it requests)."""
    functions = [getattr(item, "function", None)]
    for name, definitions in getattr(item, "_fixtureinfo").name2fixturedefs.items():
        if name not in DATA_FIXTURES:
            functions += [d.func for d in definitions]
    return any(f is not None and starts_processes(f) for f in functions)


# The modules that take longest, longest first (the sums of their tests' `--durations` in a
# fresh-clone run of scripts/run_tests.sh, 7 December 2026). They are handed out first, so that the
# two workers of scripts/run_tests.sh (pytest-xdist, --dist loadfile: a module stays on one worker;
# --no-loadscope-reorder, or xdist would hand out the modules with the most tests first instead)
# end together instead of one of them starting the study's smoke last.
LONGEST_FIRST = ("test_study_tail.py", "test_pipelines_demo.py", "test_gpu_check.py", "test_study.py",
                 "test_distributed.py", "test_bench_criterion.py", "test_faults_outputs.py",
                 "test_average_checkpoints.py", "test_pipelines_wmt.py", "test_baselines_e2e.py", "test_packaging.py",
                 "test_fairseq_matrix.py", "test_faults_checkpoints.py", "test_hf_demo.py", "test_analyze.py",
                 "test_pipelines_wikitext.py", "test_pipelines_demo_mt.py", "test_coupled_adam.py")


def longest_first(items):
    """``items`` with the modules of :data:`LONGEST_FIRST` first, in its order; every module's own
    tests, and the other modules, in the order they were collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    return sorted(items, key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))
