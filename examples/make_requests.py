"""Regenerates the example request files in examples/requests/ from the Criteo-shaped spec.

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


def main() -> None:
    spec = load_spec(SPEC)
    out = HERE / "requests"
    out.mkdir(exist_ok=True)
    files = {
        "one_item.json": synthetic_request(spec, 1, seed=1),
        "candidates_100.json": candidates_request(spec, 100, seed=2),
    }
    for name, request in files.items():
        (out / name).write_bytes(orjson.dumps(request) + b"\n")
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
