"""DLRMv2 (``dlrm_dcn``), the third architecture, added through its module alone: spec, quantized
within bounds, batched == solo, exported and compiled graphs equal eager, and an AOTInductor archive
served by a real TorchServe answering like the in-process model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from archive_tools.export import compile_aoti, export_model
from archive_tools.local_server import LocalTorchServe
from handlers.modeling.eager import eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import load_spec
from handlers.modeling.spec import WeightDtype
from handlers.runtime.artifacts import Artifact, GraphModel
from tests.conftest import MODELS
from tests.helpers import (
    QUANTIZATION_TOLERANCE,
    archive_service,
    float_scores,
    forward,
    items_request,
    model_inputs,
    with_tables,
)

DLRM_V2 = MODELS / "dlrm_v2.yaml"

# Largest |score - float score| over 128 multi-hot items of the MLPerf-shaped model (tables capped
# at 1,000 rows), worst over seeds 0-2: int8 1.9e-5, int4 2.4e-4, fp16 1.1e-6; ~10x headroom.
SCORE_BOUND = {WeightDtype.INT8: 2e-4, WeightDtype.INT4: 3e-3, WeightDtype.FP16: 1e-5}


@pytest.fixture(scope="module")
def spec():
    """The shipped DLRMv2 spec with its tables capped at 1,000 rows, to build in seconds."""
    shipped = load_spec(DLRM_V2)
    return shipped.replace(tables=[t.model_copy(update={"rows": min(t.rows, 1000)}) for t in shipped.tables])


@pytest.fixture(scope="module")
def weights(spec):
    factory = DLRMFactory(spec)
    return factory.quantize(factory.float_model(seed=0))


def test_shipped_spec_is_the_mlperf_shape():
    spec = load_spec(DLRM_V2)
    assert spec.architecture == "dlrm_dcn"
    assert (spec.dcn_num_layers, spec.dcn_low_rank_dim) == (3, 512)
    assert spec.bottom_mlp == (512, 256, 128) and spec.top_mlp == (1024, 1024, 512, 256, 1)
    assert {t.dim for t in spec.tables} == {128} and len(spec.feature_names) == 26


@pytest.mark.parametrize("dtype", list(SCORE_BOUND))
def test_quantized_scores_within_bound_of_float(spec, dtype):
    spec = with_tables(spec, weight_dtype=dtype)
    factory = DLRMFactory(spec)
    float_model = factory.float_model(seed=1)
    served = factory.inference_model(factory.quantize(float_model))
    assert type(served.inter_arch).__name__ == "InteractionDCNArch"
    inputs = model_inputs(spec, [items_request(spec, 128, seed=11, max_bag=8)])
    diff = (torch.sigmoid(forward(served, spec, inputs)) - torch.sigmoid(forward(float_model, spec, inputs)))
    assert 0 < diff.abs().max().item() <= SCORE_BOUND[dtype]


def test_batched_scores_equal_solo(spec, weights):
    model = DLRMFactory(spec).inference_model(weights)
    requests = [items_request(spec, n, seed=n, max_bag=bag) for n, bag in ((1, 0), (40, 5), (7, 30))]
    alone = torch.cat([forward(model, spec, model_inputs(spec, [r])) for r in requests])
    torch.testing.assert_close(forward(model, spec, model_inputs(spec, requests)), alone, atol=1e-6, rtol=0)


def test_exported_and_compiled_graphs_equal_eager(spec, weights, tmp_path):
    eager = eager_service(spec, DLRMFactory(spec).inference_model(weights))
    example = model_inputs(spec, [items_request(spec, n, seed=n) for n in (3, 5)])
    program = export_model(DLRMFactory(spec).inference_model(weights), eager.tags, example)
    torch.export.save(program, str(tmp_path / "model.pt2"))
    graphs = {
        Artifact.EXPORTED: GraphModel(tmp_path / "model.pt2", Artifact.EXPORTED, eager.tags),
        Artifact.AOTI: GraphModel(
            compile_aoti(program, tmp_path / "model_aoti.pt2"), Artifact.AOTI, eager.tags
        ),
    }
    for sizes in ((1,), (9, 2)):
        batch = model_inputs(spec, [items_request(spec, n, seed=20 + n) for n in sizes])
        with torch.inference_mode():
            want = eager.model(batch)
            torch.testing.assert_close(graphs[Artifact.EXPORTED](batch), want, atol=0, rtol=0)
            torch.testing.assert_close(graphs[Artifact.AOTI](batch), want, atol=1e-5, rtol=1e-4)


@pytest.mark.integration
def test_compiled_archive_served_by_torchserve_scores_as_in_process(spec, tmp_path):
    spec.to_yaml(tmp_path / "dlrm_v2.yaml")
    archive = build_archive(
        tmp_path / "dlrm_v2.yaml", checkpoint=None, seed=0, name="dlrm_v2", version="1.0",
        model_store=tmp_path / "model_store", serving=ServingConfig(batch_size=16, max_batch_delay_ms=100),
        artifact=Artifact.AOTI,
    )
    reference = archive_service(archive)
    requests = [items_request(spec, n, seed=100 + i, max_bag=4) for i, n in enumerate([1, 12, 3, 30] * 4)]
    with LocalTorchServe(model_store=archive.parent) as server:
        assert server.register(archive.name, initial_workers=1).status_code == 200
        before = server.handler_counters("dlrm_v2")
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            responses = list(pool.map(lambda r: server.predict("dlrm_v2", r), requests))
        formed = server.handler_counters("dlrm_v2").minus(before)
    float_model = DLRMFactory(spec).float_model(seed=0)  # what the archive was built from
    for request, response in zip(requests, responses):
        assert response.status_code == 200, response.text
        solo = json.loads(reference.handle([json.dumps(request)]).responses[0].body)["scores"]
        assert response.json()["scores"] == pytest.approx(solo, abs=1e-6)
        floats = float_scores(float_model, spec, request)  # inputs made without the serving decoder
        torch.testing.assert_close(torch.tensor(response.json()["scores"]), floats, atol=QUANTIZATION_TOLERANCE, rtol=0)
    assert max(formed.batches) > 1, f"TorchServe formed no batch of several requests: {formed}"
