"""The speed scenarios: the handler against TorchServe's own floor, JSON against binary tensors,
REST against gRPC, served against the in-process ceiling; all in one run, on one server.

    make bench SCENARIO=speed        # the Criteo-shaped model (26 tables of up to 100k rows)
    make bench SCENARIO=speed-1tb    # the Criteo 1TB row counts (177.9M rows)

Writes ``benchmarks/results/SCENARIO/speed.json`` (the keys below), ``summary.txt`` (each target
beside its figure) and ``speed.png``:

* the floor: a no-op handler (``benchmarks/noop_handler.py``) behind the same configuration,
  one item per request, once the frontend is warm (``WARM_UP_S`` of no-op traffic first: a
  fresh JVM answered the first 10 s at a fifth to a half of its later pace, and a floor measured
  then flatters every ratio to it): ``floor_c1_p50_ms`` (batching off, concurrency 1), ``floor_c32_items_per_s``
  and ``floor_c32_p99_ms`` (batch_size 32, 5 ms, concurrency 32), and ``floor_100cand_items_per_s`` (100-candidate JSON
  bodies, answered without work);
* the model, compiled (AOTInductor), one item per request: ``one_item_c1_p50_ms``,
  ``one_item_c32_items_per_s``, ``one_item_c32_p99_ms``; and the same requests in the form that
  TorchServe's DLRM example clients send (``float_features`` flat, lengths and ids
  feature-major: what a user migrating from the example posts),
  ``one_item_c32_items_per_s_example_form`` and its worker CPU, ``example_form_worker_cpu_us_per_item_c32``;
* 100 candidates per request at concurrency 32, batch_size 32: ``json_100cand_items_per_s`` (JSON
  over REST), ``tensor_100cand_items_per_s`` (KServe v2 binary tensors over REST),
  ``grpc_100cand_items_per_s`` (the same bytes over TorchServe's gRPC API), and
  ``ceiling_100cand_items_per_s`` (the handler in process, on the tensor bodies, at the batch size
  TorchServe formed);
* decoding, in process: ``json_decode_us_per_item``, ``tensor_decode_us_per_item``;
* the handler's cost, one item per request at concurrency 32: ``worker_cpu_us_per_item_c32`` (the
  model's worker CPU per item, from /proc), ``floor_worker_cpu_us_per_item_c32`` (the no-op
  worker's: TorchServe's own Python protocol), ``forward_us_per_item_b32`` (the forward alone, in
  process, batch 32) and ``handler_us_per_item_c32`` (the rest: the handler's own, and what the
  forward costs more served than in process); ``served_forward_us_per_item_c32``: the forward as
  served (the worker's time in forwards, from the handler's stage counters), which shares the
  cores and their caches with the frontend and the client; ``inprocess_handler_us_per_item_b32``:
  the handler's own work in process (``ScoringService.handle`` on 32 one-item requests, less the
  forward), and ``inprocess_example_form_handler_us_per_item_b32`` the same on the requests in the
  DLRM example's form;
* reading the frontend's messages, in process, per one-item request: ``torchserve_read_us_per_request``
  (TorchServe's reader, which the no-op floor's worker uses) and ``buffered_read_us_per_request``
  (the handler's ``FrameReader``, which the model's worker uses): the model's worker pays the
  difference less than the floor's protocol, so ``handler_us_per_item_c32`` is the handler's own
  work less that saving, and ``inprocess_handler_us_per_item_b32`` the handler's own alone;
* ``clients``: for each point, the load generator (``wrk`` for REST closed loops, the Python
  client for gRPC), its CPU in cores and whether it was saturated (then the point may be the
  client's pace, not the server's; the plot hatches it).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import orjson  # noqa: E402
from tqdm import tqdm  # noqa: E402

from archive_tools.local_server import HandlerCounters, LocalTorchServe  # noqa: E402
from archive_tools.model_config import ServingConfig  # noqa: E402
from benchmarks.building import NOOP, build, build_noop  # noqa: E402
from benchmarks.inprocess import CeilingProcess, frame_read_us_per_request  # noqa: E402
from benchmarks.load import LoadResult, run_closed_loop_grpc  # noqa: E402
from benchmarks.scenarios import CRITEO_CANDIDATE_FEATURES, MODELS  # noqa: E402
from benchmarks.traffic import Traffic, TrafficModel  # noqa: E402
from benchmarks.worker_cpu import worker_cpu_s  # noqa: E402
from benchmarks.wrk import run_wrk  # noqa: E402
from handlers.modeling.registry import input_schema, load_spec  # noqa: E402
from handlers.runtime.wire.decoder import RequestDecoder  # noqa: E402

TUNED_EXAMPLE_P99_MS = 23.0
WARM_UP_S = 20.0  # no-op traffic at c=32 before the floor: the JVM's compilers settle in 15-20 s here


@dataclasses.dataclass(frozen=True)
class SpeedScenario:
    name: str
    spec: Path
    build_args: tuple[str, ...]
    seconds: float = 10.0  # per load level


SPEED_SCENARIOS = {
    "speed": SpeedScenario("speed", MODELS / "criteo.yaml", ("--artifact", "aoti")),
    "speed-1tb": SpeedScenario(
        "speed-1tb",
        MODELS / "criteo_1tb.yaml",
        ("--init", "quantized", "--archive-format", "no-archive", "--artifact", "aoti"),
    ),
}


def run_speed(scenario: SpeedScenario, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = load_spec(scenario.spec)
    schema = input_schema(spec)
    one_item = TrafficModel(items_per_request=1).generate(spec, 512, seed=1)
    candidates = TrafficModel(
        items_per_request=100, candidate_features=CRITEO_CANDIDATE_FEATURES
    ).generate(spec, 256, seed=2)
    tensors = candidates.as_tensors(schema)
    example_form = one_item.as_example_form(schema)
    figures: dict = {"json_decode_us_per_item": _decode_us_per_item(schema, candidates),
                     "tensor_decode_us_per_item": _decode_us_per_item(schema, tensors)}
    read = frame_read_us_per_request(one_item)
    figures["torchserve_read_us_per_request"] = read["torchserve"]
    figures["buffered_read_us_per_request"] = read["buffered"]
    store = out_dir / "model_store"
    archive = _build(scenario, spec.name, store)
    progress = tqdm(total=11, desc=scenario.name, unit="level")
    with LocalTorchServe(model_store=store) as server:
        points = _Points(server, scenario.seconds, progress)
        figures.update(_floor(points, one_item, candidates))
        formed_one, formed = _served(points, spec.name, (one_item, example_form), candidates, tensors, figures)
    progress.set_postfix_str("in-process ceiling")
    figures["formed_one_item_c32_requests_per_batch"] = formed_one.mean_requests_per_batch
    figures["formed_100cand_requests_per_batch"] = formed.mean_requests_per_batch
    workloads = {"tensor": tensors, "one": one_item, "example": example_form}
    with CeilingProcess(archive, workloads, ServingConfig.intra_op_threads) as ceiling:  # at the batches the server formed
        figures["ceiling_100cand_items_per_s"] = ceiling.items_per_s("tensor", max(1, round(formed.mean_requests_per_batch)))
        figures["forward_us_per_item_b32"] = ceiling.forward_us_per_item("one", 32)
        # the handler's own work on the same batches in process: handle() less the forward
        figures["inprocess_handler_us_per_item_b32"] = (
            1e6 / ceiling.items_per_s("one", 32) - figures["forward_us_per_item_b32"])
        figures["inprocess_example_form_handler_us_per_item_b32"] = (
            1e6 / ceiling.items_per_s("example", 32) - figures["forward_us_per_item_b32"])
    figures["handler_us_per_item_c32"] = (
        figures["worker_cpu_us_per_item_c32"] - figures["floor_worker_cpu_us_per_item_c32"]
        - figures["forward_us_per_item_b32"]
    )
    progress.update()
    progress.close()
    results = {"scenario": scenario.name, "spec": spec.name, **figures, "clients": points.clients,
               "targets": _targets(figures)}
    (out_dir / "speed.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    (out_dir / "summary.txt").write_text(_summary(results))
    _plot(results, out_dir / "speed.png")
    print(_summary(results))
    return results


class _Points:
    """Serves closed-loop points on one TorchServe with wrk, keeping each point's client."""

    def __init__(self, server: LocalTorchServe, seconds: float, progress: tqdm) -> None:
        self.server = server
        self.auth = server.auth("inference")
        self.seconds = seconds
        self.progress = progress
        self.clients: dict = {}  # each point's client: which, its CPU in cores, saturated or not

    def serve(self, point: str, model: str, traffic: Traffic, concurrency: int) -> tuple[LoadResult, float]:
        """The point's result (wrk, closed loop) and its workers' CPU microseconds per item."""
        self.progress.set_postfix_str(point)
        server = self.server
        route = f"v2/models/{model}/infer" if traffic.header_lengths else f"predictions/{model}"
        url = f"{server.inference_url}/{route}"
        run_wrk(url, self.auth, traffic, 4, 2.0)  # warm-up
        before = worker_cpu_s(server.process.pid)
        result = run_wrk(url, self.auth, traffic, concurrency, self.seconds)
        cpu_us_per_item = (worker_cpu_s(server.process.pid) - before) / max(1, result.items) * 1e6
        self.clients[point] = result.client_summary()
        self.progress.update()
        return result, cpu_us_per_item


