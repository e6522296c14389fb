"""Dense weights in a delta: made in the form each artifact serves them, swapped in whole, and
then scoring exactly as a fresh build from the newer checkpoint does (dense precision included:
bf16 layers, TorchAO int8 weights whose one-element scales must stay swappable constants); a
checkpoint delta that would drop a dense change is refused unless told to carry it or leave it out."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from archive_tools.build import build_archive
from archive_tools.cli import main
from archive_tools.delta import DeltaSource, make_delta, verify_delta
from archive_tools.model_config import ServingConfig
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import load_spec
from handlers.runtime.artifacts import Artifact
from handlers.runtime.errors import InputError
from handlers.runtime.freshness.delta_file import DeltaError, check_dense, read_delta
from handlers.runtime.freshness.dense import dense_slot
from handlers.runtime.freshness.layout import TablesLayout
from handlers.runtime.split import SplitPlan
from tests.conftest import TINY_SPEC
from tests.helpers import archive_service, items_request

KINDS = {
    "eager": (Artifact.EAGER, None),
    "aoti": (Artifact.AOTI, None),
    "split-eager-aoti": (Artifact.SPLIT, SplitPlan(sparse=Artifact.EAGER, dense=Artifact.AOTI)),
}
# takes row deltas but cannot swap its dense weights: a dense change is refused, or left out
EXPORTED_DENSE = {
    "split-eager-exported": (Artifact.SPLIT, SplitPlan(sparse=Artifact.EAGER, dense=Artifact.EXPORTED)),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    spec_file = root / "tiny_dense.yaml"
    spec_file.write_text(TINY_SPEC.read_text() + "dense_precision: {over_arch: int8_dynamic, dense_arch: bf16}\n")
    spec = load_spec(spec_file)
    base = {k: v.clone() for k, v in DLRMFactory(spec).float_model(seed=0).state_dict().items()}
    generator = torch.Generator().manual_seed(3)
    newer = {
        k: v + 0.2 * torch.randn(v.shape, generator=generator) if v.is_floating_point() and ".embedding_bags." not in k else v
        for k, v in base.items()
    }
    dense_only = {k: v for k, v in newer.items() if ".embedding_bags." not in k}
    # base's dense_arch (served in bf16) through a bf16 round trip: a float change that serves the same
    round_trip = {k: v.bfloat16().float() if k.startswith("dense_arch.") else v for k, v in base.items()}
    assert any(not torch.equal(round_trip[k], base[k]) for k in base)
    torch.save(base, root / "base.pt")
    torch.save(round_trip, root / "round_trip.pt")
    torch.save(newer, root / "newer.pt")
    torch.save(dense_only, root / "dense_only.pt")
    requests = [items_request(spec, 4, seed=s, max_bag=3) for s in range(3)]
    return root, spec_file, requests


_BUILT: dict[tuple[Path, str, str], Path] = {}  # built once per module run: the tests only read them


def _build(setup, kind: str, checkpoint: str):
    root, spec_file, _ = setup
    key = (root, kind, checkpoint)
    if key not in _BUILT:
        _BUILT[key] = _built(root, spec_file, kind, checkpoint)
    return _BUILT[key]


def _built(root: Path, spec_file: Path, kind: str, checkpoint: str) -> Path:
    artifact, split = {**KINDS, **EXPORTED_DENSE}[kind]
    return build_archive(spec_file, checkpoint=root / checkpoint, seed=0, name=f"{kind}-{checkpoint[:-3]}", version="1",
                         model_store=root / "store", serving=ServingConfig(), artifact=artifact, split=split,
                         archive_format="no-archive")


def _scores(service, requests):
    return [r.body for r in service.handle(requests).responses]


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_dense_delta_swapped_in_scores_as_a_fresh_build(setup, kind):
    root, _, requests = setup
    base, fresh = _build(setup, kind, "base.pt"), _build(setup, kind, "newer.pt")
    summary = make_delta(base, DeltaSource(dense=root / "dense_only.pt"), root / f"{kind}.delta", sequence=1)
    assert summary.rows_by_table == {} and summary.dense_tensors > 0
    served = archive_service(base)
    before = _scores(served, requests)
    slot = dense_slot(served.model)
    delta = read_delta(summary.path, TablesLayout.load(base))
    check_dense(delta.header.dense, slot.dense_shapes())
    slot.swap_dense(delta.dense())
    assert _scores(served, requests) == _scores(archive_service(fresh), requests)
    assert _scores(served, requests) != before
    slot.swap_dense(None)
    assert _scores(served, requests) == before
    assert verify_delta(base, summary.path, root / "newer.pt") == []  # the dense weights served, as built
    assert verify_delta(base, summary.path, root / "base.pt") != []  # the check can fail


def test_a_dense_section_must_fit_the_served_weights(setup):
    root, _, _ = setup
    base = _build(setup, "aoti", "base.pt")
    eager = _build(setup, "eager", "base.pt")
    eager_delta = make_delta(eager, DeltaSource(dense=root / "dense_only.pt"), root / "eager-for-aoti.delta", sequence=1)
    slot = dense_slot(archive_service(base).model)
    with pytest.raises(DeltaError) as refused:  # float eager names and dtypes, not the package's constants
        check_dense(read_delta(eager_delta.path, TablesLayout.load(base)).header.dense, slot.dense_shapes())
    assert refused.value.field.startswith("dense.")


def test_an_exported_program_cannot_swap_and_says_so(setup):
    root, spec_file, _ = setup
    exported = build_archive(spec_file, checkpoint=root / "base.pt", seed=0, name="exported", version="1",
                             model_store=root / "store", serving=ServingConfig(), artifact=Artifact.EXPORTED,
                             archive_format="no-archive")
    assert "build aoti" in dense_slot(archive_service(exported).model)
    with pytest.raises(ValueError, match="cannot take deltas"):
        make_delta(exported, DeltaSource(dense=root / "dense_only.pt"), root / "exported.delta", sequence=1)


CHANGED = ["dense_arch.model._mlp.0._linear", "dense_arch.model._mlp.1._linear", "over_arch.model.0._mlp.0._linear",
           "over_arch.model.0._mlp.1._linear", "over_arch.model.1"]


def _delta(archive: Path, *flags: str) -> int:
    return main(["delta", str(archive), "--sequence", "1", "--out", str(archive.parent / "cli.delta"), *flags])


def test_a_checkpoint_delta_that_would_drop_a_dense_change_is_refused_naming_the_modules(setup, capsys):
    root, _, _ = setup
    base = _build(setup, "eager", "base.pt")
    capsys.readouterr()  # the build's report
    assert _delta(base, "--checkpoint", str(root / "newer.pt")) == 2  # InputError: add an argument
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(
        "torchrec-serve delta: error: " + ", ".join(CHANGED) + ": dense weights differ from the archive's (max |diff| ")
    assert f"add --dense {root / 'newer.pt'} to swap them, or --rows-only" in err
    assert not (base.parent / "cli.delta").exists()
    with pytest.raises(InputError, match="it goes with --checkpoint, not --dense"):
        DeltaSource(checkpoint=root / "newer.pt", dense=root / "newer.pt", rows_only=True)
    with pytest.raises(SystemExit) as both:  # argparse: the two are alternatives
        _delta(base, "--checkpoint", str(root / "newer.pt"), "--dense", str(root / "newer.pt"), "--rows-only")
    assert both.value.code == 2


def test_with_dense_the_delta_carries_and_verifies_the_new_dense_weights(setup, capsys):
    root, _, _ = setup
    base = _build(setup, "eager", "base.pt")
    capsys.readouterr()  # the build's report
    assert _delta(base, "--checkpoint", str(root / "newer.pt"), "--dense", str(root / "newer.pt"), "--verify") == 0
    assert "and its dense weights, which this delta swaps in" in capsys.readouterr().err
    assert read_delta(base.parent / "cli.delta", TablesLayout.load(base)).header.dense is not None
    # dense weights that are not the checkpoint's: the archive plus the delta serves something else
    assert _delta(base, "--checkpoint", str(root / "newer.pt"), "--dense", str(root / "base.pt"), "--verify") == 8
    assert capsys.readouterr().err.strip().endswith("differs from a fresh build in " + ", ".join(CHANGED))


def test_rows_only_leaves_the_dense_change_out_and_says_so(setup, capsys):
    root, _, _ = setup
    base = _build(setup, "eager", "base.pt")
    capsys.readouterr()  # the build's report
    assert _delta(base, "--checkpoint", str(root / "newer.pt"), "--rows-only", "--verify") == 0
    err = capsys.readouterr().err
    assert "rows (and slot owners) of a fresh build, byte for byte; its dense weights left out (--rows-only)" in err
    delta = read_delta(base.parent / "cli.delta", TablesLayout.load(base))
    assert delta.header.dense is None and delta.header.tables == ()


@pytest.mark.parametrize("kind", [*KINDS, *EXPORTED_DENSE])
def test_every_kind_compares_the_dense_weights_it_serves(setup, kind):
    """Refused naming the modules; a float change its bf16 layers round away is none; --rows-only."""
    root, _, _ = setup
    base = _build(setup, kind, "base.pt")
    with pytest.raises(InputError, match="^" + re.escape(", ".join(CHANGED)) + ": dense weights differ"):
        make_delta(base, DeltaSource(checkpoint=root / "newer.pt"), root / f"{kind}-refused.delta", sequence=1)
    same = make_delta(base, DeltaSource(checkpoint=root / "round_trip.pt"), root / f"{kind}-same.delta", sequence=1)
    assert same.dense_tensors == 0 and verify_delta(base, same.path, root / "round_trip.pt") == []
    rows_only = make_delta(base, DeltaSource(checkpoint=root / "newer.pt", rows_only=True),
                           root / f"{kind}-rows.delta", sequence=1)
    assert verify_delta(base, rows_only.path, root / "newer.pt", rows_only=True) == []
    assert verify_delta(base, rows_only.path, root / "newer.pt") == CHANGED  # what it leaves out


def test_dense_weights_that_serve_the_same_are_no_change(setup, capsys):
    """Compared as served: dense_arch's float weights moved, but not its bf16 ones."""
    root, _, _ = setup
    base = _build(setup, "eager", "base.pt")
    capsys.readouterr()  # the build's report
    assert _delta(base, "--checkpoint", str(root / "round_trip.pt"), "--verify") == 0
    assert "and its dense weights, unchanged from the archive's" in capsys.readouterr().err
