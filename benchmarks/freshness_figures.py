"""The freshness scenario's figures from one run: its timeline (when each part happened), p99s over
the idle and publishing stretches (with and without the machine's stalls), failed requests per
part, and its summary and plot."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.load import LoadResult  # noqa: E402
from benchmarks.stalls import overlaps  # noqa: E402

TARGETS = (  # (key, bound: a number or the key it is compared with, factor)
    ("rows_per_min", ">=", 2_000_000),
    ("publish_to_visible_p99_s", "<=", 2.0),
    ("serving_p99_ratio", "<=", 1.1),
    ("failed_requests", "<=", 0),
    ("dense_swap_failed_requests", "<=", 0),
    ("version_swap_failed_requests", "<=", 0),
    ("rollback_failed_requests", "<=", 0),
    ("rss_growth_mib", "<=", "delta_mib"),
)


@dataclasses.dataclass
class Timeline:
    """When each part of a run happened (perf_counter seconds), and what the publishing measured:
    ``busy``: (CPU seconds, seconds) of each idle and publishing stretch."""

    marks: dict[str, list[float]] = dataclasses.field(default_factory=lambda: {"publish": []})
    idle: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    publishing: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    visible_s: list[float] = dataclasses.field(default_factory=list)
    busy: dict[str, list[tuple[float, float]]] = dataclasses.field(default_factory=lambda: {"idle": [], "publishing": []})
    spans: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)  # dense, rollback, version

    def span(self, label: str, started: float) -> tuple[float, float]:
        self.marks[label] = [started]
        self.spans[label] = (started, time.perf_counter())
        return self.spans[label]


def measured(
    result: LoadResult, stalls: list[tuple[float, float]], timeline: Timeline, rows_per_delta: int,
    memory_before: dict, memory_after: dict,
) -> dict:
    """Every figure of the run but the max load's, from its requests and its timeline."""
    idle, publishing, busy, spans = timeline.idle, timeline.publishing, timeline.busy, timeline.spans
    swap = spans["version swap"]
    figures = {
        "rows_per_min": 60 * rows_per_delta * len(timeline.visible_s) / sum(b - a for a, b in publishing),
        "publish_to_visible_p50_s": float(np.percentile(timeline.visible_s, 50)),
        "publish_to_visible_p99_s": float(np.percentile(timeline.visible_s, 99)),
        "publish_to_visible_s": timeline.visible_s,
        "serving_p99_ms_idle": _p99_ms(result, *idle),
        "serving_p99_ms_during": _p99_ms(result, *publishing),
        "typical_second_p99_ms_idle": _typical_second_p99_ms(result, idle),
        "typical_second_p99_ms_during": _typical_second_p99_ms(result, publishing),
        "machine_stalls": [[float(at - result.events[0][0]), late * 1000] for at, late in stalls],
        "machine_stalls_idle": sum(1 for at, _ in stalls if any(a <= at < b for a, b in idle)),
        "machine_stalls_during": sum(1 for at, _ in stalls if any(a <= at < b for a, b in publishing)),
        "serving_p99_ms_idle_outside_stalls": _p99_ms(result, *idle, stalls=stalls),
        "serving_p99_ms_during_outside_stalls": _p99_ms(result, *publishing, stalls=stalls),
        "cpu_busy_cores_idle": sum(c for c, _ in busy["idle"]) / sum(s for _, s in busy["idle"]),
        "cpu_busy_cores_during": sum(c for c, _ in busy["publishing"]) / sum(s for _, s in busy["publishing"]),
        "failed_requests": _failed(result, result.events[0][0], float("inf")),
        "statuses": result.statuses,
        "load_client_cpu_cores": result.client_cpu_cores,  # the open loop's client (wrk)
        "load_client_saturated": result.client_saturated,
        "load_achieved_rps": result.achieved_rps,
        "load_late_sends": result.late_sends,
        "rss_growth_mib": memory_after["anon_mib"] - memory_before["anon_mib"],
        "rss_total_growth_mib": memory_after["rss_mib"] - memory_before["rss_mib"],
        "memory_before": memory_before,
        "memory_after": memory_after,
        "dense_swap_failed_requests": _failed(result, *spans["dense swap"]),
        "rollback_s": spans["rollback"][1] - spans["rollback"][0],
        "rollback_failed_requests": _failed(result, *spans["rollback"]),
        "version_swap_s": swap[1] - swap[0],
        "version_swap_failed_requests": _failed(result, swap[0], swap[1] + 1.0),
        "version_swap_p99_ms": _p99_ms(result, (swap[0], swap[1] + 1.0)),
    }
    figures["serving_p99_ratio"] = figures["serving_p99_ms_during"] / figures["serving_p99_ms_idle"]
    figures["serving_p99_ratio_outside_stalls"] = (
        figures["serving_p99_ms_during_outside_stalls"] / figures["serving_p99_ms_idle_outside_stalls"])
    return figures


