"""Counters that settle: a worker that gets no batch for ``metrics_flush_s`` publishes what it has
summed, so a scrape one interval after the last request sees every count (of a raw-id model,
under a real TorchServe), with no describe call to flush them."""

from __future__ import annotations

import time

import numpy as np
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from archive_tools.build import build_archive
from archive_tools.local_server import LocalTorchServe
from archive_tools.model_config import ServingConfig
from tests.integration.raw_id_models import owned_ids, raw_request

pytestmark = pytest.mark.integration

FLUSH_S = 0.5
MARGIN_S = 1.0  # the worker's thread wakes, and the frontend parses its lines, well within it


def _counts(text: str, model: str) -> dict[tuple[str, str], float]:
    """{(counter, its one label's value or ""): value} of ``model``'s samples in a scrape."""
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("ModelName") == model and family.name.startswith("Handler"):
                label = "".join(v for k, v in sample.labels.items() if k not in ("ModelName", "Level", "Hostname"))
                counts[(family.name, label)] = counts.get((family.name, label), 0) + sample.value
    return counts


def test_a_scrape_one_flush_interval_after_the_last_request_sees_every_count(trained, tmp_path):
    spec, spec_path, model, checkpoint = trained
    build_archive(
        spec_path, checkpoint=checkpoint, seed=0, name="idle", version="1.0", model_store=tmp_path,
        serving=ServingConfig(batch_size=8, max_batch_delay_ms=5, metrics_flush_s=FLUSH_S),
    )
    owned, table_of = owned_ids(model), {f: t.name for t in spec.tables for f in t.features}
    expected = {("HandlerBatches", "1"): 0.0, ("HandlerForwardItems", ""): 0.0}
    with LocalTorchServe(model_store=tmp_path) as server:
        assert server.register("idle.mar").status_code == 200
        time.sleep(FLUSH_S)  # the first batch flushes; the later ones, within an interval, wait
        for seed in range(6):  # one at a time: batches of one request
            request = raw_request(spec, model, seed)
            assert server.predict("idle", request).status_code == 200
            expected[("HandlerBatches", "1")] += 1
            expected[("HandlerForwardItems", "")] += len(request["items"])
            for item in request["items"]:
                for feature, ids in item["sparse"].items():
                    table = table_of[feature]
                    unseen = int((~np.isin(ids, owned[table].numpy())).sum())
                    expected[("HandlerUnseenIds", table)] = expected.get(("HandlerUnseenIds", table), 0) + unseen
                    expected[("HandlerRawIds", table)] = expected.get(("HandlerRawIds", table), 0) + len(ids)
        time.sleep(FLUSH_S + MARGIN_S)
        published = _counts(requests.get(f"{server.metrics_url}/metrics", timeout=30).text, "idle")
    assert {key: published.get(key) for key in expected} == expected
    assert all(expected[("HandlerUnseenIds", t)] for t in owned)
