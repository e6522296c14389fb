"""The command line's options, by command: what ``archive_tools.cli`` parses, with every
default shown in ``--help`` (``add_command``), and the typed objects read from them (``bounds``).
The options whose defaults are the build's own (the serving config, the verification bounds, the
artifact kinds) import torch to read them: this module imports them where those options are added,
so that ``serve`` and ``bench`` start without torch."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from archive_tools.verification import Bounds

# ``--artifact distributed`` builds a layout's archives (archive_tools.distributed).
DISTRIBUTED = "distributed"


def delta_args(parser: argparse.ArgumentParser) -> None:
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
    dense = parser.add_mutually_exclusive_group()
    dense.add_argument(
        "--dense", type=Path,
        help="new dense weights to swap in whole: a checkpoint, whole or of the dense weights alone",
    )
    dense.add_argument(
        "--rows-only", action="store_true",
        help="publish --checkpoint's rows without its dense change (without this or --dense, a checkpoint "
        "whose dense weights differ from the archive's is refused)",
    )
    parser.add_argument("--sequence", type=int, required=True, help="its place in the model's delta log: 1, 2, ...")
    parser.add_argument("--name", help="the model name it is registered under (default: the spec's)")
    parser.add_argument(
        "--out", type=Path,
        help="the delta file (default: ARCHIVE's folder/deltas/NAME-SEQUENCE.delta, where publishing finds it)",
    )
    parser.add_argument(
        "--verify", action="store_true",
        help="check what the archive plus it serves (rows, slot owners, dense weights) against a fresh build "
        "from --checkpoint",
    )


def build_args(parser: argparse.ArgumentParser) -> None:
    from archive_tools.pipeline import ARCHIVE_FORMATS
    from handlers.runtime.artifacts import Artifact
    from handlers.runtime.split import DENSE_ARTIFACTS, DEVICES, SPARSE_ARTIFACTS, SplitPlan

    built_alone = (Artifact.EAGER, Artifact.EXPORTED, Artifact.AOTI, Artifact.SPLIT)  # one archive each
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
        choices=[a.value for a in built_alone] + [DISTRIBUTED],
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
    serving_args(parser)
    verification_args(parser)


def serving_args(parser: argparse.ArgumentParser) -> None:
    """TorchServe's settings and ours, written to the archive's model-config.yaml."""
    from archive_tools.model_config import ServingConfig

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


def verify_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("archive", type=Path, help="a .mar, or an unzipped archive folder")
    weights = parser.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", type=Path, help="the trained float state dict it came from")
    weights.add_argument("--seed", type=int, help="the seed it was built from (demo archives)")
    verification_args(parser)


def verification_args(parser: argparse.ArgumentParser) -> None:
    from archive_tools.verification import Bounds

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


def plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", required=True, help="model spec: a YAML file, or a shipped spec's name")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint", type=Path, help="trained float state dict (torch.save)")
    weights.add_argument("--seed", type=int, default=0, help="random weights from this seed (demo)")
    parser.add_argument(
        "--init", choices=("float", "quantized"), default="float",
        help="quantized: seeded random tables made in the spec's dtypes, never in float (a model too large "
        "to hold in float); they are the reference, and tables can only be narrowed",
    )
    parser.add_argument(
        "--data", type=Path, required=True,
        help="labelled data: JSON lines (requests or item records with label/labels) or a Criteo TSV",
    )
    holdout = parser.add_mutually_exclusive_group()
    holdout.add_argument("--holdout", type=Path, help="labelled data to verify the plan on (default: a split of --data)")
    holdout.add_argument(
        "--holdout-share", type=float, default=0.3, help="share of --data's requests held out to verify the plan on"
    )
    parser.add_argument("--max-auc-drop", type=float, default=0.0005, help="budget: AUC drop against the float model")
    parser.add_argument(
        "--max-ne-increase", type=float, default=0.002, help="budget: normalized entropy increase against the float model"
    )
    parser.add_argument(
        "--prune", action="store_true",
        help="also prune each table's least used rows where the budget allows (their ids look up a zero row)",
    )
    parser.add_argument(
        "--counts", type=Path,
        help="with --prune: how often training looked each id up, a torch.save file of {table: int64 [rows]} "
        "(default: the ids' counts in half of the plan split)",
    )
    parser.add_argument("--max-minutes", type=float, default=None, help="stop trying moves after this long")
    parser.add_argument(
        "--out", type=Path, default=Path("plans"),
        help="where NAME.planned.yaml, NAME.plan.json and NAME.plan.png are written",
    )


def serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("archives", nargs="*", help="archives in the model store to register")
    parser.add_argument(
        "--model-store", type=Path, default=Path("model_store"), help="the archives' folder"
    )
    parser.add_argument(
        "--engine", choices=("torchserve", "asgi"), default="torchserve",
        help="torchserve, or asgi: the project's own server (uvicorn), same requests and answers on one port",
    )
    parser.add_argument("--config", type=Path, help="TorchServe config (default: the project's)")
    parser.add_argument(
        "--free-ports", action="store_true",
        help="listen on free ports, not the config's (asgi: not --port or --grpc-port)",
    )
    parser.add_argument("--workers", type=int, help="asgi: server processes (default: one per core)")
    parser.add_argument("--port", type=int, help="asgi: the port of every HTTP route (default: 8080)")
    parser.add_argument(
        "--grpc-port", type=int,
        help="asgi: the Open Inference Protocol's gRPC service (inference.GRPCInferenceService), every "
        "process on this port (default: 8081; 0: no gRPC)",
    )
    parser.add_argument(
        "--host", help="asgi: the address to listen on (default: 127.0.0.1; 0.0.0.0 in a container)"
    )
    parser.add_argument(
        "--key-file", type=Path,
        help="asgi: JSON {\"inference\": {\"key\": ...}}, read if it exists, else written with a new key "
        "(default: keys.json in a new temporary folder)",
    )


def launch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("layout", type=Path, help="layout file: model_store, dense and shards (archive, hosts)")


def bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="smoke, criteo, criteo-1tb, ...")
    parser.add_argument("--out", type=Path, help="output folder (default benchmarks/results/SCENARIO)")
    parser.add_argument(
        "--trace", action="append", default=[], metavar="WORKLOAD=FILE",
        help="replay a JSON-lines trace (one request body per line) instead of generated traffic",
    )
    parser.add_argument("--data", type=Path, nargs="+",
                        help="plan: the click log to plan on (Criteo TSV/CSV files, merged; or libfm files)")


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """An option's default after its help, where it has one and the help does not state it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_command(
    commands: argparse._SubParsersAction,
    chosen: str | None,
    name: str,
    run: Callable[[argparse.Namespace], int],
    help_text: str,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None,
) -> None:
    """The command ``name``, which runs ``run``; its options only if it is the ``chosen`` one."""
    parser = commands.add_parser(name, help=help_text, description=help_text, formatter_class=DefaultsHelp)
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    if add_arguments is not None and name == chosen:
        add_arguments(parser)
    parser.set_defaults(run=run)


def bounds(args: argparse.Namespace) -> Bounds:
    """The verification bounds of a command that verifies (build, verify)."""
    from archive_tools.verification import Bounds

    return Bounds(
        max_abs_score_diff=args.max_score_diff,
        max_rel_score_diff=args.max_rel_score_diff,
        max_auc_drop=args.max_auc_drop,
        max_ne_increase=args.max_ne_increase,
        expected_auc=args.expect_auc,
    )
