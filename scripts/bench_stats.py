"""Cost of the embedding statistics, as a command: ``python -m scripts.bench_stats`` from the
repository root (``--help`` says what it measures; benchmarks/stats.py). docs/stats.md has the results.

Usage (from the repository root): python -m scripts.bench_stats [--vocab 50000 --dim 1024] [--updates 1000]
       [--max-tokens 1024] [--repeats 2] [--device cpu|cuda] [--skip-train] [--skip-metrics]
"""
import sys

if __package__ != "scripts":  # run as a file: the repository root, and so benchmarks/, is not importable
    sys.exit("run it from the repository root as: python -m scripts.bench_stats [ARGS]")

from fairseq_agg.fairseq_facts.import_logging import import_fairseq

import_fairseq()  # before the benchmark imports it: fairseq's import would put debug lines on stderr
from benchmarks.stats import main

if __name__ == "__main__":
    main()