def _floor(points: _Points, one_item: Traffic, candidates: Traffic) -> dict:
    """The no-op handler's points: TorchServe's own floor, once the frontend is warm."""
    figures: dict = {}
    _register(points.server, NOOP)
    points.progress.set_postfix_str("warm-up")
    points.clients["warm_up"] = run_wrk(
        f"{points.server.inference_url}/predictions/{NOOP}", points.auth, one_item, 32, WARM_UP_S
    ).client_summary()
    points.progress.update()
    figures["floor_c1_p50_ms"] = points.serve("floor_c1", _unbatched(NOOP), one_item, 1)[0].latency_ms["p50"]
    floor, figures["floor_worker_cpu_us_per_item_c32"] = points.serve("floor_c32", NOOP, one_item, 32)
    figures["floor_c32_items_per_s"] = floor.items_per_s
    figures["floor_c32_p99_ms"] = floor.latency_ms["p99"]
    figures["floor_100cand_items_per_s"] = points.serve("floor_100cand", NOOP, candidates, 32)[0].items_per_s
    return figures


def _served(
    points: _Points, model: str, one_forms: tuple[Traffic, Traffic], candidates: Traffic, tensors: Traffic,
    figures: dict,
) -> tuple[HandlerCounters, HandlerCounters]:
    """The model's points, into ``figures``; the handler's counters over the one-item c=32 point
    and over the tensor point (the batches TorchServe formed). ``one_forms``: the one-item
    requests in the items form and in the DLRM example's."""
    server = points.server
    one_item, example_form = one_forms
    _register(server, model)
    figures["one_item_c1_p50_ms"] = points.serve("one_item_c1", _unbatched(model), one_item, 1)[0].latency_ms["p50"]
    before = server.handler_counters(model)
    one, figures["worker_cpu_us_per_item_c32"] = points.serve("one_item_c32", model, one_item, 32)
    formed_one = server.handler_counters(model).minus(before)
    # the forward as served (worker time in forwards): beside the other processes, caches are colder
    figures["served_forward_us_per_item_c32"] = formed_one.forward_ms * 1000 / max(1, formed_one.forward_items)
    figures["one_item_c32_items_per_s"] = one.items_per_s
    figures["one_item_c32_p99_ms"] = one.latency_ms["p99"]
    example, figures["example_form_worker_cpu_us_per_item_c32"] = points.serve(
        "one_item_c32_example_form", model, example_form, 32)
    figures["one_item_c32_items_per_s_example_form"] = example.items_per_s
    figures["json_100cand_items_per_s"] = points.serve("json_100cand", model, candidates, 32)[0].items_per_s
    before = server.handler_counters(model)
    figures["tensor_100cand_items_per_s"] = points.serve("tensor_100cand", model, tensors, 32)[0].items_per_s
    formed = server.handler_counters(model).minus(before)
    points.progress.set_postfix_str("gRPC")
    grpc = _grpc(server, model, tensors, points.seconds)
    figures["grpc_100cand_items_per_s"] = grpc.items_per_s
    points.clients["grpc_100cand"] = grpc.client_summary()
    points.progress.update()
    for name in (model, _unbatched(model)):
        server.management("DELETE", f"/models/{name}").raise_for_status()
    return formed_one, formed


