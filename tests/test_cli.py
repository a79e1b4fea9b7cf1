"""The ``fairseq-agg`` and ``fairseq-agg-analyze`` commands: the --user-dir path, every --help and
every usage error answered without importing torch or fairseq, and ``flags``."""
import os
import subprocess
import sys

import pytest
from fairseq.models import ARCH_MODEL_NAME_REGISTRY

import fairseq_agg
import fairseq_agg_cli
from fairseq_agg import flags
from fairseq_agg.stats import groups as G

BIN_DIR = os.path.dirname(sys.executable)
CONSOLE_SCRIPT = os.path.join(BIN_DIR, "fairseq-agg")
HEAVY = ("torch", "fairseq", "fairseq_agg", "numpy")


def _run(cmd, **kwargs):
    return subprocess.run(cmd, capture_output=True, text=True, cwd="/", **kwargs)


def _run_importtime(script, args):
    """Runs a real console script; returns the process and the top-level packages it imported."""
    # -X importtime lists every module the process imports, on stderr
    proc = _run([sys.executable, "-X", "importtime", os.path.join(BIN_DIR, script)] + args)
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    proc.stderr = "".join(line + "\n" for line in proc.stderr.splitlines() if not line.startswith("import time:"))
    return proc, imported


def test_every_way_to_ask_prints_the_package_dir():
    for cmd in ([CONSOLE_SCRIPT], [CONSOLE_SCRIPT, "user-dir"], [sys.executable, "-m", "fairseq_agg_cli"]):
        proc = _run(cmd, check=True)
        assert os.path.samefile(proc.stdout.strip().splitlines()[-1], fairseq_agg.user_dir()), (cmd, proc.stdout)


def test_printing_the_path_imports_neither_torch_nor_fairseq():
    proc, imported = _run_importtime("fairseq-agg", [])
    assert proc.returncode == 0 and "fairseq_agg_cli" in imported
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert not heavy, heavy
    assert os.path.samefile(proc.stdout.strip(), fairseq_agg.user_dir())


HELP = [
    ("fairseq-agg", ["--help"], "usage: fairseq-agg [COMMAND]"),
    ("fairseq-agg", ["user-dir", "--help"], "usage: fairseq-agg user-dir"),
    ("fairseq-agg", ["flags", "--help"], "usage: fairseq-agg flags"),
    ("fairseq-agg", ["analyze", "--help"], "usage: fairseq-agg-analyze"),
    ("fairseq-agg", ["average-checkpoints", "--help"], "usage: fairseq-agg average-checkpoints"),
    ("fairseq-agg-analyze", ["--help"], "usage: fairseq-agg-analyze"),
]
USAGE_ERRORS = [
    ("fairseq-agg", ["no-such-command"], "fairseq-agg: error: unknown command 'no-such-command'; choose from"),
    ("fairseq-agg", ["user-dir", "extra"], "fairseq-agg user-dir: error: unrecognized arguments: extra"),
    ("fairseq-agg", ["flags", "--no-such-flag"], "fairseq-agg flags: error: unrecognized arguments: --no-such-flag"),
    ("fairseq-agg", ["analyze", "x.pt", "--rows", "some"],
     "fairseq-agg-analyze: error: argument --rows: invalid choice: 'some' (choose from 'all', 'no-pad-madeup'"),
    ("fairseq-agg-analyze", [], "fairseq-agg-analyze: error: the following arguments are required: CHECKPOINT"),
    ("fairseq-agg-analyze", ["x.pt", "--max-tokens", "0"],
     "fairseq-agg-analyze: error: argument --max-tokens: must be >= 1, got 0"),
    ("fairseq-agg-analyze", ["x.pt", "--max-points", "many"],
     "fairseq-agg-analyze: error: argument --max-points: must be an integer >= 1, got 'many'"),
    ("fairseq-agg", ["average-checkpoints", "--inputs", "a.pt"],
     "fairseq-agg average-checkpoints: error: the following arguments are required: --output"),
    ("fairseq-agg", ["average-checkpoints", "--inputs", "dir", "--output", "o.pt", "--num-epoch-checkpoints", "0"],
     "fairseq-agg average-checkpoints: error: argument --num-epoch-checkpoints: must be >= 1, got 0"),
]


