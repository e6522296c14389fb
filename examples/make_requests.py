"""Regenerates the example request files in examples/requests/ from the Criteo-shaped spec.

    .venv/bin/python examples/make_requests.py
"""

from pathlib import Path

import orjson

from archive_tools.synthetic import context_candidates_request, items_request
from handlers.spec import ModelSpec

HERE = Path(__file__).resolve().parent
SPEC = HERE.parent / "config" / "models" / "criteo.yaml"
# In the 100-candidate request these features vary per candidate (item side); the rest is the
# shared user context, repeated in every item.
CANDIDATE_FEATURES = ("cat_9", "cat_19", "cat_20", "cat_21")


def main() -> None:
    spec = ModelSpec.from_yaml(SPEC)
    out = HERE / "requests"
    out.mkdir(exist_ok=True)
    files = {
        "one_item.json": items_request(spec, 1, seed=1),
        "candidates_100.json": context_candidates_request(
            spec, 100, seed=2, candidate_features=CANDIDATE_FEATURES
        ),
    }
    for name, request in files.items():
        (out / name).write_bytes(orjson.dumps(request) + b"\n")
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
