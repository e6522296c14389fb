"""CI runs the ``engines-smoke`` scenario end to end (tiny model): the same archives and points on
TorchServe and on the asgi engine, each engine's no-op floor, the same requests' scores compared,
the asgi engine's PSS with one process and two. The figures are checked for sanity, not against
the speed targets (the full scenario's)."""

import os

import orjson
import pytest

from benchmarks.engines import SCORED_CANDIDATES, SCORED_ONE_ITEM
from benchmarks.engines_report import TARGETS
from tests.helpers import run_scenario

pytestmark = pytest.mark.integration

RATES = ("one_item_c32_items_per_s", "floor_c32_items_per_s", "100cand_items_per_s")
LATENCIES = ("one_item_c1_p50_ms", "p99_ms_c32")
POINTS = ("floor_c32", "one_item_c1", "one_item_c32", "100cand_c32")


def test_engines_smoke_scenario_reports_both_engines(tmp_path):
    out = tmp_path / "engines"
    run_scenario("engines-smoke", out, timeout_s=600)
    figures = orjson.loads((out / "engines.json").read_bytes())
    for engine in ("ts", "asgi"):
        for key in RATES + LATENCIES:
            assert figures[f"{engine}_{key}"] > 0, key
        for point in POINTS:
            served = figures["points"][f"{engine}_{point}"]
            assert set(served["statuses"]) == {"200"} and served["requests"] > 0, (point, served)
            cpu = figures["cpu"][f"{engine}_{point}"]
            # /proc counts in ticks, read a moment apart from the wall clock: never 1% over the cores
            assert 0 < cpu["server_cores"] <= os.cpu_count() * 1.01, (point, cpu)
            assert cpu["client"] == "wrk" and cpu["client_cores"] > 0, (point, cpu)
    # one-item and 100-candidate requests, every score of each compared: the engines run one runtime
    assert figures["scores_compared"] == SCORED_ONE_ITEM + 100 * SCORED_CANDIDATES
    assert figures["max_score_diff_engines"] <= 1e-6
    pss = figures["asgi_pss_mib"]
    assert (pss["one_process"]["processes"], pss["two_processes"]["processes"]) == (1, 2)
    assert [len(pss[n]["tables"]) for n in ("one_process", "two_processes")] == [1, 2]
    assert all(0 <= t["private"] <= t["rss"] for n in ("one_process", "two_processes") for t in pss[n]["tables"])
    # a second process holds more than nothing, and at most a second copy of everything (2; slack
    # for what each process allocates while serving)
    assert 1.0 < figures["asgi_two_process_pss_ratio"] < 2.5
    assert [t["key"] for t in figures["targets"]] == [key for _, key, _, _ in TARGETS]
    assert all(isinstance(t["met"], bool) for t in figures["targets"])
    for name in ("summary.txt", "engines.png"):
        assert (out / name).stat().st_size > 0
