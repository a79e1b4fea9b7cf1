"""Importing the package changes nothing in the process (issue 46, "An import that changes
nothing"); registering with fairseq does what fairseq's commands need, scoped to them.

* A plain script, with fairseq and transformers installed, imports ``fairseq_agg``, its core
  ``fairseq_agg.ops`` and the pure-torch optimizer ``fairseq_agg.optim``: neither is loaded, and
  the root logger, ``argparse.ArgumentParser.error`` and ``sys.excepthook`` are untouched;
  fairseq, imported after, has its own checkpoint functions and argument parsing.
  An eager call of the fused layer (``kernel="eager"``) changes nothing either: no warnings
  filter, environment variable, torch safe global or logger handler (a first ``auto`` call, which
  runs torch.compile, adds some: docs/api.md).
* :func:`fairseq_agg.register_with_fairseq` (what ``--user-dir`` runs) replaces those fairseq
  functions and installs the hook, but the one-line refusals stay fairseq's: a parser of the
  program's own keeps argparse's answer even for a flag named like the plugin's, and a
  :class:`UsageError` of the program's own code keeps its traceback.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("fairseq")

# Prints what importing the core changed, as JSON; with the argument "register", also what
# registering changed. A fairseq function is "fairseq's" when its code is in fairseq's own files.
STATE_SCRIPT = r"""
import argparse, json, logging, os, sys

def process_state():
    root = logging.getLogger()
    return {"root_level": root.level, "root_handlers": [repr(h) for h in root.handlers],
            "argparse_error": argparse.ArgumentParser.error is ARGPARSE_ERROR,
            "excepthook": sys.excepthook is sys.__excepthook__}

ARGPARSE_ERROR = argparse.ArgumentParser.error
before = process_state()
import fairseq_agg, fairseq_agg.ops, fairseq_agg.optim
from fairseq_agg.ops import AggLoss, LossRequest, fused_linear_loss
from fairseq_agg.optim import CoupledAdam  # noqa: F401
def call_state():
    # what torch.compile would change on a first "auto" call (docs/api.md): none of it after an eager one
    import torch, warnings
    handlers = {name: [repr(h) for h in logger.handlers] for name, logger in logging.Logger.manager.loggerDict.items()
                if isinstance(logger, logging.Logger) and logger.handlers}
    return dict(process_state(), warning_filters=[repr(f) for f in warnings.filters], environ=dict(os.environ),
                safe_globals=[repr(g) for g in torch.serialization.get_safe_globals()], logger_handlers=handlers)

import torch
imported = call_state()
h, w = torch.randn(6, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
gates = AggLoss(9, alpha=1.0, window=1, nspecial=0).step(torch.arange(6), 0)
fused_linear_loss(h, w, torch.arange(6), LossRequest(label_smoothing=0.1, kernel="eager").with_terms(gates)).loss.backward()
report = {"before": before, "after_import": process_state(), "eager_call": [imported, call_state()],
          "fairseq_modules": sorted(m for m in sys.modules if m.split(".")[0] in ("fairseq", "fairseq_cli")),
          "hf_modules": sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "accelerate"))}

import fairseq
from fairseq import checkpoint_utils, options
from fairseq.file_io import PathManager

def fairseq_functions():
    own = os.path.dirname(fairseq.__file__)
    functions = {"PathManager.copy": PathManager.__dict__["copy"].__func__,
                 "torch_persistent_save": checkpoint_utils.torch_persistent_save,
                 "load_checkpoint_to_cpu": checkpoint_utils.load_checkpoint_to_cpu,
                 "parse_args_and_arch": options.parse_args_and_arch}
    return {name: f.__code__.co_filename.startswith(own) for name, f in functions.items()}

report["fairseq_functions"] = fairseq_functions()
if sys.argv[1:] == ["register"]:
    fairseq_agg.register_with_fairseq()
    fairseq_agg.register_with_fairseq()  # a second call, as --user-dir after the explicit call, changes nothing more
    report["after_registration"] = dict(process_state(), fairseq_functions=fairseq_functions())
