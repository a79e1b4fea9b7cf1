"""The measured study (``scripts/run_study.sh``, docs/study.md): every table and figure of
docs/results.md from one resumable command, built on the two demos (and, for the tail part, its
own word-level corpus). ``study/harness/`` holds the run, log and report helpers that the demos
share with it; it imports nothing from the demos or the rest of ``study/``."""
