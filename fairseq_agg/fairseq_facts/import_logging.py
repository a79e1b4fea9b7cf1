"""What importing fairseq does to the process's logging, and how the package's commands keep it out.

Importing fairseq configures the root logger: ``fairseq/models/wav2vec/wav2vec2_classification.py``
calls ``logging.basicConfig(level=DEBUG)``, which puts every library's debug records on stderr
(filelock's, once ``torch.compile`` runs), and ``fairseq/tasks/text_to_speech.py`` calls
``logging.basicConfig(level=INFO)`` and then logs a request to install tensorboardX where it is
missing. :func:`import_fairseq` imports fairseq with the root logger left as the caller had it.
The package's commands (``fairseq_agg_cli``) and the benchmarks call it before anything else
imports fairseq; importing the package does not call it (docs/architecture.md).
"""
import contextlib
import logging

from fairseq_agg.requirements import require_fairseq


class _WarningsOnward(logging.Handler):
    """The root logger's one handler while fairseq is imported: a record of level WARNING or above
    goes on to the handlers the root had (Python's last-resort handler where it had none), anything
    lower is dropped. Its presence makes fairseq's ``basicConfig`` calls do nothing."""

    def __init__(self, handlers):
        super().__init__(logging.WARNING)
        self.targets = list(handlers) or [h for h in (logging.lastResort,) if h is not None]

    def emit(self, record):
        for handler in self.targets:
            if record.levelno >= handler.level:
                handler.handle(record)


@contextlib.contextmanager
def root_logger_kept():
    """Inside: the root logger passes on only warnings and errors, and ``basicConfig`` changes
    nothing; after: the root logger's level and handlers are what they were before."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    root.handlers = [_WarningsOnward(handlers)]
    try:
        yield
    finally:
        root.handlers = handlers
        root.setLevel(level)


def import_fairseq():
    """Imports fairseq (all of its registries: models, tasks, criteria) keeping the root logger as
    it was; a missing fairseq is one line naming what to install (:func:`require_fairseq`)."""
    with root_logger_kept():
        require_fairseq()
