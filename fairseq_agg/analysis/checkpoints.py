"""Loading fairseq checkpoints for ``fairseq-agg-analyze``: the state, its metadata, its dictionaries
and its model with its task on a data directory. Every failure is an :class:`AnalyzeError` that
names the file or flag."""
import logging
import os
import pickle
from typing import Optional

from fairseq_agg.fairseq_facts.checkpoint_files import saved_updates
from fairseq_agg.fairseq_facts.checkpoint_state import UnsafeCheckpoint, allow_namespace_in_checkpoints
from fairseq_agg.fairseq_facts.dictionary import madeupword_ids, nspecial
from fairseq_agg.registration import register_with_fairseq
from fairseq_agg.stats.matrices import task_dictionaries

logger = logging.getLogger("fairseq_agg.analyze")


class AnalyzeError(Exception):
    """A user-facing error of the offline analysis (bad path, no embeddings, ...)."""


def check_checkpoint_path(path: str):
    """Refuses a missing checkpoint or a directory, before anything is loaded."""
    if not os.path.exists(path):
        raise AnalyzeError(f"checkpoint not found: {path}")
    if os.path.isdir(path):
        raise AnalyzeError(f"{path} is a directory; pass a checkpoint file (e.g. {os.path.join(path, 'checkpoint_best.pt')})")


def _unreadable_reason(error: Exception) -> str:
    """Why torch.load failed, in words a user can act on (its own texts are unpickling internals)."""
    text = (str(error).strip().splitlines() or [""])[0]
    if isinstance(error, (KeyError, pickle.UnpicklingError)) or "invalid load key" in text:
        return "not a file written by torch.save"
    if isinstance(error, EOFError) or "central directory" in text or "truncated" in text.lower():
        return "the file is truncated or damaged"
    return f"{type(error).__name__}: {text}"


def load_checkpoint(path: str) -> dict:
    """fairseq's ``load_checkpoint_to_cpu`` with clear errors."""
    check_checkpoint_path(path)
    from fairseq import checkpoint_utils

    register_with_fairseq()  # the plugin's models, as fairseq-train's --user-dir registers them

    allow_namespace_in_checkpoints()
    try:
        # fairseq's loader as the plugin wraps it: torch's safe loader, pinned; a refusal in one line
        state = checkpoint_utils.load_checkpoint_to_cpu(path)
    except UnsafeCheckpoint as e:  # holding objects a safe load does not run: said already
        raise AnalyzeError(str(e)) from None
    except Exception as e:  # torch.load / unpickling errors have unhelpful types and long texts
        raise AnalyzeError(f"{path} is not a readable fairseq checkpoint ({_unreadable_reason(e)})")
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise AnalyzeError(f"{path} is not a fairseq checkpoint (no 'model' state dict)")
    return state


def cfg_get(cfg, *keys, default=None):
    """``cfg.keys[0].keys[1]...`` of a DictConfig / dataclass / Namespace, or ``default``."""
    for k in keys:
        if cfg is None:
            return default
        try:
            cfg = cfg.get(k) if hasattr(cfg, "get") else getattr(cfg, k, None)
        except Exception:
            return default
    return default if cfg is None else cfg


def checkpoint_metadata(state: dict) -> dict:
    """Training progress and components recorded in a checkpoint (``None`` where absent)."""
    cfg = state.get("cfg")
    return {
        "num_updates": saved_updates(state),
        "epoch": ((state.get("extra_state") or {}).get("train_iterator") or {}).get("epoch"),
        "task": cfg_get(cfg, "task", "_name"),
        "arch": cfg_get(cfg, "model", "_name") or cfg_get(cfg, "model", "arch"),
        "criterion": cfg_get(cfg, "criterion", "_name"),
    }


def load_dictionaries(cfg, data: Optional[str]):
    """``({"enc": Dictionary, "dec": ..., "out": ...}, path)`` via the checkpoint's task on ``data``
    (or the training data path), or ``({}, None)`` when no dictionary can be found."""
    from fairseq import tasks
    from omegaconf import open_dict

    task_cfg = cfg_get(cfg, "task")
    if task_cfg is None:
        return {}, None
    path = data or cfg_get(task_cfg, "data")
    if not path or not os.path.isdir(str(path).split(os.pathsep)[0]):
        return {}, None
    try:
        with open_dict(task_cfg):
            task_cfg.data = path
        task = tasks.setup_task(task_cfg)
    except Exception as e:
        if data:
            raise AnalyzeError(f"cannot set up the checkpoint's task on --data {data}: {type(e).__name__}: {e}")
        logger.warning("no dictionary (task setup on %s failed: %s)", path, e)
        return {}, None
    return task_dictionaries(task), path


def check_dictionary_sizes(dicts: dict, matrices, data: str, checkpoint: str):
    """Refuses a ``--data`` whose dictionaries do not index the checkpoint's embedding matrices
    (before any model is built from them: fairseq would stop on a raw size-mismatch traceback)."""
    for mat in matrices:
        dictionary = dicts.get(mat.name)
        if dictionary is not None and len(dictionary) != mat.weight.size(0):
            raise AnalyzeError(
                f"--data {data}: its {mat.name} dictionary has {len(dictionary)} entries but {mat.param} of "
                f"{checkpoint} has {mat.weight.size(0)} rows; pass the data-bin the checkpoint was trained on"
            )


def dictionary_info(dictionary, source) -> Optional[dict]:
    if dictionary is None:
        return None
    return {"size": len(dictionary), "nspecial": nspecial(dictionary),
            "madeupwords": len(madeupword_ids(dictionary)), "source": source}


def load_model_and_task(checkpoint: str, state: dict, data: str, device):
    """The checkpoint's model (on ``device``, first of its ensemble) and task, set up on ``data``."""
    from fairseq import checkpoint_utils
    from fairseq.dataclass.utils import overwrite_args_by_name

    if not os.path.isdir(data):
        raise AnalyzeError(f"--data: not a directory: {data}")
    register_with_fairseq()  # the plugin's models, to build the checkpoint's
    if state.get("args") is not None:
        state["args"].data = data
    if state.get("cfg") is not None:
        overwrite_args_by_name(state["cfg"], {"data": data})
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([checkpoint], state=state)
    return models[0].to(device), task
