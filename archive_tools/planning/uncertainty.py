"""How sure a held-out AUC drop is: a paired bootstrap interval.

The held-out rows are drawn again with replacement ``resamples`` times; each draw scores the same
rows under both models (paired), and its AUC drop is the reference's AUC minus the served one's on
those rows. The interval is the middle ``level`` of the drops (percentiles).

    low, high = auc_drop_interval(float_scores, served_scores, labels)   # each [rows]

A draw is held as a count per row (how often it was drawn), so that the AUC of a draw is one pass
over the rows sorted once by score: the Mann-Whitney statistic with each row weighted by its count
(ties between a click and a non-click count one half, as for the AUC of the drawn rows themselves).
"""

from __future__ import annotations

import torch

from archive_tools.verification import weighted_auc

RESAMPLES = 1000
CHUNK = 100  # draws held in memory at once: counts [CHUNK, rows]


def auc_drop_interval(
    reference: torch.Tensor, served: torch.Tensor, labels: torch.Tensor,
    resamples: int = RESAMPLES, level: float = 0.95, seed: int = 0,
) -> tuple[float, float]:
    """The ``level`` percentile interval of the AUC drop ``auc(reference) - auc(served)`` over
    ``resamples`` paired draws of the rows (``reference``, ``served``: scores [rows]; ``labels``
    0/1 [rows]). Draw ``b`` takes the rows ``torch.randint(rows, (rows,))`` of a generator seeded
    ``seed``, drawn in order."""
    labels = labels.to(torch.float64)
    rows = len(labels)
    generator = torch.Generator().manual_seed(seed)
    drops = []
    for start in range(0, resamples, CHUNK):
        draws = min(CHUNK, resamples - start)
        counts = torch.stack([
            torch.bincount(torch.randint(rows, (rows,), generator=generator), minlength=rows) for _ in range(draws)
        ]).to(torch.float64)
        drops.append(weighted_auc(reference, labels, counts) - weighted_auc(served, labels, counts))
    tail = (1 - level) / 2
    low, high = torch.quantile(torch.cat(drops), torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return low, high

