"""``torchrec-serve``: the project's commands.

    torchrec-serve build --spec criteo --artifact aoti       # a .mar in model_store/
    torchrec-serve build --spec criteo_1tb --artifact distributed   # shard archives + a dense one
    torchrec-serve launch layout.yaml                         # a distributed layout, one TorchServe per host
    torchrec-serve verify model_store/criteo.mar --seed 0     # an archive against its float model
    torchrec-serve serve model_store/criteo.mar               # TorchServe with our config, until Ctrl-C
    torchrec-serve delta model_store/criteo.mar --checkpoint trained-2.pt --sequence 1
                                                              # changed rows, to publish
    torchrec-serve plan --spec criteo --checkpoint trained.pt --data eval.tsv
                                                              # each table's dtype, under an AUC budget
    torchrec-serve bench criteo                               # a benchmark scenario
    torchrec-serve spec-docs                                  # regenerate the spec's schema and docs

A failure prints one line on stderr naming the problem (``--debug`` shows the traceback) and exits
with a code per kind of failure, so scripts can tell them apart: see ``EXIT_CODES``. Anything
else that escapes a command is the project's own fault: one line says it is an internal error,
and the exit code is 1.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import gc
import signal
import subprocess
import sys
import time
from pathlib import Path

from archive_tools import cli_args
from archive_tools.cli_args import DISTRIBUTED

# Exit codes, one per kind of failure the user can act on (2 is also argparse's, for a bad
# command line); the first class that matches wins. Anything else is an internal error: 1. Each
# command imports what it runs (torch, for most), so that ``serve`` and ``bench`` start without
# it: a class is named by its module, and one whose module was never imported was never raised.
EXIT_CODES = {
    "handlers.modeling.errors:SpecError": 3,
    "handlers.modeling.errors:CheckpointError": 4,
    "archive_tools.validation_data:ValidationDataError": 5,
    "archive_tools.local_server:ServerDied": 6,
    "archive_tools.local_server:PortTaken": 6,
    "archive_tools.plugin:PluginBuildError": 6,
    "builtins:FileNotFoundError": 7,
    "builtins:FileExistsError": 7,
    "archive_tools.pipeline:VerificationFailed": 8,
    "archive_tools.model_errors:ModelRaised": 9,
    "handlers.runtime.errors:InputError": 2,
}
INTERNAL_ERROR = 1


def exit_code(error: Exception) -> int:
    """The code of the first class in ``EXIT_CODES`` that ``error`` is an instance of."""
    for where, code in EXIT_CODES.items():
        module, name = where.split(":")
        kind = getattr(sys.modules.get(module), name, None)
        if kind is not None and isinstance(error, kind):
            return code
    return INTERNAL_ERROR


# At exit the interpreter's last collections walk every object still alive (torch's import alone
# makes 350k): frozen first, they are skipped, 0.85 s of a command's 4.8 here.
atexit.register(gc.freeze)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Parsing imports what the chosen command's options default to (torch and the build pipeline,
    # for most): with the collector paused, the full collections that their new objects trigger do
    # not walk torch's again and again (`torchrec-serve build --help`: 3.3 CPU-seconds, 2.8 paused).
    gc.disable()
    try:
        args = _parser(_chosen_command(argv)).parse_args(argv)
    finally:
        gc.enable()
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as error:
        if args.debug:
            raise
        code = exit_code(error)
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
    from archive_tools.build import build_archive
    from archive_tools.distributed import build_distributed
    from archive_tools.model_config import ServingConfig
    from archive_tools.resources import spec_path
    from handlers.runtime.artifacts import Artifact
    from handlers.runtime.errors import InputError
    from handlers.runtime.split import SplitPlan

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
        "bounds": cli_args.bounds(args),
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
    from archive_tools.delta import DeltaSource, make_delta, verify_delta
    from archive_tools.distributed import split_delta
    from archive_tools.pipeline import VerificationFailed
    from handlers.runtime.archive import Archive
    from handlers.runtime.errors import InputError

    with Archive.open(args.archive) as archive:
        is_dense = archive.options.remote is not None
    if is_dense:
        if args.rows is None or args.checkpoint or args.dense or args.rows_only or args.out or args.name:
            raise InputError(
                f"{args.archive} is a distributed layout's dense archive: its tables are on its shards; "
                "give --rows (and --sequence) alone, and the delta is split into one per shard"
            )
        for summary in split_delta(args.archive, args.rows, args.sequence):
            rows = ", ".join(f"{t} {n:,}" for t, n in summary.rows_by_table.items()) or "no rows"
            print(f"wrote {summary.path} ({rows}; {summary.bytes / 2**20:.1f} MiB)", file=sys.stderr)
        return 0
    source = DeltaSource(checkpoint=args.checkpoint, rows=args.rows, dense=args.dense, rows_only=args.rows_only)
    out = args.out or args.archive.parent / "deltas" / f"{args.archive.name.split('.')[0]}-{args.sequence:08d}.delta"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = make_delta(args.archive, source, out, args.sequence, name=args.name)
    for table, rows in summary.rows_by_table.items():
        moved = f", {summary.moved_by_table[table]:,} of their slots to new owners" if table in summary.moved_by_table else ""
        print(f"  {table:<24}{rows:>12,} rows{moved}", file=sys.stderr)
    if summary.dense_tensors:
        print(f"  dense weights: {summary.dense_tensors} tensors, swapped whole", file=sys.stderr)
    print(f"wrote {summary.path} ({sum(summary.rows_by_table.values()):,} rows, "
          f"{summary.bytes / 2**20:.1f} MiB)", file=sys.stderr)
    if args.verify:
        if args.checkpoint is None:
            raise InputError("--verify compares with a fresh build from --checkpoint")
        differing = verify_delta(args.archive, summary.path, args.checkpoint, rows_only=args.rows_only)
        if differing:
            raise VerificationFailed(f"the archive plus this delta differs from a fresh build in {', '.join(differing)}")
        print(_verified(args.rows_only, summary.dense_tensors > 0), file=sys.stderr)
    return 0


def _verified(rows_only: bool, carries_dense: bool) -> str:
    """What ``delta --verify`` checked, dense weights included or said to be left out."""
    if rows_only:
        dense = ("; its dense weights left out (--rows-only): the model keeps those it serves (the archive's, or "
                 "an earlier delta's)")
    elif carries_dense:
        dense = ", and its dense weights, which this delta swaps in"
    else:
        dense = ", and its dense weights, unchanged from the archive's"
    return ("verified: the archive plus this delta serves the rows (and slot owners) of a fresh build, byte for "
            f"byte{dense}")


def _verify(args: argparse.Namespace) -> int:
    """The archive, loaded as a worker loads it, against the float model of its own spec with
    the given weights, on validation data."""
    from archive_tools.pipeline import VerificationFailed
    from archive_tools.validation_data import read_validation
    from archive_tools.verification import generated_validation, verify
    from handlers.loading import load_archive
    from handlers.modeling.checkpoint import read_checkpoint
    from handlers.modeling.eager import eager_service
    from handlers.modeling.factory import DLRMFactory
    from handlers.modeling.registry import archive_spec
    from handlers.runtime.archive import Archive

    with Archive.open(args.archive) as archive:
        spec = archive_spec(archive)
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
        report = verify(served, reference, data, cli_args.bounds(args))
    for line in report.lines("float"):
        print(line)
    if not report.passed:
        raise VerificationFailed(f"{args.archive}: " + "; ".join(report.failures))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from archive_tools.planning import Budget, plan_tables
    from archive_tools.resources import spec_path
    from archive_tools.verification import Bounds
    from handlers.runtime.errors import InputError

    if args.max_auc_drop <= 0 or args.max_ne_increase <= 0:
        raise InputError("--max-auc-drop and --max-ne-increase: a budget must be above 0")
    outputs = plan_tables(
        spec_path(args.spec),
        args.data,
        Budget(args.max_auc_drop, args.max_ne_increase),
        args.out,
        checkpoint=args.checkpoint,
        seed=args.seed,
        holdout_path=args.holdout,
        holdout_share=args.holdout_share,
        max_minutes=args.max_minutes,
        prune=args.prune,
        counts_path=args.counts,
        quantized_init=args.init == "quantized",
    )
    for path in (outputs.spec, outputs.pruning, outputs.report, outputs.plot):
        if path is not None:
            print(f"wrote {path}", file=sys.stderr)
    if not outputs.search.planned.within_budget:
        print("the budget does not hold on the held-out data even with every table at its widest dtype: "
              "raise it, or serve the dense layers in a wider precision", file=sys.stderr)
        return 8
    weights = f"--checkpoint {args.checkpoint}" if args.checkpoint else f"--seed {args.seed}"
    weights += " --init quantized" if args.init == "quantized" else ""
    # The build's gate checks the plan again; a plan spends its budget on AUC and NE, so scores may
    # move by more than the gate's default --max-score-diff: half again what the held-out data showed.
    score_diff = max(Bounds.max_abs_score_diff, float(f"{outputs.search.planned.max_abs_score_diff * 1.5:.1e}"))
    print(
        f"build it: torchrec-serve build --spec {outputs.spec} {weights} --validation {args.holdout or args.data} "
        f"--max-auc-drop {args.max_auc_drop:g} --max-ne-increase {args.max_ne_increase:g} --max-score-diff {score_diff:g}",
        file=sys.stderr,
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    """TorchServe with our configuration; the archives registered; until Ctrl-C (or SIGTERM: the
    server is stopped either way, never left running)."""
    if args.engine == "asgi":
        from archive_tools.asgi_engine import serve_asgi  # uvicorn and Starlette: for this engine only

        return serve_asgi(args)
    from archive_tools.local_server import LocalTorchServe
    from handlers.runtime.errors import InputError

    asgi_only = ("workers", "port", "grpc_port", "host", "key_file")
    given = [f"--{n.replace('_', '-')}" for n in asgi_only if getattr(args, n) is not None]
    if given:
        raise InputError(f"{', '.join(given)}: only with --engine asgi (TorchServe's come from --config)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
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
    from archive_tools.launcher import LayoutFile, LocalLayout

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
    command += ["--data", *map(str, args.data)] if args.data else []
    return subprocess.call(command)


def _spec_docs(args: argparse.Namespace) -> int:
    from archive_tools.spec_docs import write_spec_docs

    for path in write_spec_docs():
        print(f"wrote {path}")
    return 0


# -- the command line ------------------------------------------------------------------------------


def _chosen_command(argv: list[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option (``--debug`` takes no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def _parser(chosen: str | None) -> argparse.ArgumentParser:
    """Every command, with the options of ``chosen`` alone: adding a command's options imports
    what their defaults come from."""
    parser = argparse.ArgumentParser(
        prog="torchrec-serve",
        description="Build, verify, serve and benchmark TorchRec models on TorchServe.",
        epilog="exit codes: 0 ok, 1 internal error (a bug: --debug shows it), 2 bad arguments, 3 bad "
        "spec, 4 checkpoint does not match, 5 bad validation file, 6 TorchServe failed, 7 missing or "
        "existing file, 8 verification failed (plan: the budget does not hold), 9 the model raised (its "
        "own code, on a request the build made or read)",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add = functools.partial(cli_args.add_command, commands, chosen)
    add("build", _build, "build a .mar (or archive folder) from a spec", cli_args.build_args)
    add("verify", _verify, "check an archive against its float model", cli_args.verify_args)
    add("serve", _serve, "run TorchServe with the project's config", cli_args.serve_args)
    add("launch", _launch, "start a distributed layout here, one TorchServe per host", cli_args.launch_args)
    add("delta", _delta, "write a delta of changed table rows for a served archive", cli_args.delta_args)
    add("plan", _plan, "choose each table's dtype under an accuracy budget", cli_args.plan_args)
    add("bench", _bench, "run a benchmark scenario", cli_args.bench_args)
    add("spec-docs", _spec_docs, "regenerate spec.schema.json and SPEC.md", None)
    return parser


if __name__ == "__main__":
    sys.exit(main())
