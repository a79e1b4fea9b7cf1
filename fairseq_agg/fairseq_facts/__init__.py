"""Every fact the plugin reads from fairseq, read in one place: one module per concern.

fairseq hands a criterion only ``(model, sample)``, and an optimizer a bare list of tensors; the
methods need a little more. Each module here reads one kind of fact and says how:

* :mod:`.training_loop`: the update number, dummy batches and the batches per epoch, observed on
  the criterion's own task (three of its methods wrapped), and the task's kind (LM or MT);
* :mod:`.distributed`: the data-parallel group and whether this process is global rank 0;
* :mod:`.checkpoint_state`: criterion buffers that travel with every checkpoint (fairseq saves a
  criterion's state only when it has parameters), and torch's safe loading of fairseq's
  checkpoints;
* :mod:`.checkpoint_files`: fairseq's checkpoint files (atomic copies and saves, a damaged file in
  one line, the checkpoint loaded last);
* :mod:`.criterion_config`: a criterion's config as ``build_criterion`` may receive it (a partial
  Namespace completed with the defaults);
* :mod:`.dictionary`: the special symbols and the ``madeupword`` fillers of a dictionary;
* :mod:`.flag_choices`: the plugin's flags among fairseq's options, and an invalid choice of one
  in one line;
* :mod:`.optimizer_params`: the model behind the parameter list fairseq hands an optimizer;
* :mod:`.output_layer`: what a model and sample give an output-layer criterion (its features, output
  projection and targets, the training device), and the answer fairseq takes back;
* :mod:`.meters`: removing a meter from fairseq's ``MetersDict``;
* :mod:`.numpy_check`: a fairseq whose compiled extensions do not import under numpy 2.

Importing a module here changes nothing in fairseq. Only :func:`fairseq_agg.register_with_fairseq`
(what ``--user-dir`` runs) replaces fairseq functions: three of checkpoint_utils and PathManager
(:mod:`.checkpoint_files`) and ``options.parse_args_and_arch`` (:mod:`.flag_choices`). The training
loop is observed on one task instance, and the optimizer's model is found on the call stack
(:mod:`.optimizer_params` says why).
"""
