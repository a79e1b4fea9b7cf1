"""fairseq's console scripts run from the demos and the study: the fairseq-train command of one run
(:func:`train_command`), child processes with their output saved to a log file and their progress
lines streamed to the terminal (:func:`run_logged`; all of them with --verbose, :class:`Console`),
fairseq-preprocess, and the check of which plugin methods are registered."""
import logging
import os
import re
import subprocess
import sys
import time

from study.harness.progress import say

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
USER_DIR = os.path.join(REPO, "fairseq_agg_plugin")  # what --user-dir loads (fairseq_agg.USER_DIR)
BIN_DIR = os.path.dirname(sys.executable)


def console_script(name):
    path = os.path.join(BIN_DIR, name)
    if not os.path.exists(path):
        raise SystemExit(f"{name} not found next to {sys.executable}: run scripts/setup_env.sh first")
    return path


# Third-party warnings every fairseq process prints and nobody running the demo can act on: the
# fairseq release's use of hydra's and torch's deprecated APIs, torch's CPU-only DataLoader hint.
# They are turned off in the child processes themselves (``-W`` filters: action:message:category:
# module); hydra's start with a newline, which a message filter cannot match, so they go by module
# (one of them is attributed to "sys", line 1: its stacklevel points past the stack).
NOISY_WARNINGS = (
    "ignore::UserWarning:hydra.experimental.initialize",
    "ignore::UserWarning:hydra.experimental.compose",
    "ignore::UserWarning:hydra.compose",
    "ignore::UserWarning:hydra.core.default_element",
    "ignore::UserWarning:sys:1",
    "ignore:`torch.cuda.amp.autocast(args...)` is deprecated:FutureWarning:fairseq.tasks.fairseq_task",
    "ignore:'pin_memory' argument is set as true but no accelerator is found:UserWarning:torch.utils.data.dataloader",
    "ignore:Support for mismatched key_padding_mask and attn_mask is deprecated:UserWarning:torch.nn.functional",
)


def child_env(threads, quiet=True):
    """The environment of the fairseq processes: ``threads`` CPU threads, unbuffered output and,
    when ``quiet``, :data:`NOISY_WARNINGS` off (filters the user set in PYTHONWARNINGS come later
    and so win)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    if quiet:
        env["PYTHONWARNINGS"] = ",".join(NOISY_WARNINGS + tuple(filter(None, [os.environ.get("PYTHONWARNINGS")])))
    return env


class Console:
    """How much of the child processes' output the terminal shows; all of it always goes to their
    log files. Set once per invocation from a demo's --verbose (examples/demo_common.py, ``Demo.plan``)."""

    verbose = False


# fairseq's progress: train_inner, valid and end-of-epoch lines, "done training", and its warnings
PROGRESS_LINES = re.compile(r"\| (train_inner|train|valid|WARNING|ERROR|CRITICAL) \||done training in")
# fairseq-preprocess's last line, saying where the binarised data is
PREPROCESS_DONE = re.compile(r"Wrote preprocessed data")


def run_logged(cmd, log_path, prefix, env, show=True, on_line=None, append=False):
    """Runs a command, saving its merged stdout/stderr to log_path (after what it holds with
    ``append``) and echoing lines with a prefix: every line (``show`` True), none (False), or those a
    compiled regex ``show`` finds; every line whatever ``show`` with --verbose (:class:`Console`).
    ``on_line(line)`` sees each line as it comes.

    Returns (returncode, output lines, wall seconds).
    """
    t0 = time.time()
    lines = []
    with open(log_path, "a" if append else "w", encoding="utf-8") as log:
        log.write(" ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=REPO, bufsize=1)
        for line in proc.stdout:
            log.write(line)
            log.flush()
            line = line.rstrip("\n")
            lines.append(line)
            if on_line is not None:
                on_line(line)
            if Console.verbose or show is True or (show and show.search(line)):
                say(f"{prefix}{line}")
        proc.wait()
    return proc.returncode, lines, time.time() - t0


def preprocess(flags, log_dir, env, show=PREPROCESS_DONE):
    """fairseq-preprocess FLAGS, logged to LOG_DIR/preprocess.log (``show``: as :func:`run_logged`;
    by default its last line only); stops the demo if it fails."""
    rc, _, _ = run_logged([console_script("fairseq-preprocess"), *flags], os.path.join(log_dir, "preprocess.log"),
                          "[preprocess] ", env, show=show)
    if rc != 0:
        raise SystemExit(f"fairseq-preprocess failed; see {log_dir}/preprocess.log")


def quiet_fairseq_logging():
    """Imports fairseq's tasks, then lets this process log warnings only: that import runs
    logging.basicConfig(level=DEBUG) (its text_to_speech task), after which every library the demos
    use in-process (models and dictionaries loaded for Uniq or the MT token groups, matplotlib in
    the figures) would print its DEBUG lines."""
    import fairseq.tasks  # noqa: F401  (the import that configures logging)

    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.WARNING,
                        stream=sys.stderr, force=True)


def registered_methods(methods):
    """{name: None if usable else the reason}; methods map to dicts with 'criterion' and 'arch' (and
    an 'optimizer' when they replace the demo's adam)."""
    import fairseq_agg
    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq.models import ARCH_MODEL_REGISTRY
    from fairseq.optim import OPTIMIZER_REGISTRY

    fairseq_agg.register_with_fairseq()
    quiet_fairseq_logging()

    out = {}
    for name, m in methods.items():
        reason = None
        if m["criterion"] not in CRITERION_REGISTRY:
            reason = f"criterion '{m['criterion']}' is not registered in this build of the plugin"
        elif m["arch"] not in ARCH_MODEL_REGISTRY:
            reason = f"architecture '{m['arch']}' is not registered in this build of the plugin"
        elif m.get("optimizer", "adam") not in OPTIMIZER_REGISTRY:
            reason = f"optimizer '{m['optimizer']}' is not registered in this build of the plugin"
        out[name] = reason
    return out


def train_command(method, model, train_flags, budget, data_bin, save_dir, seed, updates, cpu, data_flags=(),
                  log_lines=10):
    """fairseq-train's argument list of one run: ``method`` (criterion, arch, args and optionally
    optimizer and optimizer_args: a demo's METHODS entry or a variant of one), the architecture flags ``model``, the
    shared ``train_flags`` and ``data_flags``, ``budget``'s max_tokens and warm-up, ``updates``
    updates, about ``log_lines`` train_inner lines. The order of the flags is part of a study run's
    identity (study/store.py, ``run_key``)."""
    cmd = [console_script("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--arch", method["arch"],
           "--criterion", method["criterion"], *method["args"], *model, *train_flags, *data_flags,
           # after the shared flags: argparse keeps the last --optimizer
           *(["--optimizer", method["optimizer"], *method.get("optimizer_args", [])] if "optimizer" in method else []),
           "--max-tokens", str(budget["max_tokens"]),
           "--warmup-updates", str(min(budget["warmup"], max(1, updates // 4))),
           "--max-update", str(updates), "--seed", str(seed), "--save-dir", save_dir,
           "--log-interval", str(max(10, updates // log_lines))]
    if cpu:
        cmd.append("--cpu")
    return cmd