print("STATE " + json.dumps(report))
"""


def run_python(tmp_path, code, *args):
    """``python program.py ARGS`` with ``code`` as the program, run from an empty directory."""
    program = tmp_path / "program.py"
    program.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(program), *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)


def state_report(tmp_path, *args):
    proc = run_python(tmp_path, STATE_SCRIPT, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("STATE ")]
    return json.loads(line[len("STATE "):]), proc


def test_importing_the_core_changes_nothing_in_the_process(tmp_path):
    report, proc = state_report(tmp_path)
    assert report["fairseq_modules"] == []
    assert report["hf_modules"] == []  # transformers is installed (the test extra), and not imported
    assert report["after_import"] == report["before"]
    assert report["eager_call"][0] == report["eager_call"][1]  # an eager call of the fused layer changes nothing
    assert report["before"]["argparse_error"] and report["before"]["excepthook"]
    assert report["fairseq_functions"] == dict.fromkeys(report["fairseq_functions"], True)
    assert len(report["fairseq_functions"]) == 4
    assert "DEBUG" not in proc.stderr  # no filelock or other debug lines


def test_registering_replaces_fairseqs_functions_but_no_parser_of_the_program(tmp_path):
    report, _ = state_report(tmp_path, "register")
    registered = report["after_registration"]
    assert registered["fairseq_functions"] == dict.fromkeys(report["fairseq_functions"], False)
    assert not registered["excepthook"]  # installed, scoped to fairseq's code (below)
    assert registered["argparse_error"]  # every parser keeps argparse's error


# A parser of the program's own, with a flag named like one of the plugin's, and fairseq's own
# parser of fairseq-train: only the latter answers in the plugin's one line.
PARSERS_SCRIPT = r"""
import argparse, contextlib, io, json, sys
import fairseq_agg
from fairseq import options

fairseq_agg.register_with_fairseq()

def refusal(parse):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parse()
        except SystemExit as e:
            return {"status": e.code, "stderr": err.getvalue()}
    return {"status": None, "stderr": err.getvalue()}

own = argparse.ArgumentParser(prog="mine")
own.add_argument("--agg-g1-mode", choices=["code", "normalized"])
flags = ["--task", "language_modeling", "--arch", "transformer_lm", "--criterion", "cross_entropy_agg",
         "--agg-g1-mode", "sqrt"]
print("REFUSALS " + json.dumps({
    "own": refusal(lambda: own.parse_args(["--agg-g1-mode", "sqrt"])),
    "fairseq": refusal(lambda: options.parse_args_and_arch(options.get_training_parser(), ["DATA"] + flags)),
}))
"""


def test_the_one_line_choice_error_is_for_fairseqs_parsers_only(tmp_path):
    proc = run_python(tmp_path, PARSERS_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("REFUSALS ")]
    refusals = json.loads(line[len("REFUSALS "):])
    own, fairseq = refusals["own"], refusals["fairseq"]
    assert own["status"] == 2 and own["stderr"].startswith("usage: mine")
    assert "argument --agg-g1-mode: invalid choice: 'sqrt'" in own["stderr"]
    assert fairseq["status"] == 2
    assert fairseq["stderr"].splitlines()[-1].endswith(
        "error: --agg-g1-mode must be one of code, normalized, got 'sqrt'")
    assert "usage:" not in fairseq["stderr"]


# A UsageError reaching the top of the process: from the program's own call of the core, and
# from inside fairseq's code (fairseq calling back into the plugin, as its commands do).
HOOK_SCRIPT = r"""
import sys
import torch
import fairseq_agg
from fairseq import utils
from fairseq_agg.ops import AggLoss

fairseq_agg.register_with_fairseq()
if sys.argv[1] == "inside-fairseq":
    utils.apply_to_sample(lambda x: AggLoss(10, window=-1), torch.zeros(1))
else:
    AggLoss(10, window=-1)
"""


@pytest.mark.parametrize("where", ["own-code", "inside-fairseq"])
def test_a_usage_error_is_one_line_only_inside_fairseqs_code(tmp_path, where):
    proc = run_python(tmp_path, HOOK_SCRIPT, where)
    last = proc.stderr.strip().splitlines()[-1]
    if where == "inside-fairseq":
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert last.startswith("program.py: error: --agg-window must be ")
    else:
        assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
        assert last.startswith("fairseq_agg.errors.UsageError: --agg-window must be ")
