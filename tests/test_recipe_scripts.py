"""The command lines of the WMT14 and WikiText-103 recipes (examples/*/{prepare,train,evaluate}.sh):
--help, unknown flags, and train.sh's GPUs, machines and launchers. Nothing here runs fairseq:
train.sh runs with DRY_RUN=1 or --dry-run (it prints the command), the others stop at --help or at
a bad flag."""
import os
import re
import shlex
import subprocess
import sys

import pytest

RECIPES = ("wmt14_en_de", "wikitext103")


def run_script(path, args, dry_run=False, **env_vars):
    env = dict(os.environ, PYTHON=sys.executable)
    env.update(env_vars)
    if dry_run:
        env["DRY_RUN"] = "1"
    return subprocess.run(["bash", path] + [str(a) for a in args], capture_output=True, text=True, env=env,
                          timeout=120)


def help_blocks(text):
    """The "Flags (default):" section of a recipe's --help: {flag: its description}."""
    section = text.split("Flags (default):\n", 1)[1]
    blocks, flag = {}, None
    for line in section.splitlines():
        m = re.match(r"^  (?:-h, )?(--[\w-]+)", line)
        if m:
            flag = m.group(1)
            blocks[flag] = line
        elif flag and line.startswith("    "):
            blocks[flag] += " " + line.strip()
        else:
            break
    return blocks


HELP_ARGS = {  # a third way to ask for help: after other arguments
    "prepare.sh": ["--out", "OUT", "--help"],
    "train.sh": ["agg", "--gpus", "2", "--dry-run", "--help"],
    "evaluate.sh": ["--out", "OUT", "--batch-size", "3", "-h"],
}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["prepare.sh", "train.sh", "evaluate.sh"])
def test_help_lists_every_flag_with_its_default(repo_root, recipe, name, tmp_path):
    script = os.path.join(repo_root, "examples", recipe, name)
    table = re.search(r'parse_flags "([^"]*)"', open(script, encoding="utf-8").read()).group(1)
    flags = [pair.split("=")[0] for pair in table.split() if pair.startswith("--") and "=" in pair]
    assert len(flags) >= 2
    out = str(tmp_path / "o")
    for args in (["--help"], ["-h"], [out if a == "OUT" else a for a in HELP_ARGS[name]]):
        proc = run_script(script, args)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        usage = f"Usage: bash examples/{recipe}/{name} "
        assert any(line.startswith(usage) for line in proc.stdout.splitlines()), proc.stdout
        blocks = help_blocks(proc.stdout)
        assert set(blocks) == set(flags) | {"--help"}, (sorted(blocks), flags)
        for flag in flags:  # its default in brackets, or "(required)"
            assert re.search(r"\(.+\)", blocks[flag]), blocks[flag]
    assert not os.listdir(tmp_path)  # --help ran nothing


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name, args", [
    ("prepare.sh", ["--bogus", "1"]),
    ("evaluate.sh", ["--bogus", "1"]),
    ("train.sh", ["agg", "--bogus", "1"]),
    ("train.sh", ["--bogus", "1", "agg"]),
])
def test_unknown_flag_is_an_error_naming_it(repo_root, recipe, name, args):
    proc = run_script(os.path.join(repo_root, "examples", recipe, name), args, dry_run=True)
    assert proc.returncode == 2 and f"{name}: error: unknown argument '--bogus'" in proc.stderr, proc.stderr
    assert proc.stdout == ""


