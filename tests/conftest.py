import importlib.util
import os

import pytest

import fairseq_agg
import fairseq_runs
import tiers


def pytest_configure(config):
    config.addinivalue_line("markers", "e2e: starts a process, or uses a fixture that does (found by "
                                       "tests/support/tiers.py); the fast tier is -m 'not e2e'")
    # Many tests build fairseq's components in this process, as a fairseq command does once
    # --user-dir has loaded the plugin; importing fairseq_agg registers nothing, so register here.
    if importlib.util.find_spec("fairseq") is not None:
        fairseq_agg.register_with_fairseq()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if tiers.is_e2e(item):
            item.add_marker(pytest.mark.e2e)
    items[:] = tiers.longest_first(items)


@pytest.fixture(scope="session")
def repo_root():
    """The checkout the tests run from: examples/, study/ and scripts/ are not part of the installed package."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def lm_data_bin(tmp_path_factory):
    """A tiny language-modelling data-bin made with a real fairseq-preprocess run."""
    return fairseq_runs.make_lm_data(str(tmp_path_factory.mktemp("lm")))


@pytest.fixture(scope="session")
def mt_data_bin(tmp_path_factory):
    """A tiny En->De-shaped translation data-bin (joined dictionary)."""
    return fairseq_runs.make_mt_data(str(tmp_path_factory.mktemp("mt")))
