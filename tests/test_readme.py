"""The README stays short and true: its set-up commands and requirements are those of the project's
files, and every link in it and in docs/ points at a file that exists. (The flag reference is
docs/flags.md, checked against the dataclasses in tests/test_flags_reference.py.) Its fairseq-train
snippets are the recipes' commands."""
import os
import re

import pytest

import fairseq_agg

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKDOWN = ["README.md"] + sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(REPO, "docs"))
                                   if name.endswith(".md"))


def _read(*parts):
    with open(os.path.join(REPO, *parts), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def readme():
    return _read("README.md")


def test_readme_setup_commands_exist(readme):
    for script in ("scripts/run_demo.sh", "scripts/run_tests.sh"):
        assert f"bash {script}" in readme
        assert os.access(os.path.join(REPO, script), os.X_OK)
    assert "scripts/run_tests.sh" in _read(".ci", "run")


def test_readme_states_the_python_and_torch_requirements_of_the_package(readme):
    python = re.search(r'^requires-python = ">=(3\.\d+)"$', _read("pyproject.toml"), re.M).group(1)
    stated = re.search(r"^Python ≥ (3\.\d+), torch ≥ (\d+\.\d+) and a fairseq", readme, re.M)
    assert stated, "README.md does not state the requirements"
    assert stated.groups() == (python, ".".join(map(str, fairseq_agg.MIN_TORCH)))


def test_readme_is_short(readme):
    assert len(readme.splitlines()) <= 200, "README.md is a five-minute read: move details to docs/"


@pytest.mark.parametrize("page", MARKDOWN)
def test_relative_links_point_at_files(page):
    base = os.path.dirname(os.path.join(REPO, page))
    text = _read(page)
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not os.path.exists(os.path.join(base, t))]
    assert not missing, f"{page} links to missing files: {missing}"


def test_no_unfilled_placeholders(readme):
    assert not re.search(r"\b[A-Z]{3,}_[A-Z_]{3,}\b", readme.replace("OMP_NUM_THREADS", "")), \
        "README.md holds an unfilled placeholder"


def _python_blocks(page, heading):
    """The ```python blocks of ``page`` between ``heading`` and the next heading of any level (a
    line starting with ``#`` inside a block is a comment, not a heading)."""
    blocks, fence, inside = [], None, False  # fence: the lines of the open code block, if any
    for line in _read(page).splitlines():
        if fence is not None:
            if line.startswith("```"):
                if fence[0] == "```python":
                    blocks.append("\n".join(fence[1:]) + "\n")
                fence = None
            else:
                fence.append(line)
        elif line.startswith("```"):
            fence = [line] if inside else None
        elif line == heading:
            inside = True
        elif inside and line.startswith("#"):
            break
    return blocks


def test_api_combining_methods_snippet_runs_as_written():
    import torch

    (code,) = _python_blocks(os.path.join("docs", "api.md"), "## Combining methods in one pass")
    namespace = {}
    exec(compile(code, "docs/api.md: Combining methods in one pass", "exec"), namespace)
    gates, frozen = namespace["gates"], namespace["freeze"].rows(namespace["u"], namespace["gates"])
    assert torch.equal(frozen, gates.rare) and gates.rare.any()
    assert torch.isfinite(namespace["out"].loss) and namespace["h"].grad is not None


def _flag_values(words):
    """{flag: value or None} of a fairseq-train command's words after the executable."""
    aliases = {"-s": "--source-lang", "-t": "--target-lang"}
    out, i = {}, 0
    while i < len(words):
        flag = aliases.get(words[i], words[i])
        if flag.startswith("-") and i + 1 < len(words) and not words[i + 1].startswith("--"):
            out[flag] = words[i + 1]
            i += 2
        else:
            out[flag] = None
            i += 1
    return out


