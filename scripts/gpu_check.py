"""The accelerator check, as a command: ``python -m scripts.gpu_check`` from the repository root
(``scripts/device/gpu_check.sh`` runs it on the accelerator machine; ``--cpu-smoke`` runs the same
code paths at tiny shapes on a CPU). What it checks and measures, part by part, is
benchmarks/gpu_check/ (its package docstring); docs/benchmarks.md has the results.

Usage (from the repository root): python -m scripts.gpu_check [--cpu-smoke] [--out DIR] [--deadline UNIX_S]
       [--budget-s S] [--parts correctness,output_layer,train,train_mt,stats]
"""
import sys

if __package__ != "scripts":  # run as a file: the repository root, and so benchmarks/, is not importable
    sys.exit("run it from the repository root as: python -m scripts.gpu_check [ARGS]")

from benchmarks.gpu_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
