"""The model behind the parameter list fairseq hands an optimizer (Coupled Adam needs to know which
tensor is the embedding).

fairseq gives an optimizer only a bare list of tensors, and no hook, task method or registry
tells an optimizer which model it is built for. So :func:`locate_model_parameters` finds the
``Trainer`` that is building the optimizer on the call stack, the one place in the plugin that
does so: nothing of fairseq's is patched, and an optimizer built outside a Trainer sees none.
"""
import inspect


def locate_model_parameters(optimizer_params):
    """For an optimizer that fairseq's ``Trainer`` is building from ``optimizer_params``: (the
    model, {trainable model parameter: (the optimizer tensor that holds it, its element offset)}),
    or (None, {}) when no Trainer is building one.

    fairseq hands an optimizer a bare list (``Trainer._build_optimizer``): the trainable parameters
    of ``model.parameters()`` in that order, then the criterion's. The parameters themselves in
    fp32, ``--amp`` and ``--memory-efficient-fp16``; fp32 copies in that order under ``--fp16
    --fp16-no-flatten-grads``; under ``--fp16`` one flat fp32 tensor concatenating them
    (``FP16Optimizer.build_fp32_params``). Other layouts (``fully_sharded``, pipeline parallelism)
    locate nothing. The trainer is found on the call stack (see the module docstring).
    """
    from fairseq.trainer import Trainer

    received = list(optimizer_params)
    frame, trainer = inspect.currentframe(), None
    while frame is not None and trainer is None:
        if frame.f_code is Trainer._build_optimizer.__code__:
            trainer = frame.f_locals.get("self")
        frame = frame.f_back
    del frame
    if trainer is None:
        return None, {}
    model = trainer.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    received_ids = {id(q) for q in received}
    if any(id(p) in received_ids for p in trainable):
        return model, {p: (p, 0) for p in trainable if id(p) in received_ids}
    if len(received) >= len(trainable) and all(p.shape == q.shape for p, q in zip(trainable, received)):
        return model, {p: (q, 0) for p, q in zip(trainable, received)}
    if len(received) == 1 and received[0].dim() == 1 and received[0].numel() >= sum(p.numel() for p in trainable):
        offsets = [0]
        for p in trainable[:-1]:
            offsets.append(offsets[-1] + p.numel())
        return model, {p: (received[0], offset) for p, offset in zip(trainable, offsets)}
    return model, {}
