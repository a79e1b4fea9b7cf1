"""fairseq's own tests (shipped in the fairseq-fixed sdist), run as stock fairseq, with the plugin
loaded, and with the plugin's criterion swapped in for cross-entropy (issue #56, item 5).

``scripts/setup_env.sh --test`` extracts the sdist's ``tests/`` into :data:`TESTS_SUBDIR` of the
venv. Each run copies them into a fresh directory as the package ``tests`` (their own imports are
``tests.X``), with :mod:`fairseq_own_conftest` as its ``conftest.py`` (which does the loading or the
swap), runs pytest there in a subprocess and reads each test's outcome from its JUnit XML.

Outcomes are compared with :data:`KNOWN_FILE`: the tests that fail for stock fairseq on this torch
and Python, each with its reason. The sdist ships only ``tests/test_*.py`` (setuptools' default for
an sdist). Their helper module ``tests/utils.py`` is absent, so each run copies ours,
:data:`TESTS_UTILS` (written from how the tests use it), in as ``tests/utils.py``, unless the sdist's
directory has one (a future sdist that ships it uses its own). fairseq's ``scripts/`` is absent too:
a file importing it (test_average_checkpoints) cannot be collected and is reported as *not
shipped*, not as a failure.
"""
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

MODES = ("stock", "loaded", "swapped")
TESTS_SUBDIR = os.path.join(".venv", "fairseq-own-tests", "tests")
KNOWN_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fairseq_own_tests_known.txt")
CONFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fairseq_own_conftest.py")
# the tests' helper module, which the sdist does not ship: ours, written from how the tests use it
TESTS_UTILS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fairseq_tests_utils.py")
# errors that mean "a module the sdist does not ship" (fairseq's scripts/), not a failure of fairseq
# or the plugin. With the plugin loaded from a checkout, fairseq's import_user_module puts the
# checkout on sys.path, so fairseq's scripts/ is looked for in this repository's: "No module named
# 'scripts.X'"
NOT_SHIPPED = ("No module named 'scripts'", "No module named 'scripts.")
# the swapped criterion's one-line refusal of a model it cannot train (FConv, LSTM: no linear output
# projection; fairseq_agg/fairseq_facts/output_layer.py, docs/compatibility.md): such a test runs
# "where the model allows it" only, and its outcome is "refused", not a failure
REFUSED = "has no linear output projection (decoder.output_projection); this criterion needs one"
# a known failure whose reason starts so may also pass: it fails only beside another file
FULL_SET_ONLY = "in the full set only"


def find_tests_dir(repo_root):
    """The extracted sdist tests under the repository's venv, or None when they are absent."""
    path = os.path.join(repo_root, TESTS_SUBDIR)
    return path if os.path.isfile(os.path.join(path, "test_train.py")) else None


def read_known(path=KNOWN_FILE):
    """{test key: reason} from ``key | reason`` lines (``#`` comments and blank lines skipped)."""
    known = {}
    with open(path) as lines:
        for line in lines:
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, reason = line.partition("|")
                known[key.strip()] = reason.strip()
    return known


def _key(case):
    """``test_train.TestLoadCheckpoint::test_x``; a file that failed to collect: ``test_binaries``."""
    classname, name = case.get("classname", ""), case.get("name", "")
    if not classname:
        return name.removeprefix("tests.")
    return f"{classname.removeprefix('tests.')}::{name}"


def read_junit(path):
    """{test key: passed | failed | error | skipped | not shipped | refused} from pytest's JUnit XML."""
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                text = (child.get("message") or "") + (child.text or "")
                if child.tag != "skipped" and any(marker in text for marker in NOT_SHIPPED):
                    outcome = "not shipped"
                elif child.tag != "skipped" and REFUSED in text:
                    outcome = "refused"
                break
        outcomes[_key(case)] = outcome
    return outcomes


