"""``--user-dir .../fairseq_agg``, the plugin's location before ``fairseq_agg_plugin/`` (issue #56,
item 4): a user's existing command keeps working, says in one log line where the plugin is now, and
has the plugin's hooks (a refused flag is one line); importing ``fairseq_agg`` still changes
nothing (fairseq_agg/tasks/, docs/architecture.md). Real fairseq-train processes."""
import os
import subprocess
import sys

import torch

import fairseq_agg
from fairseq_runs import TINY_LM_ARGS, run_cli

OLD_USER_DIR = os.path.dirname(os.path.abspath(fairseq_agg.__file__))
MOVED = '--user-dir .../fairseq_agg is the plugin\'s old location; it still works, but pass --user-dir "$(fairseq-agg)"'


def old_path_args(data, save_dir, extra=()):
    return [data, "--user-dir", OLD_USER_DIR, *TINY_LM_ARGS, "--criterion", "cross_entropy_agg", "--max-update", "2",
            "--save-dir", save_dir, "--no-epoch-checkpoints", *extra]


def test_the_old_user_dir_trains_and_says_where_the_plugin_is(lm_data_bin, tmp_path):
    save_dir = tmp_path / "save"
    proc = run_cli("fairseq-train", old_path_args(lm_data_bin, str(save_dir)), timeout=300)
    output = proc.stdout + proc.stderr
    assert sum(MOVED in line for line in output.splitlines()) == 1
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    assert state["cfg"]["criterion"]["_name"] == "cross_entropy_agg"
    assert state["optimizer_history"][-1]["num_updates"] == 2
    assert any(key.startswith("window.") for key in state["criterion"])  # AGG's counts: the plugin's criterion ran

    # the plugin's hooks are installed too: a refused value is one line, exit status 2
    proc = run_cli("fairseq-train", old_path_args(lm_data_bin, str(tmp_path / "bad"), ["--agg-alpha", "-1"]),
                   expect_ok=False, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("fairseq-train: error: --agg-alpha")


def test_importing_the_package_does_not_reach_the_old_path_module():
    code = "import sys, fairseq_agg; print(sorted(m for m in sys.modules if m.startswith(('fairseq_agg.tasks', 'fairseq.'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
