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
"""
import argparse
import collections
import os
import re
import sys

import torch

from fairseq_agg.fairseq_hooks import allow_namespace_in_checkpoints

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
        raise ValueError(
            f"--num-{kind}-checkpoints {num}: only {len(found)} {kind} checkpoints in {directory}"
            + (f" at or below --checkpoint-upper-bound {upper_bound}" if upper_bound is not None else "")
        )
    return [path for _, path in found[:num]]


def _load(path):
    # fairseq's loader upgrades old checkpoint layouts. fairseq stores the legacy model config as
    # an argparse.Namespace, which torch >= 2.6 refuses to unpickle with weights_only=True unless
    # it is allow-listed.
    from fairseq import checkpoint_utils

    allow_namespace_in_checkpoints()
    return checkpoint_utils.load_checkpoint_to_cpu(path)


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
        raise ValueError("--inputs: no checkpoints to average")
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
            raise ValueError(f"{path}: parameters differ from {paths[0]} (e.g. {diff[:3]})")
        for k, v in model.items():
            if v.shape != sums[k].shape:
                raise ValueError(f"{path}: {k} has shape {tuple(v.shape)}, {paths[0]} has {tuple(sums[k].shape)}")
            if v.is_floating_point():
                sums[k].add_(v.double())
            elif not torch.equal(v, sums[k]):
                # integer buffers (counters, version stamps) cannot be averaged meaningfully
                raise ValueError(f"{path}: non-float tensor {k} differs between checkpoints")
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


def build_parser():
    p = argparse.ArgumentParser(
        prog="fairseq-agg average-checkpoints",
        description="Average the model parameters of fairseq checkpoints.",
    )
    p.add_argument("--inputs", nargs="+", required=True,
                   help="checkpoint files, or one directory with --num-epoch/--num-update-checkpoints")
    p.add_argument("--output", required=True, help="path of the averaged checkpoint")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--num-epoch-checkpoints", type=int, help="average the last N checkpointEPOCH.pt")
    g.add_argument("--num-update-checkpoints", type=int, help="average the last N checkpoint_E_UPDATE.pt")
    p.add_argument("--checkpoint-upper-bound", type=int,
                   help="ignore checkpoints after this epoch (or update, with --num-update-checkpoints)")
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    num = args.num_epoch_checkpoints or args.num_update_checkpoints
    try:
        if num is not None:
            if num < 1:
                flag = "--num-epoch-checkpoints" if args.num_epoch_checkpoints is not None else "--num-update-checkpoints"
                raise ValueError(f"{flag} must be >= 1, got {num}")
            if len(args.inputs) != 1 or not os.path.isdir(args.inputs[0]):
                raise ValueError("--inputs must be one checkpoint directory with --num-*-checkpoints")
            kind = "epoch" if args.num_epoch_checkpoints is not None else "update"
            paths = find_checkpoints(args.inputs[0], num, kind, args.checkpoint_upper_bound)
        else:
            if args.checkpoint_upper_bound is not None:
                raise ValueError("--checkpoint-upper-bound needs --num-epoch-checkpoints or --num-update-checkpoints")
            paths = list(args.inputs)
            for path in paths:
                if not os.path.isfile(path):
                    raise ValueError(f"--inputs: no such checkpoint file: {path}")
        state = average_checkpoints(paths)
    except ValueError as e:
        parser.error(str(e))
    from fairseq import checkpoint_utils

    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    # fairseq's own writer: a temporary file renamed into place, so no half-written output remains
    checkpoint_utils.torch_persistent_save(state, args.output)
    print(f"averaged {len(paths)} checkpoints -> {args.output}")
    for path in paths:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
