"""``python -m fairseq_agg`` prints the directory to pass to ``fairseq-train --user-dir``."""
from .cli import main

if __name__ == "__main__":
    import sys

    sys.exit(main())
