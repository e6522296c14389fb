"""``torchrec-serve``: the project's commands.

    torchrec-serve build --spec criteo --artifact aoti       # a .mar in model_store/
    torchrec-serve build --spec criteo_1tb --artifact distributed   # shard archives + a dense one
    torchrec-serve launch layout.yaml                         # a distributed layout, one TorchServe per host
    torchrec-serve verify model_store/criteo.mar --seed 0     # an archive against its float model
    torchrec-serve serve model_store/criteo.mar               # TorchServe with our config, until Ctrl-C
    torchrec-serve delta model_store/criteo.mar --checkpoint trained-2.pt --sequence 1
                                                              # changed rows, to publish
    torchrec-serve bench criteo                               # a benchmark scenario
    torchrec-serve spec-docs                                  # regenerate the spec's schema and docs

A failure prints one line on stderr naming the problem (``--debug`` shows the traceback) and exits
with a code per kind of failure, so scripts can tell them apart: see ``EXIT_CODES``. Anything
else that escapes a command is the project's own fault: one line says it is an internal error,
and the exit code is 1.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from archive_tools.pipeline import ARCHIVE_FORMATS, VerificationFailed
from archive_tools.delta import DeltaSource, make_delta, verify_delta
from archive_tools.distributed import build_distributed, split_delta
from archive_tools.launcher import LayoutFile, LocalLayout
from archive_tools.local_server import LocalTorchServe, PortTaken, ServerDied
from archive_tools.resources import spec_path
from archive_tools.validation_data import ValidationDataError, read_validation
from archive_tools.verification import Bounds, generated_validation, verify
from handlers.loading import load_archive
from handlers.modeling.checkpoint import read_checkpoint
from handlers.modeling.eager import eager_service
from handlers.modeling.errors import CheckpointError, SpecError
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import load_spec
from handlers.runtime.archive import Archive
from handlers.runtime.archive_files import SPEC
from handlers.runtime.artifacts import Artifact
from handlers.runtime.errors import InputError
from handlers.runtime.split import DENSE_ARTIFACTS, DEVICES, SPARSE_ARTIFACTS, SplitPlan

# What --artifact builds as one archive; ``distributed`` builds a layout's (archive_tools.distributed).
BUILT_ALONE = (Artifact.EAGER, Artifact.EXPORTED, Artifact.AOTI, Artifact.SPLIT)
DISTRIBUTED = "distributed"

# Exit codes, one per kind of failure the user can act on (2 is also argparse's, for a bad
# command line); the first class that matches wins. Anything else is an internal error: 1.
EXIT_CODES = {
    SpecError: 3,
    CheckpointError: 4,
    ValidationDataError: 5,
    ServerDied: 6,
    PortTaken: 6,
    FileNotFoundError: 7,
    FileExistsError: 7,
    VerificationFailed: 8,
    InputError: 2,
}
INTERNAL_ERROR = 1


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as error:
        if args.debug:
            raise
        code = next((code for cls, code in EXIT_CODES.items() if isinstance(error, cls)), INTERNAL_ERROR)
        if code == INTERNAL_ERROR:
            first_line = (str(error).strip().splitlines() or [""])[0]
            print(
                f"torchrec-serve {args.command}: internal error: {type(error).__name__}: {first_line} "
                "(a bug in torchrec-serve; --debug shows the traceback)",
                file=sys.stderr,
            )
        else:
            print(f"torchrec-serve {args.command}: error: {error}", file=sys.stderr)
        return code


# -- the commands --------------------------------------------------------------------------------


def _build(args: argparse.Namespace) -> int:
    if args.init == "quantized" and args.checkpoint is not None:
        raise InputError("--init quantized makes random tables; it does not read --checkpoint")
    serving = ServingConfig(
        batch_size=args.batch_size,
        max_batch_delay_ms=args.max_batch_delay,
        workers=args.workers,
        intra_op_threads=args.intra_op_threads,
        parallel_from_items=args.parallel_from_items,
        metrics_flush_s=args.metrics_flush,
        max_queue_wait_ms=args.max_queue_wait_ms,
        hang_after_ms=args.hang_after_ms,
        delta_rows_per_s=args.delta_rows_per_s,
    )
    common = {  # what every build takes: the weights, the names, where it goes, how it is checked
        "checkpoint": args.checkpoint,
        "seed": args.seed,
        "name": args.name,
        "version": args.version,
        "model_store": args.model_store,
        "serving": serving,
        "bounds": _bounds(args),
        "validation": args.validation,
        "quantized_init": args.init == "quantized",
        "archive_format": args.archive_format,
    }
    if args.artifact == DISTRIBUTED:
        if args.sparse is not None or args.dense_device is not None:
            raise InputError(
                "--sparse/--dense-device: a distributed layout's shards serve eager lookups, its "
                "dense part runs on cpu"
            )
        build_distributed(spec_path(args.spec), dense=Artifact(args.dense or Artifact.AOTI.value), **common)
        return 0
    artifact = Artifact(args.artifact)
    split_options = {"sparse": args.sparse, "dense": args.dense, "dense_device": args.dense_device}
    given = {k: v for k, v in split_options.items() if v is not None}
    if given and artifact != Artifact.SPLIT:
        raise InputError(f"--{'/--'.join(given).replace('_', '-')}: only with --artifact split")
    build_archive(
        spec_path(args.spec),
        artifact=artifact,
        split=SplitPlan.from_options(given) if artifact == Artifact.SPLIT else None,
        compare_precisions=args.compare_dense_precisions,
        **common,
    )
    return 0


def _delta(args: argparse.Namespace) -> int:
    with Archive.open(args.archive) as archive:
        is_dense = archive.options.remote is not None
    if is_dense:
        if args.rows is None or args.checkpoint or args.dense or args.out or args.name:
            raise InputError(
                f"{args.archive} is a distributed layout's dense archive: its tables are on its shards; "
                "give --rows (and --sequence) alone, and the delta is split into one per shard"
            )
        for summary in split_delta(args.archive, args.rows, args.sequence):
            rows = ", ".join(f"{t} {n:,}" for t, n in summary.rows_by_table.items()) or "no rows"
            print(f"wrote {summary.path} ({rows}; {summary.bytes / 2**20:.1f} MiB)", file=sys.stderr)
        return 0
    source = DeltaSource(checkpoint=args.checkpoint, rows=args.rows, dense=args.dense)
    out = args.out or args.archive.parent / "deltas" / f"{args.archive.name.split('.')[0]}-{args.sequence:08d}.delta"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = make_delta(args.archive, source, out, args.sequence, name=args.name)
    for table, rows in summary.rows_by_table.items():
        print(f"  {table:<24}{rows:>12,} rows", file=sys.stderr)
    if summary.dense_tensors:
        print(f"  dense weights: {summary.dense_tensors} tensors, swapped whole", file=sys.stderr)
    print(f"wrote {summary.path} ({sum(summary.rows_by_table.values()):,} rows, "
          f"{summary.bytes / 2**20:.1f} MiB)", file=sys.stderr)
    if args.verify:
        if args.checkpoint is None:
            raise InputError("--verify compares with a fresh build from --checkpoint")
        differing = verify_delta(args.archive, summary.path, args.checkpoint)
        if differing:
            raise VerificationFailed(f"the archive plus this delta differs from a fresh build in tables {differing}")
        print("verified: the archive plus this delta holds the rows of a fresh build, byte for byte", file=sys.stderr)
    return 0


def _delta_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "archive", type=Path,
        help="the served archive (.mar or folder) the delta applies to; a distributed layout's dense "
        "archive: one delta per shard, from --rows",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", type=Path, help="a newer trained checkpoint (as build takes it)")
    source.add_argument(
        "--rows", type=Path,
        help="changed rows: torch.save({table: {'ids': int64 [n], 'rows': float [n, dim]}})",
    )
    parser.add_argument(
        "--dense", type=Path,
        help="new dense weights to swap in whole: a checkpoint, whole or of the dense weights alone",
    )
    parser.add_argument("--sequence", type=int, required=True, help="its place in the model's delta log: 1, 2, ...")
    parser.add_argument("--name", help="the model name it is registered under (default: the spec's)")
    parser.add_argument(
        "--out", type=Path,
        help="the delta file (default: ARCHIVE's folder/deltas/NAME-SEQUENCE.delta, where publishing finds it)",
    )
    parser.add_argument("--verify", action="store_true", help="check it against a fresh build from --checkpoint")


def _verify(args: argparse.Namespace) -> int:
    """The archive, loaded as a worker loads it, against the float model of its own spec with
    the given weights, on validation data."""
    with Archive.open(args.archive) as archive:
        spec = load_spec(archive.file(SPEC))
        factory = DLRMFactory(spec)
        reference_model = factory.float_model(seed=args.seed)
        if args.checkpoint is not None:
            factory.load_checkpoint(reference_model, read_checkpoint(args.checkpoint))
        reference = eager_service(spec, reference_model)
        served = load_archive(archive)
        data = (
            read_validation(args.validation, spec)
            if args.validation is not None
            else generated_validation(spec, reference, 64, 16, args.seed or 0)
        )
        report = verify(served, reference, data, _bounds(args))
    for line in report.lines("float"):
        print(line)
    if not report.passed:
        raise VerificationFailed(f"{args.archive}: " + "; ".join(report.failures))
    return 0


def _serve(args: argparse.Namespace) -> int:
    """TorchServe with our configuration; the archives registered; until Ctrl-C."""
    store = args.model_store.resolve()
    with LocalTorchServe(model_store=store, config=args.config, free_ports=args.free_ports) as server:
        print(f"TorchServe: inference {server.inference_url}, management {server.management_url}, "
              f"metrics {server.metrics_url}")
        print(f"keys (Authorization: Bearer <key>): {server.workdir / 'key_file.json'}")
        for archive in args.archives:
            started = time.perf_counter()
            response = server.register(Path(archive).name)
            if response.status_code != 200:
                raise InputError(f"registering {archive}: {response.status_code} {response.text}")
            print(f"registered {archive} in {time.perf_counter() - started:.1f}s")
        print("serving; Ctrl-C stops the server")
        while True:
            server.check_alive()
            time.sleep(1.0)


def _launch(args: argparse.Namespace) -> int:
    """A distributed layout on this machine: every host started and registered; until Ctrl-C (or
    SIGTERM: every host is stopped either way)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with LocalLayout(LayoutFile.read(args.layout)) as layout:
        for line in layout.describe():
            print(line)
        print("serving; Ctrl-C stops every host")
        while True:
            for server in layout.dense + [s for servers in layout.shards.values() for s in servers]:
                server.check_alive()
            time.sleep(1.0)


