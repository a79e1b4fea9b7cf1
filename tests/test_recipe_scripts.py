"""The command lines of the WMT14 and WikiText-103 recipes (examples/*/{prepare,train,evaluate}.sh):
--help, unknown flags, and train.sh's GPU count. Nothing here runs fairseq: train.sh runs with
DRY_RUN=1 (it prints the fairseq-train command), the others stop at --help or at a bad flag."""
import os
import re
import subprocess
import sys

import pytest

RECIPES = ("wmt14_en_de", "wikitext103")


def run_script(path, args, dry_run=False, **env_vars):
    env = dict(os.environ, PYTHON=sys.executable, **env_vars)
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
    "train.sh": ["agg", "--gpus", "2", "--help"],
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


@pytest.mark.parametrize("recipe, max_tokens", [("wmt14_en_de", 8192), ("wikitext103", 4096)])
def test_train_sh_gpu_count_keeps_tokens_per_update(repo_root, recipe, max_tokens):
    script = os.path.join(repo_root, "examples", recipe, "train.sh")
    paper = f"(the paper: 1 x {max_tokens} x 8 = {8 * max_tokens})"
    one = run_script(script, ["agg"], dry_run=True)
    assert f"--max-tokens {max_tokens} --update-freq 8 --distributed-world-size 1 " in one.stdout
    assert f"tokens per update = GPUs x --max-tokens x --update-freq = 1 x {max_tokens} x 8 = {8 * max_tokens} " \
           f"{paper}" in one.stderr
    assert "AGG's rare-token threshold does not depend on it" in one.stderr
    two = run_script(script, ["agg", "--gpus", "2"], dry_run=True)
    assert f"--max-tokens {max_tokens} --update-freq 4 --distributed-world-size 2 " in two.stdout
    assert f"= 2 x {max_tokens} x 4 = {8 * max_tokens} {paper}" in two.stderr
    bad = run_script(script, ["agg", "--gpus", "3"], dry_run=True)
    assert bad.returncode == 2 and "--gpus 3 does not divide" in bad.stderr and "--update-freq" in bad.stderr
    three = run_script(script, ["agg", "--gpus", "3", "--update-freq", "3"], dry_run=True)
    assert "--update-freq 3 --distributed-world-size 3 " in three.stdout
    assert f"= 3 x {max_tokens} x 3 = {9 * max_tokens} " in three.stderr
    # fairseq flags after -- are what the run uses, and the printed product follows them
    tiny = run_script(script, ["agg", "--", "--max-tokens", "800", "--update-freq=2"], dry_run=True)
    assert tiny.stdout.rstrip().endswith("--max-tokens 800 --update-freq=2") and "= 1 x 800 x 2 = 1600 " in tiny.stderr
    for args, flag in ((["agg", "--gpus", "0"], "--gpus must be an integer >= 1"),
                       (["agg", "--update-freq", "x"], "--update-freq must be an integer >= 1")):
        bad = run_script(script, args, dry_run=True)
        assert bad.returncode == 2 and flag in bad.stderr, (args, bad.stderr)


@pytest.mark.parametrize("recipe, dict_file", [("wmt14_en_de", "dict.en.txt"), ("wikitext103", "dict.txt")])
def test_train_sh_refuses_more_gpus_than_torch_sees(repo_root, recipe, dict_file, tmp_path):
    import torch

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / dict_file).write_text("")
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = seen + 2
    proc = run_script(os.path.join(repo_root, "examples", recipe, "train.sh"), ["agg", "--gpus", n, "--update-freq", 1],
                      DATA_BIN=str(tmp_path / "data"), SAVE_DIR=str(tmp_path / "save"))
    assert proc.returncode == 2 and f"--gpus {n}: torch sees {seen} GPUs here" in proc.stderr, proc.stderr
    assert not (tmp_path / "save").exists()


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
