"""The raw-id test models (``test_raw_ids``): the tiny spec with every table ``ids: raw`` (MCH,
one eviction policy or another, and t_item ZCH), trained on Zipf-distributed raw ids spread over
the whole int64 range, built into every artifact kind; and the same model trained on, with
evictions.

FBGEMM's CPU kernel for ZCH only looks up, so t_item's slots are assigned as its training on a
GPU would insert them (``zch_insert``, the most frequent ids first) and its lookups stay
read-only while the other tables train."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from handlers.modeling.factory import DLRMFactory
from handlers.modeling import tbe
from handlers.modeling.raw_ids import slot_owners, zch_insert
from handlers.modeling.spec import ModelSpec
from handlers.runtime.artifacts import Artifact
from handlers.runtime.inputs import MCH_FREE_SLOT, ZCH_EMPTY_SLOT
from handlers.runtime.split import SplitPlan
from tests.helpers import items_request

from torchrec import KeyedJaggedTensor  # isort: skip
from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule  # isort: skip

REMAPS = {
    "t_user": {"kind": "mch", "eviction": "lfu", "eviction_interval": 2},
    "t_item": {"kind": "zch", "max_probe": 16, "buckets": 2},
    "t_category": {"kind": "mch", "eviction": "distance_lfu", "eviction_interval": 2},
    "t_hour": {"kind": "mch", "eviction": "lru", "eviction_interval": 2},
}
# t_hour's slot map is small enough (<= 8) that Inductor would compile it into code as a literal
ROWS = {"t_user": 300, "t_item": 200, "t_category": 40, "t_hour": 6}
VOCABULARY = 4000  # raw ids the training draws from (Zipf): more than any table has slots
ZCH_INSERTED = 150  # the most frequent ids t_item's slots are given (of 200)
EXTREMES = [MCH_FREE_SLOT - 1, -(2**63), 2**53 + 1, -(2**53) - 1, 0]  # each must arrive exactly


def raw_spec(tiny_spec: ModelSpec) -> ModelSpec:
    """tiny with every table's ids raw: MCH with one eviction policy or another, t_item ZCH."""
    tables = [
        {**t.model_dump(mode="json"), "rows": ROWS[t.name], "ids": "raw", "remap": REMAPS[t.name]}
        for t in tiny_spec.tables
    ]
    return tiny_spec.replace(name="tiny_raw", tables=tables)


def zipf_batch(spec: ModelSpec, vocabulary: torch.Tensor, generator: torch.Generator, n: int = 64):
    features = len(spec.feature_names)
    lengths = torch.randint(0, 4, (features * n,), generator=generator)
    ranks = torch.distributions.Pareto(1.0, 0.6).sample((int(lengths.sum()),)).long() - 1  # Zipf-like, long-tailed
    values = vocabulary[ranks.clamp_max(len(vocabulary) - 1)]
    ids = KeyedJaggedTensor(keys=list(spec.feature_names), values=values, lengths=lengths)
    return torch.randn(n, spec.dense_features, generator=generator), ids


@pytest.fixture(scope="module")
def trained(tiny_spec, tmp_path_factory):
    """(spec, its YAML, the trained float model in eval, its checkpoint): 30 SGD steps, MCH
    assigning slots to raw ids and evicting them as it goes."""
    folder = tmp_path_factory.mktemp("raw")
    spec = raw_spec(tiny_spec)
    spec.to_yaml(folder / "tiny_raw.yaml")
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    vocabulary = torch.randint(-(2**63), MCH_FREE_SLOT, (VOCABULARY,), generator=generator)
    model = DLRMFactory(spec).float_model(seed=0)
    insert_zch(model, vocabulary[:ZCH_INSERTED])
    train(model, spec, vocabulary, generator, steps=30)
    torch.save(model.state_dict(), folder / "checkpoint.pt")
    return spec, folder / "tiny_raw.yaml", model, folder / "checkpoint.pt"


def insert_zch(model, ids: torch.Tensor, evict: int = 0) -> None:
    """t_item's ZCH slots: ``evict`` of its owned slots freed (the first ones), then ``ids``
    inserted through the probe sequence, as its training would."""
    _, remaps = tbe.managed_collision_parts(model.sparse_arch.embedding_bag_collection.mc_embedding_bag_collection)
    identities = tbe.zch_identities(remaps["t_item"])
    identities[torch.nonzero(identities != ZCH_EMPTY_SLOT).flatten()[:evict]] = ZCH_EMPTY_SLOT
    zch_insert(identities, ids, REMAPS["t_item"]["max_probe"], REMAPS["t_item"]["buckets"])


def train(model, spec: ModelSpec, vocabulary: torch.Tensor, generator: torch.Generator, steps: int) -> None:
    model.train()
    for module in model.modules():
        if isinstance(module, HashZchManagedCollisionModule):
            module.eval()  # FBGEMM's CPU kernel looks up only (its slots: insert_zch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        dense, ids = zipf_batch(spec, vocabulary, generator)
        clicks = (dense[:, 0] > 0).float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, ids).reshape(-1), clicks)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.fixture(scope="module")
def trained_on(trained):
    """(the model trained 20 steps more, on a vocabulary whose most frequent half is new: MCH
    evicts ids and gives their slots to new ones, ZCH 40 evictions and 60 new ids; its checkpoint)."""
    spec, _, model, checkpoint = trained
    later = DLRMFactory(spec).float_model(seed=0)
    later.load_state_dict(torch.load(checkpoint, weights_only=True))
    generator = torch.Generator().manual_seed(2)
    fresh = torch.randint(-(2**63), MCH_FREE_SLOT, (VOCABULARY // 2,), generator=generator)
    old = torch.randint(-(2**63), MCH_FREE_SLOT, (VOCABULARY,), generator=torch.Generator().manual_seed(0))
    insert_zch(later, fresh[:60], evict=40)
    train(later, spec, torch.cat([fresh, old[: VOCABULARY // 2]]), generator, steps=20)
    torch.save(later.state_dict(), checkpoint.with_name("checkpoint-2.pt"))
    return later, checkpoint.with_name("checkpoint-2.pt")


@pytest.fixture(scope="module")
def archives(trained, tmp_path_factory) -> dict[str, Path]:
    _, spec_path, _, checkpoint = trained
    store = tmp_path_factory.mktemp("raw_store")
    kinds = {"eager": (Artifact.EAGER, None), "exported": (Artifact.EXPORTED, None), "aoti": (Artifact.AOTI, None),
             "split": (Artifact.SPLIT, SplitPlan(sparse=Artifact.EXPORTED, dense=Artifact.EXPORTED))}
    return {
        kind: build_archive(
            spec_path, checkpoint=checkpoint, seed=0, name=f"tiny_raw_{kind}", version="1.0", model_store=store,
            serving=ServingConfig(batch_size=8, max_batch_delay_ms=20), artifact=artifact, split=split,
        )
        for kind, (artifact, split) in kinds.items()
    }


def owned_ids(model) -> dict[str, torch.Tensor]:
    return {name: ids[ids != MCH_FREE_SLOT] for name, ids in slot_owners(model).items()}


def raw_request(spec: ModelSpec, model, seed: int, items: int = 12) -> dict:
    """Items whose bags mix ids the model owns slots for, unseen ids, and ``EXTREMES``."""
    request = items_request(spec, items, seed=seed, max_bag=4, owned_ids=slot_owners(model))
    request["items"][0]["sparse"]["user_id"] = EXTREMES
    return request


def tbe_weight(model, table: str) -> torch.Tensor:
    return model.sparse_arch.embedding_bag_collection.bags.embedding_bags[table].weight
