"""The verification gate: metrics, and refusing an archive whose model no longer predicts."""

import zipfile

import orjson
import pytest
import torch

from archive_tools.build import ServingConfig, VerificationFailed, build_archive
from archive_tools.verification import ValidationData, auc, normalized_entropy
from handlers.modeling.factory import DLRMFactory
from tests.conftest import TINY_SPEC
from tests.helpers import items_request


def test_auc_and_normalized_entropy_on_known_cases():
    labels = torch.tensor([0, 0, 1, 1])
    assert auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), labels) == 1.0
    assert auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), labels) == 0.0
    # predicting the base rate is NE 1; better predictions are below 1
    assert normalized_entropy(torch.full((4,), 0.5), labels) == pytest.approx(1.0)
    assert normalized_entropy(torch.tensor([0.1, 0.2, 0.8, 0.9]), labels) < 0.3


def _build(tmp_path, **kwargs):
    return build_archive(
        TINY_SPEC, checkpoint=None, seed=0, name="tiny", version="1.0",
        model_store=tmp_path / "model_store", serving=ServingConfig(), **kwargs,
    )


def test_report_is_kept_in_the_archive(tmp_path):
    archive = _build(tmp_path)
    with zipfile.ZipFile(archive) as z:
        report = orjson.loads(z.read("verification.json"))
    assert report["passed"] and report["items"] == 64 * 16
    assert report["auc_reference"] > 0.5 and abs(report["auc_served"] - report["auc_reference"]) < 1e-3
    assert report["ne_served"] == pytest.approx(report["ne_reference"], abs=1e-3)
    assert 0 < report["max_abs_score_diff"] < report["bounds"]["max_abs_score_diff"]


def test_labelled_validation_file_is_used(tmp_path, tiny_spec):
    lines = []
    for k in range(8):
        request = items_request(tiny_spec, 5, seed=k)
        lines.append(orjson.dumps({"request": request, "labels": [k % 2, 1, 0, 1, 0]}))
    path = tmp_path / "validation.jsonl"
    path.write_bytes(b"\n".join(lines))
    archive = _build(tmp_path, validation=path)
    report = orjson.loads((archive.parent / "tiny.verification.json").read_bytes())
    assert report["source"] == f"file {path}" and report["items"] == 40
    assert report["auc_reference"] is not None


def test_gate_refuses_a_broken_transformation(tmp_path, monkeypatch):
    """A quantizer that writes the wrong int8 scale for one table: no archive is written."""
    original = DLRMFactory.quantize

    def broken(self, float_model):
        weights = original(self, float_model)
        _, scale_bias = weights.tables["t_user"]
        scale_bias.view(torch.float16)[:, 0] = 1.0  # should be ~2e-4: rows now dequantize to 0..255
        return weights

    monkeypatch.setattr(DLRMFactory, "quantize", broken)
    with pytest.raises(VerificationFailed, match="max abs score diff .* > 0.02"):
        _build(tmp_path)
    assert not (tmp_path / "model_store" / "tiny.mar").exists()
    report = orjson.loads((tmp_path / "model_store" / "tiny.verification.json").read_bytes())
    assert not report["passed"] and report["failures"]


def test_validation_file_labels_must_match_items(tmp_path, tiny_spec):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(orjson.dumps({"request": items_request(tiny_spec, 3, seed=0), "labels": [1]}))
    with pytest.raises(ValueError, match="one 0/1 label per item"):
        ValidationData.from_jsonl(path)
