"""Data-parallel facts: the process group AGG sums its histograms over, and whether this process
is global rank 0 (only rank 0 computes and logs statistics)."""
import torch


def _distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def data_parallel_group():
    """fairseq's data-parallel process group, or None when not running distributed."""
    if not _distributed():
        return None
    from fairseq.distributed import utils as distributed_utils

    return distributed_utils.get_data_parallel_group()


def data_parallel_world_size() -> int:
    """The number of data-parallel ranks (1 when not running distributed)."""
    group = data_parallel_group()
    return 1 if group is None else torch.distributed.get_world_size(group)


def is_global_rank0() -> bool:
    return not _distributed() or torch.distributed.get_rank() == 0
