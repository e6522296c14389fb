"""Regenerates the example request files in examples/requests/ (and the KServe v2 form of one of
them in examples/kserve_v2/) from the Criteo-shaped spec.

    .venv/bin/python examples/make_requests.py
"""

from pathlib import Path

import numpy as np
import orjson

from handlers.modeling.registry import load_spec, synthetic_request

HERE = Path(__file__).resolve().parent
SPEC = HERE.parent / "config" / "models" / "criteo.yaml"
# In the 100-candidate request these features vary per candidate (item side); the rest is the
# shared user context, repeated in every item.
CANDIDATE_FEATURES = ("cat_9", "cat_19", "cat_20", "cat_21")


def candidates_request(spec, num_candidates: int, seed: int, max_bag: int = 3) -> dict:
    """One user scored against ``num_candidates`` items: the user's dense and sparse features
    repeat in every item; only ``CANDIDATE_FEATURES`` vary per item."""
    user = synthetic_request(spec, 1, seed, max_bag)["items"][0]
    rng = np.random.default_rng(seed + 1)
    rows = dict(zip(spec.feature_names, spec.feature_rows))
    items = []
    for _ in range(num_candidates):
        sparse = dict(user["sparse"])
        for feature in CANDIDATE_FEATURES:
            size = int(rng.integers(1, max_bag + 1))
            sparse[feature] = rng.integers(0, rows[feature], size=size).tolist()
        items.append({"dense": user["dense"], "sparse": sparse})
    return {"items": items}


def as_kserve_v2(spec, request: dict) -> dict:
    """The items-form ``request`` as a KServe v2 / Open Inference Protocol body."""
    items, features = request["items"], spec.feature_names
    values = [i for f in features for item in items for i in item["sparse"].get(f, [])]
    return {
        "inputs": [
            {"name": "dense_features", "datatype": "FP32", "shape": [len(items), spec.dense_features],
             "data": [x for item in items for x in item["dense"]]},
            {"name": "sparse_features.lengths", "datatype": "INT64", "shape": [len(features), len(items)],
             "data": [len(item["sparse"].get(f, [])) for f in features for item in items]},
            {"name": "sparse_features.values", "datatype": "INT64", "shape": [len(values)], "data": values},
        ]
    }


def main() -> None:
    spec = load_spec(SPEC)
    one_item = synthetic_request(spec, 1, seed=1)
    files = {
        HERE / "requests" / "one_item.json": one_item,
        HERE / "requests" / "candidates_100.json": candidates_request(spec, 100, seed=2),
        HERE / "kserve_v2" / "one_item.json": as_kserve_v2(spec, one_item),
    }
    for path, request in files.items():
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(orjson.dumps(request) + b"\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