@pytest.mark.parametrize("recipe, method", [("wikitext103", ["agg"]), ("wmt14_en_de", ["agg", "base"])])
def test_readme_training_commands_are_the_recipes(readme, recipe, method, tmp_path):
    """The README's fairseq-train snippet of a recipe trains with the recipe's own flags: those of
    `train.sh ... --dry-run`, less where it writes and logs; --fp16 included, which a dry run prints
    on any machine (the command is for a GPU machine)."""
    import shlex
    import subprocess
    import sys

    text = readme.replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.startswith(f"fairseq-train data/{recipe}/data-bin "))
    documented = _flag_values(shlex.split(line)[2:])  # after fairseq-train and the data path
    dry_run = subprocess.run(["bash", os.path.join(REPO, "examples", recipe, "train.sh"), *method, "--dry-run"],
                             capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHON=sys.executable))
    words = shlex.split(dry_run.stdout.splitlines()[-1])
    start = next(i for i, w in enumerate(words) if w.endswith("/fairseq-train"))
    recipe_flags = _flag_values(words[start + 2:])
    where = {"--user-dir", "--save-dir", "--seed", "--log-format", "--log-interval", "--distributed-world-size"}
    assert documented["--fp16"] is None and recipe_flags["--fp16"] is None
    assert {k: v for k, v in documented.items() if k not in where} == \
        {k: v for k, v in recipe_flags.items() if k not in where}
    assert documented["--save-dir"] == os.path.relpath(recipe_flags["--save-dir"], REPO)


ACTIVATE = "source .venv/bin/activate"
DOC_PAGES = MARKDOWN + sorted(os.path.join("examples", d, "README.md") for d in os.listdir(os.path.join(REPO, "examples"))
                              if os.path.isfile(os.path.join(REPO, "examples", d, "README.md")))


def _fenced_shell_commands(page):
    """Every command line of ``page``'s ```bash blocks, continuation lines joined."""
    commands, inside, pending = [], False, ""
    for line in _read(page).splitlines():
        if line.startswith("```"):
            inside = not inside and line.strip() in ("```bash", "```sh")
            continue
        if inside and (pending or (line.strip() and not line.lstrip().startswith("#"))):
            pending += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
            if not line.endswith("\\"):
                commands.append(pending.strip())
                pending = ""
    return commands


def _cheap(command):
    """A command that only prints: the plugin's directory, or a recipe's --dry-run without a redirect."""
    return command.split("#")[0].strip() == "fairseq-agg" or (
        re.match(r"bash examples/\w+/train\.sh ", command) and "--dry-run" in command and ">" not in command)


def test_readme_activates_the_environment_once_up_front(readme):
    """The set-up commands create .venv/ (scripts/setup_env.sh); the line after them activates it,
    so that the bare commands after it (fairseq-agg, fairseq-train, python) run as written."""
    assert 'venv="$root/.venv"' in _read("scripts", "setup_env.sh")
    setup = _fenced_shell_commands("README.md")[:3]
    assert [c.split("#")[0].strip() for c in setup] == ["bash scripts/run_demo.sh", "bash scripts/run_tests.sh",
                                                        ACTIVATE]
    assert readme.count(ACTIVATE) == 1


def test_the_docs_cheap_commands_run_as_written():
    """The fenced commands that only print (fairseq-agg, the recipes' dry runs) run exactly as printed
    in the activated environment (the venv's bin first on PATH, as activation puts it)."""
    import subprocess
    import sys

    commands = sorted({c for page in DOC_PAGES for c in _fenced_shell_commands(page) if _cheap(c)})
    assert len(commands) >= 5 and "fairseq-agg" in {c.split("#")[0].strip() for c in commands}, commands
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), VIRTUAL_ENV=os.path.dirname(bindir))
    procs = [(c, subprocess.Popen(["bash", "-c", c], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)) for c in commands]
    for command, proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.strip(), (command, err[-2000:])
        if "train.sh" in command:
            assert "/fairseq-train " in out and "--dry-run" not in out, command
