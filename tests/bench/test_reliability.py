"""CI runs the reliability suite's ``reliability-smoke`` scenario end to end (tiny model, seconds
per phase): every disruption against the real TorchServe with the project's config and plugin."""

import subprocess
import sys

import orjson
import pytest

from benchmarks.reliability import TARGETS
from tests.conftest import REPO

pytestmark = pytest.mark.integration


def test_reliability_smoke_scenario_runs_and_holds_the_hard_targets(tmp_path):
    out = tmp_path / "reliability"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "reliability-smoke", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = orjson.loads((out / "reliability.json").read_bytes())
    assert {key for key, *_ in TARGETS} <= set(figures)
    # correctness targets hold at any size; the latency and memory ones are the full scenario's
    assert figures["scale_down_lost_requests"] == 0, figures["scale_down_statuses"]
    assert figures["kill_worker_failed_requests"] <= figures["kill_worker_inflight"], figures["kill_worker_statuses"]
    assert figures["hung_worker_detect_s"] <= 5
    assert figures["version_swap_failed_requests"] == 0
    assert figures["soak_errors"] == 0, figures["soak_statuses"]
    assert figures["fuzz_5xx"] == 0 and not figures["fuzz_worker_restarted"], figures["fuzz_statuses"]
    assert figures["token_expiry_client_errors"] == 0 and figures["token_refreshes"] >= 2
    assert figures["overload_2x_statuses"].get("503", 0) > 0, "twice the capacity must be shed"
    for name in ("summary.txt", "disruptions.png"):
        assert (out / name).stat().st_size > 0
