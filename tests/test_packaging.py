"""The package as pip installs it: built from its sdist, installed into an environment that already
holds torch and fairseq, it changes neither and works as fairseq's --user-dir.

No second torch or fairseq is installed: the test environments are fresh venvs that see this
environment's packages through a .pth file, via a directory of links that leaves out this
checkout's own (editable) install, and pip runs with --no-index and no configuration, so it can
take nothing from anywhere else. pip's install report lists what it would have changed.
"""
import email
import glob
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest
import torch

import fairseq
import fairseq_agg
import fairseq_runs as fr

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what the sdist is built from (the rest of the checkout is not part of the package)
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "fairseq_agg_cli.py", "fairseq_agg",
           "fairseq_agg_plugin")
SITE_PACKAGES = sysconfig.get_paths()["purelib"]


def _clean_env(**extra):
    """os.environ without pip settings, without PYTHONPATH and with pip's config files off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", **extra)
    return env


def _run(cmd, cwd, env=None, expect_ok=True, timeout=600):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or _clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def _pip(*args, cwd):
    return _run([sys.executable, "-m", "pip", *args], cwd=cwd)


def _distribution_of(module_name):
    """The installed distribution that provides the import name ``module_name``."""
    names = importlib.metadata.packages_distributions().get(module_name, [])
    assert len(names) == 1, (module_name, names)
    return names[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """sdist of the checkout's package sources, and the wheel pip builds from that sdist."""
    root = tmp_path_factory.mktemp("build")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        path = os.path.join(REPO, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    dist = root / "dist"
    # the PEP 517 hook a frontend calls; build isolation off, as in scripts/setup_env.sh
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    sdist = dist / _run([sys.executable, "-c", code, dist], cwd=src).stdout.strip().splitlines()[-1]
    unpacked = root / "unpacked"
    with tarfile.open(sdist) as tar:
        tar.extractall(unpacked, filter="data")
    (sdist_dir,) = unpacked.iterdir()
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, sdist_dir, cwd=root)
    (wheel,) = glob.glob(str(dist / "*.whl"))
    return {"sdist": str(sdist), "wheel": wheel, "root": root}


def _wheel_file(wheel, suffix):
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith(suffix))).decode()


def _wheel_metadata(wheel):
    with zipfile.ZipFile(wheel) as zf:
        files = zf.namelist()
    return email.message_from_string(_wheel_file(wheel, ".dist-info/METADATA")), files


