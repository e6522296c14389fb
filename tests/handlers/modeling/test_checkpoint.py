"""Checkpoint names: a refusal names a few names of each kind with their counts, the prefix mapping
that makes them match (which, put in the spec, loads), and the MCH eviction setting a table's
extra state belongs to; a raw-id collection saved as TorchRec's own managed-collision EBC loads as
the adapter-named one does."""

import copy
import re

import pytest
import torch
import yaml
from torch import nn

from handlers.modeling.checkpoint import load_checkpoint
from handlers.modeling.errors import CheckpointError
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.spec import CheckpointMapping
from tests.integration.raw_id_models import insert_zch, raw_spec, train, zipf_batch

from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection  # isort: skip

SPARSE = "sparse_arch.embedding_bag_collection."


class _Wrapped(nn.Module):
    """A user's model holding the spec's model one level down, under ``din.``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.din = inner


def _refusal(model: nn.Module, checkpoint: dict, mapping: CheckpointMapping = CheckpointMapping()) -> str:
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(model, checkpoint, mapping)
    return str(error.value)


def _suggested(message: str) -> CheckpointMapping:
    """The mapping the refusal suggests, read as the spec's YAML would read it."""
    text = re.search(r"put (checkpoint_mapping: \{.*\}) in the spec: then every name matches", message)
    assert text, message
    return CheckpointMapping(**yaml.safe_load(text.group(1))["checkpoint_mapping"])


@pytest.mark.parametrize(
    "rename, model_of",
    [
        (lambda k: k, _Wrapped),  # the checkpoint lacks the model's prefix ("": "din.")
        (lambda k: f"din.{k}", lambda m: m),  # it has one the model lacks ("din.": "")
        (lambda k: k.replace(SPARSE, "sparse_arch."), lambda m: m),  # a segment in the middle left out
    ],
    ids=["removed", "added", "inserted"],
)
def test_a_refusal_suggests_the_prefix_mapping_that_loads_and_caps_the_names_it_shows(
    tiny_spec, tiny_float_model, rename, model_of
):
    checkpoint = {rename(k): v for k, v in tiny_float_model.state_dict().items()}
    model = model_of(DLRMFactory(tiny_spec).float_model(seed=99))
    message = _refusal(model, checkpoint)
    unmatched = len(set(checkpoint) - set(model.state_dict()))
    assert f"{unmatched} unexpected: " in message and f"{unmatched} missing: " in message
    shown = re.search(r"\d+ unexpected: (.*?) and (\d+) more;", message)
    assert len(shown.group(1).split(", ")) == 3 and int(shown.group(2)) == unmatched - 3, message
    assert len(message) < 800  # a line, not every name
    load_checkpoint(model, checkpoint, _suggested(message))
    loaded = {rename(k): v for k, v in model.state_dict().items()} if model_of is not _Wrapped else {
        k.removeprefix("din."): v for k, v in model.state_dict().items()
    }
    assert loaded.keys() == checkpoint.keys()
    assert all(torch.equal(loaded[k], v) for k, v in checkpoint.items())


def test_a_suggestion_that_matches_most_names_says_what_it_leaves(tiny_spec, tiny_float_model):
    checkpoint = {f"module.{k}": v for k, v in tiny_float_model.state_dict().items()}
    checkpoint["module.optimizer_step"] = torch.zeros(1)
    message = _refusal(DLRMFactory(tiny_spec).float_model(seed=0), checkpoint)
    assert (
        'put checkpoint_mapping: {prefixes: {"module.": ""}} in the spec: then 0 missing and 1 unexpected remain'
    ) in message


def _mch(spec, eviction: str):
    return spec.replace(tables=[
        {**t.model_dump(mode="json"), "ids": "raw", "remap": {"kind": "mch", "eviction": eviction}} for t in spec.tables
    ])


@pytest.mark.parametrize("served", ["lfu", "lru"])
def test_mch_state_of_another_eviction_policy_names_the_spec_setting(tiny_spec, served):
    trained = DLRMFactory(_mch(tiny_spec, "distance_lfu")).float_model(seed=0).state_dict()
    factory = DLRMFactory(_mch(tiny_spec, served))
    with pytest.raises(CheckpointError) as error:
        factory.load_checkpoint(factory.float_model(seed=0), trained)
    message = str(error.value)
    assert (
        "4 MCH tables (t_category, t_hour, t_item and 1 more) hold the state of eviction distance_lfu "
        f"(_mch_counts, _mch_last_access_iter), the spec's remap.eviction is {served}: set "
        "remap.eviction: distance_lfu on them, as trained"
    ) in message
    assert "missing:" not in message and "unexpected:" not in message and "prefixes" not in message


def test_torchrecs_own_managed_collision_ebc_at_dlrms_sparse_arch_loads_and_scores_as_the_adapters(tiny_spec):
    """A DLRM trained with TorchRec's ManagedCollisionEmbeddingBagCollection itself as its sparse
    arch's collection (MCH and ZCH tables) saves it one level higher than the adapter (the float
    model's naming) does: that checkpoint loads, with a note, and scores as the adapter-named one."""
    spec = raw_spec(tiny_spec)
    generator = torch.Generator().manual_seed(0)
    vocabulary = torch.randint(-(2**62), 2**62, (2000,), generator=generator)
    trained = DLRMFactory(spec).float_model(seed=0)
    insert_zch(trained, vocabulary[:150])
    train(trained, spec, vocabulary, generator, steps=5)
    theirs = copy.deepcopy(trained)
    mc_ebc = theirs.sparse_arch.embedding_bag_collection.mc_embedding_bag_collection
    assert type(mc_ebc) is ManagedCollisionEmbeddingBagCollection
    theirs.sparse_arch.embedding_bag_collection = mc_ebc  # TorchRec's own module where DLRM keeps its collection
    own_named = theirs.state_dict()
    assert not set(own_named) & {k for k in trained.state_dict() if k.startswith(SPARSE)}
    factory = DLRMFactory(spec)
    from_own, from_adapter = factory.float_model(seed=1), factory.float_model(seed=2)
    note = factory.load_checkpoint(from_own, own_named)
    assert note == (
        "read TorchRec's ManagedCollisionEmbeddingBagCollection names at sparse_arch.embedding_bag_collection "
        "as its McEmbeddingBagCollectionAdapter's"
    )
    assert factory.load_checkpoint(from_adapter, trained.state_dict()) is None
    dense, ids = zipf_batch(spec, vocabulary, torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = from_adapter(dense, ids)
        assert torch.equal(from_own(dense, ids), expected)
        assert not torch.equal(factory.float_model(seed=1)(dense, ids), expected)  # what loading changed
