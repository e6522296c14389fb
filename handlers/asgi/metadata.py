"""What the KServe v2 metadata route says of a model: its name, versions, and the tensors it takes
and answers, as ``handlers.runtime.wire.kserve_v2`` reads and writes them (-1: any size).

    model_metadata(schema, "tiny", ["1.0"])
    # {"name": "tiny", "versions": ["1.0"], "platform": "torchrec-serve",
    #  "inputs": [{"name": "dense_features", "datatype": "FP32", "shape": [-1, 4]}, ...],
    #  "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1]}, ...]}
"""

from __future__ import annotations

from typing import Any, Sequence

from handlers.runtime.inputs import InputSchema, Output

PLATFORM = "torchrec-serve"


def model_metadata(schema: InputSchema, name: str, versions: Sequence[str]) -> dict[str, Any]:
    return {
        "name": name,
        "versions": list(versions),
        "platform": PLATFORM,
        "inputs": _inputs(schema),
        "outputs": _outputs(schema),
    }


def _tensor(name: str, datatype: str, shape: list[int]) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape}


def _inputs(schema: InputSchema) -> list[dict[str, Any]]:
    jagged, features = schema.jagged.name, len(schema.feature_names)
    shard = schema.output == Output.EMBEDDINGS
    inputs = [] if shard else [_tensor(schema.rows.name, "FP32", [-1, schema.dense_features])]
    inputs += [_tensor(f"{jagged}.lengths", "INT64", [features, -1]), _tensor(f"{jagged}.values", "INT64", [-1])]
    if schema.weighted_ids:
        inputs.append(_tensor(f"{jagged}.weights", "FP32", [-1]))
    if shard:
        inputs.append(_tensor(f"{jagged}.bags", "INT64", [features]))
    if schema.context is not None:
        inputs.append(_tensor(schema.context.name, "FP32", [1, schema.context_features]))
    if schema.context_jagged is not None:
        name = schema.context_jagged.name
        inputs += [_tensor(f"{name}.lengths", "INT64", [len(schema.context_sparse), 1]), _tensor(f"{name}.values", "INT64", [-1])]
    return inputs


def _outputs(schema: InputSchema) -> list[dict[str, Any]]:
    if schema.output == Output.EMBEDDINGS:
        return [_tensor("embeddings", "FP32", [-1, sum(schema.embedding_widths)])]
    return [_tensor("scores", "FP32", [-1]), _tensor("logits", "FP32", [-1])]
