"""The paired bootstrap interval of a held-out AUC drop, against the same draws scored one by one
with torchmetrics' AUROC on the drawn rows."""

import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from archive_tools.planning.uncertainty import auc_drop_interval


def _scores(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float scores, the same rounded coarsely (many ties, as a narrow dtype gives), labels."""
    generator = torch.Generator().manual_seed(seed)
    labels = (torch.rand(rows, generator=generator) < 0.3).long()
    reference = torch.sigmoid(labels * 0.8 + torch.randn(rows, generator=generator))
    served = (reference * 20).round() / 20
    return reference, served, labels


def test_the_interval_is_the_percentiles_of_the_paired_draws_each_scored_by_torchmetrics():
    reference, served, labels = _scores(300, seed=0)
    low, high = auc_drop_interval(reference, served, labels, resamples=200, seed=3)
    generator = torch.Generator().manual_seed(3)
    drops = []
    for _ in range(200):
        rows = torch.randint(len(labels), (len(labels),), generator=generator)
        drops.append(float(binary_auroc(reference[rows].double(), labels[rows]))
                     - float(binary_auroc(served[rows].double(), labels[rows])))
    expected = torch.quantile(torch.tensor(drops, dtype=torch.float64), torch.tensor([0.025, 0.975], dtype=torch.float64))
    assert (low, high) == pytest.approx(expected.tolist(), abs=1e-6)  # torchmetrics returns float32 AUCs
    drop = float(binary_auroc(reference.double(), labels)) - float(binary_auroc(served.double(), labels))
    assert low < drop < high and high - low > 1e-3


def test_the_same_scores_drop_nothing_in_every_draw():
    reference, _, labels = _scores(100, seed=1)
    assert auc_drop_interval(reference, reference.clone(), labels, resamples=50) == (0.0, 0.0)
