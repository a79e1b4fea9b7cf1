"""The package's commands print only their output (issue #57): importing fairseq configures the root
logger (a DEBUG handler from its wav2vec2 classification module, an INFO one from its text-to-speech
task, which asks for tensorboardX where it is missing), and fairseq_agg.fairseq_facts.import_logging
keeps that out of the commands' view, without changing a process that imports the package."""
import os
import subprocess
import sys

TENSORBOARDX_NAG = "Please install tensorboardX"


def without_tensorboardx(tmp_path):
    """An environment whose tensorboardX cannot be imported (a package of that name that refuses),
    as in an install without the test extra: fairseq then logs its request to install it."""
    package = tmp_path / "no_tensorboardx" / "tensorboardX"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise ImportError("tensorboardX is not installed here")\n')
    path = os.pathsep.join(p for p in (str(package.parent), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path)


def test_flags_prints_only_its_output(tmp_path):
    env = without_tensorboardx(tmp_path)
    # the environment does make fairseq's import speak (on the process's root logger)
    plain = subprocess.run([sys.executable, "-c", "import fairseq"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert TENSORBOARDX_NAG in plain.stderr, plain.stderr[-2000:]
    command = os.path.join(os.path.dirname(sys.executable), "fairseq-agg")
    proc = subprocess.run([command, "flags", "cross_entropy_agg"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    assert proc.stdout.startswith("criterion cross_entropy_agg ") and "--agg-alpha" in proc.stdout
    assert TENSORBOARDX_NAG not in proc.stdout and "DEBUG" not in proc.stdout


def test_import_fairseq_keeps_the_root_logger_and_its_warnings():
    """Inside the scope fairseq's basicConfig calls do nothing and only warnings reach the caller's
    handlers; after it the root logger's level and handlers are the caller's."""
    code = r'''
import io, logging, sys
stream = io.StringIO()
root = logging.getLogger()
handler = logging.StreamHandler(stream)
root.addHandler(handler)
root.setLevel(logging.INFO)
from fairseq_agg.fairseq_facts.import_logging import import_fairseq, root_logger_kept
import_fairseq()
assert "fairseq.models.wav2vec.wav2vec2_classification" in sys.modules
assert root.handlers == [handler] and root.level == logging.INFO, (root.handlers, root.level)
with root_logger_kept():
    logging.basicConfig(level=logging.DEBUG)
    logging.getLogger("x").info("an info line")
    logging.getLogger("x").warning("a warning line")
assert root.handlers == [handler] and root.level == logging.INFO
logging.getLogger("x").info("after")
print(repr(stream.getvalue()))
'''
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == repr("a warning line\nafter\n")
