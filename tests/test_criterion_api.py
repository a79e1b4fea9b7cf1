"""fairseq's criterion API for every criterion of the plugin (issue #56, item 3).

* ``CLASS.build_criterion(Namespace(<partial>), task)``, as fairseq's own tests build criteria, and
  fairseq's registry given a Namespace: the missing fields take the dataclass defaults, the
  interpolated ones (``--sentence-avg``, ``--cpu``, ...) fairseq's option defaults, the same
  values a ``fairseq-train`` command line gives;
* every flag of every config is settable through argparse (``fairseq-train --flag``) and through a
  hydra config (what ``fairseq-hydra-train --config-dir`` composes);
* ``compute_loss()``, which fairseq's ``translation_moe`` task calls on a decoder output it computed.
"""
import dataclasses
import enum
import typing
from argparse import Namespace

import pytest
import torch
from fairseq import criterions, optim, options
from fairseq.criterions import CRITERION_DATACLASS_REGISTRY, CRITERION_REGISTRY
from fairseq.data import Dictionary
from fairseq.dataclass.utils import convert_namespace_to_omegaconf, merge_with_parent
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask
from omegaconf import OmegaConf

from fairseq_agg.errors import UsageError, plain_value
from fairseq_runs import STRONG_GATING, TINY_MT_ARGS, build_parts, criterion_from_flags

PLUGIN_CRITERIA = sorted(name for name, cls in CRITERION_REGISTRY.items() if cls.__module__.startswith("fairseq_agg."))


def test_the_plugin_registers_its_criteria():
    assert {"cross_entropy_agg", "augmented_loss", "cross_entropy_with_stats"} <= set(PLUGIN_CRITERIA)


def flag_fields(name):
    """The fields of a criterion's config that are flags (not fairseq's interpolated options)."""
    return [f for f in dataclasses.fields(CRITERION_DATACLASS_REGISTRY[name])
            if not f.name.startswith("_") and not str(f.default).startswith("${")]


def other_value(config_field):
    """A value of the field other than its default, of its type."""
    kind, default = config_field.type, config_field.default
    if typing.get_origin(kind) is typing.Union:  # Optional[X]
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return next(member.value for member in kind if member.value != plain_value(default))
    if kind is bool:
        return not default
    if kind is int:
        return (default or 0) + 3
    if kind is float:
        return (default or 0.0) + 0.25
    if kind is str:
        return "0.2,0.5,0.3"  # the only str flag: --embed-group-fractions
    raise AssertionError(f"{config_field.name}: no other value for {kind}")


def tiny_lm_task():
    dictionary = Dictionary()
    for i in range(20):
        dictionary.add_symbol(f"w{i}", n=20 - i)
    return LanguageModelingTask(LanguageModelingConfig(), dictionary, dictionary)


def command_line_config(name, extra=()):
    """cfg.criterion as fairseq-train builds it from its command line."""
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["unused-data", "--task", "language_modeling", "--arch",
                                                "transformer_lm", "--criterion", name, *extra])
    return convert_namespace_to_omegaconf(args).criterion


@pytest.mark.parametrize("name", PLUGIN_CRITERIA)
def test_build_criterion_from_a_partial_namespace_takes_the_defaults(name):
    task = tiny_lm_task()
    criterion_class = CRITERION_REGISTRY[name]
    from_flags = command_line_config(name)
    for namespace, built in (
        (Namespace(), lambda ns: criterion_class.build_criterion(ns, task)),
        (Namespace(criterion=name), lambda ns: criterions.build_criterion(ns, task)),  # fairseq's registry
    ):
        criterion = built(namespace)
        assert isinstance(criterion, criterion_class)
        cfg = getattr(criterion, "cfg", None)
        if cfg is not None:  # the plugin's output-layer criteria keep their config: every field as fairseq-train's
            for config_field in dataclasses.fields(CRITERION_DATACLASS_REGISTRY[name]):
                if not config_field.name.startswith("_"):
                    assert plain_value(getattr(cfg, config_field.name)) == plain_value(
                        getattr(from_flags, config_field.name)), config_field.name
            assert cfg.sentence_avg is False and cfg.update_freq == [1]  # not the strings "${...}"
        assert not criterion.embedding_stats.settings.enabled
    # a field given is kept
    given = criterion_class.build_criterion(Namespace(embed_stats_interval=5), task)
    assert given.embedding_stats.settings.interval == 5
    with pytest.raises(UsageError, match="--embed-stats-interval"):  # and validated as on the command line
        criterion_class.build_criterion(Namespace(embed_stats_interval=-1), task)


