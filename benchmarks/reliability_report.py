"""The reliability suite's targets, its summary and its plot of each disruption's requests."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.load import LoadResult  # noqa: E402

TARGETS = (  # (key, op, value or the key it is compared with, factor)
    ("scale_down_lost_requests", "<=", 0, 1),
    ("kill_worker_failed_requests", "<=", "kill_worker_inflight", 1),
    ("kill_worker_recovery_s", "<=", 10, 1),
    ("hung_worker_detect_s", "<=", 5, 1),
    ("overload_2x_reject_p99_ms", "<=", 10, 1),
    ("overload_2x_accepted_p99_ms", "<=", "inference_p99_ms_unloaded", 2),
    ("register_during_load_inference_p99_ms", "<=", "inference_p99_ms_baseline", 1.5),
    ("version_swap_failed_requests", "<=", 0, 1),
    ("poisoned_good_failed", "<=", 0, 1),
    ("poisoned_good_p99_ms", "<=", "poisoned_clean_p99_ms", 1.5),
    ("soak_errors", "<=", 0, 1),
    ("soak_rss_growth_pct", "<=", 5, 1),
    ("fuzz_5xx", "<=", 0, 1),
    ("token_expiry_client_errors", "<=", 0, 1),
    ("log_bytes_per_hour_at_1k_rps", "<=", 50 * 2**20, 1),
)


def summary(figures: dict) -> str:
    lines = [f"reliability scenario {figures['scenario']}"]
    for key, _, bound, factor in TARGETS:
        if key not in figures or (isinstance(bound, str) and bound not in figures):
            lines.append(f"  {key:<40}{'-':>14}  not measured: phase skipped in this scenario")
            continue
        value = figures.get(key)
        limit = factor * (figures[bound] if isinstance(bound, str) else bound)
        met = value is not None and value <= limit
        label = f"{factor:g} x {bound}" if isinstance(bound, str) and factor != 1 else str(bound)
        lines.append(f"  {key:<40}{_fmt(value):>14}  target <= {label} ({_fmt(limit)}): {'met' if met else 'MISSED'}")
    return "\n".join(lines) + "\n"


def _fmt(value: object) -> str:
    return f"{value:,.2f}" if isinstance(value, float) else str(value)


def plot(timelines: dict[str, tuple[LoadResult, float]], path: Path) -> None:
    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 2.6 * len(timelines)), squeeze=False)
    for ax, (title, (result, at)) in zip(axes[:, 0], timelines.items()):
        events = np.array([(sent - at, (answered - sent) * 1000) for sent, answered, _ in result.events])
        ok = np.array([status == "200" for _, _, status in result.events])
        if len(events):
            ax.scatter(events[ok, 0], events[ok, 1], s=2, label="200")
            ax.scatter(events[~ok, 0], events[~ok, 1], s=6, color="red", label="other")
        ax.axvline(0, color="black", linestyle="--", linewidth=1)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("latency, ms")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds from the disruption")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
