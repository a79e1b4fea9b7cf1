"""Criteria registered with fairseq on import (one module per criterion)."""
import importlib
import os

from fairseq_agg.requirements import require_fairseq

require_fairseq()  # without fairseq: one line saying what to install

for _file in sorted(os.listdir(os.path.dirname(__file__))):
    if _file.endswith(".py") and not _file.startswith("_"):
        importlib.import_module(__name__ + "." + _file[: -len(".py")])