def _bench(args: argparse.Namespace) -> int:
    """The benchmark package runs on top of this one (it builds archives with it), so it runs as
    a process of its own: ``python -m benchmarks``."""
    command = [sys.executable, "-m", "benchmarks", args.scenario]
    command += ["--out", str(args.out)] if args.out else []
    for trace in args.trace:
        command += ["--trace", trace]
    return subprocess.call(command)


def _spec_docs(args: argparse.Namespace) -> int:
    from archive_tools.spec_docs import write_spec_docs

    for path in write_spec_docs():
        print(f"wrote {path}")
    return 0


# -- the command line ------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrec-serve",
        description="Build, verify, serve and benchmark TorchRec models on TorchServe.",
        epilog="exit codes: 0 ok, 1 internal error (a bug: --debug shows it), 2 bad arguments, 3 bad "
        "spec, 4 checkpoint does not match, 5 bad validation file, 6 TorchServe failed, 7 missing or "
        "existing file, 8 verification failed",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _command(commands, "build", _build, "build a .mar (or archive folder) from a spec", _build_args)
    _command(commands, "verify", _verify, "check an archive against its float model", _verify_args)
    _command(commands, "serve", _serve, "run TorchServe with the project's config", _serve_args)
    _command(commands, "launch", _launch, "start a distributed layout here, one TorchServe per host", _launch_args)
    _command(commands, "delta", _delta, "write a delta of changed table rows for a served archive", _delta_args)
    _command(commands, "bench", _bench, "run a benchmark scenario", _bench_args)
    _command(commands, "spec-docs", _spec_docs, "regenerate spec.schema.json and SPEC.md", None)
    return parser


