"""conftest.py of a run of fairseq's own tests (tests/support/fairseq_own_tests.py copies it next to
the extracted ``tests`` package). ``FAIRSEQ_OWN_TESTS_MODE`` says what is done before the tests are
collected:

- ``stock``: nothing, fairseq as installed;
- ``loaded``: the plugin registered exactly as ``--user-dir`` does it
  (``fairseq.utils.import_user_module`` on the ``fairseq_agg_plugin`` directory);
- ``swapped``: loaded, and the registry's ``cross_entropy`` (fairseq's default ``--criterion``)
  resolved to the plugin's ``cross_entropy_agg`` with its defaults: every path that builds the
  criterion by that name (argparse default, a command line, hydra configs, ``build_criterion``)
  gets AGG's gates, its window and its checkpoint state, not only the command lines a test spells.

``FAIRSEQ_OWN_TESTS_REPORT``, when set, is a file that gets one line saying what the mode did; in
``swapped`` mode it names the class fairseq then builds for ``--criterion cross_entropy``.
"""
import argparse
import importlib.util
import os

MODE = os.environ.get("FAIRSEQ_OWN_TESTS_MODE", "stock")


def load_plugin_as_user_dir():
    from fairseq.utils import import_user_module

    # the directory, found without importing it: importing it is what registers
    plugin_dir = importlib.util.find_spec("fairseq_agg_plugin").submodule_search_locations[0]
    import_user_module(argparse.Namespace(user_dir=plugin_dir))
    return plugin_dir


def swap_cross_entropy():
    from hydra.core.config_store import ConfigStore
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY, CRITERION_REGISTRY

    agg, agg_config = CRITERION_REGISTRY["cross_entropy_agg"], CRITERION_DATACLASS_REGISTRY["cross_entropy_agg"]
    CRITERION_REGISTRY["cross_entropy"] = agg
    CRITERION_DATACLASS_REGISTRY["cross_entropy"] = agg_config
    # fairseq stored its configs' nodes when it was imported (fairseq.dataclass.initialize): the
    # hydra path composes "criterion=cross_entropy" from that node, so it is replaced too
    node = agg_config()
    node._name = "cross_entropy"
    ConfigStore.instance().store(name="cross_entropy", group="criterion", node=node, provider="fairseq")
    return built_for("cross_entropy")


def built_for(criterion):
    """The class fairseq builds for ``--criterion CRITERION`` of a language-modelling command line,
    through argparse, the hydra config made from it and the task, as fairseq-train does."""
    from fairseq import options
    from fairseq.data import Dictionary
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.tasks.language_modeling import LanguageModelingTask

    args = options.parse_args_and_arch(options.get_training_parser(), [
        os.devnull, "--task", "language_modeling", "--arch", "transformer_lm", "--criterion", criterion])
    cfg = convert_namespace_to_omegaconf(args)
    dictionary = Dictionary()
    dictionary.add_symbol("token")
    built = LanguageModelingTask(cfg.task, dictionary, dictionary).build_criterion(cfg.criterion)
    return f"{type(built).__module__}.{type(built).__name__}"


def pytest_configure(config):
    if MODE not in ("stock", "loaded", "swapped"):
        raise ValueError(f"FAIRSEQ_OWN_TESTS_MODE={MODE!r}: stock, loaded or swapped")
    said = "stock fairseq"
    if MODE in ("loaded", "swapped"):
        said = f"plugin loaded from {load_plugin_as_user_dir()}"
    if MODE == "swapped":
        said += f"; cross_entropy -> {swap_cross_entropy()}"
    report = os.environ.get("FAIRSEQ_OWN_TESTS_REPORT")
    if report:
        with open(report, "w") as out:
            out.write(said + "\n")
