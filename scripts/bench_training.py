"""Whole training steps, as a command: ``python -m scripts.bench_training`` from the repository root
(``--help`` says what it measures; benchmarks/training.py). docs/benchmarks.md has the results.

Usage (from the repository root): python -m scripts.bench_training [--shape demo,words] [--methods stock,agg,...]
       [--updates 300] [--repeats 3] [--stats-methods stock] [--stats-interval 100] [--threads 2] [--json FILE]
"""
import sys

if __package__ != "scripts":  # run as a file: the repository root, and so benchmarks/, is not importable
    sys.exit("run it from the repository root as: python -m scripts.bench_training [ARGS]")

from benchmarks.training import main

if __name__ == "__main__":
    main()
