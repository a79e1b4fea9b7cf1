"""``python -m fairseq_agg``: the ``fairseq-agg`` command (prints the --user-dir path by default).

Slower than ``fairseq-agg`` itself: ``-m`` imports the package, which registers it with fairseq.
"""
import sys

from fairseq_agg_cli import main

if __name__ == "__main__":
    sys.exit(main())