def one_error_line(proc, script_name):
    """The message of a refusal: exit status 2, one "SCRIPT: error: ..." line, nothing on stdout."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{script_name}: error: "), proc.stderr
    assert proc.stdout == ""
    return lines[0]


def fairseq_args(command_line):
    """The fairseq-train arguments of a printed command line (after the fairseq-train path)."""
    words = command_line.split()
    start = next(i for i, w in enumerate(words) if w.endswith("/fairseq-train"))
    return words[start + 1:]


def value_of(args, flag):
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("recipe, max_tokens", [("wmt14_en_de", 8192), ("wikitext103", 4096)])
def test_train_sh_gpu_count_keeps_tokens_per_update(repo_root, recipe, max_tokens):
    script = os.path.join(repo_root, "examples", recipe, "train.sh")
    paper_tokens = 8 * max_tokens
    paper = f"(the paper: 1 x {max_tokens} x 8 = {paper_tokens})"
    one = run_script(script, ["agg"], dry_run=True)
    assert f"--max-tokens {max_tokens} --update-freq 8 --distributed-world-size 1 " in one.stdout
    assert f"tokens per update = GPUs x --max-tokens x --update-freq = 1 x {max_tokens} x 8 = {paper_tokens} " \
           f"{paper}" in one.stderr
    assert "AGG's rare-token threshold does not depend on it" in one.stderr
    # M x N GPUs: the update frequency falls while it can, then --max-tokens (in whole 1,024-token units)
    for nodes, gpus, micro, freq in ((1, 2, max_tokens, 4), (1, 8, max_tokens, 1), (2, 8, max_tokens // 2, 1),
                                     (4, 8, max_tokens // 4, 1)):
        proc = run_script(script, ["agg", "--nodes", nodes, "--gpus", gpus, "--rdzv-endpoint", "node1:29500"]
                          if nodes > 1 else ["agg", "--gpus", gpus], dry_run=True)
        assert proc.returncode == 0, proc.stderr
        args = fairseq_args(proc.stdout)
        world = nodes * gpus
        assert (value_of(args, "--max-tokens"), value_of(args, "--update-freq"),
                value_of(args, "--distributed-world-size")) == (str(micro), str(freq), str(world))
        assert world * micro * freq == paper_tokens
        assert f"= {world} x {micro} x {freq} = {paper_tokens} {paper}" in proc.stderr
    # no whole number of 1,024-token units per GPU: the user chooses the batch
    for args, world in ((["--gpus", "3"], 3), (["--nodes", "2", "--gpus", "3", "--rdzv-endpoint", "h:1"], 6)):
        bad = run_script(script, ["agg"] + args, dry_run=True)
        line = one_error_line(bad, "train.sh")
        assert f"= {world} GPUs cannot share the paper's {paper_tokens} tokens per update" in line
        assert f"pass --update-freq K (tokens per update = {world} x {max_tokens} x K)" in line
    three = run_script(script, ["agg", "--gpus", "3", "--update-freq", "3"], dry_run=True)
    assert "--max-tokens %d --update-freq 3 --distributed-world-size 3 " % max_tokens in three.stdout
    assert f"= 3 x {max_tokens} x 3 = {9 * max_tokens} " in three.stderr
    # fairseq flags after -- are what the run uses, and the printed product follows them
    tiny = run_script(script, ["agg", "--", "--max-tokens", "800", "--update-freq=2"], dry_run=True)
    assert tiny.stdout.rstrip().endswith("--max-tokens 800 --update-freq=2") and "= 1 x 800 x 2 = 1600 " in tiny.stderr


@pytest.mark.parametrize("recipe", RECIPES)
def test_train_sh_launchers(repo_root, recipe, tmp_path):
    script = os.path.join(repo_root, "examples", recipe, "train.sh")
    # torchrun on two machines: the same command on each, fairseq-train under it with the world size
    torchrun = run_script(script, ["agg", "--nodes", "2", "--gpus", "8", "--rdzv-endpoint", "node1:29500",
                                   "--dry-run"])
    assert torchrun.returncode == 0, torchrun.stderr
    words = torchrun.stdout.split()
    assert os.path.basename(words[0]) == "torchrun"
    assert " ".join(words[1:9]) == "--nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node1:29500"
    assert words[9].endswith("/fairseq-train")
    args = fairseq_args(torchrun.stdout)
    assert value_of(args, "--distributed-world-size") == "16" and "--fp16" in args
    assert "--distributed-init-method" not in args  # fairseq takes env:// from torchrun's variables
    assert "[train] run this command on each of the 2 nodes" in torchrun.stderr
    # one machine under torchrun: a local rendezvous
    local = run_script(script, ["agg", "--gpus", "4", "--launcher", "torchrun"], dry_run=True)
    assert "--nnodes 1 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint localhost:29500 " in local.stdout
    # slurm: an sbatch script with one task per GPU; fairseq meets at --distributed-port
    slurm = run_script(script, ["agg", "--nodes", "4", "--gpus", "8", "--launcher", "slurm",
                                "--distributed-port", "12345", "--dry-run"], SAVE_DIR=str(tmp_path / "save"))
    assert slurm.returncode == 0, slurm.stderr
    lines = slurm.stdout.splitlines()
    assert lines[:5] == ["#!/bin/bash", "#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gres=gpu:8",
                         f"mkdir -p {tmp_path / 'save'}"]
    assert lines[5].startswith("srun --nodes 4 --ntasks-per-node 8 --gres gpu:8 ") and len(lines) == 6
    args = fairseq_args(lines[5])
    assert value_of(args, "--distributed-world-size") == "32" and value_of(args, "--distributed-port") == "12345"
    assert not (tmp_path / "save").exists()  # printed, not run
    # a port after -- is fairseq-train's last word, so it wins over the launcher's
    overridden = run_script(script, ["agg", "--nodes", "4", "--gpus", "8", "--launcher", "slurm", "--dry-run", "--",
                                     "--distributed-port", "1234"])
    args = fairseq_args(overridden.stdout.splitlines()[-1])
    assert args.count("--distributed-port") == 2 and args[::-1].index("1234") < args[::-1].index("29500")
    # --dry-run and DRY_RUN=1 print the same command
    assert run_script(script, ["agg", "--dry-run"]).stdout == run_script(script, ["agg"], dry_run=True).stdout
    # several machines and no launcher named, printed: the torchrun command and the sbatch script,
    # each as its own launcher prints it (the rendezvous host a placeholder when none is given)
    both = run_script(script, ["agg", "--nodes", "2", "--gpus", "8", "--dry-run"], SAVE_DIR=str(tmp_path / "save"))
    assert both.returncode == 0, both.stderr
    torchrun_part, slurm_part = both.stdout.split("# or SLURM: ")
    assert torchrun_part.startswith("# torchrun: run this command on each of the 2 nodes, first-node replaced by")
    alone = run_script(script, ["agg", "--nodes", "2", "--gpus", "8", "--launcher", "torchrun",
                                "--rdzv-endpoint", "first-node:29500", "--dry-run"], SAVE_DIR=str(tmp_path / "save"))
    assert torchrun_part.splitlines()[1:] == alone.stdout.splitlines()
    alone = run_script(script, ["agg", "--nodes", "2", "--gpus", "8", "--launcher", "slurm", "--dry-run"],
                       SAVE_DIR=str(tmp_path / "save"))
    assert slurm_part.splitlines()[1:] == alone.stdout.splitlines()
    assert value_of(fairseq_args(slurm_part.splitlines()[-1]), "--distributed-port") == "29500"
    assert "--distributed-port" not in torchrun_part  # torchrun's processes meet by env://
    assert not (tmp_path / "save").exists()
    # ... and run rather than printed (on prepared data), torchrun needs the rendezvous host
    data = tmp_path / "data"
    data.mkdir()
    for name in ("dict.txt", "dict.en.txt"):
        (data / name).write_text("a 1\n")
    proc = run_script(script, ["agg", "--nodes", "2"], SAVE_DIR=str(tmp_path / "save"), DATA_BIN=str(data))
    assert "--launcher torchrun on --nodes 2 needs --rdzv-endpoint HOST:PORT" in one_error_line(proc, "train.sh")
    assert not (tmp_path / "save").exists()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "--nodes must be an integer >= 1, got '0'"),
    (["--nodes", "two"], "--nodes must be an integer >= 1, got 'two'"),
    (["--gpus", "0"], "--gpus must be an integer >= 1, got '0'"),
    (["--update-freq", "x"], "--update-freq must be an integer >= 1, got 'x'"),
    (["--launcher", "mpirun"], "--launcher must be fairseq, torchrun or slurm, got 'mpirun'"),
    (["--launcher", "both"], "--launcher must be fairseq, torchrun or slurm, got 'both'"),
    (["--nodes", "2", "--launcher", "fairseq"], "--launcher fairseq starts processes on this node only; --nodes 2 "
                                                 "needs --launcher torchrun or slurm"),
    (["--nodes", "2", "--launcher", "torchrun"], "--launcher torchrun on --nodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--launcher", "torchrun", "--rdzv-endpoint", "node1"], "--rdzv-endpoint must be HOST:PORT with a port in "
                                                              "1..65535, got 'node1'"),
    (["--launcher", "torchrun", "--rdzv-endpoint", "node1:70000"], "got 'node1:70000'"),
    (["--rdzv-endpoint", "node1:29500"], "--rdzv-endpoint is for --launcher torchrun (the launcher is fairseq)"),
    (["--launcher", "slurm", "--distributed-port", "0"], "--distributed-port must be an integer in 1..65535, got '0'"),
    (["--launcher", "torchrun", "--distributed-port", "29500"], "--distributed-port is for --launcher slurm "
                                                                 "(the launcher is torchrun)"),
    (["--nodes"], "--nodes needs a value"),
])
def test_train_sh_launch_flags_refuse_bad_values_in_one_line(repo_root, recipe, args, message, tmp_path):
    proc = run_script(os.path.join(repo_root, "examples", recipe, "train.sh"), ["agg"] + args + ["--dry-run"],
                      SAVE_DIR=str(tmp_path / "save"))
    line = one_error_line(proc, "train.sh")
    assert message in line, line
    assert not (tmp_path / "save").exists()


@pytest.mark.parametrize("recipe", RECIPES)
def test_train_sh_warns_only_on_one_node_with_more_gpus_than_it_sees(repo_root, recipe):
    import torch

    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = seen + 2
    script = os.path.join(repo_root, "examples", recipe, "train.sh")
    proc = run_script(script, ["agg", "--gpus", n, "--update-freq", 1], dry_run=True)
    assert proc.returncode == 0 and f"[train] warning: --gpus {n}, but torch sees {seen} GPUs on this node" \
        in proc.stderr, proc.stderr
    assert f"--distributed-world-size {n} " in proc.stdout
    several = run_script(script, ["agg", "--nodes", 2, "--gpus", n, "--update-freq", 1, "--rdzv-endpoint", "h:1"],
                         dry_run=True)
    assert several.returncode == 0 and "warning" not in several.stderr, several.stderr


@pytest.mark.parametrize("recipe", RECIPES)
def test_train_sh_needs_a_method_and_takes_fairseq_flags_after_dashes(repo_root, recipe):
    script = os.path.join(repo_root, "examples", recipe, "train.sh")
    missing = run_script(script, [], dry_run=True)
    assert missing.returncode == 2 and "METHOD is required" in missing.stderr
    bad = run_script(script, ["sgd"], dry_run=True)
    assert bad.returncode == 2 and "METHOD must be one of" in bad.stderr and "agg+mlra" in bad.stderr
    # a fairseq flag before -- is not taken for one of the recipe's
    bad = run_script(script, ["agg", "--max-update", "7"], dry_run=True)
    assert bad.returncode == 2 and "'--max-update'" in bad.stderr and "fairseq flags go after --" in bad.stderr
    ok = run_script(script, ["agg", "--", "--max-update", "7"], dry_run=True)
    assert ok.returncode == 0 and ok.stdout.rstrip().endswith("--max-update 7")


def recording_bin(directory):
    """A bin directory for PYTHON=DIR/python: python runs this interpreter, and fairseq-train (what
    train.sh runs from beside it) writes the arguments it gets to DIR/args, one a line."""
    directory.mkdir()
    (directory / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (directory / "fairseq-train").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > '{directory / 'args'}'\n")
    for name in ("python", "fairseq-train"):
        (directory / name).chmod(0o755)
    return directory


PRECISION_NOTICE = ("[train] --precision auto: the printed command trains in fp16 (--fp16) on the GPU machine it "
                    "is for; --precision fp32 prints it without")


@pytest.mark.parametrize("recipe", RECIPES)
def test_train_sh_precision_is_the_target_machines(repo_root, recipe, tmp_path):
    """A dry run prints the command for the GPU machine it is meant for: the recipe's --fp16 also on
    a machine without a GPU, fp32 with --precision fp32 (issue #49). A run started here trains in
    fp16 where it is on GPUs, in fp32 on this machine's CPU, unless --precision says otherwise."""
    import torch

    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    script = os.path.join(repo_root, "examples", recipe, "train.sh")
    for args, fp16 in ((["--dry-run"], True), (["--dry-run", "--precision", "fp32"], False),
                       (["--dry-run", "--precision", "fp16"], True),
                       (["--nodes", "2", "--gpus", "8", "--rdzv-endpoint", "h:1", "--dry-run", "--precision", "fp32"],
                        False)):
        proc = run_script(script, ["agg"] + args)
        assert proc.returncode == 0, proc.stderr
        assert ("--fp16" in fairseq_args(proc.stdout)) == fp16, args
        assert (PRECISION_NOTICE in proc.stderr.splitlines()) == (seen == 0 and "--precision" not in args), args
    bad = run_script(script, ["agg", "--precision", "bf16", "--dry-run"], SAVE_DIR=str(tmp_path / "save"))
    assert "--precision must be auto, fp16 or fp32, got 'bf16'" in one_error_line(bad, "train.sh")
    # run, not printed: what fairseq-train gets
    data, bindir = tmp_path / "data", recording_bin(tmp_path / "bin")
    data.mkdir()
    for name in ("dict.txt", "dict.en.txt"):
        (data / name).write_text("a 1\n")
    for args, fp16 in (([], seen > 0), (["--precision", "fp16"], True), (["--precision", "fp32"], False)):
        proc = run_script(script, ["agg"] + args, PYTHON=str(bindir / "python"), DATA_BIN=str(data),
                          SAVE_DIR=str(tmp_path / "save"))
        assert proc.returncode == 0, proc.stderr
        assert PRECISION_NOTICE not in proc.stderr
        received = (bindir / "args").read_text().splitlines()
        assert received[0] == str(data) and ("--fp16" in received) == fp16, args


@pytest.mark.parametrize("recipe, checkpoint_flag, dictionary", [("wikitext103", "--checkpoint", "dict.txt"),
                                                                  ("wmt14_en_de", "--checkpoints", "dict.de.txt")])
def test_evaluate_sh_reads_the_data_from_data_bin(repo_root, recipe, checkpoint_flag, dictionary, tmp_path):
    """DATA_BIN moves the data for evaluate.sh as for train.sh (issue #49): a DATA_BIN without the
    data is refused in one line naming it, before anything is written, even where --prep has it
    (the recipes' end-to-end tests evaluate from a DATA_BIN whose --prep holds no data-bin)."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    if checkpoint_flag == "--checkpoint":
        checkpoint = checkpoint / "checkpoint_best.pt"
        checkpoint.write_bytes(b"")
    prep = tmp_path / "prep"
    (prep / "data-bin").mkdir(parents=True)
    (prep / "data-bin" / dictionary).write_text("a 1\n")
    proc = run_script(os.path.join(repo_root, "examples", recipe, "evaluate.sh"),
                      [checkpoint_flag, checkpoint, "--prep", prep, "--out", tmp_path / "out"],
                      DATA_BIN=str(tmp_path / "moved"))
    line = one_error_line(proc, "evaluate.sh")
    assert line == f"evaluate.sh: error: DATA_BIN={tmp_path / 'moved'} has no {dictionary} (a data-bin of prepare.sh)"
    assert not (tmp_path / "out").exists()


# The METHODs whose logged `loss` is not the cross-entropy, so that fairseq's default ranking of
# checkpoint_best.pt (on `loss`) would not be the perplexity's: the augmented loss adds its KL, and
# the WMT14 recipe's label smoothing smooths every METHOD's loss (issue #57).
RANKED_ON_NLL = {"wikitext103": {"aug", "agg+aug"},
                 "wmt14_en_de": {"baseline", "agg", "aug", "agg+aug", "mlra", "agg+mlra", "coupled-adam",
                                 "agg+coupled-adam"}}
TRAIN_METHODS = sorted(RANKED_ON_NLL["wmt14_en_de"])


@pytest.fixture(scope="module")
def train_commands(repo_root):
    """{(recipe, METHOD): fairseq's own parse of the fairseq-train command that `train.sh METHOD
    --dry-run` prints}, the scripts run side by side."""
    from fairseq import options

    env = dict(os.environ, PYTHON=sys.executable)
    procs = {(recipe, method): subprocess.Popen(["bash", os.path.join(repo_root, "examples", recipe, "train.sh"),
                                                 method, "--dry-run"], stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, text=True, env=env)
             for recipe in RECIPES for method in TRAIN_METHODS}
    parsed = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (key, err)
        words = shlex.split(out)  # the command as a shell reads it (printf %q quotes "(0.9, 0.98)")
        start = next(i for i, w in enumerate(words) if w.endswith("/fairseq-train"))
        parsed[key] = options.parse_args_and_arch(options.get_training_parser(), words[start + 1:])
    return parsed


@pytest.mark.parametrize("recipe", RECIPES)
def test_train_sh_ranks_checkpoints_on_the_nll_where_the_loss_is_not_it(train_commands, recipe):
    seen = set()
    for method in TRAIN_METHODS:
        args = train_commands[recipe, method]
        on_nll = method in RANKED_ON_NLL[recipe]
        assert args.best_checkpoint_metric == ("nll_loss" if on_nll else "loss"), method
        assert not args.maximize_best_checkpoint_metric
        # where `loss` is kept, it is the NLL: no label smoothing, no augmented loss
        smoothing = getattr(args, "label_smoothing", 0.0)
        assert on_nll == (smoothing > 0 or args.criterion == "augmented_loss" or getattr(args, "aug_alpha", 0) > 0), \
            method
        seen.add(args.criterion)
    assert {"augmented_loss", "cross_entropy_agg"} <= seen


@pytest.mark.parametrize("recipe", RECIPES)
def test_train_sh_trains_coupled_adam_at_its_authors_weight_decay(train_commands, recipe):
    """coupled-adam and agg+coupled-adam: the baseline's and agg's criteria with --optimizer
    coupled_adam, whose weight decay skips the coupled embedding and the 1-D parameters as its authors'
    runs do (docs/coupled_adam.md); the recipe's adam settings are kept."""
    plain, agg = train_commands[recipe, "baseline"], train_commands[recipe, "agg"]
    for method, like in (("coupled-adam", plain), ("agg+coupled-adam", agg)):
        args = train_commands[recipe, method]
        assert (args.optimizer, args.coupled_adam_decay) == ("coupled_adam", "non-embedding-matrices"), method
        assert (args.criterion, args.arch, args.adam_betas, args.weight_decay, args.lr) == \
            (like.criterion, like.arch, like.adam_betas, like.weight_decay, like.lr), method
        assert args.save_dir.endswith(f"/{method}" if recipe == "wikitext103" else f"/{method}-base")
    assert plain.optimizer == agg.optimizer == "adam"


@pytest.mark.parametrize("recipe, cost", [
    ("wikitext103", "[train] cost: about 5.4 GPU-hours (measured, one H200); about 60 GB of disk for its checkpoints"),
    ("wmt14_en_de", "[train] cost: about 8.2 GPU-hours (derived, not measured); about 14 GB of disk for its checkpoints"),
])
def test_train_sh_says_the_cost_and_checks_the_free_disk(repo_root, recipe, cost, tmp_path):
    """The cost from the recipe's README before the run starts; a save directory whose disk has less
    free space than --min-free-gb (default: the run's checkpoints) is refused in one line before
    anything is written or started, unless the check is lowered (issue #57)."""
    script = os.path.join(repo_root, "examples", recipe, "train.sh")
    printed = run_script(script, ["agg"], dry_run=True)
    assert printed.returncode == 0 and cost in printed.stderr, printed.stderr
    data, bindir, save = tmp_path / "data", recording_bin(tmp_path / "bin"), tmp_path / "not" / "yet" / "save"
    data.mkdir()
    for name in ("dict.txt", "dict.en.txt"):
        (data / name).write_text("a 1\n")
    env = dict(PYTHON=str(bindir / "python"), DATA_BIN=str(data), SAVE_DIR=str(save))
    import shutil

    free_gb = shutil.disk_usage(tmp_path).free // (1 << 30)
    refused = run_script(script, ["agg", "--min-free-gb", free_gb + 10], **env)
    line = one_error_line(refused, "train.sh")
    assert f"the disk of SAVE_DIR {save} has " in line and f"GB free, less than the {free_gb + 10} GB this run needs" \
        in line and "--min-free-gb N (0: no check)" in line, line
    assert not (tmp_path / "not").exists() and not (bindir / "args").exists()
    bad = run_script(script, ["agg", "--min-free-gb", "-1"], **env)
    assert "--min-free-gb must be an integer >= 0, got '-1'" in one_error_line(bad, "train.sh")
    for lowered in ("0", str(max(free_gb - 1, 0))):
        started = run_script(script, ["agg", "--min-free-gb", lowered], **env)
        assert started.returncode == 0 and (bindir / "args").read_text().splitlines()[0] == str(data), started.stderr
        (bindir / "args").unlink()


@pytest.mark.parametrize("recipe, args, cost", [
    ("wikitext103", ["--tokenizer", "word"], "[prepare] cost: about 1.7 GB of disk (download 0.74 GB, kept; 0.7 GB "
                                             "while it runs; data-bin 0.24 GB; derived: examples/wikitext103/README.md"),
    ("wmt14_en_de", [], "[prepare] cost: a first run needs about 12 GB of disk"),
])
def test_prepare_sh_says_the_cost_before_it_starts(repo_root, recipe, args, cost, tmp_path):
    """Printed once the flags are checked, before the first step (here an empty --raw-dir, refused)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    proc = run_script(os.path.join(repo_root, "examples", recipe, "prepare.sh"),
                      ["--raw-dir", raw, "--out", tmp_path / "out"] + args)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stdout.splitlines()[0].startswith(cost), proc.stdout
    bad = run_script(os.path.join(repo_root, "examples", recipe, "prepare.sh"), ["--workers", "0"])
    assert bad.returncode == 2 and "cost" not in bad.stdout  # a refused flag: nothing printed before it
