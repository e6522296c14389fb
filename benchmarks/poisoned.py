"""One request in a hundred that the model itself refuses, under a steady load: the others must
keep their answers and their latency.

The model is the own-model example (``examples/own_model``, a ranker that takes exactly one
candidate id an item) built from a spec that takes one or two, so that a request with two
candidate ids passes the decoder and fails in the model's forward. Its batch is then split until
the request fails alone (``ScoringService``): the good requests beside it are scored, later by
the forwards the split cost. The same open loop runs twice, clean and with 1% of such requests,
and the figures compare the good requests' p99:

* ``poisoned_share``, ``poisoned_requests``, ``poisoned_refused`` (their 400s),
  ``poisoned_good_failed`` (any other answer than 200 or the refusals: must be 0);
* ``poisoned_clean_p99_ms``, ``poisoned_good_p99_ms``, ``poisoned_p99_ratio`` (target: at most 1.5).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import orjson
import yaml

from archive_tools.local_server import LocalTorchServe
from benchmarks.building import build
from benchmarks.disruptions import ok
from benchmarks.load import run_open_loop
from benchmarks.traffic import Traffic

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "own_model"
NAME = "seq_ranker_lenient"
SHARE = 0.01
REQUESTS = 100  # one of them poisoned


def build_lenient(store: Path, artifact: str = "aoti") -> None:
    """The example built (``artifact``: aoti or exported) from a spec that lets two candidate ids
    through (``benchmarks.lenient_ranker``: its build still runs the model on one an item)."""
    raw = yaml.safe_load((EXAMPLE / "seq_ranker.yaml").read_text())
    item = raw["tables"][0]
    item["ids_per_item"] = {"min": 1, "max": 2}
    item["max_sequence_length"] = 2
    spec = store.parent / f"{NAME}.yaml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    architecture = "benchmarks.lenient_ranker:LenientSeqRanker"
    spec.write_text(yaml.safe_dump({**raw, "name": NAME, "architecture": architecture}, sort_keys=False))
    path = os.pathsep.join(p for p in (str(EXAMPLE), os.environ.get("PYTHONPATH")) if p)
    build(spec, store, "--seed", "0", "--artifact", artifact, quiet=True, env={**os.environ, "PYTHONPATH": path})


def traffic(seed: int = 0) -> tuple[Traffic, Traffic]:
    """One-candidate requests for the example (its rows: 2,000 items, 500 users; histories of 0 to
    20 items): clean, and the same with one in ``REQUESTS`` holding a second candidate id."""
    rng = np.random.default_rng(seed)
    requests = [
        {
            "items": [
                {"dense": [0.0], "sparse": {"candidate": [int(rng.integers(2000))], "user_id": [int(rng.integers(500))]}}
            ],
            "context_sparse": {"history": rng.integers(2000, size=int(rng.integers(21))).tolist()},
        }
        for _ in range(REQUESTS)
    ]
    clean = Traffic([orjson.dumps(r) for r in requests], [1] * REQUESTS)
    requests[REQUESTS // 2]["items"][0]["sparse"]["candidate"].append(1)
    return clean, Traffic([orjson.dumps(r) for r in requests], [1] * REQUESTS)


def poisoned_load(server: LocalTorchServe, rate: float, seconds: float) -> dict:
    """The lenient model registered (batch 32, 5 ms), the clean and the poisoned open loops at
    ``rate`` for ``seconds`` each; unregistered after."""
    ok(server.register(f"{NAME}.mar", batch_size=32, max_batch_delay=5))
    url, auth = f"{server.inference_url}/predictions/{NAME}", server.auth("inference")
    clean, poisoned = traffic()
    run_open_loop(url, auth, clean, rate, min(seconds, 2.0))  # warm-up
    before = run_open_loop(url, auth, clean, rate, seconds)
    after = run_open_loop(url, auth, poisoned, rate, seconds)
    ok(server.management("DELETE", f"/models/{NAME}"))
    refused = after.statuses.get("400", 0)
    return {
        "poisoned_share": SHARE,
        "poisoned_rate_rps": round(rate, 1),
        "poisoned_requests": after.requests,
        "poisoned_refused": refused,
        "poisoned_good_failed": after.requests - after.statuses.get("200", 0) - refused,
        "poisoned_clean_failed": before.requests - before.statuses.get("200", 0),
        "poisoned_clean_p99_ms": before.latency_ms["p99"],
        "poisoned_good_p99_ms": after.latency_ms["p99"],
        "poisoned_p99_ratio": round(after.latency_ms["p99"] / before.latency_ms["p99"], 3),
        "poisoned_statuses": after.statuses,
        "poisoned_client_cpu_cores": after.client_cpu_cores,
    }
