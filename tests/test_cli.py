"""The ``fairseq-agg`` command: the --user-dir path without importing torch, and ``flags``."""
import dataclasses
import os
import subprocess
import sys

import pytest
from fairseq.criterions import CRITERION_DATACLASS_REGISTRY
from fairseq.models import ARCH_MODEL_NAME_REGISTRY

import fairseq_agg
import fairseq_agg_cli
from fairseq_agg import flags

BIN_DIR = os.path.dirname(sys.executable)
CONSOLE_SCRIPT = os.path.join(BIN_DIR, "fairseq-agg")


def _run(cmd, **kwargs):
    return subprocess.run(cmd, capture_output=True, text=True, cwd="/", **kwargs)


def test_every_way_to_ask_prints_the_package_dir():
    for cmd in ([CONSOLE_SCRIPT], [CONSOLE_SCRIPT, "user-dir"], [sys.executable, "-m", "fairseq_agg"]):
        proc = _run(cmd, check=True)
        assert os.path.samefile(proc.stdout.strip().splitlines()[-1], fairseq_agg.user_dir()), (cmd, proc.stdout)


def test_printing_the_path_imports_neither_torch_nor_fairseq():
    # -X importtime lists every module the real console script imports, on stderr
    proc = _run([sys.executable, "-X", "importtime", CONSOLE_SCRIPT], check=True)
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "fairseq_agg_cli" in imported
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "fairseq", "fairseq_agg", "numpy"))
    assert not heavy, heavy
    assert os.path.samefile(proc.stdout.strip(), fairseq_agg.user_dir())


def test_unknown_command_exits_2():
    proc = _run([CONSOLE_SCRIPT, "no-such-command"])
    assert proc.returncode == 2
    assert "unknown command 'no-such-command'" in proc.stderr and "average-checkpoints" in proc.stderr


def test_help_and_version():
    assert fairseq_agg_cli.main(["--help"]) == 0
    proc = _run([CONSOLE_SCRIPT, "--version"], check=True)
    assert proc.stdout.strip() == f"fairseq-agg {fairseq_agg.__version__}"


def test_every_plugin_model_is_described():
    """A model registered by the plugin but unknown to flags.py would have no flags listed."""
    assert set(flags.CRITERIA) <= set(flags.plugin_criteria())
    assert {ARCH_MODEL_NAME_REGISTRY[a] for a in flags.plugin_archs()} == set(flags.MODELS)
    assert set(flags.MODELS) <= set(flags.plugin_archs())  # each model's base architecture


def _switch(value):
    return "on" if value else "off"


@pytest.mark.parametrize("name", flags.plugin_criteria())
def test_criterion_flags_are_its_dataclass_fields(name):
    """The rows agree with the criterion's dataclass, read independently of fairseq's parser."""
    stock_fields = {f.name for f in dataclasses.fields(CRITERION_DATACLASS_REGISTRY[flags.stock_criterion(name)])}
    # II("...") fields are interpolated from fairseq's own options: they add no flag
    fields = [f for f in dataclasses.fields(CRITERION_DATACLASS_REGISTRY[name])
              if f.name not in stock_fields and not str(f.default).startswith("${")]
    rows = {row.flag: row for row in flags.flag_rows(name)}
    assert sorted(rows) == sorted("--" + f.name.replace("_", "-") for f in fields)
    for f in fields:
        row = rows["--" + f.name.replace("_", "-")]
        expected = _switch(f.default) if isinstance(f.default, bool) else f.default
        assert str(row.default) == str(expected), (row, f.default)
        assert row.help == " ".join(f.metadata["help"].split())


def test_flags_of_one_criterion_and_one_named_arch(capsys):
    assert flags.main(["cross_entropy_agg", "transformer_lm_mlra_gpt"]) == 0
    out = capsys.readouterr().out
    agg_alpha = next(r for r in flags.flag_rows("cross_entropy_agg") if r.flag == "--agg-alpha")
    assert "criterion cross_entropy_agg" in out
    assert f"  --agg-alpha  (default: {agg_alpha.default})" in out
    assert agg_alpha.help.split()[0] in out
    # a criterion's own listing includes the statistics flags every plugin criterion has
    assert "--embed-stats-interval  (default: 0)" in out
    assert "architecture transformer_lm_mlra_gpt" in out and "--arch transformer_lm_mlra_gpt" in out
    # a named architecture has its base architecture's flags
    named = [r.flag for r in flags.flag_rows("transformer_lm_mlra_gpt")]
    assert named == [r.flag for r in flags.flag_rows("transformer_lm_mlra")]
    assert all(f"  {flag}  (default: " in out for flag in named)


def test_flags_without_a_name_lists_everything(capsys):
    assert flags.main([]) == 0
    out = capsys.readouterr().out
    for name in flags.plugin_criteria() + list(flags.MODELS):
        assert f"{flags.kind(name)} {name}  (" in out
    assert "transformer_mlra_wmt_en_de" in out  # named architectures are listed under their model
    assert out.count("--embed-stats-interval  (default:") == 1  # the shared flags once


def test_unknown_flags_name_is_a_usage_error():
    proc = _run([CONSOLE_SCRIPT, "flags", "cross_entropy_agq"])
    assert proc.returncode == 2
    assert "unknown criterion or architecture 'cross_entropy_agq'" in proc.stderr
    assert "cross_entropy_agg" in proc.stderr and "transformer_lm_mlra" in proc.stderr
    assert proc.stdout == ""
