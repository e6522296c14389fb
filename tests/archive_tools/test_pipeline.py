"""The build's stages, each run alone: staging, the reference, the validation data, verification
and packaging (the whole builds, single-host and distributed, run them in tests of their own)."""

from __future__ import annotations

import orjson
import pytest
import torch
import yaml

from archive_tools.pipeline import (
    GENERATED_ITEMS,
    GENERATED_REQUESTS,
    VerificationFailed,
    check_replaceable,
    package,
    reference_service,
    stage_files,
    validation_data,
    verify_staged,
)
from archive_tools.verification import Bounds
from handlers.modeling.eager import eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import input_schema
from handlers.runtime import archive_files
from handlers.runtime.archive import Archive
from handlers.runtime.freshness.layout import TablesLayout
from handlers.runtime.inputs import Limits
from tests.helpers import items_request


@pytest.fixture
def staged(tmp_path, tiny_spec, tiny_weights):
    staging = tmp_path / "build" / "extra"
    stage_files(staging, tiny_spec, DLRMFactory(tiny_spec), tiny_weights)
    return staging


def test_staging_writes_the_archives_files(staged, tiny_spec):
    assert (staged / archive_files.HANDLERS / archive_files.HANDLER).is_file()
    assert not list((staged / archive_files.HANDLERS).rglob("__pycache__"))
    archive = Archive(staged)
    assert archive.inputs == input_schema(tiny_spec)
    assert sorted(t.name for t in archive.layout.tables) == sorted(t.name for t in tiny_spec.tables)
    assert archive.layout == DLRMFactory(tiny_spec).tables_layout(staged / archive_files.WEIGHTS)


def test_staging_takes_other_inputs(tmp_path, tiny_spec, tiny_weights):
    other = input_schema(tiny_spec.replace(limits={"max_items_per_request": 7}))
    assert other.limits != input_schema(tiny_spec).limits
    stage_files(tmp_path / "extra", tiny_spec, DLRMFactory(tiny_spec), tiny_weights, other)
    assert Archive(tmp_path / "extra").inputs.limits == Limits(**{**other.limits.__dict__})


def test_the_reference_without_a_float_model_is_the_staged_quantized_one(staged, tiny_spec, tiny_weights):
    factory = DLRMFactory(tiny_spec)
    reference = reference_service(tiny_spec, factory, None, staged)
    built = eager_service(tiny_spec, factory.inference_model(tiny_weights))
    body = orjson.dumps(items_request(tiny_spec, 5, seed=1))
    assert reference.handle([body]).responses == built.handle([body]).responses


def test_validation_data_is_the_users_file_or_generated_and_labelled(tmp_path, tiny_spec, tiny_float_model):
    reference = eager_service(tiny_spec, tiny_float_model)
    generated = validation_data(tiny_spec, reference, None, seed=0)
    assert len(generated.requests) == GENERATED_REQUESTS and len(generated.labels) == GENERATED_REQUESTS
    assert {len(labels) for labels in generated.labels} == {GENERATED_ITEMS}
    assert 0 < sum(map(sum, generated.labels)) < GENERATED_REQUESTS * GENERATED_ITEMS  # both classes
    lines = [{**items_request(tiny_spec, 2, seed=k), "labels": [0, 1]} for k in range(3)]
    (tmp_path / "eval.jsonl").write_bytes(b"\n".join(orjson.dumps(line) for line in lines))
    given = validation_data(tiny_spec, reference, tmp_path / "eval.jsonl", seed=0)
    assert given.labels == [[0, 1]] * 3


def test_verification_past_the_bounds_writes_the_report_and_refuses(staged, tmp_path, tiny_spec, tiny_float_model):
    factory = DLRMFactory(tiny_spec)
    reference = eager_service(tiny_spec, tiny_float_model)
    data = validation_data(tiny_spec, reference, None, seed=0)
    store = tmp_path / "store"
    passed = verify_staged(eager_service(tiny_spec, factory.inference_model(factory.quantize(tiny_float_model))),
                           reference, data, Bounds(), name="tiny", model_store=store, staging=staged, against="float")
    assert passed.passed and orjson.loads((store / "tiny.verification.json").read_bytes())["passed"]
    other = eager_service(tiny_spec, factory.float_model(seed=1))
    with pytest.raises(VerificationFailed, match=r"refusing to write tiny: max abs score diff"):
        verify_staged(other, reference, data, Bounds(), name="tiny", model_store=store, staging=staged, against="float")
    for report in (store / "tiny.verification.json", staged / archive_files.VERIFICATION):
        assert orjson.loads(report.read_bytes())["passed"] is False


def test_packaging_writes_the_config_beside_the_staged_files(staged, tmp_path):
    config = {"minWorkers": 1, "handler": {"artifact": "eager"}}
    folder = package(staged, config, "tiny", "2.0", tmp_path / "store", "no-archive")
    archive = Archive(folder)
    assert archive.model_config == config and archive.has(archive_files.WEIGHTS)
    manifest = orjson.loads(archive.file(archive_files.MANIFEST).read_bytes())
    assert manifest["model"]["modelVersion"] == "2.0" and manifest["model"]["handler"] == archive_files.HANDLER
    assert yaml.safe_load((staged.parent / archive_files.MODEL_CONFIG).read_text()) == config
    check_replaceable(folder)  # an archive folder may be replaced; anything else may not
    (tmp_path / "notes").mkdir()
    with pytest.raises(FileExistsError, match="is not an archive folder"):
        check_replaceable(tmp_path / "notes")
    assert torch.load(folder / archive_files.WEIGHTS, weights_only=True).keys()
    assert TablesLayout.load(folder).tables
