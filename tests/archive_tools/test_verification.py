"""The verification gate: metrics, and refusing an archive whose model no longer predicts."""

import math
import zipfile

import numpy as np
import orjson
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from archive_tools.pipeline import VerificationFailed
from archive_tools.verification import Bounds
from archive_tools.validation_data import ValidationDataError, read_validation
from archive_tools.verification import auc, log_loss, normalized_entropy
from handlers.modeling.factory import DLRMFactory
from tests.conftest import TINY_SPEC
from tests.helpers import float_scores, items_request


def test_auc_and_normalized_entropy_on_known_cases():
    labels = torch.tensor([0, 0, 1, 1])
    assert auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), labels) == 1.0
    assert auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), labels) == 0.0
    # predicting the base rate is NE 1; better predictions are below 1
    assert normalized_entropy(torch.full((4,), 0.5), labels) == pytest.approx(1.0)
    assert normalized_entropy(torch.tensor([0.1, 0.2, 0.8, 0.9]), labels) < 0.3
    assert log_loss(torch.full((4,), 0.5), labels) == pytest.approx(0.6931472)


def test_auc_is_torchmetrics_auroc_with_ties():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 50, (2000,), generator=generator).float() / 50  # many ties
    labels = (torch.rand(2000, generator=generator) < scores).long()
    expected = float(binary_auroc(scores.double(), labels))  # a float32
    assert auc(scores, labels) == pytest.approx(expected, abs=1e-6)


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
    served, reference = report["served"], report["reference"]
    assert reference["auc"] > 0.5 and abs(served["auc"] - reference["auc"]) < 1e-3
    assert served["ne"] == pytest.approx(reference["ne"], abs=1e-3)
    assert served["log_loss"] == pytest.approx(reference["log_loss"], abs=1e-3)
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
    # the reference's AUC on these labels, counted here pair by pair from the float model's scores
    model = DLRMFactory(tiny_spec).float_model(seed=0)
    scored = [(float(p), label) for k in range(8) for p, label in
              zip(float_scores(model, tiny_spec, items_request(tiny_spec, 5, seed=k)), [k % 2, 1, 0, 1, 0])]
    assert report["reference"]["auc"] == pytest.approx(_pairwise_auc(scored), abs=1e-6)


def _pairwise_auc(scored: list[tuple[float, int]]) -> float:
    """The share of (positive, negative) pairs the scores order right, ties half."""
    positives = [p for p, label in scored if label == 1]
    negatives = [p for p, label in scored if label == 0]
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


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


def test_the_training_evaluations_auc_is_a_bound(tmp_path):
    """--expect-auc: the served artifact must rank as well as the training evaluation said."""
    with pytest.raises(VerificationFailed, match="below the training evaluation's 0.99"):
        _build(tmp_path, bounds=Bounds(expected_auc=0.99))
    assert _build(tmp_path, bounds=Bounds(expected_auc=0.5)).exists()


def _write(path, rows):
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows))
    return path


def test_validation_records_in_the_shapes_users_have(tmp_path, tiny_spec):
    """Item records with "label", request bodies with "labels" or "label", the project's own
    {"request", "labels"} lines and the columnar form all read the same items."""
    one = items_request(tiny_spec, 1, seed=1)
    three = items_request(tiny_spec, 3, seed=2)
    item = one["items"][0]
    columnar = {
        "float_features": [[0.1, 0.2, 0.3, 0.4]],
        "id_list_features.lengths": [1, 0, 0, 0, 1],
        "id_list_features.values": [7, 3],
    }
    path = _write(tmp_path / "eval.jsonl", [
        {**item, "label": 1},
        {**one, "label": 0},
        {**three, "labels": [0, 1, 1]},
        {"request": three, "labels": [1, 1, 0]},
        {**columnar, "labels": [1]},
    ])
    data = read_validation(path, tiny_spec)
    assert data.labels == [[1], [0], [0, 1, 1], [1, 1, 0], [1]]
    assert data.requests[0] == one and data.requests[2] == three and data.requests[4] == columnar
    assert data.origins[3] == f"{path}:4"


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"items": [], "labels": []}, "not json"], ":2: not JSON: "),
        ([{"dense": [0] * 4, "label": 2}], ":1: label: labels must be 0 or 1, got [2]"),
        ([{"dense": [0] * 4, "label": 1}, {"dense": [0] * 4}], ":2: has no label, while other lines do"),
        ([{"dense": [0] * 4, "label": 1, "labels": [1]}], ":1: label: give 'label' or 'labels'"),
        ([{"dense": [0] * 4, "label": 0}, {"dense": [1] * 4, "label": 0}], ": every label is 0: AUC and NE need"),
    ],
)
def test_a_bad_validation_line_is_named(tmp_path, tiny_spec, rows, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(r.encode() if isinstance(r, str) else orjson.dumps(r) for r in rows))
    with pytest.raises(ValidationDataError) as error:
        read_validation(path, tiny_spec)
    assert str(error.value).startswith(f"{path}{message}")


