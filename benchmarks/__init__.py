"""The benchmarks and the accelerator check: a package of the checkout, outside the installed wheel
(pyproject.toml's package discovery takes ``fairseq_agg`` only; tests/test_packaging.py checks it).

The commands are the thin modules of ``scripts/`` (``python -m scripts.bench_criterion`` and so on,
from the repository root); what they share is here, once:

* :mod:`benchmarks.ops`: the one module that calls ``fairseq_agg.ops`` (and reads the criteria's
  defaults), so that a change of the core's API is adapted in one place;
* :mod:`benchmarks.variants`: the one registry of the output-layer variants (one name per step)
  and the grammar of the keys that name one measurement of a variant;
* :mod:`benchmarks.timing`: the one timing harness (untimed first calls, warm-up, interleaved
  rounds; CUDA events on a GPU);
* :mod:`benchmarks.targets`: the one table of targets (each limit once, with its source);
* :mod:`benchmarks.memory`: peak memory of one step on a CPU (the profiler's trace, or the RSS of a
  fresh process);
* :mod:`benchmarks.external`: the anchors outside torch and the package (Liger-Kernel,
  cut-cross-entropy);
* :mod:`benchmarks.train_worker`: ``fairseq-train`` in a worker process that records when each
  update ended (the GPU check's training parts and the whole-step benchmark);
* one package or module per command: :mod:`benchmarks.criterion` (the output layer + loss),
  :mod:`benchmarks.gpu_check` (the accelerator check, one module per part),
  :mod:`benchmarks.training` (whole ``fairseq-train`` steps), :mod:`benchmarks.attention` (MLRA
  against fairseq's attention), :mod:`benchmarks.stats` (the embedding statistics).

The output-layer problem, the package's steps on it and the reference constructions the
benchmarks time are in ``tests/support/`` (imported as ``tests.support.X``), which the tests share.
"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
