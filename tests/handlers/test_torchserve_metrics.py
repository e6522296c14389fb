"""The worker's per-batch lines from TorchServe are dropped; everything else still goes out."""

from __future__ import annotations

import io
import logging

from handlers.torchserve_metrics import quiet_per_batch_lines


def test_torchserve_per_batch_lines_are_dropped_and_others_kept():
    out = io.StringIO()
    stdout = logging.StreamHandler(out)  # what the worker's basicConfig puts on the root logger
    root = logging.getLogger()
    root.addHandler(stdout)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        quiet_per_batch_lines()
        logging.info("Backend received inference at: %d", 1700000000)
        logging.getLogger("ts.metrics.caching_metric").info("[METRICS]PredictionTime.Milliseconds:1.2|#ModelName:m")
        logging.getLogger("ts.metrics.caching_metric").info("[METRICS]HandlerBatches.Count:3|#ModelName:m")
        logging.getLogger("handlers").warning("a warning")
    finally:
        root.removeHandler(stdout)
        root.setLevel(level)
    assert out.getvalue().splitlines() == ["[METRICS]HandlerBatches.Count:3|#ModelName:m", "a warning"]
