"""CI runs the ``raw_ids-smoke`` scenario end to end (tiny model, eager): the row-id, MCH and ZCH
archives built, served in turn by the real TorchServe, the raw-id models' unseen ids counted
against the truth, slot deltas published under traffic with no torn id/row pair, a slot map
swapped in process."""


import orjson
import pytest

from tests.helpers import run_scenario

pytestmark = pytest.mark.integration


def test_raw_ids_smoke_scenario_counts_unseen_ids_exactly_and_sees_no_torn_pair(tmp_path):
    out = tmp_path / "raw_ids"
    run_scenario("raw_ids-smoke", out, timeout_s=600)
    figures = orjson.loads((out / "raw_ids.json").read_bytes())
    assert figures["unseen_counted"] == figures["unseen_true"] > 0
    assert figures["unseen_counted_zch"] == figures["unseen_true_zch"] > figures["unseen_true"]  # and free slots'
    assert figures["extra_bytes_per_row"] == 16.0  # sorted owners and their slots, int64 each
    assert figures["extra_bytes_per_row_zch"] == 8.0  # row-aligned identities
    assert figures["p50_ms_row_ids"] > 0 and figures["p50_ms_raw_ids"] > 0 and figures["p50_ms_zch_ids"] > 0
    assert figures["remap_us_per_4k_ids_mch"] > 0 and figures["remap_us_per_4k_ids_zch"] > 0
    assert all(not client["saturated"] for client in figures["clients"].values())
    assert figures["torn_pairs"] == 0 and figures["torn_probe_requests"] > 0
    assert figures["torn_pairs_zch"] == 0 and figures["torn_probe_requests_zch"] > 0
    assert figures["mch_swap"]["t_user"]["evictions"] == 100 and figures["mch_swap_s"] > 0
    assert figures["zch_swap"]["t_user"]["evictions"] == 100
    assert [t["met"] for t in figures["targets"]][2:] == [True] * 7  # latency is the full scenario's
    assert "p50_overhead_pct_zch" in (out / "summary.txt").read_text()
