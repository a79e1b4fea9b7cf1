"""Average the parameters of several fairseq checkpoints (``fairseq-agg average-checkpoints``).

fairseq keeps its averaging script in the source tree only (it is not installed with the
package), and the WMT14 recipes of the AGG and Transformer papers evaluate the average of the
last checkpoints. Usage::

    fairseq-agg average-checkpoints --inputs CKPT_DIR --num-epoch-checkpoints 5 --output avg.pt
    fairseq-agg average-checkpoints --inputs CKPT_DIR --num-update-checkpoints 10 --output avg.pt
    fairseq-agg average-checkpoints --inputs a.pt b.pt c.pt --output avg.pt

The output is the newest input checkpoint with its model weights replaced by the average (the
optimizer state is dropped: it belongs to none of the averaged weights), saved in the layout
fairseq-train writes, so fairseq-generate, fairseq-interactive, fairseq-eval-lm and
fairseq-agg-analyze load it like any checkpoint, with torch's default safe loading.

Every mistake is one line before anything is written: an ``--output`` that is one of the inputs,
a directory, a device, FIFO or socket, empty or not writable, an input given twice, an input that
is missing, a directory (without ``--num-*-checkpoints``), no regular file, unreadable, truncated or
no fairseq checkpoint. The output is written under a temporary name beside it
(``.NAME.<pid>.<random>.tmp``, removed by the next run if this one is killed) and renamed when
complete, so a failure, a kill or a full disk (one line: the previous output is kept) leaves no
half-written checkpoint (:mod:`fairseq_agg.files`).
"""
import collections
import os
import re

import torch

from fairseq_agg.errors import UsageError
from fairseq_agg.files import atomic_output, irregular_file_kind
from fairseq_agg.analysis.checkpoints import AnalyzeError, load_checkpoint

_EPOCH_RE = re.compile(r"checkpoint(\d+)\.pt")
_UPDATE_RE = re.compile(r"checkpoint_\d+_(\d+)\.pt")


def find_checkpoints(directory, num, kind, upper_bound=None):
    """The ``num`` newest epoch (``checkpointN.pt``) or update (``checkpoint_E_U.pt``) checkpoints.

    ``upper_bound`` excludes checkpoints after that epoch / update number (as the papers'
    ``--checkpoint-upper-bound``). Returned newest first.
    """
    pattern = _EPOCH_RE if kind == "epoch" else _UPDATE_RE
    found = []
    for name in os.listdir(directory):
        m = pattern.fullmatch(name)
        if m is None:
            continue
        idx = int(m.group(1))
        if upper_bound is not None and idx > upper_bound:
            continue
        found.append((idx, os.path.join(directory, name)))
    found.sort(reverse=True)
    if len(found) < num:
        raise UsageError(
            f"--num-{kind}-checkpoints {num}: only {len(found)} {kind} checkpoints in {directory}"
            + (f" at or below --checkpoint-upper-bound {upper_bound}" if upper_bound is not None else "")
        )
    return [path for _, path in found[:num]]


def _load(path):
    """fairseq's loader (it upgrades old checkpoint layouts), with every failure in one line."""
    try:
        return load_checkpoint(path)
    except AnalyzeError as e:
        raise UsageError(f"--inputs: {e}") from None


