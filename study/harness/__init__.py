"""The run, log and report helpers that the demos (``examples/``) and the study share: a corpus
fetched and prepared once (:mod:`~study.harness.corpus_cache`), the options both command lines
check (:mod:`~study.harness.cli`), fairseq's console scripts run with their lines streamed
(:mod:`~study.harness.fairseq_commands`), their log lines read (:mod:`~study.harness.fairseq_logs`),
"run k of N" and the time left (:mod:`~study.harness.progress`), and the tables and figures
(:mod:`~study.harness.tables`, :mod:`~study.harness.figures`).

This floor imports the package and the standard library only: the demos import it, and the rest
of ``study/`` builds on the demos.
"""
