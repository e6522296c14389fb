"""Reading a raw-id model's in-graph counts (``UnseenIdCounter``) and refusing the ids a remap
reserves (``validation``): the counts of several collections add up per table, a model that does
not count is refused naming its tables, and a reserved id is refused naming its feature whether
the request's other features are raw, of the other kind, or row ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from handlers.runtime.errors import BadRequest
from handlers.runtime.inputs import MCH_FREE_SLOT, ZCH_EMPTY_SLOT, Feature, OutOfRangePolicy
from handlers.runtime.unseen_ids import UnseenIdCounter
from handlers.runtime.validation import _IdChecks


class _Counted(nn.Module):
    """What a runner exposes of an eager model: its buffers, one ``counts`` per raw-id collection."""

    def __init__(self, *counts: torch.Tensor) -> None:
        super().__init__()
        for k, tensor in enumerate(counts):
            self.add_module(f"c{k}", nn.Module())
            getattr(self, f"c{k}").add_module("raw_id_remaps", nn.Module())
            getattr(self, f"c{k}").raw_id_remaps.register_buffer("counts", tensor)


class _Runner:
    def __init__(self, module: nn.Module) -> None:
        self.module = module


class _Schema:
    def __init__(self, tables: list[str]) -> None:
        self.features = tuple(Feature(f"f_{t}", 10, raw_id_table=t) for t in tables) + (Feature("plain", 10),)
        self.context_sparse = ()


def test_two_collections_counts_add_up_per_table_and_uncounted_work_is_left_out():
    first, second = torch.zeros((2, 2), dtype=torch.int64), torch.zeros((2, 2), dtype=torch.int64)
    counter = UnseenIdCounter.of_runner(_Schema(["b", "a"]), _Runner(_Counted(first, second)))
    first += torch.tensor([[1, 0], [4, 0]])  # a's collection: 1 of 4 ids unseen
    second += torch.tensor([[0, 2], [0, 3]])  # b's: 2 of 3
    assert counter.since_last() == ({"a": 1, "b": 2}, {"a": 4, "b": 3})
    with counter.uncounted():
        first += 7  # a padding request's ids
    second += torch.tensor([[0, 1], [0, 1]])
    assert counter.since_last() == ({"a": 0, "b": 1}, {"a": 0, "b": 1})


def test_a_forward_that_raises_is_left_out_and_one_that_succeeds_is_counted():
    """``uncounted(unless_it_raises=True)``: a forward that raised is scored again apart (its ids
    would count twice); one that did not keeps its counts."""
    counts = torch.zeros((2, 1), dtype=torch.int64)
    counter = UnseenIdCounter.of_runner(_Schema(["a"]), _Runner(_Counted(counts)))
    with pytest.raises(RuntimeError), counter.uncounted(unless_it_raises=True):
        counts += 5
        raise RuntimeError("the forward failed after its remap counted")
    with counter.uncounted(unless_it_raises=True):
        counts += torch.tensor([[1], [3]])
    assert counter.since_last() == ({"a": 1}, {"a": 3})


def test_a_model_that_does_not_count_its_raw_ids_is_refused_naming_the_tables():
    with pytest.raises(ValueError, match=r"raw-id tables \['a', 'b'\]: .* \[2, 2\] \(found \[\[2, 1\]\]\).*rebuild"):
        UnseenIdCounter.of_runner(_Schema(["a", "b"]), _Runner(_Counted(torch.zeros((2, 1), dtype=torch.int64))))
    assert UnseenIdCounter.of_runner(_Schema([]), _Runner(_Counted())) is None


@pytest.mark.parametrize("features, reserved_at", [
    # every feature raw, one kind: one compare
    ((Feature("u", 5, raw_id_table="t", reserved_raw_id=MCH_FREE_SLOT),) * 2, 1),
    # both kinds: each feature's own marker (-1 is an MCH feature's id, ZCH's marker)
    ((Feature("m", 5, raw_id_table="t", reserved_raw_id=MCH_FREE_SLOT),
      Feature("z", 5, raw_id_table="s", reserved_raw_id=ZCH_EMPTY_SLOT)), 1),
    # a raw feature beside a row-id one
    ((Feature("r", 5), Feature("m", 5, raw_id_table="t", reserved_raw_id=MCH_FREE_SLOT)), 1),
])
def test_a_reserved_raw_id_is_refused_naming_its_feature_and_others_pass(features, reserved_at):
    checks = _IdChecks(features, bag_cap=8, policy=OutOfRangePolicy.REJECT)
    lengths = np.array([[1], [2]])  # one item: a bag of one id, then one of two
    marker = features[reserved_at].reserved_raw_id
    fine = np.array([3, -1 if marker == MCH_FREE_SLOT else 2**62, 4], dtype=np.int64)
    ids, hashed = checks.check(fine.copy(), lengths, lambda f, i, k: f"items[{i}].sparse.{features[f].name}[{k}]")
    assert ids.tolist() == fine.tolist() and hashed == 0
    refused = np.array([3, 4, marker], dtype=np.int64)
    with pytest.raises(BadRequest) as error:
        checks.check(refused, lengths, lambda f, i, k: f"items[{i}].sparse.{features[f].name}[{k}]")
    assert error.value.field == f"items[0].sparse.{features[reserved_at].name}[1]"
    assert "reserved" in error.value.message
