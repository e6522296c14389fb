"""Helpers shared by the tests: spec variants, requests, and model inputs built from them."""

from __future__ import annotations

from pathlib import Path

import torch

from handlers.loading import load_archive
from handlers.runtime.archive import Archive
from handlers.modeling.eager import EagerModel
from handlers.modeling.registry import input_schema, synthetic_request
from handlers.modeling.spec import ModelSpec, ShardingSpec, ShardingType
from handlers.runtime.batching import Batch, coalesce
from handlers.runtime.freshness.applier import file_offset
from handlers.runtime.service import ScoringService
from handlers.runtime.wire.decoder import RequestDecoder

items_request = synthetic_request  # (spec, num_items, seed, max_bag=3, return_logits=False)


def with_tables(spec: ModelSpec, **changes) -> ModelSpec:
    """The spec with ``changes`` (e.g. weight_dtype=..., sharding=...) applied to every table."""
    return spec.replace(tables=[t.model_copy(update=changes) for t in spec.tables])


def sharded(spec: ModelSpec, world_size: int, sharding: ShardingType) -> ModelSpec:
    return with_tables(spec, sharding=sharding).replace(
        sharding=ShardingSpec(device="cpu", world_size=world_size)
    )


def model_inputs(spec: ModelSpec, requests: list[dict]) -> Batch:
    """Decodes JSON-like requests and coalesces them into one batch of model inputs."""
    schema = input_schema(spec)
    decoder = RequestDecoder(schema)
    return coalesce([decoder.decode(r).inputs for r in requests], schema.tags)


def forward(model: torch.nn.Module, spec: ModelSpec, inputs: Batch) -> torch.Tensor:
    """An eager model's logits for a batch of ``spec``'s inputs, flattened."""
    with torch.inference_mode():
        return EagerModel(model, input_schema(spec).tags)(inputs).reshape(-1)


def is_file_mapped(tensor: torch.Tensor, path) -> bool:
    """Whether ``tensor``'s memory lies in a mapping of the file ``path`` (``/proc/self/maps``)."""
    try:
        file_offset(tensor, Path(path))
    except ValueError:
        return False
    return True


def archive_service(archive: Path) -> ScoringService:
    """A built archive (``.mar`` or folder) loaded in this process as a worker loads it."""
    return load_archive(Archive.open(archive))