@pytest.mark.parametrize("name", PLUGIN_CRITERIA)
def test_every_flag_is_settable_through_argparse_and_hydra(name, tmp_path):
    from hydra import compose, initialize_config_dir
    from fairseq.dataclass.initialize import add_defaults, hydra_init

    values = {f.name: other_value(f) for f in flag_fields(name)}
    argv = []
    for field_name, value in values.items():
        flag = "--" + field_name.replace("_", "-")
        argv += [flag] if isinstance(value, bool) else [flag, str(value)]
    from_argparse = command_line_config(name, argv)

    OmegaConf.save({"defaults": ["config", "_self_"], "criterion": {"_name": name, **values}}, tmp_path / "run.yaml")
    hydra_init("config")
    # hydra's version base is global; fairseq's own hydra calls need one before 1.2
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.1"):
        composed = compose("run")
    add_defaults(composed)  # what fairseq-hydra-train does next
    composed = OmegaConf.create(OmegaConf.to_container(composed, resolve=True, enum_to_str=True))
    from_hydra = merge_with_parent(CRITERION_DATACLASS_REGISTRY[name](), composed.criterion)

    for field_name, value in values.items():
        assert plain_value(getattr(from_argparse, field_name)) == value, field_name
        assert plain_value(getattr(from_hydra, field_name)) == value, field_name


# --- compute_loss: fairseq's translation_moe task (fairseq/examples/translation_moe)

MOE_ARGS = [a if a != "translation" else "translation_moe" for a in TINY_MT_ARGS] + ["--method", "hMoEup",
                                                                                    "--num-experts", "2"]


@pytest.fixture(scope="module")
def translation_moe():
    import fairseq.examples.translation_moe.translation_moe_src  # noqa: F401  registers the task
    from fairseq.tasks import TASK_REGISTRY

    return TASK_REGISTRY["translation_moe"]


def moe_parts(data, extra):
    cfg, task, model, criterion = build_parts(data, MOE_ARGS, ["--dropout", "0"] + extra)
    task.begin_epoch(1, model)  # fairseq-train's start-up: the criterion checks the model
    return cfg, task, model, criterion


def moe_train_step(cfg, task, model, criterion, sample):
    model.zero_grad()
    optimizer = optim.build_optimizer(cfg.optimizer, [p for p in model.parameters() if p.requires_grad])
    loss, sample_size, log = task.train_step(sample, model, criterion, optimizer, update_num=0)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compute_loss_per_position_equals_stock_cross_entropy(translation_moe, mt_data_bin):
    from fairseq_runs import padded_batch

    cfg, task, model, agg = moe_parts(mt_data_bin, ["--criterion", "cross_entropy_agg", "--label-smoothing", "0"])
    stock = criterion_from_flags(task, mt_data_bin, MOE_ARGS, ["--criterion", "cross_entropy"])
    sample = padded_batch(task, "train")
    assert sample["target"].eq(task.target_dictionary.pad()).any()
    model.eval()
    with torch.no_grad():
        net_output = model(**sample["net_input"])
        ours, nll = agg.compute_loss(model, net_output, sample, reduce=False)
        theirs, _ = stock.compute_loss(model, net_output, sample, reduce=False)
        summed, _ = agg.compute_loss(model, model(**sample["net_input"]), sample, reduce=True)
    assert ours.shape == theirs.shape == (sample["target"].numel(),)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nll, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(summed, theirs.sum(), rtol=1e-5, atol=1e-4)
    # a decoder output the projection did not produce (here: a copy) is refused in one line
    with pytest.raises(UsageError, match="compute_loss: the decoder output of TransformerModel"):
        agg.compute_loss(model, (net_output[0].clone(), net_output[1]), sample)


def test_translation_moe_train_step_with_agg_gates_only_rare_rows(translation_moe, mt_data_bin):
    """translation_moe's own train_step (responsibilities, winner, loss through compute_loss): AGG's
    loss and every gradient but the rare rows of the output embedding are stock cross-entropy's."""
    cfg, task, model, agg = moe_parts(mt_data_bin, ["--criterion", "cross_entropy_agg"] + STRONG_GATING)
    stock = criterion_from_flags(task, mt_data_bin, MOE_ARGS, ["--criterion", "cross_entropy"])
    from fairseq_runs import first_batch

    sample = first_batch(task)
    loss_a, grads_a = moe_train_step(cfg, task, model, agg, sample)
    gates = agg.last_gates
    loss_s, grads_s = moe_train_step(cfg, task, model, stock, sample)
    assert loss_a.item() == pytest.approx(loss_s.item(), rel=1e-5)
    weight_name = "encoder.embed_tokens.weight"  # --share-all-embeddings: one matrix
    assert set(grads_a) == set(grads_s)
    for name in grads_s:
        if name != weight_name:
            torch.testing.assert_close(grads_a[name], grads_s[name], rtol=1e-4, atol=1e-6, msg=name)
    assert gates is not None and gates.rare.any() and (~gates.rare).any()
    torch.testing.assert_close(grads_a[weight_name][~gates.rare], grads_s[weight_name][~gates.rare],
                               rtol=1e-4, atol=1e-6)
    assert not torch.allclose(grads_a[weight_name][gates.rare], grads_s[weight_name][gates.rare], atol=1e-6)
    # the window counted the batch's targets once (the responsibilities are computed without gradients)
    target = sample["target"].reshape(-1)
    target = target[target.ne(task.target_dictionary.pad())]
    assert torch.equal(agg.window.counts, torch.bincount(target, minlength=len(task.target_dictionary)))
