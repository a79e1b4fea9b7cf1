"""The README documents every flag the plugin adds, with the default fairseq really uses, and its
set-up commands and Python requirement are those of the project's files."""
import os
import re

import pytest

import fairseq_agg
from fairseq_agg import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
    with open(os.path.join(REPO, *parts), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def readme():
    return _read("README.md")


@pytest.mark.parametrize("component", flags.TABLES)
def test_flag_table_is_in_the_readme_verbatim(component, readme):
    """Each table is `fairseq-agg flags --markdown`'s output: every flag, default and help text."""
    table = flags.markdown(component)
    assert len(table.splitlines()) > 2, f"{component} adds no flags?"
    missing = [line for line in table.splitlines() if line not in readme.splitlines()]
    assert table in readme, (
        f"README.md's table for {component} is out of date (regenerate with `fairseq-agg flags --markdown "
        f"{component}`); rows not in the README:\n" + "\n".join(missing)
    )


@pytest.mark.parametrize("component", flags.plugin_criteria())
def test_every_criterion_flag_is_in_a_table(component):
    """A criterion's flags are in its own table (flags.TABLES) or in the shared statistics table."""
    tabled = {(row.flag, str(row.default)) for name in {component, flags.SHARED} & set(flags.TABLES)
              for row in flags.table_rows(name)}
    rows = flags.flag_rows(component)
    assert rows and {(row.flag, str(row.default)) for row in rows} <= tabled


def test_readme_setup_commands_exist(readme):
    for script in ("scripts/run_demo.sh", "scripts/run_tests.sh"):
        assert f"bash {script}" in readme
        assert os.access(os.path.join(REPO, script), os.X_OK)
    assert "scripts/run_tests.sh" in _read(".ci", "run")


def test_readme_states_the_python_and_torch_requirements_of_the_package(readme):
    python = re.search(r'^requires-python = ">=(3\.\d+)"$', _read("pyproject.toml"), re.M).group(1)
    stated = re.search(r"^Python ≥ (3\.\d+), torch ≥ (\d+\.\d+) and a fairseq", readme, re.M)
    assert stated, "README.md's set-up section does not state the requirements"
    assert stated.groups() == (python, ".".join(map(str, fairseq_agg.MIN_TORCH)))
