"""Helpers shared by the tests: spec variants and model inputs built from requests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from handlers.batching import coalesce
from handlers.decode import RequestDecoder
from handlers.models import input_tags
from handlers.spec import ModelSpec, ShardingSpec, ShardingType


def with_tables(spec: ModelSpec, **changes) -> ModelSpec:
    """The spec with ``changes`` (e.g. weight_dtype=..., sharding=...) applied to every table."""
    tables = tuple(dataclasses.replace(t, **changes) for t in spec.tables)
    return dataclasses.replace(spec, tables=tables)


def sharded(spec: ModelSpec, world_size: int, sharding: ShardingType) -> ModelSpec:
    return dataclasses.replace(
        with_tables(spec, sharding=sharding), sharding=ShardingSpec("cpu", world_size)
    )


def model_inputs(spec: ModelSpec, requests: list[dict]) -> dict:
    """Decodes JSON-like requests and coalesces them into one batch of model inputs."""
    decoder = RequestDecoder(spec)
    return coalesce([decoder.decode(r).inputs for r in requests], input_tags(spec))


def forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.inference_mode():
        return model(**inputs).reshape(-1)


def is_file_mapped(tensor: torch.Tensor, path) -> bool:
    """Whether ``tensor``'s memory lies in a mapping of the file ``path`` (``/proc/self/maps``)."""
    address = tensor.data_ptr()
    target = str(Path(path).resolve())
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == target:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    return True
    return False