def checkpoint_paths(args):
    """The checkpoints to average (the first supplies everything but the weights): existing,
    readable files, each once."""
    num = args.num_epoch_checkpoints or args.num_update_checkpoints
    if num is not None:
        if len(args.inputs) != 1 or not os.path.isdir(args.inputs[0]):
            raise UsageError("--inputs must be one checkpoint directory with --num-*-checkpoints")
        kind = "epoch" if args.num_epoch_checkpoints is not None else "update"
        return find_checkpoints(args.inputs[0], num, kind, args.checkpoint_upper_bound)
    if args.checkpoint_upper_bound is not None:
        raise UsageError("--checkpoint-upper-bound needs --num-epoch-checkpoints or --num-update-checkpoints")
    seen = {}
    for path in args.inputs:
        if os.path.isdir(path):
            raise UsageError(f"--inputs: {path} is a directory; to average the last N checkpoints in it, add "
                             "--num-epoch-checkpoints N (checkpointEPOCH.pt) or --num-update-checkpoints N "
                             "(checkpoint_EPOCH_UPDATE.pt)")
        kind = irregular_file_kind(path)
        if kind is not None:
            raise UsageError(f"--inputs: {path}: not a regular file ({kind}); name a checkpoint file")
        if not os.path.isfile(path):
            raise UsageError(f"--inputs: no such checkpoint file: {path}")
        if not os.access(path, os.R_OK):
            raise UsageError(f"--inputs: {path} is not readable")
        stat = os.stat(path)
        key = (stat.st_dev, stat.st_ino)  # the same file under two names counts too
        if key in seen:
            raise UsageError(f"--inputs: {path} and {seen[key]} are the same checkpoint; give each one once")
        seen[key] = path
    return list(args.inputs)


def _as_saved_by_fairseq(state):
    """``state`` with ``cfg`` a plain container again, as fairseq's Trainer.state_dict saves it.

    fairseq's loader turns ``cfg`` into an OmegaConf DictConfig, a class torch's safe loading
    (weights_only=True, the default since torch 2.6) refuses: saved as loaded, the average could
    only be read with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1.
    """
    from omegaconf import OmegaConf

    if OmegaConf.is_config(state.get("cfg")):
        state["cfg"] = OmegaConf.to_container(state["cfg"], resolve=True, enum_to_str=True)
    return state


def average_checkpoints(paths):
    """Returns the newest (first) checkpoint's state with the element-wise mean of all models."""
    if not paths:
        raise UsageError("--inputs: no checkpoints to average")
    sums = collections.OrderedDict()
    dtypes = {}
    base = None
    for i, path in enumerate(paths):
        state = _load(path)
        model = state["model"]
        if i == 0:
            base = state
            for k, v in model.items():
                dtypes[k] = v.dtype
                # float64 accumulation: the mean of fp16/fp32 weights without rounding drift.
                sums[k] = v.double().clone() if v.is_floating_point() else v.clone()
            continue
        if set(model) != set(sums):
            diff = sorted(set(model) ^ set(sums))
            raise UsageError(f"--inputs: {path}: parameters differ from {paths[0]} (e.g. {diff[:3]})")
        for k, v in model.items():
            if v.shape != sums[k].shape:
                raise UsageError(f"--inputs: {path}: {k} has shape {tuple(v.shape)}, {paths[0]} has {tuple(sums[k].shape)}")
            if v.is_floating_point():
                sums[k].add_(v.double())
            elif not torch.equal(v, sums[k]):
                # integer buffers (counters, version stamps) cannot be averaged meaningfully
                raise UsageError(f"--inputs: {path}: non-float tensor {k} differs between checkpoints")
        del state
    n = len(paths)
    averaged = collections.OrderedDict()
    for k, v in sums.items():
        averaged[k] = (v / n).to(dtypes[k]) if v.is_floating_point() else v
    base["model"] = averaged
    base.pop("last_optimizer_state", None)
    if isinstance(base.get("extra_state"), dict):
        base["extra_state"].pop("ema", None)
        base["extra_state"].pop("ema_fp32_params", None)
    return _as_saved_by_fairseq(base)


def run(args, parser):
    """``fairseq-agg average-checkpoints`` with the arguments fairseq_agg_cli parsed."""
    try:
        paths = checkpoint_paths(args)
        # the output is checked, and its temporary file created, before any checkpoint is read
        with atomic_output(args.output, inputs=paths, flag="--output") as handle:
            state = average_checkpoints(paths)
            # torch.save, as fairseq-train's writer: the same layout, loaded by the same tools; into
            # a Python file, whose failed write keeps its errno (a full disk is then one line)
            torch.save(state, handle)
    except UsageError as e:
        parser.error(str(e))  # one line, exit status 2
    print(f"averaged {len(paths)} checkpoints -> {args.output}")
    for path in paths:
        print(f"  {path}")
    return 0
