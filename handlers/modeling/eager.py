"""Eager TorchRec models behind the runtime's batch: the debug path of serving, the reference of
the build, and the wrapper that ``torch.export`` captures.

The runtime's batch holds plain tensors (a jagged input as ``JaggedIds``); TorchRec modules take a
``KeyedJaggedTensor``. ``EagerModel`` builds one per jagged input with TorchRec's own constructor
and calls the model; ``PlainInputs`` does the same from positional tensors, for export.

    service = eager_service(spec, DLRMFactory(spec).inference_model(weights))
    service.handle([body])                                  # exactly what a worker does
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import input_schema
from handlers.modeling.spec import ModelSpec
from handlers.modeling.weights import InferenceWeights
from handlers.runtime.batching import Batch
from handlers.runtime.freshness.delta_file import DenseShapes, dense_shapes
from handlers.runtime.inputs import RAW_ID_COUNTER, BatchKind, InputTag, JaggedIds
from handlers.runtime.quiet import quieter
from handlers.runtime.service import ScoringService

from torchrec import KeyedJaggedTensor  # isort: skip
from torch.fx._symbolic_trace import is_fx_tracing  # isort: skip

# TorchRec's modules ask torch.fx whether they are being traced, the function TorchRec calls
# itself; torch's first answer in a process warns that torch.export also counts as tracing.
with quieter("torch.fx._symbolic_trace"):
    is_fx_tracing()


class EagerModel:
    """``module`` (its forward takes the inputs in tag order) called with the coalescer's batch,
    moved to ``device``."""

    def __init__(
        self, module: nn.Module, tags: Sequence[InputTag], device: torch.device = torch.device("cpu")
    ) -> None:
        self.module = module
        self.tags = tuple(tags)
        self.device = device

    def __call__(self, batch: Batch) -> torch.Tensor:
        arguments: list[Any] = []
        for tag in self.tags:
            value = batch[tag.name]
            if isinstance(value, JaggedIds):
                arguments.append(
                    KeyedJaggedTensor.from_lengths_sync(
                        keys=list(tag.keys),
                        values=value.values,
                        lengths=value.lengths.reshape(-1),
                        weights=value.weights,
                    ).to(self.device)
                )
            else:
                arguments.append(value.to(self.device))
        return self.module(*arguments)


class PlainInputs(nn.Module):
    """``model`` taking plain tensors, as ``handlers.runtime.batching.plain_arguments`` lays them
    out (a jagged input as values, lengths [F, N or K] and, if ``weighted``, the items' weights): the module that
    ``torch.export`` captures, so that graphs take exactly what the runtime's batch holds."""

    def __init__(self, model: nn.Module, tags: Sequence[InputTag], weighted: bool) -> None:
        super().__init__()
        self.model = model
        self.tags = tuple(tags)
        self.weighted = weighted

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        inputs: list[Any] = []
        position = 0
        for tag in self.tags:
            if tag.kind in (BatchKind.JAGGED, BatchKind.CONTEXT_JAGGED):
                weighted = self.weighted and tag.kind == BatchKind.JAGGED  # per-id weights: items' only
                values, lengths = tensors[position], tensors[position + 1]
                weights = tensors[position + 2] if weighted else None
                position += 3 if weighted else 2
                inputs.append(
                    KeyedJaggedTensor(
                        keys=list(tag.keys), values=values, lengths=lengths.reshape(-1), weights=weights
                    )
                )
            else:
                inputs.append(tensors[position])
                position += 1
        return self.model(*inputs)


def eager_service(spec: ModelSpec, model: nn.Module) -> ScoringService:
    """A scoring service over an eager model of ``spec`` (float or served)."""
    schema = input_schema(spec)
    return ScoringService(schema, EagerModel(model, schema.tags))


class SwappableEagerModel(EagerModel):
    """The archive's eager model, whose dense weights swap whole (``freshness.dense.DenseSlot``):
    a second model is built around the same mapped tables with the new dense weights (its dense
    layers are the one extra copy), then replaces the served one; a forward under way keeps the
    model it started with."""

    def __init__(self, factory: DLRMFactory, weights: InferenceWeights, device: torch.device) -> None:
        self.factory = factory
        self.weights = weights
        super().__init__(self._model(weights.dense, device), input_schema(factory.spec).tags, device)

    def _model(self, dense: Mapping[str, torch.Tensor], device: torch.device) -> nn.Module:
        weights = dataclasses.replace(self.weights, dense=dict(dense))
        return self.factory.inference_model(weights, device)

    def dense_shapes(self) -> DenseShapes | str:
        if self.device.type != "cpu" or self.factory.spec.is_sharded:
            return "its tables are copied into the model at load; a second model would copy them again"
        return dense_shapes(self.weights.dense)

    def swap_dense(self, tensors: Mapping[str, torch.Tensor] | None) -> None:
        module = self._model(self.weights.dense if tensors is None else tensors, self.device)
        # the new model counts on in the served one's raw-id counters, which the handler reads
        for name, counter in self.module.named_buffers():
            if RAW_ID_COUNTER.search(name):
                path, _, attribute = name.rpartition(".")
                setattr(module.get_submodule(path), attribute, counter)
        self.module = module


def load_eager_model(
    spec: ModelSpec, weights_path: Path, device: torch.device = torch.device("cpu")
) -> SwappableEagerModel:
    """The archive's eager model: the factory's TorchRec modules on the memory-mapped weights."""
    factory = DLRMFactory(spec)
    return SwappableEagerModel(factory, factory.load_weights(weights_path), device)


def load_eager_lookups(spec: ModelSpec, weights_path: Path) -> EagerModel:
    """The sparse part of a split archive with eager lookups, on its mapped ``weights.pt``."""
    factory = DLRMFactory(spec)
    lookups = factory.lookups(factory.load_weights(weights_path))
    jagged = [t for t in input_schema(spec).tags if t.kind == BatchKind.JAGGED]
    return EagerModel(lookups, jagged)