def _in(result: LoadResult, start: float, end: float) -> list[tuple[float, float, str]]:
    return [e for e in result.events if start <= e[0] < end]


def _latencies_ms(
    result: LoadResult, spans: tuple[tuple[float, float], ...], stalls: Sequence[tuple[float, float]] = ()
) -> list[tuple[float, float]]:
    """(sent, latency in ms) of the requests sent within ``spans`` and answered 200, leaving out
    those in flight during one of ``stalls``."""
    return [(sent, (answered - sent) * 1000) for start, end in spans
            for sent, answered, status in _in(result, start, end)
            if status == "200" and not overlaps(stalls, sent, answered)]


def _p99_ms(result: LoadResult, *spans: tuple[float, float], stalls: Sequence[tuple[float, float]] = ()) -> float:
    latencies = [ms for _, ms in _latencies_ms(result, spans, stalls)]
    if not latencies:
        raise RuntimeError(f"no request answered 200 in the {sum(b - a for a, b in spans):.2f} s measured")
    return float(np.percentile(latencies, 99))


def _typical_second_p99_ms(result: LoadResult, spans: list[tuple[float, float]]) -> float:
    """The median over the seconds of ``spans`` of each second's p99."""
    by_second: dict[int, list[float]] = {}
    for sent, ms in _latencies_ms(result, tuple(spans)):
        by_second.setdefault(int(sent), []).append(ms)
    return float(np.median([np.percentile(ms, 99) for ms in by_second.values()]))


def _failed(result: LoadResult, start: float, end: float) -> int:
    return sum(1 for _, _, status in _in(result, start, end) if status != "200")


def summary(figures: dict) -> str:
    lines = [f"freshness scenario {figures['scenario']}: {figures['workers']} workers, "
             f"{figures['load_rps']:.0f} req/s ({figures['load_rps'] / figures['max_load_rps']:.0%} of max load {figures['max_load_rps']:.0f}); "
             f"client (wrk) {figures['load_client_cpu_cores']:.2f} cores{', saturated' if figures['load_client_saturated'] else ''}, "
             f"{figures['load_achieved_rps']:.0f} req/s achieved, {figures['load_late_sends']} sent late"]
    for key, op, bound in TARGETS:
        value = figures[key]
        limit = figures[bound] if isinstance(bound, str) else bound
        met = value >= limit if op == ">=" else value <= limit
        lines.append(f"  {key:<32}{_fmt(value):>14}  target {op} {bound} ({_fmt(limit)}): {'met' if met else 'MISSED'}")
    for key in ("publish_to_visible_p50_s", "serving_p99_ms_idle", "serving_p99_ms_during", "typical_second_p99_ms_idle",
                "typical_second_p99_ms_during", "machine_stalls_idle", "machine_stalls_during",
                "serving_p99_ms_idle_outside_stalls", "serving_p99_ms_during_outside_stalls",
                "serving_p99_ratio_outside_stalls", "cpu_busy_cores_idle", "cpu_busy_cores_during", "rss_total_growth_mib",
                "dense_swap_s", "dense_swap_worker_s", "rollback_s", "version_swap_s", "version_swap_p99_ms"):
        lines.append(f"  {key:<32}{_fmt(figures[key]):>14}")
    return "\n".join(lines) + "\n"


def _fmt(value: object) -> str:
    return f"{value:,.3f}" if isinstance(value, float) else f"{value:,}"


def plot(
    result: LoadResult,
    marks: dict[str, list[float]],
    stalls: list[tuple[float, float]],
    spans: dict[str, list[tuple[float, float]]],
    path: Path,
) -> None:
    start = result.events[0][0]
    sent = np.array([e[0] - start for e in result.events if e[2] == "200"])
    latency = np.array([(e[1] - e[0]) * 1000 for e in result.events if e[2] == "200"])
    seconds = np.floor(sent).astype(int)
    bins = np.unique(seconds)
    p99 = [np.percentile(latency[seconds == s], 99) for s in bins]
    fig, ax = plt.subplots(figsize=(10, 3.6))
    ax.plot(bins, p99, linewidth=1, color="black", label="p99 of each second")
    colors = {"idle": "#dddddd", "publishing": "#cfe3f7", "dense": "#f7e0c3", "rollback": "#e3d3f2", "version": "#d3f2d9"}
    for label, stretches in spans.items():
        for index, (a, b) in enumerate(stretches):
            ax.axvspan(a - start, b - start, color=colors[label], label=label if index == 0 else None)
    for t in marks["publish"]:
        ax.axvline(t - start, color="tab:blue", linewidth=0.4)
    if stalls:
        ax.plot([at - start for at, _ in stalls], [late * 1000 for _, late in stalls], "v", color="tab:red",
                markersize=5, label="machine stall (ms late)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("p99 latency, ms")
    ax.set_title("serving p99 while deltas are published (blue lines), dense weights swapped, rolled back, "
                 "and the version changed; the machine's own stalls in red", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
