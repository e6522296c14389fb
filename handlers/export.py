"""The served model captured with ``torch.export`` (and compiled with AOTInductor): graphs that
run without the model's Python.

An archive serves one ``Artifact``, named in its ``model-config.yaml``: ``aoti`` (the compiled
package, fastest), ``exported`` (the exported program, run by PyTorch's interpreter), ``eager``
(the factory's TorchRec model on the memory-mapped ``weights.pt``; for debugging) or ``split``
(a sparse and a dense part, each one of the kinds above, run by ``handlers.split``).

The exported program takes plain tensors, laid out by the model's batch tags
(``handlers.models.input_tags``), so that the same tags give its dynamic shapes:

* ``ROWS`` / ``CONTEXT`` ``[N or K, D]``: dim 0 dynamic (N items, or K requests);
* ``JAGGED``: ``values [V]`` (and ``weights [V]``) with V dynamic, and ``lengths [F, N]``;
* ``ITEM_COUNTS`` ``[K]``; ``STATIC``: as is.

``export_model`` captures, ``compile_aoti`` compiles, and ``GraphModel`` runs either on the
coalescer's batch, so ``ScoringService`` drives it exactly like the eager model.

A graph takes batches of any size, except where TorchAO's int8 dynamic activation quantization is
in it: that quantizer adds a guard against batch 1, so such graphs are captured for K >= 2 requests
(``min_requests``) and the service pads a single request with an empty one.
"""

from __future__ import annotations

import enum
import functools
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from torch.export import Dim
from torch.export.passes import move_to_device_pass

import fbgemm_gpu  # noqa: F401  registers the TBE operators the graph calls
from handlers.batching import BatchInput, BatchKind, InputTag
from handlers.spec import DensePrecision, ModelSpec
from torchrec import KeyedJaggedTensor
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode  # isort: skip
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (  # isort: skip
    IntNBitTableBatchedEmbeddingBagsCodegen,
)

MAX_BATCH = 1 << 16
MAX_VALUES = 1 << 28


class Artifact(str, enum.Enum):
    AOTI = "aoti"
    EXPORTED = "exported"
    EAGER = "eager"
    SPLIT = "split"

    def file_name(self, part: str = "model") -> str:
        """The file that holds ``part`` (``model``, ``sparse`` or ``dense``) as this artifact."""
        if self == Artifact.EAGER:
            return "weights.pt"
        if self == Artifact.SPLIT:
            raise ValueError("a split archive holds one file per part")
        return f"{part}_aoti.pt2" if self == Artifact.AOTI else f"{part}.pt2"

    def files(self, part: str = "model") -> list[str]:
        """Every file that holds ``part`` as this artifact (a compiled package has its weights
        beside it)."""
        main = self.file_name(part)
        return [main, aoti_weights_file(Path(main)).name] if self == Artifact.AOTI else [main]


def min_requests(spec: ModelSpec) -> int:
    """The fewest requests (and items) a graph of this model is captured for: 2 where TorchAO's
    int8 dynamic activation quantization guards against batch 1, else 1."""
    return 2 if any(p == DensePrecision.INT8_DYNAMIC for _, p in spec.dense_precision) else 1


class PlainInputs(nn.Module):
    """``model`` with its KeyedJaggedTensor inputs taken apart into plain tensors (for export).

    ``model`` takes its inputs positionally, in the order of ``tags``."""

    def __init__(self, model: nn.Module, tags: Sequence[InputTag]) -> None:
        super().__init__()
        self.model = model
        self.tags = tuple(tags)
        self.weighted = _is_weighted(model)

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        inputs: list[Any] = []
        position = 0
        for tag in self.tags:
            if tag.kind == BatchKind.JAGGED:
                values, lengths = tensors[position], tensors[position + 1]
                weights = tensors[position + 2] if self.weighted else None
                position += 3 if self.weighted else 2
                inputs.append(
                    KeyedJaggedTensor(
                        keys=list(tag.keys),
                        values=values,
                        lengths=lengths.reshape(-1),
                        weights=weights,
                    )
                )
            else:
                inputs.append(tensors[position])
                position += 1
        return self.model(*inputs)


def plain_arguments(batch: dict[str, BatchInput], tags: Sequence[InputTag]) -> tuple[torch.Tensor, ...]:
    """The coalescer's batch as the exported program's positional tensors."""
    arguments: list[torch.Tensor] = []
    for tag in tags:
        value = batch[tag.name]
        if isinstance(value, KeyedJaggedTensor):
            arguments += [value.values(), value.lengths().reshape(len(tag.keys), -1)]
            if value.weights_or_none() is not None:
                arguments.append(value.weights())
        else:
            arguments.append(value)
    return tuple(arguments)


def dynamic_shapes(
    tags: Sequence[InputTag], weighted: bool, min_batch: int = 1
) -> tuple[dict[int, Dim] | None, ...]:
    items = Dim("items", min=min_batch, max=MAX_BATCH)
    requests = Dim("requests", min=min_batch, max=MAX_BATCH)
    values = Dim("values", min=0, max=MAX_VALUES)
    shapes: list[dict[int, Dim] | None] = []
    for tag in tags:
        if tag.kind == BatchKind.ROWS or (tag.kind == BatchKind.CONTEXT and tag.broadcast):
            shapes.append({0: items})
        elif tag.kind in (BatchKind.CONTEXT, BatchKind.ITEM_COUNTS):
            shapes.append({0: requests})
        elif tag.kind == BatchKind.JAGGED:
            shapes += [{0: values}, {1: items}] + ([{0: values}] if weighted else [])
        else:
            shapes.append(None)
    return tuple(shapes)