def test_a_request_the_model_refuses_names_its_line_and_field(tmp_path, tiny_spec):
    path = _write(tmp_path / "eval.jsonl", [
        {**items_request(tiny_spec, 1, seed=1), "label": 1},
        {"dense": [0.0] * 3, "label": 0},
    ])
    with pytest.raises(ValidationDataError, match=rf"{path}:2: items\[0\].dense: must hold 4 numbers, got 3"):
        _build(tmp_path, validation=path)


def test_validation_file_labels_must_match_items(tmp_path, tiny_spec):
    path = _write(tmp_path / "bad.jsonl", [{"request": items_request(tiny_spec, 3, seed=0), "labels": [1]}])
    with pytest.raises(ValidationDataError, match=":1: labels: one label per item: the request has 3 items, got 1"):
        read_validation(path, tiny_spec)


def test_criteo_tsv_is_read_as_torchrec_preprocesses_it(tmp_path):
    """Label, 13 dense integers, 26 hex ids; empty fields are 0; dense ln(x - min + 2)."""
    from handlers.modeling.registry import load_spec
    from tests.conftest import CRITEO_SPEC

    spec = load_spec(CRITEO_SPEC)
    dense = [["5", "", "-1"] + ["1"] * 10, ["0"] * 13]
    ids = [["68fd1e64", ""] + ["1a"] * 24, ["0"] * 26]
    path = tmp_path / "day_0_sample.tsv"
    path.write_text("".join("\t".join([str(label), *d, *c]) + "\n" for label, d, c in zip((1, 0), dense, ids)))
    data = read_validation(path, spec)
    assert data.labels == [[1, 0]] and len(data.requests[0]["items"]) == 2
    first = data.requests[0]["items"][0]
    assert first["dense"][:3] == pytest.approx([math.log(5 + 1 + 2), math.log(0 + 1 + 2), math.log(2)])
    assert first["sparse"]["cat_0"] == [0x68FD1E64] and first["sparse"]["cat_1"] == [0]
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t" + "\t".join(["1"] * 13 + ["zz"] + ["0"] * 25) + "\n")
    with pytest.raises(ValidationDataError, match=r"bad.tsv:1: categorical field cat_0: must be an hex id, got 'zz'"):
        read_validation(bad, spec)


def test_a_criteo_tsv_verifies_a_criteo_shaped_archive(tmp_path):
    """End to end: the build reads the TSV, the model hashes the large ids, the report has AUC."""
    from handlers.modeling.registry import load_spec
    from tests.conftest import CRITEO_SPEC

    small = load_spec(CRITEO_SPEC)
    small = small.replace(tables=[t.model_copy(update={"rows": min(t.rows, 500)}) for t in small.tables])
    small.to_yaml(tmp_path / "criteo_small.yaml")
    rng = np.random.default_rng(0)
    lines = [
        "\t".join([str(int(rng.integers(0, 2)))] + [str(int(v)) for v in rng.integers(0, 50, 13)]
                  + [format(int(v), "x") for v in rng.integers(0, 2**32, 26)])
        for _ in range(200)
    ]
    (tmp_path / "eval.tsv").write_text("\n".join(lines) + "\n")
    archive = build_archive(
        tmp_path / "criteo_small.yaml", checkpoint=None, seed=0, name="criteo_small", version="1.0",
        model_store=tmp_path / "model_store", serving=ServingConfig(), validation=tmp_path / "eval.tsv",
    )
    report = orjson.loads((archive.parent / "criteo_small.verification.json").read_bytes())
    assert report["items"] == 200 and report["requests"] == 4
    # the float model's AUC on the file's labels, counted pair by pair (its large ids hashed here)
    data = read_validation(tmp_path / "eval.tsv", small)
    model = DLRMFactory(small).float_model(seed=0)
    scored = [(float(p), label) for request, labels in zip(data.requests, data.labels)
              for p, label in zip(float_scores(model, small, request), labels)]
    assert report["reference"]["auc"] == pytest.approx(_pairwise_auc(scored), abs=1e-6)
