"""A criterion's config as fairseq's ``build_criterion`` may receive it.

fairseq-train hands a criterion a DictConfig of its dataclass, every field present and the
interpolated ones (``II("optimization.sentence_avg")``) resolved against the whole run's config.
``CLASS.build_criterion(Namespace(...), task)``, the way fairseq's own tests build criteria, hands
only the fields the caller set; fairseq's registry, given a Namespace, fills a dataclass but leaves
the interpolations as strings (``"${optimization.sentence_avg}"``). :func:`complete_config` gives
both the dataclass's defaults for what is missing, and an interpolation the default of the
fairseq option it names, as a stock criterion's keyword defaults do.
"""
import dataclasses
from argparse import Namespace

from fairseq.dataclass.configs import FairseqConfig


def fairseq_option_default(path: str):
    """The default of the fairseq option ``path`` ("optimization.sentence_avg")."""
    group_name, name = path.split(".", 1)
    group = {f.name: f for f in dataclasses.fields(FairseqConfig)}[group_name]
    default = group.default_factory() if group.default is dataclasses.MISSING else group.default
    return getattr(default() if isinstance(default, type) else default, name)


def _interpolation(value):
    """The option path of ``"${optimization.sentence_avg}"``, else None."""
    if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
        return value[2:-1]
    return None


def complete_config(cfg, config_class):
    """``cfg`` (a Namespace or a dataclass instance, possibly partial) as a ``config_class``
    instance with every field set; a DictConfig (fairseq-train's, hydra's) is returned as it is."""
    if not (isinstance(cfg, Namespace) or dataclasses.is_dataclass(cfg)):
        return cfg  # a DictConfig: complete, its interpolations resolved by OmegaConf
    config = config_class()
    for config_field in dataclasses.fields(config_class):
        if config_field.name.startswith("_"):
            continue
        value = getattr(cfg, config_field.name, getattr(config, config_field.name))
        path = _interpolation(value)
        setattr(config, config_field.name, fairseq_option_default(path) if path else value)
    return config