def export_model(
    model: nn.Module,
    tags: Sequence[InputTag],
    example: dict[str, BatchInput],
    min_batch: int = 1,
) -> torch.export.ExportedProgram:
    """Captures the served model (or a part of it) for batches of ``min_batch`` requests and more
    (1: any size), tables stored once. ``example`` must have more than ``min_batch`` requests."""
    _register_fake_classes()
    _drop_table_views(model)
    _name_table_buffers(model)
    _skip_bounds_checks(model)
    plain = PlainInputs(model, tags).eval()
    arguments = plain_arguments(example, tags)
    with torch.inference_mode():
        plain(*arguments)  # one eager forward fills buffers that TorchRec builds lazily
    from torch.fx.experimental import _config as fx_config

    with fx_config.patch(backed_size_oblivious=True):  # else batch 1 is specialized away
        return torch.export.export(
            plain,
            arguments,
            dynamic_shapes=(dynamic_shapes(tags, _is_weighted(model), min_batch),),  # for *tensors
            strict=False,
        )


def compile_aoti(program: torch.export.ExportedProgram, path: Path) -> Path:
    """AOTInductor: the exported program compiled to a native package (C++ compiler needed), its
    weights beside it (``aoti_weights_file``), by name, to be memory-mapped at load rather than
    copied out of the package's shared library."""
    with torch._inductor.config.patch({"aot_inductor.package_constants_in_so": False}):
        package = Path(torch._inductor.aoti_compile_and_package(program, package_path=str(path)))
    state = {**program.state_dict, **program.constants}
    needed = torch._inductor.aoti_load_package(str(package)).get_constant_fqns()
    missing = [name for name in needed if not isinstance(state.get(name), torch.Tensor)]
    if missing:
        raise RuntimeError(f"{package}: needs weights that the exported program lacks: {missing}")
    torch.save({name: state[name] for name in needed}, aoti_weights_file(package))
    return package


def aoti_weights_file(package: Path) -> Path:
    """``model_aoti.pt2`` -> ``model_aoti_weights.pt``."""
    return package.with_name(f"{package.stem}_weights.pt")


class GraphModel:
    """A loaded exported program or AOTInductor package, called like the eager model with the
    coalescer's batch (on ``device``)."""

    def __init__(
        self, path: str | Path, artifact: Artifact, tags: Sequence[InputTag], device: str = "cpu"
    ) -> None:
        if artifact == Artifact.AOTI:
            if device != "cpu":
                raise ValueError(
                    f"{path}: compiled for cpu; an exported program can move to {device}"
                )
            self.run = torch._inductor.aoti_load_package(str(path))
            # Mapped, not read: the tables cost page cache shared by every worker, and the package
            # uses these tensors in place (user-managed), so they must live as long as it does.
            self.weights = torch.load(aoti_weights_file(Path(path)), mmap=True, weights_only=True)
            self.run.load_constants(self.weights, check_full_update=True, user_managed=True)
        elif artifact == Artifact.EXPORTED:
            program = torch.export.load(str(path))
            if device != "cpu":  # captured on cpu: its weights and device arguments move
                program = move_to_device_pass(program, device)
            self.run = program.module()
        else:
            raise ValueError(f"{artifact.value} is not a graph artifact")
        self.tags = tuple(tags)

    def __call__(self, **batch: BatchInput) -> torch.Tensor:
        return self.run(*plain_arguments(batch, self.tags))


@functools.cache
def _register_fake_classes() -> None:
    """FBGEMM's script objects inside the TBEs need fake versions to be traced (once a process)."""
    from torchrec.pt2.utils import register_fake_classes

    register_fake_classes()


def _is_weighted(model: nn.Module) -> bool:
    return any(
        isinstance(m, QuantEmbeddingBagCollection) and m.is_weighted() for m in model.modules()
    )


def _skip_bounds_checks(model: nn.Module) -> None:
    """The decoder has already refused (or hashed) every id outside its table, so the TBEs' own
    per-call bounds check is redundant; its data-dependent guards also stop AOTInductor."""
    for module in model.modules():
        if isinstance(module, IntNBitTableBatchedEmbeddingBagsCodegen):
            module.bounds_check_mode_int = BoundsCheckMode.NONE.value


def _name_table_buffers(model: nn.Module) -> None:
    """FBGEMM keeps a TBE's tables (and their placement and offset arrays) as plain attributes,
    which export lifts as anonymous constants (``_tensor_constant0``); as registered buffers they
    keep their module names, by which a compiled package's weights are saved and loaded."""
    for module in model.modules():
        if isinstance(module, IntNBitTableBatchedEmbeddingBagsCodegen):
            for name in ("weights_host", "weights_placements", "weights_offsets"):
                if name not in module._buffers:
                    tensor = getattr(module, name)
                    delattr(module, name)
                    module.register_buffer(name, tensor, persistent=False)


def _drop_table_views(model: nn.Module) -> None:
    """The quantized EBC exposes each table again as a ``weight`` buffer (a view, for
    ``state_dict``); exported as is, the tables would be stored twice. The TBEs hold the real ones."""
    for module in model.modules():
        if isinstance(module, QuantEmbeddingBagCollection):
            for table in module.embedding_bags.values():
                table._buffers.pop("weight", None)
