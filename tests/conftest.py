import os

import pytest

import fairseq_runs


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
