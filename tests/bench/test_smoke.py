"""CI runs the benchmark's ``smoke`` scenario end to end: build, real TorchServe, closed and open
loop, handler counters, in-process ceiling, JSON, plots and summary."""


import orjson
import pytest

from tests.helpers import run_scenario

pytestmark = pytest.mark.integration


def test_smoke_scenario_runs_and_reports(tmp_path):
    out = tmp_path / "smoke"
    run_scenario("smoke", out, timeout_s=600)
    results = orjson.loads((out / "results.json").read_bytes())
    assert [c["batch_size"] for c in results["configs"]] == [8]
    for config in results["configs"]:
        assert config["register_s"] > 0 and config["worker_loaded"]["workers"] == 1
        for run in config["runs"]:
            assert set(run["statuses"]) == {"200"}, run["statuses"]
            assert run["items"] > 0 and run["worker_cpu_us_per_item"] > 0
            assert run["items_per_s"] == pytest.approx(run["items"] / run["wall_s"], rel=1e-9)
            # the in-process ceiling has no server in the way: it must outpace the served rate
            assert run["ceiling_items_per_s"] > run["items_per_s"], run
            if run["mode"] == "open":  # the Python client: the server's counters saw exactly its answers
                assert run["client"] == "python"
                assert run["formed"]["requests"] == run["requests"], run
                assert run["formed"]["items"] == run["items"], run
            else:  # wrk: an answer in flight when it stopped (one per connection at most) is not counted
                assert run["client"] == "wrk"
                assert run["requests"] <= run["formed"]["requests"] <= run["requests"] + run["level"], run
                if run["workload"] == "one-item":
                    assert run["items"] == run["requests"]
    batched = next(c for c in results["configs"] if c["batch_size"] == 8)
    closed_8 = next(r for r in batched["runs"] if r["mode"] == "closed" and r["level"] == 8)
    assert closed_8["formed"]["mean_requests_per_batch"] > 1, "8 concurrent senders should share batches"
    assert batched["two_workers"]["one"]["workers"] == 1 and batched["two_workers"]["two"]["workers"] == 2
    assert set(results["tables_mib"]) == {"t_user", "t_item", "t_category", "t_hour"}
    for name in ("latency_vs_throughput.png", "memory_by_table.png", "summary.txt"):
        assert (out / name).stat().st_size > 0
    assert (out / "traces" / "one-item.jsonl").exists()
