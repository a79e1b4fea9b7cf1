"""A console command run inside the test process, answered like the subprocess that would run it.

Most refusals happen at start-up, before a single update: parsing the flags, setting up the task,
building the model, criterion and optimizer, loading a checkpoint. A real process per case costs
about 4 s of imports; here a case costs what fairseq's own start-up costs. What a process would do
with the outcome is done the same way: ``SystemExit`` gives the exit status, and any other
exception goes to ``sys.excepthook``, the hook a console script's uncaught exception reaches
(where the plugin prints its one-line refusal and exits with status 2, or the traceback is
printed and the status is 1). stdout and stderr are what the command itself wrote to them.

Each channel a refusal can take also keeps at least one real subprocess in the suite
(tests/test_bad_inputs.py names them), so that the console scripts and the hook as installed in a
fresh process are tested too.
"""
import contextlib
import dataclasses
import io
import logging
import sys


@dataclasses.dataclass
class Outcome:
    """What ``subprocess.run(..., capture_output=True, text=True)`` would return."""

    args: list
    returncode: int
    stdout: str
    stderr: str


def _exit_status(code):
    if code is None:
        return 0
    return code if isinstance(code, int) else 1  # sys.exit("message") prints it and exits with 1


def run_in_process(prog, entry, argv):
    """Runs ``entry()`` (a console script's function, which reads ``sys.argv``) as ``PROG ARGV``."""
    argv = [str(a) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_raise = sys.argv, logging.raiseExceptions
    sys.argv = [prog, *argv]
    # a logging handler an earlier test left on a stream that is gone (pytest's captured stderr
    # of an in-process command) must not print "--- Logging error ---" here: in a fresh process
    # no such handler exists
    logging.raiseExceptions = False
    status = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = _exit_status(entry())
            except SystemExit as e:
                if e.code is not None and not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
                status = _exit_status(e.code)
            except Exception as e:  # uncaught in a process: the interpreter hands it to sys.excepthook
                try:
                    sys.excepthook(type(e), e, e.__traceback__)
                    status = 1
                except SystemExit as hook_exit:
                    status = _exit_status(hook_exit.code)
    finally:
        sys.argv, logging.raiseExceptions = saved_argv, saved_raise
    return Outcome([prog, *argv], status, out.getvalue(), err.getvalue())


def fairseq_train(argv):
    """``fairseq-train ARGV`` in this process (fairseq_cli.train:cli_main, its console script)."""
    import fairseq_agg
    from fairseq_cli import train

    fairseq_agg.register_with_fairseq()  # what --user-dir does in a process: the plugin and its hooks

    return run_in_process("fairseq-train", train.cli_main, argv)


def fairseq_agg_command(argv):
    """``fairseq-agg ARGV`` in this process (fairseq_agg_cli:main)."""
    import fairseq_agg_cli

    return run_in_process("fairseq-agg", fairseq_agg_cli.main, argv)


def fairseq_agg_analyze(argv):
    """``fairseq-agg-analyze ARGV`` in this process (fairseq_agg_cli:analyze_main)."""
    import fairseq_agg_cli

    return run_in_process("fairseq-agg-analyze", fairseq_agg_cli.analyze_main, argv)
