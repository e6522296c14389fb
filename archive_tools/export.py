"""Capturing the served model with ``torch.export``, and compiling it with AOTInductor.

The captured module is ``PlainInputs`` around the model: it takes plain tensors laid out by the
model's batch tags (``handlers.runtime.batching.plain_arguments``), so the same tags give the
graph's dynamic shapes:

* ``ROWS`` / ``CONTEXT`` ``[N or K, D]``: dim 0 dynamic (N items, or K requests);
* ``JAGGED``: ``values [V]`` (and ``weights [V]``) with V dynamic, and ``lengths [F, N]``;
* ``CONTEXT_JAGGED``: ``values [V']`` with V' dynamic, and ``lengths [F', K]``;
* ``ITEM_COUNTS`` ``[K]``.

A graph takes batches of any size, except where TorchAO's int8 dynamic activation quantization is
in it: that quantizer adds a guard against batch 1, so such graphs are captured for K >= 2 requests
(``ModelSpec.min_requests``) and the service pads a single request with an empty one.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.export import Dim

from archive_tools import compile_cache
from handlers.modeling import tbe
from handlers.modeling.eager import PlainInputs
from handlers.runtime.archive_files import aoti_weights_file
from handlers.runtime.batching import Batch, plain_arguments
from handlers.runtime.id_buckets import is_index
from handlers.runtime.inputs import BatchKind, InputTag, JaggedIds, is_slot_map
from handlers.runtime.quiet import quieter
from handlers.runtime.slot_maps import SlotMap, part_names
from handlers.runtime.torch_internals import kept_as_constants, load_package

# torch's own pytree code, when a program is saved or compiled, trips its own deprecation warning.
_PYTREE_DEPRECATION = (r"`isinstance\(treespec, LeafSpec\)` is deprecated",)

AOTI_SETTINGS = MappingProxyType({  # a compile adds to the dict it is given: each gets a copy
    "aot_inductor.package_constants_in_so": False,
    # A weight whose elements are all equal (a 1-element scale of TorchAO's) would be folded into
    # the code, out of reach of a dense swap.
    "joint_graph_constant_folding": False,
})

MAX_BATCH = 1 << 16
MAX_VALUES = 1 << 28


def dynamic_shapes(
    tags: Sequence[InputTag], weighted: bool, min_batch: int = 1
) -> tuple[dict[int, Dim], ...]:
    items = Dim("items", min=min_batch, max=MAX_BATCH)
    requests = Dim("requests", min=min_batch, max=MAX_BATCH)
    values = Dim("values", min=0, max=MAX_VALUES)
    shapes: list[dict[int, Dim]] = []
    for tag in tags:
        if tag.kind == BatchKind.ROWS:
            shapes.append({0: items})
        elif tag.kind in (BatchKind.CONTEXT, BatchKind.ITEM_COUNTS):
            shapes.append({0: requests})
        elif tag.kind == BatchKind.CONTEXT_JAGGED:  # ids per request: their own count of values
            shapes += [{0: Dim("context_values", min=0, max=MAX_VALUES)}, {1: requests}]
        else:  # JAGGED
            shapes += [{0: values}, {1: items}] + ([{0: values}] if weighted else [])
    return tuple(shapes)


def export_model(
    model: nn.Module,
    tags: Sequence[InputTag],
    example: Batch,
    min_batch: int = 1,
) -> torch.export.ExportedProgram:
    """Captures the served model (or a part of it) for batches of ``min_batch`` requests and more
    (1: any size), tables stored once. ``example`` must have more than ``min_batch`` requests.
    The model is prepared for capture in place (its TBEs skip bounds checks and name their tables)."""
    _register_fake_classes()
    tbe.drop_table_views(model)
    tbe.name_table_buffers(model)
    tbe.skip_bounds_checks(model)
    weighted = any(isinstance(v, JaggedIds) and v.weights is not None for v in example.values())
    plain = PlainInputs(model, tags, weighted).eval()
    arguments = plain_arguments(example, tags)
    # TorchRec asks torch.fx whether it is tracing, which warns that export counts as tracing.
    with quieter("torch.fx._symbolic_trace", warning_messages=_PYTREE_DEPRECATION):
        with torch.inference_mode():
            plain(*arguments)  # one eager forward fills buffers that TorchRec builds lazily
        # Size checks the trace would turn into guards (batch == 1 among them) become runtime
        # asserts instead, so a graph traced on the example's sizes still takes a batch of 1.
        return torch.export.export(
            plain,
            arguments,
            dynamic_shapes=(dynamic_shapes(tags, weighted, min_batch),),  # for *tensors
            strict=False,
            prefer_deferred_runtime_asserts_over_guards=True,
        )


def table_constants(model: nn.Module) -> tuple[str, ...]:
    """The names ``export_model(model, ...)``'s program gives the model's TBE buffers, in order
    (``PlainInputs`` holds the model as ``model``)."""
    return tbe.table_constant_names(model, prefix="model.")


def compile_aoti(
    program: torch.export.ExportedProgram, path: Path, slot_maps: Mapping[str, SlotMap] | None = None
) -> Path:
    """AOTInductor: the exported program compiled to a native package (C++ compiler needed), its
    weights beside it (``aoti_weights_file``), by name, to be memory-mapped at load rather than
    copied out of the package's shared library. Every parameter stays a constant, so that a dense
    swap reaches all of them. ``slot_maps``: the raw-id tables' (views of the program's remap
    constants), which the file holds under their own names too (``slot_maps.slot_maps_in``)
    for the delta writers, stored once. A package compiled before from the same graph (other weights)
    is copied from the compile cache (``archive_tools.compile_cache``), then checked the same way."""
    state = {**program.state_dict, **program.constants}
    held = {t.untyped_storage().data_ptr() for t in state.values() if type(t) in (torch.Tensor, nn.Parameter)}
    foreign = sorted(t for t, parts in (slot_maps or {}).items() if any(
        part.untyped_storage().data_ptr() not in held for part in parts))
    if foreign:  # before a compile is spent on it
        raise ValueError(f"{path}: the slot maps of tables {foreign} are not views of the program's constants")
    parameters = _parameter_constants(program)
    key = compile_cache.package_key(program, AOTI_SETTINGS)
    kept_constants: list[set[str]] = []  # the cached package's, loaded once

    def kept_values(kept: Path) -> str:
        kept_constants.append(set(load_package(kept).get_constant_fqns()))
        return compile_cache.compiled_in(state, kept_constants[-1])

    package, from_cache = path, compile_cache.fetch(key, path, kept_values)
    if from_cache:
        constants = kept_constants[-1]
    else:
        with quieter("torch.fx._symbolic_trace", warning_messages=_PYTREE_DEPRECATION), kept_as_constants(parameters):
            package = Path(torch._inductor.aoti_compile_and_package(
                program, package_path=str(path), inductor_configs=dict(AOTI_SETTINGS)))
        constants = set(load_package(package).get_constant_fqns())
    # but a raw-id remap's bucket index, which a worker makes from its sorted ids (id_buckets.derived_constants)
    weights = {name: package_constant(state, name) for name in constants if not is_index(name)}
    missing = [name for name, tensor in weights.items() if tensor is None]
    if missing:
        raise RuntimeError(f"{package}: needs weights that the exported program lacks: {missing}")
    # A tensor subclass may leave an inner tensor unread (TorchAO's symmetric zero points).
    inlined = sorted(n for n in parameters - constants if ".parametrizations." not in n)
    if inlined:
        raise RuntimeError(f"{package}: parameters compiled in as literals, out of reach of a dense swap: {inlined}")
    for table, parts in (slot_maps or {}).items():
        weights.update({f"slot_maps.{table}.{name}": part for name, part in zip(part_names(parts), parts)})
    torch.save(weights, aoti_weights_file(package))
    if not from_cache:
        compile_cache.keep(key, package, compile_cache.compiled_in(state, constants))
    return package


def _parameter_constants(program: torch.export.ExportedProgram) -> set[str]:
    """The constant names the program's parameters and buffers take in a package: their own, or
    for a tensor subclass (TorchAO's int8 weights) one per inner tensor (see ``package_constant``).
    A raw-id table's slot maps too, however few their rows: the unseen-id counter reads them."""
    names = {name for name in program.graph_signature.buffers if is_slot_map(name)}
    for name in program.graph_signature.parameters:
        value = program.state_dict[name]
        if type(value) in (torch.Tensor, torch.nn.Parameter):
            names.add(name)
        else:
            owner, attr = name.rsplit(".", 1)
            inner, _ = value.__tensor_flatten__()
            names.update(f"{owner}.parametrizations.{attr}.original{i}" for i in range(len(inner)))
    return names


_FLATTENED = re.compile(r"^(?P<owner>.*)\.parametrizations\.(?P<attr>\w+)\.original(?P<index>\d+)$")


def package_constant(state: dict[str, Any], name: str) -> torch.Tensor | None:
    """The package's constant ``name``, from the program's state. AOTInductor stores a tensor
    subclass (TorchAO's int8 weights) as its inner tensors, named
    ``<owner>.parametrizations.<attr>.original<i>`` after the i-th of ``__tensor_flatten__``'s
    attributes; plain tensors keep their names."""
    value = state.get(name)
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return value
    match = _FLATTENED.match(name)
    if match is None:
        return None
    wrapped = state.get(f"{match['owner']}.{match['attr']}")
    if wrapped is None or not hasattr(wrapped, "__tensor_flatten__"):
        return None
    inner_names, _ = wrapped.__tensor_flatten__()
    return getattr(wrapped, inner_names[int(match["index"])])


@functools.cache
def _register_fake_classes() -> None:
    """FBGEMM's script objects inside the TBEs need fake versions to be traced (once a process)."""
    from torchrec.pt2.utils import register_fake_classes

    register_fake_classes()
