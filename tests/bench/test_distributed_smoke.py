"""CI runs the ``distributed-smoke`` scenario end to end (tiny model): one host against a
two-shard layout on loopback under the same load, a replica stopped under load and a shard down."""

import subprocess
import sys

import orjson
import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

KEYS = {
    "single_host_100cand_items_per_s", "di_100cand_items_per_s", "single_host_p50_ms", "di_extra_p50_ms",
    "single_host_rss_mib", "shard_rss_mib", "dense_rss_mib", "failover_failed_requests", "shard_down_answer_ms",
}


def test_distributed_smoke_scenario_scores_like_one_host_and_fails_over(tmp_path):
    out = tmp_path / "distributed"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "distributed-smoke", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = orjson.loads((out / "distributed.json").read_bytes())
    assert KEYS <= set(figures)
    # correctness holds at any size; latency and memory ratios are the full scenario's
    assert figures["max_score_diff"] <= 1e-6
    assert figures["failover_failed_requests"] == 0, figures["failover_statuses"]
    assert figures["shard_down_statuses"] == [503] * 5
    assert figures["di_100cand_items_per_s"] > 0 and figures["shard_rss_mib"] > 0
    # the candidates share the user's bags: the shards answer each distinct bag once
    assert figures["shard_answer_kib_per_request"] < 0.5 * figures["shard_answer_kib_per_request_all_bags"]
    assert 0 < figures["shard_handler_ms_per_call"] < figures["shard_lookups_p50_ms"]
    for name in ("summary.txt", "distributed.png"):
        assert (out / name).stat().st_size > 0
