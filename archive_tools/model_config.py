"""What an archive's ``model-config.yaml`` holds: TorchServe's per-model settings and the sections
our handler and plugin read (``handler``, ``guard``, ``freshness``)."""

from __future__ import annotations

import dataclasses

from handlers.runtime.artifacts import Artifact
from handlers.runtime.options import HandlerOptions
from handlers.runtime.remote.plan import RemotePlan
from handlers.runtime.split import SplitPlan


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """TorchServe's per-model settings, written to the archive's ``model-config.yaml``."""

    batch_size: int = 32
    max_batch_delay_ms: int = 5
    workers: int = 1
    # Served on 2 cores beside TorchServe's frontend, a second thread pays from about 400 items
    # per forward (`python -m benchmarks.threads`); smaller forwards run on one.
    intra_op_threads: int = 2
    parallel_from_items: int = 400
    # TorchServe's own reply timeout, a backstop: the plugin's watchdog restarts a hung worker first.
    response_timeout_s: int = 30
    metrics_flush_s: float = 1.0
    # The plugin's admission control and watchdog (0: derived from the measured batch time).
    max_queue_wait_ms: int = 0
    hang_after_ms: int = 0
    # How fast a published delta's rows are written into the served tables (handlers.runtime.freshness).
    delta_rows_per_s: float = 80_000.0

    def model_config(
        self, artifact: Artifact, weights_bytes: int, split: SplitPlan | None, remote: RemotePlan | None = None
    ) -> dict:
        # Loading is dominated by reading the weights: allow a minute plus 30 s per GB.
        startup_timeout_s = 60 + int(30 * weights_bytes / 2**30)
        return {
            "minWorkers": self.workers,
            "maxWorkers": self.workers,
            "batchSize": self.batch_size,
            "maxBatchDelay": self.max_batch_delay_ms,
            "responseTimeout": self.response_timeout_s,
            "startupTimeout": startup_timeout_s,
            "handler": HandlerOptions(
                artifact, split, self.intra_op_threads, self.parallel_from_items, self.metrics_flush_s, remote
            ).to_mapping(),
            "guard": {"max_queue_wait_ms": self.max_queue_wait_ms, "hang_after_ms": self.hang_after_ms},
            "freshness": {"rows_per_s": self.delta_rows_per_s},
        }
