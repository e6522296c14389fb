"""Training with TorchRec's own delta tracker, then publishing the rows it saw change.

A training job knows which rows it touched: TorchRec's ``ModelDeltaTracker`` (on a
``DistributedModelParallel`` model, ``init_torchrec_delta_tracker``) records the ids each lookup
used. Here the tiny model trains a few steps on one CPU process (gloo, world size 1), starting from
the weights an archive was built with; the ids the tracker returns, with their trained rows, make
a rows file, and the delta tool (``torchrec-serve delta ARCHIVE --rows touched.pt --dense
trained.pt``) a delta of exactly those rows, with the dense weights that trained along. The example
checks that the tracked rows are the rows that changed, and that the archive plus the delta serves
what a fresh build of the trained weights serves.

    .venv/bin/python examples/track_touched_rows.py --out /tmp/tracked
    #   t_user  20 rows tracked, 20 changed, the same rows ...
    #   wrote /tmp/tracked/tiny-00000001.delta: ...; the archive plus it equals a fresh build ...

ID_ONLY tracking works for embedding-bag tables on CPU (EMBEDDING mode is refused for an
EmbeddingBagCollection); asking the tracker when nothing was looked up since the last read
raises, so ``touched_ids`` answers "nothing" instead.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from archive_tools.delta import DeltaSource, make_delta, verify_delta
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import load_spec
from handlers.modeling.spec import ModelSpec

from torchrec import KeyedJaggedTensor  # isort: skip
from torchrec.distributed.model_parallel import DistributedModelParallel  # isort: skip
from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode  # isort: skip

SPEC = Path(__file__).resolve().parent.parent / "config" / "models" / "tiny.yaml"


def batch(spec: ModelSpec, size: int, rng: np.random.Generator) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    """Random dense rows, one id per feature (few distinct ids, so few rows are touched), labels."""
    ids = [rng.integers(0, min(rows, 20), size) for rows in spec.feature_rows]
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=list(spec.feature_names),
        values=torch.from_numpy(np.concatenate(ids)),
        lengths=torch.ones(len(ids) * size, dtype=torch.int32),
    )
    return torch.randn(size, spec.dense_features), sparse, torch.randint(0, 2, (size,)).float()


def plain_checkpoint(model: DistributedModelParallel) -> dict[str, torch.Tensor]:
    """The model's weights as plain tensors (one rank holds every table whole)."""
    return {k: (v.local_shards()[0].tensor if hasattr(v, "local_shards") else v).detach().clone()
            for k, v in model.module.state_dict().items()}


def touched_ids(tracker) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The ids looked up since the last read, per table FQN (empty when there were none)."""
    try:
        return tracker.get_unique_ids()
    except ValueError as e:  # TorchRec 1.8 concatenates an empty list instead of answering "none"
        if "non-empty list of Tensors" in str(e):
            return {}
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where the archive and deltas go (default: a new temporary folder)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.out is None:  # made only when asked for: a default made here would be made on every run
        args.out = Path(tempfile.mkdtemp(prefix="tracked-"))
    args.out.mkdir(parents=True, exist_ok=True)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:  # a free loopback port for the one-process group
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)

    spec = load_spec(SPEC)
    factory = DLRMFactory(spec)
    trained = DistributedModelParallel(factory.float_model(seed=0), device=torch.device("cpu"))  # its own init
    torch.save(plain_checkpoint(trained), args.out / "start.pt")  # what the served archive starts from
    archive = build_archive(SPEC, checkpoint=args.out / "start.pt", seed=0, name="tiny", version="1.0",
                            model_store=args.out, serving=ServingConfig())
    tracker = trained.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY))
    # Large tables train with the optimizer fused into their kernels; the rest (small tables are
    # data-parallel) with plain SGD, which leaves rows without a gradient as they are.
    unfused = [p for p in trained.parameters() if not hasattr(p, "_in_backward_optimizers")]
    dense_optimizer = torch.optim.SGD(unfused, lr=0.01)
    rng = np.random.default_rng(0)
    for _ in range(args.steps):
        dense, sparse, labels = batch(spec, 32, rng)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(trained(dense, sparse).squeeze(1), labels)
        dense_optimizer.zero_grad()
        loss.backward()
        dense_optimizer.step()
        tracker.step()

    checkpoint = plain_checkpoint(trained)
    torch.save(checkpoint, args.out / "trained.pt")
    start = torch.load(args.out / "start.pt", weights_only=True)
    rows = {}
    for fqn, ids in touched_ids(tracker).items():
        table = fqn.rsplit(".", 1)[-1]
        key = f"sparse_arch.embedding_bag_collection.embedding_bags.{table}.weight"
        ids = ids.to(torch.int64).sort().values
        changed = (checkpoint[key] != start[key]).any(dim=1).nonzero().flatten()
        rows[table] = {"ids": ids, "rows": checkpoint[key][ids]}
        print(f"  {table:<12} {len(ids):>4} rows tracked, {len(changed):>4} changed, "
              f"{'the same rows' if torch.equal(ids, changed) else 'NOT the same rows'}")
    torch.save(rows, args.out / "touched.pt")
    assert touched_ids(tracker) == {}, "read already: nothing new"
    source = DeltaSource(rows=args.out / "touched.pt", dense=args.out / "trained.pt")  # the dense layers trained too
    summary = make_delta(archive, source, args.out / "tiny-00000001.delta", 1)
    differing = verify_delta(archive, summary.path, args.out / "trained.pt")
    print(f"wrote {summary.path}: {summary.rows_by_table}; the archive plus it "
          + (f"differs from a fresh build in {differing}" if differing else "equals a fresh build of the trained weights"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
