"""The target vocabularies of a fairseq task: over which dictionary each decoder predicts.

A method that counts target tokens (AGG's window, FACE's counts) counts per output matrix, that is
per target dictionary:

- ``multilingual_translation`` **splits** them: one dictionary per language (``dict.LANG.txt``) and
  a decoder per target language, so one vocabulary per target language. They are **shared**, one
  vocabulary for every target language, where the target languages share one output matrix:
  ``--share-decoders``, ``--share-all-embeddings``, or ``--share-decoder-embeddings`` with
  ``--share-decoder-input-output-embed`` (fairseq then requires their dictionaries to be equal).
- ``translation_multi_simple_epoch`` **shares** one dictionary between all languages (with
  language tokens) and one decoder: one vocabulary.
- Every other task: one vocabulary, its ``target_dictionary``.

A criterion gets the ``(model, sample)`` of one language pair at a time
(``multilingual_translation`` hands it ``model.models[pair]``); :meth:`TargetVocabularies.name_of`
finds that model's vocabulary from its decoder's dictionary; at start-up it gets the whole model,
whose language pairs :func:`language_pair_models` lists (the multi-model's own ``decoder`` is only
the first pair's).
"""
from collections import OrderedDict

from fairseq_agg.errors import UsageError

SHARED = ""  # the name of a task's one vocabulary


def _shares_output_matrix(args) -> bool:
    """Whether a ``multilingual_translation`` run's target languages share one output matrix."""
    flag = lambda name: bool(getattr(args, name, False))  # noqa: E731
    tied = flag("share_decoder_input_output_embed")
    return flag("share_decoders") or flag("share_all_embeddings") or (flag("share_decoder_embeddings") and tied)


class TargetVocabularies:
    """``dictionaries``: vocabulary name -> its target dictionary, in the task's order of target
    languages (one entry named :data:`SHARED` where the task has one); ``split``: whether there are
    several."""

    def __init__(self, task):
        from fairseq.tasks.multilingual_translation import MultilingualTranslationTask

        self.dictionaries = OrderedDict()
        self._names = {}  # id of a target dictionary object -> its vocabulary's name
        self._language_names = {}  # target language -> its vocabulary's name (multilingual_translation)
        if isinstance(task, MultilingualTranslationTask):
            targets = list(OrderedDict.fromkeys(pair.split("-")[1] for pair in task.model_lang_pairs))
            shared = len(targets) == 1 or _shares_output_matrix(task.args)  # one target language: one vocabulary
            for lang in targets:
                name = SHARED if shared else lang
                self.dictionaries.setdefault(name, task.dicts[lang])
                self._names[id(task.dicts[lang])] = name
                self._language_names[lang] = name
        else:
            self.dictionaries[SHARED] = task.target_dictionary
            self._names[id(task.target_dictionary)] = SHARED
        self.split = len(self.dictionaries) > 1

    @property
    def first(self):
        """The dictionary of the first vocabulary (the only one where it is shared)."""
        return next(iter(self.dictionaries.values()))

    def name_of_pair(self, pair: str) -> str:
        """The vocabulary a language pair (``src-tgt``) of the task predicts over."""
        return self._language_names.get(pair.split("-")[-1], SHARED) if self.split else SHARED

    def name_of(self, model) -> str:
        """The vocabulary of the model (or language pair's model) a criterion was handed."""
        if not self.split:
            return SHARED
        dictionary = getattr(model.decoder, "dictionary", None)
        name = self._names.get(id(dictionary))
        if name is None:
            raise UsageError(f"the decoder of {type(model).__name__} predicts over none of the task's target "
                             f"dictionaries ({', '.join(self.dictionaries)})")
        return name


def language_pair_models(model) -> "OrderedDict[str, object]":
    """``{language pair: its model}`` of a ``multilingual_translation`` model (a ``FairseqMultiModel``,
    one decoder per target language unless shared), else ``{SHARED: model}``."""
    from fairseq.models import FairseqMultiModel

    if isinstance(model, FairseqMultiModel):
        return OrderedDict(model.models.items())
    return OrderedDict([(SHARED, model)])
