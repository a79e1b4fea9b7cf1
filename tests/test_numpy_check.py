"""numpy 2 at start-up (issue #23): a fairseq whose compiled extensions were built against numpy 1.x
is refused when the plugin registers, in one ImportError line naming the fix, instead of fairseq's
"Please build Cython components" at the first batch.

In-process, with numpy's version and the extension's import faked; the real numpy-2 environment is
tests/test_packaging.py's.
"""
import importlib.abc
import importlib.metadata
import importlib.util
import sys

import numpy
import pytest

import fairseq_agg
from fairseq_agg.fairseq_facts.numpy_check import NUMPY_EXTENSION, check_fairseq_extensions_match_numpy

# what numpy 2 prints and Cython's import_array raises for an extension built against numpy 1.x
NUMPY_2_STDERR = "A module that was compiled using NumPy 1.x cannot be run in\nNumPy 2.2.6 as it may crash.\n" \
                 "Traceback (most recent call last):\n  File ...\n"
NUMPY_2_IMPORT_ERROR = "numpy.core.multiarray failed to import"


class FailingExtension(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds NUMPY_EXTENSION and fails its import as numpy 2 does (or with another message)."""

    def __init__(self, message, stderr=""):
        self.message, self.stderr, self.imports = message, stderr, 0

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == NUMPY_EXTENSION else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.imports += 1
        sys.stderr.write(self.stderr)
        raise ImportError(self.message)


@pytest.fixture
def extension(monkeypatch):
    """Installs a FailingExtension: ``extension(message, stderr)``."""
    def install(message, stderr=""):
        finder = FailingExtension(message, stderr)
        monkeypatch.delitem(sys.modules, NUMPY_EXTENSION, raising=False)
        monkeypatch.setattr(sys, "meta_path", [finder] + sys.meta_path)
        return finder

    return install


def test_numpy_2_with_extensions_built_for_numpy_1_is_refused_in_one_line(monkeypatch, extension, capsys):
    monkeypatch.setattr(numpy, "__version__", "2.2.6")
    finder = extension(NUMPY_2_IMPORT_ERROR, NUMPY_2_STDERR)
    with pytest.raises(ImportError) as refused:
        check_fairseq_extensions_match_numpy()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"fairseq's compiled extensions ({NUMPY_EXTENSION}) were built against numpy 1.x "
                              "and do not import under numpy 2.2.6: ")
    # the distribution that installed fairseq here, rebuilt against numpy 2; or numpy 1 again
    dist = importlib.metadata.packages_distributions()["fairseq"][0]
    fix = f"pip install --no-build-isolation --no-deps --force-reinstall --no-cache-dir {dist}=="
    assert f"rebuild them with {fix}{importlib.metadata.version(dist)}, or pip install 'numpy<2'" in message
    assert finder.imports == 1
    assert capsys.readouterr().err == ""  # numpy's own explanation and stack listing are not shown


def test_registration_runs_the_check_first(monkeypatch, extension):
    monkeypatch.setattr(numpy, "__version__", "2.0.0")
    extension(NUMPY_2_IMPORT_ERROR)
    with pytest.raises(ImportError, match=r"^fairseq's compiled extensions .* or pip install 'numpy<2'$"):
        fairseq_agg.register_with_fairseq()


def test_numpy_1_imports_no_extension(extension):
    assert int(numpy.__version__.split(".")[0]) < 2  # this environment's numpy (scripts/setup_env.sh)
    finder = extension(NUMPY_2_IMPORT_ERROR)
    check_fairseq_extensions_match_numpy()
    assert finder.imports == 0


def test_numpy_2_with_extensions_that_import_passes(monkeypatch):
    monkeypatch.setattr(numpy, "__version__", "2.2.6")
    check_fairseq_extensions_match_numpy()  # the real extension, importable here


def test_an_extension_missing_for_another_reason_is_left_to_fairseq(monkeypatch, extension):
    # fairseq installed without its extensions: fairseq's own message ("Please build Cython
    # components") is the right one
    monkeypatch.setattr(numpy, "__version__", "2.2.6")
    finder = extension(f"No module named '{NUMPY_EXTENSION}'")
    check_fairseq_extensions_match_numpy()
    assert finder.imports == 1