@pytest.mark.parametrize("script,args,usage", HELP, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_help_imports_neither_torch_nor_fairseq(script, args, usage):
    proc, imported = _run_importtime(script, args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(usage) and proc.stderr == ""
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert not heavy, heavy


@pytest.mark.parametrize("script,args,message", USAGE_ERRORS,
                         ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_usage_errors_are_one_line_without_importing_torch(script, args, message):
    proc, imported = _run_importtime(script, args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(message), proc.stderr
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert not heavy, heavy


def test_the_analyze_choices_are_those_of_the_groups_module():
    """fairseq_agg_cli names them itself (importing fairseq_agg.stats.groups would import torch)."""
    assert fairseq_agg_cli.ROW_POLICIES == G.ROW_POLICIES
    assert set(fairseq_agg_cli.GROUP_PRESETS) == set(G.PRESETS)


def test_help_and_version():
    assert fairseq_agg_cli.main(["--help"]) == 0
    proc = _run([CONSOLE_SCRIPT, "--version"], check=True)
    assert proc.stdout.strip() == f"fairseq-agg {fairseq_agg.__version__}"


# ----------------------------------------------------------------------------------------------
# fairseq-agg flags (the reference docs/flags.md: tests/test_flags_reference.py)


def test_every_plugin_model_is_described():
    """A model registered by the plugin but unknown to flags.py would have no flags listed."""
    assert set(flags.CRITERIA) <= set(flags.plugin_criteria())
    assert {ARCH_MODEL_NAME_REGISTRY[a] for a in flags.plugin_archs()} == set(flags.MODELS)
    assert set(flags.MODELS) <= set(flags.plugin_archs())  # each model's base architecture


def test_flags_of_one_criterion_and_one_named_arch(capsys):
    assert fairseq_agg_cli.run_command("flags", ["cross_entropy_agg", "transformer_lm_mlra_gpt"]) == 0
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


def test_flags_without_a_name_lists_everything_and_a_shared_flag_once(capsys):
    assert fairseq_agg_cli.run_command("flags", []) == 0
    out = capsys.readouterr().out
    for option in flags.component_options():
        for name in flags.plugin_components(option):
            if option != "--arch" or name in flags.MODELS:
                assert f"\n{option} {name}\n" in out, name
    assert "transformer_mlra_wmt_en_de" in out  # named architectures are listed under their model
    assert out.count("--embed-stats-interval  (default:") == 1  # the statistics flags once
    assert out.count("--label-smoothing  (default:") == 1  # shared by the output-loss criteria
    # a flag shared with different defaults: each default with its criteria
    assert "--aug-alpha  (default: 0.5 (augmented_loss); 0.0 (cross_entropy_agg))" in out


def test_flags_output_is_written_atomically(tmp_path, capsys):
    out = tmp_path / "reference.md"
    assert fairseq_agg_cli.run_command("flags", ["--markdown", "cross_entropy_cosreg", "--output", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert text.startswith("### `--criterion cross_entropy_cosreg`\n") and "| `--cosreg-gamma` |" in text
    assert sorted(os.listdir(tmp_path)) == ["reference.md"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() would create it, not private
    with pytest.raises(SystemExit) as exc:
        fairseq_agg_cli.run_command("flags", ["--markdown", "--output", str(tmp_path)])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"fairseq-agg flags: error: --output {tmp_path} is a directory; name a file"


def test_unknown_flags_name_is_a_usage_error():
    proc = _run([CONSOLE_SCRIPT, "flags", "cross_entropy_agq"])
    assert proc.returncode == 2
    assert proc.stderr.startswith("fairseq-agg flags: error: unknown criterion, architecture or optimizer "
                                  "'cross_entropy_agq'")
    assert len(proc.stderr.splitlines()) == 1
    assert "cross_entropy_agg" in proc.stderr and "transformer_lm_mlra" in proc.stderr
    assert proc.stdout == ""