def run(mode, tests_dir, files=(), keyword=None, timeout=None):
    """Runs fairseq's tests (``files``: names in ``tests_dir``; all when empty) in one pytest
    subprocess; returns {"mode", "said" (what the conftest did), "outcomes", "seconds", "cpu_seconds",
    "returncode", "output"}."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    with tempfile.TemporaryDirectory(prefix=f"fairseq-own-tests-{mode}-") as work:
        shutil.copytree(tests_dir, os.path.join(work, "tests"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        open(os.path.join(work, "tests", "__init__.py"), "a").close()
        if not os.path.exists(os.path.join(work, "tests", "utils.py")):  # an sdist that ships one keeps it
            shutil.copy(TESTS_UTILS, os.path.join(work, "tests", "utils.py"))
        shutil.copy(CONFTEST, os.path.join(work, "conftest.py"))
        junit, report = os.path.join(work, "junit.xml"), os.path.join(work, "said.txt")
        env = dict(os.environ, FAIRSEQ_OWN_TESTS_MODE=mode, FAIRSEQ_OWN_TESTS_REPORT=report)
        env.setdefault("OMP_NUM_THREADS", "1")
        # fairseq 0.12 reads checkpoints with torch.load naming no weights_only, and torch >= 2.6's
        # safe default refuses the argparse.Namespace fairseq stores: the tests' own checkpoints are
        # read as stock fairseq's users must on this torch (the same in every mode; the loads the
        # plugin wraps stay pinned to the safe loader, Namespace allowed, whatever this says)
        env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
        # -c /dev/null -o ...: none of this repository's pytest settings; -p no:xdist: one process
        command = [sys.executable, "-m", "pytest", "-q", "-c", os.devnull, "--rootdir", work,
                   "-p", "no:cacheprovider", "-p", "no:xdist", "--continue-on-collection-errors",
                   f"--junitxml={junit}", *(["-k", keyword] if keyword else []),
                   *[os.path.join("tests", name) for name in files or ["."]]]
        start, cpu_start = time.monotonic(), _children_cpu_seconds()
        proc = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
        seconds, cpu_seconds = time.monotonic() - start, _children_cpu_seconds() - cpu_start
        outcomes = read_junit(junit) if os.path.exists(junit) else {}
        said = open(report).read().strip() if os.path.exists(report) else ""
    return {"mode": mode, "said": said, "outcomes": outcomes, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "returncode": proc.returncode, "output": proc.stdout + proc.stderr}


def _children_cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def classify(outcomes, known):
    """{"passed", "skipped", "known" (failed as stock does), "unexpected" (failed, not known),
    "known but passed" (listed, now passes: the list is stale), "not shipped", "refused" (the
    swapped criterion refused the test's model in one line)}: sorted keys each. A parametrized test
    is known by its key without the parameters (``...::test_x``) too; a known failure "in the full
    set only" may pass."""
    groups = {name: [] for name in ("passed", "skipped", "known", "unexpected", "known but passed", "not shipped",
                                    "refused")}
    for key, outcome in sorted(outcomes.items()):
        reason = known.get(key, known.get(key.split("[")[0]))
        listed = reason is not None
        if outcome in ("failed", "error"):
            groups["known" if listed else "unexpected"].append(key)
        elif outcome == "passed" and listed and not reason.startswith(FULL_SET_ONLY):
            groups["known but passed"].append(key)
        else:
            groups[outcome].append(key)
    return groups


def summary(result, groups):
    counts = ", ".join(f"{len(keys)} {name}" for name, keys in groups.items() if keys)
    lines = [f"[{result['mode']}] {result['said']}: {counts} ({result['seconds']:.0f} s, "
             f"{result['cpu_seconds']:.0f} s of CPU)"]
    for name in ("unexpected", "known but passed"):
        lines += [f"  {name}: {key}" for key in groups[name]]
    if groups["refused"]:
        lines.append("  refused (the swapped criterion refuses the model in one line: no linear output projection): "
                     + " ".join(groups["refused"]))
    if groups["not shipped"]:
        lines.append("  not shipped (import fairseq's scripts/, absent from the sdist): "
                     + " ".join(groups["not shipped"]))
    return "\n".join(lines)
