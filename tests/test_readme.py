"""The README documents every flag the plugin adds, with the default fairseq really uses."""
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import flag_tables  # noqa: E402


@pytest.fixture(scope="module")
def readme():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("component", sorted(flag_tables.COMPONENTS))
def test_every_flag_and_default_is_in_the_readme(component, readme):
    rows = flag_tables.flag_rows(component)
    assert rows is not None, f"{component} is not registered"
    assert rows, f"{component} adds no flags?"
    for flag, default, _ in rows:
        pattern = re.compile(r"^\|\s*`" + re.escape(flag) + r"`\s*\|\s*`" + re.escape(str(default)) + r"`\s*\|", re.M)
        assert pattern.search(readme), f"README.md lacks the row for {flag} with default {default!r}"


def test_readme_setup_commands_exist(readme):
    for script in ("scripts/run_demo.sh", "scripts/run_tests.sh"):
        assert f"bash {script}" in readme
        assert os.access(os.path.join(REPO, script), os.X_OK)
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
        assert "scripts/run_tests.sh" in f.read()


def test_user_dir_commands_print_the_package_dir():
    expected = os.path.join(REPO, "fairseq_agg")
    bin_dir = os.path.dirname(sys.executable)
    for cmd in ([os.path.join(bin_dir, "fairseq-agg")], [sys.executable, "-m", "fairseq_agg"],
                [os.path.join(bin_dir, "fairseq-agg"), "user-dir"]):
        out = subprocess.run(cmd, capture_output=True, text=True, cwd="/", check=True).stdout.strip().splitlines()
        assert os.path.samefile(out[-1], expected), (cmd, out)