def _grpc(server: LocalTorchServe, model: str, tensors: Traffic, seconds: float) -> LoadResult:
    """``tensors`` sent through TorchServe's gRPC API by 32 concurrent callers (the Python client:
    wrk speaks HTTP/1.1 only)."""
    metadata = [(k.lower(), v) for k, v in server.auth("inference").items()]
    target = f"127.0.0.1:{server.ports['grpc_inference_port']}"
    run_closed_loop_grpc(target, metadata, model, tensors, 4, 2.0, 200)  # warm-up
    return run_closed_loop_grpc(target, metadata, model, tensors, 32, seconds, 10**6)


def _decode_us_per_item(schema, traffic: Traffic, min_time_s: float = 1.0) -> float:
    """Decoding alone, in process: the best of three timings over the traffic's bodies."""
    decoder = RequestDecoder(schema)
    payloads = [traffic.payload(i) for i in range(len(traffic.bodies))]
    items = sum(traffic.items)
    for payload in payloads:
        decoder.decode(payload)
    timings = []
    for _ in range(3):
        rounds, started = 0, time.perf_counter()
        while time.perf_counter() - started < min_time_s:
            for payload in payloads:
                decoder.decode(payload)
            rounds += 1
        timings.append((time.perf_counter() - started) / (rounds * items) * 1e6)
    return min(timings)


def _build(scenario: SpeedScenario, name: str, store: Path) -> Path:
    build(scenario.spec, store, *scenario.build_args)
    build_noop(store)
    unzipped = "no-archive" in scenario.build_args
    return store / (name if unzipped else f"{name}.mar")


