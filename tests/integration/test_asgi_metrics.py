"""The ASGI engine's ``/metrics``, scraped by a real Prometheus (Debian's ``prometheus``, which
``make test`` installs): known requests to a server of two processes, then exact counts from
Prometheus' query API (whichever process answered each request, and the scrape), under the names
and labels the Grafana dashboard (config/grafana/torchrec-serve.json) queries; and every dashboard
query that applies to this model answers."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests

from archive_tools.build import build_archive
from archive_tools.local_asgi import LocalAsgiServer
from archive_tools.local_server import free_port
from archive_tools.model_config import ServingConfig
from handlers.runtime.wire.transport import Arrival
from tests.conftest import TINY_SPEC
from tests.helpers import archive_service, items_request

pytestmark = pytest.mark.integration

DASHBOARD = Path(__file__).parents[2] / "config" / "grafana" / "torchrec-serve.json"
SCRAPE_S = 0.5
SCRAPE = "500ms"  # SCRAPE_S, as Prometheus writes a duration
BAD = {"items": [{"dense": [0.1, 0.2, 0.3, 0.4]}], "colour": 1}  # 400, naming "colour"
# panels of features this model has not: hashed, pruned or raw ids
NOT_THIS_MODEL = ("HandlerHashedIds", "HandlerPrunedIds", "HandlerUnseenIds")


class Prometheus:
    """``prometheus`` scraping ``target`` every ``SCRAPE_S``, its storage in ``workdir``; stopped by pid."""

    def __init__(self, target: str, workdir: Path) -> None:
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE},
            "scrape_configs": [{"job_name": "asgi", "static_configs": [{"targets": [target]}]}],
        }))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = workdir / "prometheus.out"
        if shutil.which("prometheus") is None:
            raise FileNotFoundError("prometheus is not installed: `make test` installs it (apt-get install prometheus)")
        command = ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                   f"--web.listen-address={self.url.removeprefix('http://')}"]
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"prometheus did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    def query(self, expr: str) -> list[dict]:
        answer = requests.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def values(self, expr: str, by: str | None = None) -> dict[str, float]:
        return {r["metric"].get(by, "") if by else "": float(r["value"][1]) for r in self.query(expr)}

    def scrapes(self) -> int:
        return int(self.values('count_over_time(up{job="asgi"}[1h])').get("", 0))

    def wait_for_scrapes(self, count: int, timeout_s: float = 15) -> None:
        """Waits for ``count`` more scrapes (two: a rate over what they saw exists), all of them good."""
        wanted = self.scrapes() + count
        deadline = time.monotonic() + timeout_s
        while self.scrapes() < wanted:
            if time.monotonic() > deadline:
                raise AssertionError(f"fewer than {count} scrapes in {timeout_s} s:\n{self.log.read_text()[-3000:]}")
            time.sleep(SCRAPE_S / 2)
        assert self.values('min_over_time(up{job="asgi"}[1h])') == {"": 1.0}, "a scrape failed"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("asgi-metrics") / "model_store"
    build_archive(TINY_SPEC, checkpoint=None, seed=0, name="tiny", version="1.0", model_store=store,
                  serving=ServingConfig(batch_size=8, max_batch_delay_ms=5))
    return store


def test_prometheus_scrapes_exact_counts_summed_over_processes(store, tiny_spec, tmp_path):
    good = [items_request(tiny_spec, n, seed=n) for n in (1, 3, 2, 5, 4, 1)]
    reference = archive_service(store / "tiny.mar")
    refused = reference.handle([Arrival(json.dumps(BAD).encode(), "application/json", None, None)])
    with LocalAsgiServer(store, ["tiny.mar"], 2, tmp_path) as server:
        prometheus = Prometheus(f"127.0.0.1:{server.port}", tmp_path)
        try:
            assert requests.get(f"{server.url}/metrics", timeout=10).status_code == 200  # no key
            for request in good:  # one at a time: batches of one request
                assert server.post("/predictions/tiny", request).status_code == 200
            assert server.post("/predictions/tiny", BAD).status_code == 400
            assert server.post("/predictions/tiny", good[0], auth=False).status_code == 400  # no key: not counted
            prometheus.wait_for_scrapes(2)
            model = '{ModelName="tiny", Level="Model"}'
            assert prometheus.values(f"sum by (Requests) (HandlerBatches{model})", "Requests") == {"1": 7}
            assert prometheus.values(f"sum(HandlerForwardItems{model})") == {"": sum(len(r["items"]) for r in good)}
            assert prometheus.values(f"sum(HandlerForwards{model})") == {"": len(good)}
            assert prometheus.values(f"sum by (Reason) (HandlerRejectedRequests{model})", "Reason") == {
                reason: float(count) for reason, count in refused.stats.rejected.items()}
            stages = prometheus.values(f"sum by (Stage) (HandlerStageMilliseconds{model})", "Stage")
            assert set(stages) == {"decode", "coalesce", "forward", "encode"} and stages["forward"] > 0
            torchserve = '{model_name="tiny", model_version="1.0"}'
            assert prometheus.values(f"sum(ts_inference_requests_total{torchserve})") == {"": 7}
            assert prometheus.values(f"sum(ts_queue_latency_microseconds{torchserve})")[""] > 0
            for panel, expr in _dashboard_queries():
                if not any(name in expr for name in NOT_THIS_MODEL):
                    assert prometheus.query(expr.replace("$model", "tiny")), f"dashboard panel {panel!r}: no data"
        finally:
            prometheus.stop()


def _dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]
