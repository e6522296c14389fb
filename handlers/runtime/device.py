"""Where a worker runs its model: the cpu, or the GPU that TorchServe assigned to this worker.

TorchServe hands each worker a ``gpu_id`` (round-robin over ``number_of_gpu``) in its context;
a model asking for ``cuda`` runs on ``cuda:<gpu_id>``, never on whichever GPU happens to be first.
"""

from __future__ import annotations

import torch

from handlers.runtime.errors import InputError


def worker_device(requested: str, gpu_id: int | None) -> torch.device:
    """``cpu`` -> cpu; ``cuda`` -> ``cuda:<gpu_id>``. Refuses ``cuda`` where TorchServe assigned
    no GPU (its ``number_of_gpu`` is 0, or it saw none) or this process sees no such device."""
    if requested == "cpu":
        return torch.device("cpu")
    if requested != "cuda":
        raise InputError(f"device: must be 'cpu' or 'cuda', got {requested!r}")
    if gpu_id is None:
        raise RuntimeError(
            "device: the model runs on cuda, but TorchServe assigned this worker no GPU "
            "(set number_of_gpu in config.properties, on a machine with GPUs)"
        )
    device = torch.device("cuda", gpu_id)
    if not torch.cuda.is_available() or gpu_id >= torch.cuda.device_count():
        raise RuntimeError(f"device: TorchServe assigned {device}, but this worker sees no such GPU")
    return device
