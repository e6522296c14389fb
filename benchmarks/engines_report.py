"""The engines scenario's targets, its summary (each target beside its figure, each point's CPU)
and its plot (bars per point per engine)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

TARGETS = (  # (label, measured key, op, bound: a number or the key it is compared with)
    ("asgi one item, c=32: items/s >= TorchServe's", "asgi_one_item_c32_items_per_s", ">=", "ts_one_item_c32_items_per_s"),
    ("asgi one item, c=32: p99 <= TorchServe's", "asgi_p99_ms_c32", "<=", "ts_p99_ms_c32"),
    ("asgi one item, c=1, batching off: p50 <= TorchServe's", "asgi_one_item_c1_p50_ms", "<=", "ts_one_item_c1_p50_ms"),
    ("the same requests score the same on both engines (max abs diff)", "max_score_diff_engines", "<=", 1e-6),
    ("asgi: two processes' PSS <= 1.1x one's (the tables shared)", "asgi_two_process_pss_ratio", "<=", 1.1),
)

# (point, its figure's label) per panel: throughput, then latency
THROUGHPUT = (("floor_c32", "no-op floor\n1 item, c=32"), ("one_item_c32", "model\n1 item, c=32"),
              ("100cand_c32", "model\n100 cand., c=32"))
LATENCY = (("one_item_c1", "p50", "1 item, c=1\nbatching off: p50"), ("one_item_c32", "p99", "1 item, c=32\np99"))
ENGINES = (("ts", "TorchServe", "#37a"), ("asgi", "asgi engine", "#e83"))


def targets(results: dict) -> list[dict]:
    listed = []
    for label, key, op, bound in TARGETS:
        limit = results[bound] if isinstance(bound, str) else bound
        value = results[key]
        met = value >= limit if op == ">=" else value <= limit
        listed.append({"target": label, "key": key, "measured": value, "op": op,
                       "bound": bound, "bound_value": limit, "met": met})
    return listed


def summary(results: dict) -> str:
    lines = [f"engines, {results['spec']} (load average at start {_loads(results['load_average_at_start'])}, "
             f"at end {_loads(results['load_average_at_end'])})"]
    width = max(len(key) for key in results)
    for key, value in results.items():
        if isinstance(value, int) and not isinstance(value, bool):
            lines.append(f"  {key:<{width}}  {value:>14,d}")
        elif isinstance(value, float):
            lines.append(f"  {key:<{width}}  {value:>14.3g}" if key.startswith("max_") else f"  {key:<{width}}  {value:>14,.2f}")
    lines.append("PSS, MiB (each process, total):")
    for label, key in (("asgi, large tables", "asgi_large_tables_pss_mib"), ("asgi", "asgi_pss_mib"),
                       ("TorchServe", "ts_pss_mib")):
        for count, measured in results.get(key, {}).items():
            each = " + ".join(f"{mib:,.0f}" for mib in measured["each"])
            tables = "; ".join(f"rss {t['rss']:,.0f}, pss {t['pss']:,.0f}, private {t['private']:,.0f}" for t in measured["tables"])
            lines.append(f"  {label}, {count.replace('_', ' ')}: {each} = {measured['total']:,.0f} (the tables' copies: {tables})")
    lines.append("cpu per point (cores: the server's processes, the client's; * the client saturated):")
    for point, cpu in results["cpu"].items():
        mark = "*" if cpu["client_saturated"] else " "
        lines.append(f"  {point:<24}server {cpu['server_cores']:5.2f}   {cpu['client']} {cpu['client_cores']:5.2f}{mark}")
    lines.append("targets:")
    for t in results["targets"]:
        bound = f"{t['bound']} = {t['bound_value']:.4g}" if isinstance(t["bound"], str) else f"{t['bound']:g}"
        lines.append(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']}: {t['measured']:.4g} ({t['op']} {bound})")
    return "\n".join(lines) + "\n"


def _loads(loads: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in loads)


def plot(results: dict, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.38
    for offset, (engine, name, color) in zip((-width / 2, width / 2), ENGINES):
        rates = [results["points"][f"{engine}_{point}"]["items_per_s"] for point, _ in THROUGHPUT]
        bars = left.bar([i + offset for i in range(len(THROUGHPUT))], rates, width, label=name, color=color)
        left.bar_label(bars, [f"{rate:,.0f}" for rate in rates], fontsize=7)
        _hatch_saturated(bars, [f"{engine}_{point}" for point, _ in THROUGHPUT], results)
        latencies = [results["points"][f"{engine}_{point}"]["latency_ms"][q] for point, q, _ in LATENCY]
        bars = right.bar([i + offset for i in range(len(LATENCY))], latencies, width, label=name, color=color)
        right.bar_label(bars, [f"{ms:.2f}" for ms in latencies], fontsize=7)
        _hatch_saturated(bars, [f"{engine}_{point}" for point, _, _ in LATENCY], results)
    left.set_xticks(range(len(THROUGHPUT)), [label for _, label in THROUGHPUT])
    left.set_ylabel("items/s (one process each, batch 32 / 5 ms)")
    right.set_xticks(range(len(LATENCY)), [label for _, _, label in LATENCY])
    right.set_yscale("log")  # a p50 of a millisecond beside a p99 of tens
    lowest = min(results["points"][f"{engine}_{point}"]["latency_ms"][q] for engine, _, _ in ENGINES for point, q, _ in LATENCY)
    right.set_ylim(bottom=lowest / 4)
    right.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    right.set_ylabel("ms (log scale)")
    for ax in (left, right):
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
    saturated = any(cpu["client_saturated"] for cpu in results["cpu"].values())
    fig.suptitle(f"{results['spec']}: TorchServe and the asgi engine, the same archives and requests"
                 + (" (hatched: the client was saturated)" if saturated else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _hatch_saturated(bars, points: list[str], results: dict) -> None:
    for bar, point in zip(bars, points):
        if results["cpu"][point]["client_saturated"]:
            bar.set_hatch("//")
