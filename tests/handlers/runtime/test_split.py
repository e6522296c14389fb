"""The split model: the sparse and dense parts, captured as graphs of their own and run by the
executor, score exactly as the whole eager model; each part's file holds only its own weights."""

from __future__ import annotations

import dataclasses
import zipfile
from pathlib import Path

import orjson
import pytest
import torch

from archive_tools.capture import capture
from handlers.loading import load_service
from handlers.modeling import tbe
from handlers.modeling.eager import EagerModel, eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import architecture_of, input_schema
from handlers.runtime.artifacts import Artifact
from handlers.runtime.archive_files import INPUTS, TABLES
from handlers.runtime.freshness.layout import TablesLayout
from handlers.runtime.options import HandlerOptions
from handlers.runtime.service import ScoringService
from handlers.runtime.split import SplitModel, SplitPlan, dense_tags, sparse_tags
from tests.helpers import items_request

SIZES = [(1,), (2, 7), (200, 1, 30)]


@pytest.fixture(scope="module", params=["tiny", "ranker"])
def model(request, tiny_spec, tiny_weights, ranker_spec, ranker_weights):
    """(spec, quantized weights, eager service) for DLRM and the context ranker."""
    spec, weights = (tiny_spec, tiny_weights) if request.param == "tiny" else (ranker_spec, ranker_weights)
    return spec, weights, eager_service(spec, DLRMFactory(spec).inference_model(weights))


def _stage(folder: Path, spec, weights) -> Path:
    """An archive's staging folder before capture: spec, weights and where the tables lie, as the
    build writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    spec.to_yaml(folder / "spec.yaml")
    input_schema(spec).save(folder / INPUTS)
    DLRMFactory(spec).save_weights(weights, folder / "weights.pt")
    DLRMFactory(spec).tables_layout(folder / "weights.pt").save(folder)
    return folder


def _requests(spec, service, sizes, seed):
    return [service.decoder.decode(items_request(spec, n, seed=seed + n)).inputs for n in sizes]


def test_parts_compose_to_the_whole_model(model):
    spec, _, eager = model
    sparse, dense = architecture_of(spec).split(eager.model.module)
    tags = eager.schema.tags
    split = ScoringService(
        eager.schema,
        SplitModel(EagerModel(sparse, sparse_tags(tags)), EagerModel(dense, dense_tags(tags)), tags),
    )
    for sizes in SIZES:
        requests = _requests(spec, eager, sizes, seed=3)
        for got, want in zip(split.logits(requests), eager.logits(requests)):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize(
    "plan",
    [SplitPlan(Artifact.EXPORTED, Artifact.EXPORTED), SplitPlan(Artifact.EAGER, Artifact.EXPORTED)],
    ids=["exported+exported", "eager+exported"],
)
def test_captured_parts_score_like_eager(model, plan, tmp_path):
    spec, weights, eager = model
    staging = _stage(tmp_path, spec, weights)
    capture(staging, Artifact.SPLIT, plan)
    kept = {p.name for p in staging.iterdir()}
    assert kept == {"spec.yaml", INPUTS, TABLES, *plan.files}
    served = load_service(staging, HandlerOptions(Artifact.SPLIT, plan))
    for sizes in SIZES:
        requests = _requests(spec, eager, sizes, seed=11)
        for got, want in zip(served.logits(requests), eager.logits(requests)):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_dense_part_compiled_alone_scores_like_eager(tiny_spec, tiny_weights, tmp_path):
    """AOTInductor for the dense part only, behind the exported lookups."""
    eager = eager_service(tiny_spec, DLRMFactory(tiny_spec).inference_model(tiny_weights))
    plan = SplitPlan(sparse=Artifact.EXPORTED, dense=Artifact.AOTI)
    staging = _stage(tmp_path, tiny_spec, tiny_weights)
    capture(staging, Artifact.SPLIT, plan)
    assert {p.name for p in staging.iterdir()} == {"spec.yaml", INPUTS, TABLES, *plan.files}
    assert plan.files == ["sparse.pt2", "dense_aoti.pt2", "dense_aoti_weights.pt"]
    served = load_service(staging, HandlerOptions(Artifact.SPLIT, plan))
    for sizes in ((1,), (64, 3)):
        requests = _requests(tiny_spec, eager, sizes, seed=5)
        for got, want in zip(served.logits(requests), eager.logits(requests)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_each_part_stores_only_its_own_weights(tiny_spec, tiny_weights, tmp_path):
    """The tables are in sparse.pt2 once (as FBGEMM's TBE buffers) and not in dense.pt2; with eager
    lookups, weights.pt keeps the tables and the dense weights are only in the dense part."""
    staging = _stage(tmp_path, tiny_spec, tiny_weights)
    factory = DLRMFactory(tiny_spec)
    loaded = factory.load_weights(staging / "weights.pt")
    table_bytes = sum(b.numel() for b in loaded.buffers)
    dense_bytes = sum(t.numel() * t.element_size() for t in loaded.dense.values())
    del loaded
    capture(staging, Artifact.SPLIT, SplitPlan(Artifact.EXPORTED, Artifact.EXPORTED))
    sparse_data, dense_data = (_tensor_bytes(staging / f"{part}.pt2") for part in ("sparse", "dense"))
    assert table_bytes <= sparse_data <= 1.1 * table_bytes + 4096, (sparse_data, table_bytes)
    assert dense_bytes <= dense_data <= 1.1 * dense_bytes + 4096, (dense_data, dense_bytes)
    # tables.json names the sparse graph's table buffers as the graph does (how deltas find them)
    program = torch.export.load(str(staging / "sparse.pt2"))
    constants = TablesLayout.load(staging).buffer_constants
    assert len(constants) == len(tbe.tbes(factory.lookups(tiny_weights))) > 0
    assert set(constants) <= set(program.constants) | set(program.state_dict), constants

    eager_lookups = _stage(tmp_path / "eager", tiny_spec, tiny_weights)
    capture(eager_lookups, Artifact.SPLIT, SplitPlan(Artifact.EAGER, Artifact.EXPORTED))
    kept = torch.load(eager_lookups / "weights.pt", mmap=True, weights_only=True)
    assert sorted(kept) == [f"tbe.{i}" for i in range(len(kept))], "dense weights left weights.pt"


def _tensor_bytes(pt2: Path) -> int:
    """Bytes of the weights and constants an exported program's zip stores."""
    with zipfile.ZipFile(pt2) as z:
        return sum(
            i.file_size
            for i in z.infolist()
            if ("/data/weights/" in i.filename or "/data/constants/" in i.filename)
            and not i.filename.endswith(".json")
        )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"sparse": "onnx"}, "sparse: unknown artifact 'onnx'"),
        ({"sparse": "split"}, "sparse: must be one of"),
        ({"dense": "eager"}, "dense: must be one of ['aoti', 'exported']"),
        ({"dense_device": "tpu"}, "dense_device: must be one of ['cpu', 'cuda']"),
        ({"dense_device": "cuda"}, "dense_device: cuda needs dense: exported"),
    ],
)
def test_split_plan_names_the_bad_option(options, message):
    with pytest.raises(ValueError) as error:
        SplitPlan.from_options(options)
    assert message in str(error.value)


