"""Benchmark output: results.json, plots (latency against throughput, memory by table) and a short
text summary with each target beside its measured figure."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import orjson  # noqa: E402

from benchmarks.scenarios import Scenario  # noqa: E402


def evaluate_targets(scenario: Scenario, results: dict) -> list[dict]:
    evaluated = []
    for target in scenario.targets:
        if target.workload is None:
            measured = _config_metric(results, target.batch_size, target.metric)
        else:
            run = _find_run(results, target.workload, target.batch_size, target.concurrency)
            measured = None if run is None else _metric(run, target.metric)
        evaluated.append(
            {
                "label": target.label,
                "target": f"{target.op} {target.value:g}",
                "measured": measured,
                "met": measured is not None and target.met(measured),
            }
        )
    return evaluated


def _find_run(results: dict, workload: str, batch_size: int, concurrency: int) -> dict | None:
    for config in results["configs"]:
        if config["batch_size"] != batch_size:
            continue
        for run in config["runs"]:
            if run["workload"] == workload and run["mode"] == "closed" and run["level"] == concurrency:
                return run
    return None


def _config_metric(results: dict, batch_size: int, metric: str) -> float | None:
    config = next((c for c in results["configs"] if c["batch_size"] == batch_size), None)
    if config is None:
        return None
    after = config["worker_after_runs"]
    if metric == "register_s":
        return config["register_s"]
    if metric == "worker_rss_gib":
        return after["rss_mib"] / 1024
    if metric == "load_peak_ratio":
        return config["load_peak_rss_mib"] / after["rss_mib"]
    if metric == "two_workers_ratio":
        two = config.get("two_workers")
        return None if two is None else two["two"]["pss_mib"] / two["one"]["pss_mib"]
    raise ValueError(f"unknown model metric {metric!r}")


def _metric(run: dict, metric: str) -> float:
    if metric.endswith("_ms"):
        return run["latency_ms"][metric[: -len("_ms")]]
    return run[metric]


def write(results: dict, out_dir: Path) -> None:
    (out_dir / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    plot_latency(results, out_dir / "latency_vs_throughput.png")
    plot_tables(results, out_dir / "memory_by_table.png")
    text = summary(results)
    (out_dir / "summary.txt").write_text(text)
    print(text)


def plot_latency(results: dict, path: Path) -> None:
    workloads = sorted({r["workload"] for c in results["configs"] for r in c["runs"]})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        for color, config in enumerate(results["configs"]):
            for mode, marker in (("closed", "o"), ("open", "s")):
                runs = [r for r in config["runs"] if r["workload"] == workload and r["mode"] == mode]
                runs = [r for r in runs if r["latency_ms"]]
                if not runs:
                    continue
                x = [r["items_per_s"] for r in runs]
                label = f"batch {config['batch_size']}, {mode} loop"
                for pct, style in (("p50", "-"), ("p99", "--")):
                    ax.plot(x, [r["latency_ms"][pct] for r in runs], style, marker=marker,
                            color=f"C{color}", label=f"{label} {pct}")
                for r, xi in zip(runs, x):
                    tag = f"c={r['level']:g}" if mode == "closed" else f"{r['level']:g}/s"
                    ax.annotate(tag, (xi, r["latency_ms"]["p99"]), fontsize=7,
                                textcoords="offset points", xytext=(3, 3))
        ax.set_yscale("log")
        ax.set_xlabel("items/s served")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"{results['scenario']}: {workload}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tables(results: dict, path: Path) -> None:
    tables = sorted(results["tables_mib"].items(), key=lambda kv: kv[1])
    fig, ax = plt.subplots(figsize=(7, max(3, 0.25 * len(tables))))
    ax.barh([name for name, _ in tables], [mib for _, mib in tables])
    ax.set_xlabel("MiB (rows + per-row scale/bias)")
    total = sum(mib for _, mib in tables)
    ax.set_title(f"{results['scenario']}: memory by table, {total:.1f} MiB in all")
    if tables and tables[-1][1] / max(tables[0][1], 1e-9) > 1000:
        ax.set_xscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(results: dict) -> str:
    build = results["build"]
    lines = [
        f"scenario {results['scenario']} ({results['spec']}), {results['machine']['cpus']} CPUs, "
        f"torch {results['machine']['torch']}",
        f"archive: {build['archive_mib']:.1f} MiB, built in {build['seconds']:.1f} s, "
        f"build peak RSS {build['peak_rss_mib']:.0f} MiB; tables {sum(results['tables_mib'].values()):.1f} MiB",
    ]
    for config in results["configs"]:
        loaded, after = config["worker_loaded"], config["worker_after_runs"]
        two = config.get("two_workers")
        lines += [
            "",
            f"batch_size {config['batch_size']} (max_batch_delay {config['max_batch_delay_ms']} ms): "
            f"register->ready {config['register_s']:.1f} s; worker RSS {loaded['rss_mib']:.0f} MiB "
            f"loaded, peak while loading {config['load_peak_rss_mib']:.0f} MiB; after the runs RSS "
            f"{after['rss_mib']:.0f} MiB, PSS {after['pss_mib']:.0f} MiB"
            + (
                f"; PSS of one worker {two['one']['pss_mib']:.0f} MiB, of two together "
                f"{two['two']['pss_mib']:.0f} MiB"
                if two
                else ""
            ),
            f"  {'workload':<15}{'load':>9}{'req/s':>9}{'items/s':>10}{'p50':>8}{'p90':>8}{'p99':>8}"
            f"{'p99.9':>8}{'req/batch':>10}{'ceiling':>10}{'eff':>6}{'us/item':>8}{'client':>7}  by     errors",
        ]
        for r in config["runs"]:
            lat = r["latency_ms"]
            errors = {k: v for k, v in r["statuses"].items() if k != "200"}
            load = f"c={r['level']:g}" if r["mode"] == "closed" else f"{r['level']:g}/s"
            lines.append(
                f"  {r['workload']:<15}{load:>9}{r['requests_per_s']:>9.0f}{r['items_per_s']:>10.0f}"
                + "".join(f"{lat.get(p, float('nan')):>8.1f}" for p in ("p50", "p90", "p99", "p99.9"))
                + f"{r['formed']['mean_requests_per_batch']:>10.1f}{r['ceiling_items_per_s']:>10.0f}"
                f"{r['efficiency']:>6.2f}{r['worker_cpu_us_per_item']:>8.0f}{r['client_cpu_cores']:>7.2f}"
                f"{'*' if r['client_saturated'] else ' '} {r['client']:<6} {errors or '-'}"
            )
    if results["targets"]:
        lines += ["", "targets:"]
        for t in results["targets"]:
            measured = "n/a" if t["measured"] is None else f"{t['measured']:.3g}"
            lines.append(f"  [{'met' if t['met'] else 'MISSED'}] {t['label']}: {measured} (target {t['target']})")
    lines.append("")
    lines.append("latency in ms; ceiling: in-process items/s of the same artifact at the formed batch "
                 "size; eff = served / ceiling; us/item = the workers' CPU per item answered; client = "
                 "load generator CPU in cores (closed loop: wrk; open loop: Python), * = saturated: the "
                 "client, not the server, may have set the pace")
    return "\n".join(lines) + "\n"
