"""The main job, end to end (``make demo``):

1. build ``model_store/criteo.mar`` from the Criteo-shaped spec (seeded random weights, int8 tables),
   compiled with AOTInductor (or, where the machine cannot compile, as an exported program);
2. start TorchServe with ``config/config.properties`` (token authorization on) on free loopback ports;
3. register the archive through the management API (batching on: batch_size 32, 5 ms);
4. score the example requests in ``examples/requests/`` and print the scores;
5. stop the server.
"""

from __future__ import annotations

import time
from pathlib import Path

import orjson

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from archive_tools.pipeline import VerificationFailed
from archive_tools.local_server import LocalTorchServe
from handlers.runtime.artifacts import Artifact

REPO = Path(__file__).resolve().parent.parent
SPEC = REPO / "config" / "models" / "criteo.yaml"
MODEL_STORE = REPO / "model_store"
REQUESTS = REPO / "examples" / "requests"


def _build(artifact: Artifact) -> Path:
    return build_archive(
        SPEC,
        checkpoint=None,
        seed=0,
        name="criteo",
        version="1.0",
        model_store=MODEL_STORE,
        serving=ServingConfig(batch_size=32, max_batch_delay_ms=5),
        artifact=artifact,
    )


def main() -> None:
    print(f"== 1. building the archive from {SPEC.relative_to(REPO)}")
    try:
        archive = _build(Artifact.AOTI)
    except VerificationFailed:
        raise
    except Exception as error:  # no C++ toolchain, or AOTInductor cannot compile here
        print(f"   AOTInductor failed ({type(error).__name__}: {error}); serving the exported program")
        archive = _build(Artifact.EXPORTED)

    print("== 2. starting TorchServe with config/config.properties")
    with LocalTorchServe(model_store=MODEL_STORE) as server:
        print(f"   inference {server.inference_url}, management {server.management_url}")
        print("   clients authenticate with the keys TorchServe wrote to key_file.json:")
        print("   curl -H 'Authorization: Bearer <inference key>' ...")

        print(f"== 3. registering {archive.name}")
        started = time.perf_counter()
        response = server.register(archive.name, batch_size=32, max_batch_delay=5, initial_workers=1)
        response.raise_for_status()
        print(f"   {response.json()['status']} ({time.perf_counter() - started:.1f}s to ready)")

        print("== 4. scoring the example requests")
        for path in sorted(REQUESTS.glob("*.json")):
            body = path.read_bytes()
            started = time.perf_counter()
            response = server.predict("criteo", body)
            elapsed_ms = 1000 * (time.perf_counter() - started)
            response.raise_for_status()
            scores = response.json()["scores"]
            shown = ", ".join(f"{s:.6f}" for s in scores[:5]) + (", ..." if len(scores) > 5 else "")
            print(f"   {path.name}: {len(scores)} score(s) in {elapsed_ms:.1f} ms: [{shown}]")

        bad = {"items": [{"dense": [0.0] * 12}]}
        response = server.predict("criteo", orjson.dumps(bad))
        print(f"   a bad request gets {response.status_code}: {response.json()['message']}")
        print("== 5. stopping TorchServe")
    print("done")


if __name__ == "__main__":
    main()