def test_split_plan_round_trips_through_handler_options():
    plan = SplitPlan(sparse=Artifact.EAGER, dense=Artifact.EXPORTED, dense_device="cuda")
    assert SplitPlan.from_options(plan.to_options()) == plan
    assert SplitPlan.from_options({}) == SplitPlan()


def test_a_dense_part_for_cuda_goes_to_the_workers_gpu(tiny_spec, tiny_weights, tmp_path):
    """The dense part runs on the GPU TorchServe assigned (gpu_id), never on cuda:0 by default;
    without one, loading says why."""
    plan = SplitPlan(Artifact.EXPORTED, Artifact.EXPORTED, dense_device="cuda")
    staging = _stage(tmp_path, tiny_spec, tiny_weights)
    capture(staging, Artifact.SPLIT, plan)  # captured on cpu whatever the serving device
    options = HandlerOptions(Artifact.SPLIT, plan)
    with pytest.raises(RuntimeError, match="assigned this worker no GPU"):
        load_service(staging, options, gpu_id=None)
    if torch.cuda.is_available():
        service = load_service(staging, options, gpu_id=0)
        assert service.model.dense.device == torch.device("cuda", 0)
        on_cpu = load_service(staging, HandlerOptions(Artifact.SPLIT, dataclasses.replace(plan, dense_device="cpu")))
        body = orjson.dumps(items_request(tiny_spec, 6, seed=4))
        scores = [orjson.loads(s.handle([body]).responses[0].body)["scores"] for s in (service, on_cpu)]
        assert scores[0] == pytest.approx(scores[1], abs=1e-5)  # the same graph, its weights on the GPU
    else:
        with pytest.raises(RuntimeError, match="assigned cuda:1, but this worker sees no such GPU"):
            load_service(staging, options, gpu_id=1)


def test_a_split_archive_holds_one_file_per_part():
    with pytest.raises(ValueError, match="one file per part"):
        Artifact.SPLIT.file_name()