def _command(
    commands: argparse._SubParsersAction,
    name: str,
    run: Callable[[argparse.Namespace], int],
    help_text: str,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None,
) -> None:
    parser = commands.add_parser(
        name, help=help_text, description=help_text,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    if add_arguments is not None:
        add_arguments(parser)
    parser.set_defaults(run=run)


def _build_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec", required=True, help="model spec: a YAML file, or a shipped spec's name (criteo)"
    )
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint", type=Path, help="trained float state dict (torch.save)")
    weights.add_argument("--seed", type=int, default=0, help="random weights from this seed (demo)")
    parser.add_argument(
        "--init",
        choices=("float", "quantized"),
        default="float",
        help="float: a float model (checkpoint or seed), quantized and verified against it; "
        "quantized: seeded random tables made in their served dtypes, never in float (huge models)",
    )
    parser.add_argument(
        "--artifact",
        choices=[a.value for a in BUILT_ALONE] + [DISTRIBUTED],
        default=Artifact.EAGER.value,
        help="what the archive serves: aoti (AOTInductor package), exported (torch.export program), "
        "eager (TorchRec modules on memory-mapped weights), split (a sparse and a dense part, "
        "see --sparse / --dense), or distributed (an archive per embedding shard named by the "
        "spec's tables[].shard, and a dense archive calling them: NAME-<shard>, NAME-dense)",
    )
    defaults = SplitPlan()
    parser.add_argument(
        "--sparse",
        choices=[a.value for a in SPARSE_ARTIFACTS],
        help=f"split: the embedding lookups as (default {defaults.sparse.value}); eager keeps the "
        "tables in the memory-mapped weights.pt, for tables of many GB",
    )
    parser.add_argument(
        "--dense",
        choices=[a.value for a in DENSE_ARTIFACTS],
        help=f"split, distributed: the dense layers as (default {defaults.dense.value})",
    )
    parser.add_argument(
        "--dense-device",
        choices=DEVICES,
        help=f"split: where the dense part runs (default {defaults.dense_device}; cuda needs "
        "--dense exported)",
    )
    parser.add_argument(
        "--archive-format",
        choices=ARCHIVE_FORMATS,
        default="default",
        help="default: a zipped NAME.mar; no-archive: a folder NAME/ (no compression, no unpacking)",
    )
    parser.add_argument(
        "--compare-dense-precisions", action="store_true",
        help="also time every dense precision for the MLPs, check each against the float model, "
        "and print the fastest that passes (for one item and for large batches)",
    )
    parser.add_argument("--name", help="model name (default: the spec's name)")
    parser.add_argument("--version", default="1.0", help="model version")
    parser.add_argument(
        "--model-store", type=Path, default=Path("model_store"), help="where the archive goes"
    )
    parser.add_argument(
        "--batch-size", type=int, default=ServingConfig.batch_size,
        help="TorchServe batchSize: requests coalesced into one forward at most",
    )
    parser.add_argument(
        "--max-batch-delay", type=int, default=ServingConfig.max_batch_delay_ms,
        help="TorchServe maxBatchDelay, ms: how long a batch waits to fill",
    )
    parser.add_argument("--workers", type=int, default=ServingConfig.workers, help="workers per model")
    parser.add_argument(
        "--intra-op-threads", type=int, default=ServingConfig.intra_op_threads,
        help="torch intra-op threads for a large forward",
    )
    parser.add_argument(
        "--parallel-from-items", type=int, default=ServingConfig.parallel_from_items,
        help="a forward of fewer items runs on one thread (0: every forward on --intra-op-threads)",
    )
    parser.add_argument(
        "--metrics-flush", type=float, default=ServingConfig.metrics_flush_s,
        help="seconds between the worker's metric updates (0: every batch)",
    )
    parser.add_argument(
        "--max-queue-wait-ms", type=int, default=ServingConfig.max_queue_wait_ms,
        help="admission control: overloaded, requests that would wait longer get a fast 503 "
        "(0: four times the measured batch time, at least 100 ms)",
    )
    parser.add_argument(
        "--hang-after-ms", type=int, default=ServingConfig.hang_after_ms,
        help="a worker that runs one batch this long is restarted, the batch answered 503 "
        "(0: 20 times the measured batch time, at least 2000 ms)",
    )
    parser.add_argument(
        "--delta-rows-per-s", type=float, default=ServingConfig.delta_rows_per_s,
        help="the pace at which a published delta's rows are written into the served tables",
    )
    _verification_args(parser)