def _register(server: LocalTorchServe, model: str) -> None:
    """``model`` registered twice, both kept for the run: batching off (``_unbatched(model)``, for
    the concurrency-1 point) and batch_size 32. Both serve one copy of the tables (it is the
    archive's): registering the model again for each point would copy them anew and free the
    last copy, whose freeing (6 GiB at the Criteo 1TB size) pauses the machine for seconds while
    the next point runs."""
    url = model if (server.model_store / model).is_dir() else f"{model}.mar"
    for name, batch_size in ((_unbatched(model), 1), (model, 32)):
        server.register(url, model_name=name, batch_size=batch_size, max_batch_delay=5).raise_for_status()


def _unbatched(model: str) -> str:
    return f"{model}-unbatched"


def _targets(figures: dict) -> list[dict]:
    def target(label: str, value: float, op: str, bound: float) -> dict:
        met = value >= bound if op == ">=" else value <= bound
        return {"target": label, "measured": value, "op": op, "bound": bound, "met": met}

    return [
        target("tensor decode at least 5x cheaper per item than JSON",
               figures["json_decode_us_per_item"] / figures["tensor_decode_us_per_item"], ">=", 5.0),
        target("100 candidates served at >= 0.9 of the in-process ceiling (best transport)",
               max(figures[k] for k in ("json_100cand_items_per_s", "tensor_100cand_items_per_s",
                                        "grpc_100cand_items_per_s"))
               / figures["ceiling_100cand_items_per_s"], ">=", 0.9),
        target("one item, c=32: >= 0.7 of the no-op floor's items/s",
               figures["one_item_c32_items_per_s"] / figures["floor_c32_items_per_s"], ">=", 0.7),
        target("one item, c=32, in the DLRM example's form: >= 0.9 of the items form's items/s",
               figures["one_item_c32_items_per_s_example_form"] / figures["one_item_c32_items_per_s"], ">=", 0.9),
        target("one item, c=1, batching off: p50 <= the floor's p50 + 0.25 ms",
               figures["one_item_c1_p50_ms"] - figures["floor_c1_p50_ms"], "<=", 0.25),
        target("one item, c=32: the handler's own CPU per item (beyond forward and protocol) <= 25 us",
               figures["handler_us_per_item_c32"], "<=", 25.0),
        target("one item, c=32: p99 <= half the tuned DLRM example's 23 ms",
               figures["one_item_c32_p99_ms"], "<=", TUNED_EXAMPLE_P99_MS / 2),
    ]


def _summary(results: dict) -> str:
    lines = [f"speed, {results['spec']}"]
    for key, value in results.items():
        if isinstance(value, float):
            lines.append(f"  {key:<40}{value:>12,.2f}")
    lines.append("clients (cores; * saturated):")
    for point, client in results["clients"].items():
        mark = "*" if client["saturated"] else " "
        lines.append(f"  {point:<40}{client['client']:>6} {client['cpu_cores']:>6.2f}{mark}")
    lines.append("targets:")
    for t in results["targets"]:
        lines.append(f"  {'met   ' if t['met'] else 'missed'} {t['target']}: {t['measured']:.3g} ({t['op']} {t['bound']:g})")
    return "\n".join(lines) + "\n"


def _plot(results: dict, path: Path) -> None:
    bars = {  # label: (items/s, the point's client, if a served one)
        "no-op floor\n1 item": (results["floor_c32_items_per_s"], "floor_c32"),
        "model\n1 item": (results["one_item_c32_items_per_s"], "one_item_c32"),
        "model, 1 item\nexample form": (results["one_item_c32_items_per_s_example_form"], "one_item_c32_example_form"),
        "no-op floor\n100 cand. JSON": (results["floor_100cand_items_per_s"], "floor_100cand"),
        "JSON\n100 cand.": (results["json_100cand_items_per_s"], "json_100cand"),
        "tensors REST\n100 cand.": (results["tensor_100cand_items_per_s"], "tensor_100cand"),
        "tensors gRPC\n100 cand.": (results["grpc_100cand_items_per_s"], "grpc_100cand"),
        "in-process\nceiling": (results["ceiling_100cand_items_per_s"], None),
    }
    fig, ax = plt.subplots(figsize=(10, 4.5))
    saturated = [point is not None and results["clients"][point]["saturated"] for _, point in bars.values()]
    drawn = ax.bar(list(bars), [value for value, _ in bars.values()],
                   color=["#999", "#37a", "#37a", "#999", "#e83", "#3a5", "#384", "#555"])
    for bar, hatched in zip(drawn, saturated):
        if hatched:
            bar.set_hatch("//")
    if any(saturated):
        ax.text(0.01, 0.97, "hatched: the client was saturated", transform=ax.transAxes, va="top", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("items/s, concurrency 32, batch_size 32")
    ax.set_title(f"{results['spec']}: served throughput by format and transport")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