def test_sdist_and_wheel_contents(built):
    with tarfile.open(built["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "LICENSE", "fairseq_agg_cli.py", "fairseq_agg/__init__.py"} <= names
    meta, files = _wheel_metadata(built["wheel"])
    assert meta["Name"] == "fairseq-agg" and meta["Version"] == fairseq_agg.__version__
    assert meta["License-Expression"] == "MIT"
    assert any(f.endswith(".dist-info/licenses/LICENSE") for f in files)
    assert "fairseq_agg_cli.py" in files and "fairseq_agg/criterions/agg.py" in files
    assert "fairseq_agg_plugin/__init__.py" in files  # what --user-dir loads
    assert not any(f.startswith(("tests/", "examples/", "study/", "scripts/")) for f in files)
    entry_points = _wheel_file(built["wheel"], ".dist-info/entry_points.txt")
    assert "fairseq-agg = fairseq_agg_cli:main" in entry_points
    assert "fairseq-agg-analyze = fairseq_agg_cli:analyze_main" in entry_points


def test_wheel_holds_no_test_or_benchmark_code(built):
    """Only what a user runs: the benchmarks and the accelerator check (scripts/), and the tests'
    helpers and the reference constructions they share with them (tests/support/) stay in the checkout."""
    _, files = _wheel_metadata(built["wheel"])
    checkout_only = {os.path.basename(path) for folder in ("tests", "scripts")
                     for path in glob.glob(os.path.join(REPO, folder, "**", "*.py"), recursive=True)
                     if os.path.basename(path) != "__init__.py"}  # a package's (tests/support/zloss_plugin) is no name
    assert {"gpu_check.py", "bench_criterion.py", "reference_constructions.py", "fairseq_runs.py"} <= checkout_only
    assert not [f for f in files if os.path.basename(f) in checkout_only]
    assert not [f for f in files if re.search(r"(^|/)(tests?|testing|benchmarks?)/", f)]
    with zipfile.ZipFile(built["wheel"]) as zf:
        importing_pytest = [name for name in zf.namelist() if name.endswith(".py")
                            and re.search(rb"^\s*(import|from)\s+pytest\b", zf.read(name), re.M)]
    assert not importing_pytest


def test_requirements_never_replace_torch_or_fairseq(built):
    """Whatever fairseq distribution provides ``import fairseq`` (stock fairseq 0.12.x, a source
    install of fairseq main, fairseq-fixed), no requirement names another one, and torch is not
    pinned: only the `fairseq` extra asks for the fork."""
    meta, _ = _wheel_metadata(built["wheel"])
    requirements = meta.get_all("Requires-Dist")
    by_name = {}
    for req in requirements:
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("_", "-")
        by_name.setdefault(name, []).append(req)
    assert by_name["torch"] == ["torch"]
    assert "fairseq" not in by_name
    assert by_name["fairseq-fixed"] == ['fairseq-fixed==0.12.3.1; extra == "fairseq"']
    assert meta["Requires-Python"] == ">=3.9"


# imported by the package only when the user asks for them, and refused with a message naming what
# to install when missing: Triton (the compiled path on a GPU, part of CUDA builds of torch) and the
# foreign kernels of --output-kernel liger / cce
OPTIONAL_IMPORTS = {"triton", "liger_kernel", "cut_cross_entropy"}
# the checkout's own top-level modules, imported by bare name (tests/support is on pytest's path)
OWN_MODULES = {"fairseq_agg", "fairseq_agg_cli", "fairseq_agg_plugin", "benchmarks", "examples", "study", "scripts", "tests"} | {
    os.path.splitext(name)[0] for folder in ("tests", os.path.join("tests", "support"))
    for name in os.listdir(os.path.join(REPO, folder))
    if name.endswith(".py") or os.path.isfile(os.path.join(REPO, folder, name, "__init__.py"))}


def _normal(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements_by_extra(meta):
    """{extra or None: {normalised distribution name}} of the wheel's Requires-Dist."""
    out = {}
    for req in meta.get_all("Requires-Dist"):
        name = _normal(re.match(r"[A-Za-z0-9_.-]+", req).group(0))
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", req)
        out.setdefault(extra.group(1) if extra else None, set()).add(name)
    return out


def _fairseqs_requirements():
    """The distribution that provides ``import fairseq`` and what it requires itself (no extras)."""
    dist = _distribution_of("fairseq")
    reqs = [r for r in importlib.metadata.requires(dist) or [] if "extra ==" not in r]
    return {_normal(dist)} | {_normal(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) for r in reqs}


def _third_party_imports(*paths):
    """{top-level module: [file, ...]} of the absolute imports in the .py files under ``paths``
    (anywhere in a file, lazy imports included), without the standard library and the checkout's
    own modules."""
    import ast

    files = []
    for path in paths:
        full = os.path.join(REPO, path)
        files += [full] if full.endswith(".py") else glob.glob(os.path.join(full, "**", "*.py"), recursive=True)
    found = {}
    for file in files:
        with open(file, encoding="utf-8") as f:
            tree = ast.parse(f.read(), file)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in OWN_MODULES:
                    found.setdefault(top, []).append(os.path.relpath(file, REPO))
    return found


def _unprovided(imports, distributions):
    """The modules of ``imports`` that no distribution of ``distributions`` provides here."""
    provided = importlib.metadata.packages_distributions()
    return {module: files for module, files in imports.items() if module not in OPTIONAL_IMPORTS
            and not {_normal(d) for d in provided.get(module, [])} & distributions}


needs_stdlib_names = pytest.mark.skipif(not hasattr(sys, "stdlib_module_names"),
                                        reason="the standard library's module names need Python >= 3.10")


@needs_stdlib_names
def test_install_requirements_are_what_the_package_imports(built):
    """Each install requirement is imported by the package, and the package imports nothing that
    neither they nor fairseq (which brings numpy and omegaconf) provide: what only the demos, the
    study or the tests need is in the extras."""
    meta, _ = _wheel_metadata(built["wheel"])
    required = _requirements_by_extra(meta)[None]
    imports = _third_party_imports("fairseq_agg", "fairseq_agg_cli.py", "fairseq_agg_plugin")
    # the Hugging Face front end (fairseq_agg/hf/) is the one part whose imports the `hf` extra provides
    front_end = os.path.join("fairseq_agg", "hf") + os.sep
    hf_only = {module: files for module, files in imports.items() if all(f.startswith(front_end) for f in files)}
    rest = {module: files for module, files in imports.items() if module not in hf_only}
    assert not _unprovided(rest, required | _fairseqs_requirements())
    assert not _unprovided(hf_only, required | _requirements_by_extra(meta)["hf"])
    provided = importlib.metadata.packages_distributions()
    imported = {_normal(d) for module in imports for d in provided.get(module, [])}
    assert required <= imported, f"required but never imported by the package: {sorted(required - imported)}"


@needs_stdlib_names
def test_examples_study_and_tests_need_only_the_extras(built):
    """The demo and study commands install the package with [examples], the test command with
    [examples,test] (scripts/setup_env.sh); each set of folders imports nothing more."""
    meta, _ = _wheel_metadata(built["wheel"])
    extras = _requirements_by_extra(meta)
    assert {"sacrebleu", "sacremoses", "sentencepiece"} <= extras["examples"]
    assert {"pytest", "tensorboardx"} <= extras["test"]
    base = extras[None] | _fairseqs_requirements()
    assert not _unprovided(_third_party_imports("examples", "study"), base | extras["examples"])
    assert not _unprovided(_third_party_imports("examples", "study", "tests", "scripts", "benchmarks"),
                           base | extras["examples"] | extras["test"])
    with open(os.path.join(REPO, "scripts", "setup_env.sh"), encoding="utf-8") as f:
        setup = f.read()
    assert 'extra="[examples]"' in setup and 'extra="[examples,test]"' in setup


def _venv_with_links(path, leave_out):
    """A venv whose sys.path also holds links to this environment's packages, minus ``leave_out``
    (names matched by prefix) and this checkout's install; returns (python, site-packages)."""
    _run([sys.executable, "-m", "venv", "--without-pip", path], cwd=os.path.dirname(path))
    python = os.path.join(path, "bin", "python")
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=path).stdout.strip()
    links = os.path.join(path, "outer-packages")
    os.mkdir(links)
    skip = ("fairseq_agg", "__editable__", "_distutils_hack") + tuple(leave_out)
    for name in os.listdir(SITE_PACKAGES):
        if not name.startswith(skip) and not name.endswith(".pth"):
            os.symlink(os.path.join(SITE_PACKAGES, name), os.path.join(links, name))
    with open(os.path.join(purelib, "outer-packages.pth"), "w") as f:
        f.write(links + "\n")
    return python, purelib


_VERSIONS = ("import importlib.metadata as m, json, os, torch, fairseq; "
             "print(json.dumps([torch.__version__, os.path.realpath(torch.__file__), "
             "m.version({dist!r}), os.path.realpath(fairseq.__file__)]))")


def test_install_into_an_environment_with_torch_and_fairseq(built, lm_data_bin, tmp_path):
    fairseq_dist = _distribution_of("fairseq")
    python, purelib = _venv_with_links(str(tmp_path / "venv"), leave_out=())
    versions = _VERSIONS.format(dist=fairseq_dist)
    before = json.loads(_run([python, "-c", versions], cwd=tmp_path).stdout)
    assert before == [torch.__version__, os.path.realpath(torch.__file__), importlib.metadata.version(fairseq_dist),
                      os.path.realpath(fairseq.__file__)]

    # with dependencies: everything the package needs must already be there
    report = tmp_path / "report.json"
    _pip("--python", python, "install", "--no-index", "--report", report, built["wheel"], cwd=tmp_path)
    installed = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installed == ["fairseq-agg"]
    assert json.loads(_run([python, "-c", versions], cwd=tmp_path).stdout) == before
    own = os.listdir(purelib)
    assert not [n for n in own if re.match(r"(torch|fairseq)(?!_agg)", n)], own

    # the installed package, not the checkout, from an unrelated working directory
    where = _run([python, "-c", "import fairseq_agg, fairseq_agg_cli; print(fairseq_agg.__file__); "
                  "print(fairseq_agg_cli.__file__)"], cwd=tmp_path).stdout.split()
    installed_dir = os.path.join(purelib, "fairseq_agg")
    assert where == [os.path.join(installed_dir, "__init__.py"), os.path.join(purelib, "fairseq_agg_cli.py")]
    printed = _run([os.path.join(os.path.dirname(python), "fairseq-agg")], cwd=tmp_path).stdout.strip()
    assert printed == os.path.join(purelib, "fairseq_agg_plugin")

    # a real training run with the plugin's criterion, loaded by fairseq from the installed
    # directory (python -m fairseq_cli.train is what the fairseq-train script runs)
    proc = _run([python, "-m", "fairseq_cli.train", lm_data_bin, "--user-dir", printed, *fr.TINY_LM_ARGS,
                 "--criterion", "cross_entropy_agg", "--max-update", "3", "--no-save", "--log-format", "json"],
                cwd=tmp_path, env=_clean_env(OMP_NUM_THREADS="2"))
    records = [r for r in fr.read_json_log(proc.stdout + proc.stderr) if "agg_rare" in r]
    assert records and records[-1]["num_updates"] == "3", proc.stdout[-3000:]


def test_import_without_fairseq_says_what_to_install(built, tmp_path):
    fairseq_dist = _distribution_of("fairseq")
    leave_out = ("fairseq", "fairseq_cli", fairseq_dist.replace("-", "_"))
    python, purelib = _venv_with_links(str(tmp_path / "venv"), leave_out=leave_out)
    _pip("--python", python, "install", "--no-index", "--no-deps", built["wheel"], cwd=tmp_path)
    # the pure-torch core works without fairseq; the fairseq side says what to install
    core = _run([python, "-c", "import sys, fairseq_agg.ops; assert 'fairseq' not in sys.modules"], cwd=tmp_path)
    assert core.returncode == 0, core.stderr
    for side in ("fairseq_agg.criterions", "fairseq_agg.models", "fairseq_agg.optim.fairseq_coupled_adam"):
        proc = _run([python, "-c", f"import {side}"], cwd=tmp_path, expect_ok=False)
        assert proc.returncode == 1, side
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError: fairseq-agg needs fairseq, which is not installed: "), (side, last)
        assert "--no-build-isolation 'fairseq-agg[fairseq]'" in last
        assert "ModuleNotFoundError" not in proc.stderr  # the one line, not a chained traceback
    # the path still prints: it needs neither torch nor fairseq
    printed = _run([os.path.join(os.path.dirname(python), "fairseq-agg")], cwd=tmp_path).stdout.strip()
    assert printed == os.path.join(purelib, "fairseq_agg_plugin")


def test_legacy_setup_py_and_editable_install(built):
    """setup.py reads pyproject.toml: legacy ``python setup.py`` tooling and pip's editable install
    see the same package (in a copy of the sources, so the checkout gets no build files)."""
    src = built["root"] / "src"
    assert _run([sys.executable, "setup.py", "--version"], cwd=src).stdout.strip().splitlines()[-1] == (
        fairseq_agg.__version__)
    report = built["root"] / "editable.json"
    _pip("install", "--dry-run", "--no-deps", "--no-build-isolation", "--no-index", "--report", report,
         "--editable", src, cwd=built["root"])
    (item,) = json.loads(report.read_text())["install"]
    assert item["metadata"]["name"] == "fairseq-agg" and item["metadata"]["version"] == fairseq_agg.__version__
    assert item["download_info"]["dir_info"] == {"editable": True}


# numpy 2 (issue #23): installing the package into an environment that already has torch, a fairseq
# and numpy 2.x changes none of the three, and the README's training paths run there.
NUMPY_2 = "2.2.6"
# the fairseq extensions compiled against numpy's C API (NumpyExtension in fairseq's setup.py); a
# build for numpy 1.x does not import under numpy 2, so the test builds them against numpy 2 as a
# user's fairseq for numpy 2 is built (its torch extensions libbase, libnat, libbleu do not use numpy)
FAIRSEQ_NUMPY_EXTENSIONS = ("fairseq.data.data_utils_fast", "fairseq.data.token_block_utils_fast")
_BUILD_EXTENSIONS = (
    "import sys, numpy; from Cython.Build import cythonize; from setuptools import Extension, setup; "
    "setup(name='fairseq-numpy-extensions', script_args=['build_ext', '--inplace'], ext_modules=cythonize(["
    "Extension(n, [n.replace('.', '/') + '.pyx'], language='c++', include_dirs=[numpy.get_include()], "
    "extra_compile_args=['-std=c++11', '-O3']) for n in sys.argv[1:]], quiet=True))"
)


def _index_env():
    """os.environ without PYTHONPATH: pip with this machine's own configuration (index, certificates)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _freeze(python, names, cwd):
    """The ``pip freeze`` line of each distribution of ``names`` (None when it is not installed)."""
    def normal(name):
        return re.sub(r"[-_.]+", "-", name).lower()

    lines = _pip("--python", python, "freeze", cwd=cwd).stdout.splitlines()
    found = {normal(re.split(r"[=@ ]", line, maxsplit=1)[0]): line for line in lines}
    return {name: found.get(normal(name)) for name in names}


def _fairseq_for_the_venv_numpy(python, links, sdist, tmp_path):
    """Replaces the venv's link to this environment's fairseq by a tree of links to its files, with
    FAIRSEQ_NUMPY_EXTENSIONS built from ``sdist`` against the venv's numpy."""
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "fairseq-src", filter="data")
    (src,) = (tmp_path / "fairseq-src").iterdir()
    # setuptools imports it; the links leave it out (it belongs with a .pth file they do not copy)
    os.symlink(os.path.join(SITE_PACKAGES, "_distutils_hack"), os.path.join(links, "_distutils_hack"))
    _run([python, "-c", _BUILD_EXTENSIONS, *FAIRSEQ_NUMPY_EXTENSIONS], cwd=src)
    original = os.path.realpath(os.path.join(links, "fairseq"))
    os.remove(os.path.join(links, "fairseq"))
    rebuilt = {name.rsplit(".", 1)[1] + "." for name in FAIRSEQ_NUMPY_EXTENSIONS}
    for folder, _, files in os.walk(original):
        target = os.path.join(links, "fairseq", os.path.relpath(folder, original))
        os.makedirs(target, exist_ok=True)
        for name in files:
            if not (name.startswith(tuple(rebuilt)) and name.endswith(".so")):
                os.symlink(os.path.join(folder, name), os.path.join(target, name))
    for name in FAIRSEQ_NUMPY_EXTENSIONS:
        (built_ext,) = glob.glob(os.path.join(src, name.replace(".", "/") + ".*.so"))
        shutil.copy2(built_ext, os.path.join(links, name.rsplit(".", 1)[0].replace(".", "/")))


def test_install_into_an_environment_with_numpy_2_changes_nothing(built, lm_data_bin, mt_data_bin, tmp_path):
    fairseq_dist = _distribution_of("fairseq")
    fairseq_version = importlib.metadata.version(fairseq_dist)
    downloads = tmp_path / "downloads"
    # the only steps that need the package index: numpy 2 and fairseq's source
    for spec, binary in ((f"numpy=={NUMPY_2}", "--only-binary"), (f"{fairseq_dist}=={fairseq_version}", "--no-binary")):
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", binary, ":all:",
              "-d", downloads, spec], cwd=tmp_path, env=_index_env())
    (sdist,) = [p for p in downloads.iterdir() if p.name.endswith(".tar.gz")]

    python, purelib = _venv_with_links(str(tmp_path / "venv"), leave_out=("numpy",))
    _pip("--python", python, "install", "--no-index", "--no-deps", "--find-links", downloads, f"numpy=={NUMPY_2}",
         cwd=tmp_path)
    _fairseq_for_the_venv_numpy(python, str(tmp_path / "venv" / "outer-packages"), sdist, tmp_path)
    names = ("torch", fairseq_dist, "numpy")
    before = _freeze(python, names, tmp_path)
    assert before["numpy"] == f"numpy=={NUMPY_2}" and before["torch"] == f"torch=={torch.__version__}"
    assert before[fairseq_dist] == f"{fairseq_dist}=={fairseq_version}"

    # no index: a requirement the environment does not meet (numpy<2 did) fails instead of installing
    report = tmp_path / "report.json"
    _pip("--python", python, "install", "--no-index", "--report", report, built["wheel"], cwd=tmp_path)
    assert [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]] == ["fairseq-agg"]
    assert _freeze(python, names, tmp_path) == before

    # the README's training paths under numpy 2: a language model and a translation model with the
    # plugin's criterion and its statistics, loaded from the installed copy
    user_dir = os.path.join(purelib, "fairseq_agg_plugin")
    for data, args in ((lm_data_bin, fr.TINY_LM_ARGS), (mt_data_bin, fr.TINY_MT_ARGS)):
        code = ("import numpy, runpy; print('numpy', numpy.__version__); "
                "runpy.run_module('fairseq_cli.train', run_name='__main__')")
        proc = _run([python, "-c", code, data, "--user-dir", user_dir, *args, "--criterion", "cross_entropy_agg",
                     "--embed-stats-interval", "1", "--max-update", "2", "--no-save", "--log-format", "json"],
                    cwd=tmp_path, env=_clean_env(OMP_NUM_THREADS="2"))
        assert proc.stdout.startswith(f"numpy {NUMPY_2}\n")
        records = [r for r in fr.read_json_log(proc.stdout + proc.stderr) if "agg_rare" in r and "tev_mu" in r]
        assert records and records[-1]["num_updates"] == "2", proc.stdout[-3000:]
