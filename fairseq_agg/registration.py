"""Registering the plugin with fairseq, in one call: :func:`register_with_fairseq`.

fairseq's ``--user-dir "$(fairseq-agg)"`` runs it: the directory is the small ``fairseq_agg_plugin``
package, whose import makes this call (fairseq imports a ``--user-dir`` once, by its directory's
name). A program that runs fairseq's own ``main`` in its process calls it itself. Importing
:mod:`fairseq_agg` or its core does none of it.
"""


def register_with_fairseq():
    """Registers the plugin with fairseq and installs its fairseq hooks. Idempotent.

    * refuses a fairseq built for numpy 1.x under numpy 2, in one line (:mod:`.fairseq_facts.numpy_check`);
    * fills fairseq's registries: the criteria (:mod:`.criterions`), the models and architectures
      (:mod:`.models`) and ``--optimizer coupled_adam`` (:mod:`.optim.fairseq_coupled_adam`);
    * makes fairseq's checkpoint saves and copies atomic (a full disk one line) and a damaged
      checkpoint one line (:mod:`.fairseq_facts.checkpoint_files`);
    * makes the plugin's refusals one line in fairseq's commands, and only there: an invalid choice
      of a plugin flag in the parsers fairseq's commands parse with
      (:mod:`.fairseq_facts.flag_choices`), and a :class:`~.errors.UsageError` that reaches the
      top of the process from inside fairseq's code (:func:`.errors.report_usage_errors_in_one_line`).
    """
    from fairseq_agg.requirements import require_fairseq

    require_fairseq()  # without fairseq: one line saying what to install
    from fairseq_agg.errors import report_usage_errors_in_one_line
    from fairseq_agg.fairseq_facts.checkpoint_files import (check_checkpoints_on_load, make_checkpoint_copies_atomic,
                                                            make_checkpoint_saves_one_line)
    from fairseq_agg.fairseq_facts.checkpoint_state import allow_namespace_in_checkpoints
    from fairseq_agg.fairseq_facts.flag_choices import report_invalid_choices_in_one_line
    from fairseq_agg.fairseq_facts.numpy_check import check_fairseq_extensions_match_numpy

    check_fairseq_extensions_match_numpy()
    allow_namespace_in_checkpoints()
    make_checkpoint_copies_atomic()
    make_checkpoint_saves_one_line()
    check_checkpoints_on_load()
    report_invalid_choices_in_one_line()
    report_usage_errors_in_one_line(within=("fairseq", "fairseq_cli"))
    # each module registers what it defines (@register_criterion, @register_model, ...)
    from fairseq_agg import criterions, models  # noqa: F401
    from fairseq_agg.optim import fairseq_coupled_adam  # noqa: F401
