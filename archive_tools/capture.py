"""The capture stage of the archive build: the staged eager model exported as one graph or as its
sparse and dense parts (``handlers.runtime.split``), each saved as an exported program or
compiled with AOTInductor.

    capture(staging, Artifact.AOTI, None)                 # model_aoti.pt2
    capture(staging, Artifact.SPLIT, SplitPlan(sparse=Artifact.EAGER, dense=Artifact.AOTI))
                                                  # weights.pt (tables only) + dense_aoti.pt2
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from archive_tools.export import compile_aoti, export_model, table_constants
from archive_tools.model_errors import describe_batch, raised_by_model
from handlers.modeling.eager import EagerModel, load_eager_model
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.raw_ids import served_slot_maps
from handlers.modeling.registry import architecture_of, load_spec, synthetic_request
from handlers.modeling.spec import ModelSpec, ShardingType
from handlers.runtime.archive_files import INPUTS, SPEC, WEIGHTS
from handlers.runtime.artifacts import Artifact
from handlers.runtime.batching import coalesce, padding_request, plain_arguments
from handlers.runtime.errors import InputError
from handlers.runtime.freshness.layout import TablesLayout
from handlers.runtime.inputs import InputSchema, RequestInputs
from handlers.runtime.slot_maps import SlotMap
from handlers.runtime.split import EMBEDDINGS_INPUT, SplitPlan, dense_tags, sparse_tags
from handlers.runtime.wire.decoder import RequestDecoder


def check_capturable(spec: ModelSpec, split: bool = False) -> None:
    """Refuses, before any work, what torch.export cannot capture on this stack; ``split``: the
    build captures the model's two parts (a split artifact, a distributed layout)."""
    if split and not architecture_of(spec).splits:
        raise InputError(
            f"architecture {spec.architecture}: does not split into lookups and a dense part (it "
            "defines no split method); build --artifact eager, exported or aoti"
        )
    row_wise = [t.name for t in spec.tables if t.sharding == ShardingType.ROW_WISE]
    if spec.is_sharded and row_wise:
        raise InputError(
            f"tables {row_wise}: row-wise sharded tables cannot be captured as a graph with "
            "fbgemm-gpu 1.8 (its fake kernel for sum_reduce_to_one returns a meta tensor); shard "
            "them table_wise, or build --artifact eager"
        )


def capture(staging: Path, artifact: Artifact, split: SplitPlan | None) -> None:
    """Exports the staged eager model, whole or as its two parts (and compiles what is ``aoti``).
    Once a graph file holds the tables, ``weights.pt`` leaves the archive: no table is stored twice.
    """
    weights = staging / WEIGHTS
    spec = load_spec(staging / SPEC)
    eager = load_eager_model(spec, weights)
    decoder = RequestDecoder(architecture_of(spec).input_schema(spec))
    tags = decoder.schema.tags
    requests = [decoder.decode(synthetic_request(spec, n, seed=n)).inputs for n in (3, 5, 2)]
    example, example_request = coalesce(requests, tags), requests[0]
    if split is None:
        with raised_by_model("capture", lambda: describe_batch(example, tags)):
            program = export_model(eager.module, tags, example, spec.min_requests)
        _pad_single_items(program, staging, example_request)
        _save_graph(program, staging, artifact, "model", served_slot_maps(eager.module))
        _name_table_constants(staging, eager.module)
    else:
        sparse, dense = architecture_of(spec).split(eager.module)
        with raised_by_model("capture", lambda: describe_batch(example, tags)):
            with torch.inference_mode():
                embeddings = EagerModel(sparse, sparse_tags(tags))(example)
            if split.sparse != Artifact.EAGER:
                program = export_model(sparse, sparse_tags(tags), example)
                _save_graph(program, staging, split.sparse, "sparse", served_slot_maps(sparse))
                _name_table_constants(staging, sparse)
            dense_example = {**example, EMBEDDINGS_INPUT: embeddings}
            program = export_model(dense, dense_tags(tags), dense_example, spec.min_requests)
        _save_graph(program, staging, split.dense, "dense")
    del eager  # its tables are mapped from weights.pt, about to be replaced
    if split is None or split.sparse != Artifact.EAGER:
        weights.unlink()
    else:
        _keep_only_tables(weights, spec)


def _pad_single_items(program: torch.export.ExportedProgram, staging: Path, like: RequestInputs) -> None:
    """Where the graph refuses a forward of one item, the archive's ``inputs.json`` asks the
    worker to pad such a forward with a second item (``min_requests`` 2). torch.export can assert
    that a size the trace could not know (the rows a lookup returns) is at least 2 where the model
    makes it equal to the items (joining a candidate's looked-up row to its item, say)."""
    schema = InputSchema.from_file(staging / INPUTS)
    if schema.min_requests > 1:
        return
    one_item = coalesce([padding_request(like, schema, with_ids=True)], schema.tags)
    try:
        with torch.inference_mode():
            program.module()(*plain_arguments(one_item, schema.tags))
    except RuntimeError as error:
        if "Runtime assertion failed" not in str(error):
            raise
        dataclasses.replace(schema, min_requests=2).save(staging / INPUTS)
        print(f"the captured graph refuses a forward of one item ({str(error).splitlines()[0]}): "
              "a worker pads such a forward with a second item")


def _name_table_constants(staging: Path, captured: torch.nn.Module) -> None:
    """``tables.json`` names the graph's table buffers as its weights file holds them: how a delta
    and the workers find each table's rows there."""
    layout = TablesLayout.load(staging)
    dataclasses.replace(layout, buffer_constants=table_constants(captured)).save(staging)


def _keep_only_tables(weights: Path, spec: ModelSpec) -> None:
    """Eager lookups read their tables from ``weights.pt``; the dense weights are in the dense
    part's graph now, so they leave the file (rewritten once, tables streamed from the mapping)."""
    factory = DLRMFactory(spec)
    loaded = factory.load_weights(weights)
    rewritten = weights.with_suffix(".tables")
    factory.save_weights(dataclasses.replace(loaded, dense={}), rewritten)
    del loaded
    rewritten.replace(weights)


def _save_graph(
    program: torch.export.ExportedProgram, staging: Path, artifact: Artifact, part: str,
    slot_maps: dict[str, SlotMap] | None = None,
) -> None:
    path = staging / artifact.file_name(part)
    if artifact == Artifact.AOTI:
        compile_aoti(program, path, slot_maps)
    else:
        torch.export.save(program, str(path))