def _verify_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("archive", type=Path, help="a .mar, or an unzipped archive folder")
    weights = parser.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", type=Path, help="the trained float state dict it came from")
    weights.add_argument("--seed", type=int, help="the seed it was built from (demo archives)")
    _verification_args(parser)


def _verification_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--validation",
        type=Path,
        help="validation data: JSON lines (requests or item records with label/labels) or a Criteo "
        "TSV (default: requests generated from the spec, labelled by the reference)",
    )
    parser.add_argument(
        "--max-score-diff",
        type=float,
        default=Bounds.max_abs_score_diff,
        help="refuse if any validation score differs from the reference's by more",
    )
    parser.add_argument("--max-rel-score-diff", type=float, default=None, help="same, relative")
    parser.add_argument(
        "--max-auc-drop", type=float, default=Bounds.max_auc_drop,
        help="refuse if the AUC on labelled validation data drops by more",
    )
    parser.add_argument(
        "--max-ne-increase", type=float, default=Bounds.max_ne_increase,
        help="refuse if the normalized entropy on labelled validation data rises by more",
    )
    parser.add_argument(
        "--expect-auc", type=float, default=None,
        help="the training evaluation's AUC: refuse if the served AUC falls below it by more "
        "than --max-auc-drop",
    )


def _bounds(args: argparse.Namespace) -> Bounds:
    return Bounds(
        max_abs_score_diff=args.max_score_diff,
        max_rel_score_diff=args.max_rel_score_diff,
        max_auc_drop=args.max_auc_drop,
        max_ne_increase=args.max_ne_increase,
        expected_auc=args.expect_auc,
    )


def _serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("archives", nargs="*", help="archives in the model store to register")
    parser.add_argument(
        "--model-store", type=Path, default=Path("model_store"), help="the archives' folder"
    )
    parser.add_argument("--config", type=Path, help="TorchServe config (default: the project's)")
    parser.add_argument(
        "--free-ports", action="store_true", help="listen on free ports, not the config's"
    )


def _launch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("layout", type=Path, help="layout file: model_store, dense and shards (archive, hosts)")


def _bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="smoke, criteo, criteo-1tb, ...")
    parser.add_argument("--out", type=Path, help="output folder (default benchmarks/results/SCENARIO)")
    parser.add_argument(
        "--trace", action="append", default=[], metavar="WORKLOAD=FILE",
        help="replay a JSON-lines trace (one request body per line) instead of generated traffic",
    )


if __name__ == "__main__":
    sys.exit(main())
