"""Raw 64-bit ids (``ids: raw``): a DLRM trained with TorchRec's managed collisions (MCH) on
Zipf-distributed raw ids spread over the whole int64 range, built into every artifact kind and
served by the real TorchServe; TorchRec's own eval model is the reference throughout."""

from __future__ import annotations

import json
import re
import zipfile

import numpy as np
import orjson
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from archive_tools.build import build_archive
from archive_tools.cli import main as cli_main
from archive_tools.delta import DeltaSource, make_delta
from archive_tools.local_server import LocalTorchServe
from archive_tools.model_config import ServingConfig
from archive_tools.planning import plan_tables
from archive_tools.planning.search import Budget
from benchmarks.raw_ids import raw_traffic, weights_file
from benchmarks.traffic import TrafficModel
from handlers.modeling import tbe
from handlers.modeling.errors import SpecError
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.raw_ids import RawIdBags, first_probe_slots, fused_in, served_remap, slot_maps, slot_owners
from handlers.modeling.registry import input_schema
from handlers.runtime.archive import Archive
from handlers.runtime.archive_files import LOG_POINTER
from handlers.runtime.artifacts import Artifact, CompiledPackage
from handlers.runtime.errors import BadRequest, InputError
from handlers.runtime.freshness.dense import dense_slot
from handlers.runtime.freshness.worker import WorkerFreshness
from handlers.runtime.id_buckets import index_of, is_index
from handlers.runtime.inputs import MCH_FREE_SLOT, ZCH_EMPTY_SLOT
from handlers.runtime.slot_maps import owners_of, slot_maps_in
from handlers.runtime.wire.decoder import RequestDecoder
from handlers.runtime.wire.messages import BinaryBody, Rejected
from handlers.runtime.wire.v2_tensors import encode_request
from tests.helpers import QUANTIZATION_TOLERANCE, archive_service, float_scores, items_request
from tests.integration.raw_id_models import (
    EXTREMES,
    REMAPS,
    ROWS,
    owned_ids,
    raw_request,
    tbe_weight,
    train,
)

from torchrec.modules.mc_adapter import McEmbeddingBagCollectionAdapter  # isort: skip
from torchrec.sparse.jagged_tensor import JaggedTensor  # isort: skip

pytestmark = pytest.mark.integration

def test_the_remap_is_torchrecs_eval_remap_on_a_million_ids(trained):
    """The served model's slot of every id equals TorchRec's MCH or ZCH module's in eval, for ids
    it owns slots for and ids it has never seen (half each), every table's in one call."""
    spec, _, model, _ = trained
    factory = DLRMFactory(spec)
    served = factory.inference_model(factory.quantize(model))
    remaps = served.sparse_arch.embedding_bag_collection
    assert isinstance(remaps, RawIdBags)
    _, modules = tbe.managed_collision_parts(model.sparse_arch.embedding_bag_collection.mc_embedding_bag_collection)
    remap = remaps.raw_id_remaps
    assert remap.hashed_tables == ["t_item"] and set(remap.sorted_tables) == set(ROWS) - {"t_item"}
    generator = torch.Generator().manual_seed(1)
    unseen_shares, ids, expected = {}, {}, {}
    for name, owned in owned_ids(model).items():
        assert len(owned) > ROWS[name] // 2, f"{name}: training gave few slots an owner"
        seen = owned[torch.randint(0, len(owned), (500_000,), generator=generator)]
        anywhere = torch.randint(-(2**63), MCH_FREE_SLOT, (500_000,), generator=generator)
        ids[name] = torch.cat([seen, anywhere, torch.tensor(EXTREMES)])
        lengths = torch.ones(len(ids[name]), dtype=torch.int64)
        expected[name] = modules[name].remap({name: JaggedTensor(values=ids[name], lengths=lengths)})[name].values()
    first_feature = {t.name: t.features[0] for t in spec.tables}  # a table's ids all go to its first
    table_of = {f: t.name for t in spec.tables for f in t.features}
    per_feature = [ids[table_of[f]][: len(ids[table_of[f]]) if f == first_feature[table_of[f]] else 0]
                   for f in remap.features]
    sizes = [len(i) for i in per_feature]
    mapped = remap(torch.cat(per_feature), torch.tensor(sizes)).split(sizes)
    for name in ids:
        slots = mapped[remap.features.index(first_feature[name])]
        assert torch.equal(slots, expected[name]), name
        unseen_shares[name] = float((slot_owners(model)[name][slots[500_000:]] != ids[name][500_000:]).float().mean())
        unseen_slots = slots[500_000:].unique().numel()  # MCH: the default row; ZCH: where probing starts
        assert unseen_slots == 1 if name != "t_item" else unseen_slots == ROWS[name], (name, unseen_slots)
    assert all(share > 0.99 for share in unseen_shares.values()), unseen_shares  # random ids are unseen


def test_served_scores_are_the_trained_models_within_quantization(trained, archives):
    """Guards TorchRec's trap (its quantized managed-collision module made from the float one
    alone serves random tables): the eager archive scores as the trained float model."""
    spec, _, model, _ = trained
    service = archive_service(archives["eager"])
    for seed in range(3):
        request = raw_request(spec, model, seed)
        body = orjson.loads(service.handle([orjson.dumps(request)]).responses[0].body)
        torch.testing.assert_close(
            torch.tensor(body["scores"]), float_scores(model, spec, request), atol=QUANTIZATION_TOLERANCE, rtol=0
        )


def test_every_artifact_kind_remaps_and_counts_unseen_ids_as_eager(trained, archives):
    spec, _, model, _ = trained
    services = {kind: archive_service(path) for kind, path in archives.items()}
    requests = [orjson.dumps(raw_request(spec, model, seed, items)) for seed, items in ((5, 1), (6, 9), (7, 40))]
    eager_service = services.pop("eager")
    expected = [orjson.loads(r.body)["scores"] for r in eager_service.handle(requests).responses]
    unseen, raw = eager_service.unseen_ids.since_last()
    assert all(unseen.values()) and raw.keys() == set(ROWS)
    for kind, service in services.items():
        for got, want in zip(service.handle(requests).responses, expected):
            assert orjson.loads(got.body)["scores"] == pytest.approx(want, abs=1e-6), kind
        assert service.unseen_ids.since_last() == (unseen, raw), kind
        empty = raw_request(spec, model, 8, items=2)
        for item in empty["items"]:
            item["sparse"] = {}  # no id at all: the service pads the forward with one, not counted
        service.handle([orjson.dumps(empty)])
        assert set(service.unseen_ids.since_last()[1].values()) == {0}, kind


def test_a_compiled_package_makes_its_bucket_index_from_its_sorted_ids_and_refuses_a_weights_file_short_of_a_map(
    archives, tmp_path
):
    """The weights file holds no bucket index (``compile_aoti`` leaves it out): loading the
    package makes it from its sorted ids. A constant the file lacks is refused naming it."""
    with Archive.open(archives["aoti"]) as archive:
        package = archive.unpacked() / "model_aoti.pt2"
        weights = torch.load(weights_file(package.parent), weights_only=True)
        assert not [name for name in weights if is_index(name)]
        active = CompiledPackage(package).active
        (index,) = [name for name in active if is_index(name)]
        remap = index.removesuffix("bucket_index")
        assert torch.equal(active[index], index_of(active[remap + "sorted_ids"], active[remap + "bucket_tables"]))
        short = tmp_path / "weights.pt"
        torch.save({k: v for k, v in weights.items() if not k.endswith("raw_id_remaps.slots")}, short)
        with pytest.raises(ValueError, match=r"its weights file lacks constants \['.*raw_id_remaps\.slots'\]"):
            CompiledPackage(package, short)


def test_unseen_ids_are_counted_on_after_a_dense_swap(trained, archives):
    """A swap of the dense weights (a delta's dense section) keeps the model's raw-id counters."""
    spec, _, model, _ = trained
    request = [orjson.dumps(raw_request(spec, model, 13))]
    for kind in ("eager", "aoti"):
        service = archive_service(archives[kind])
        counted = _unseen_after(service, request)
        assert all(counted.values()), kind
        dense_slot(service.model).swap_dense(None)
        assert _unseen_after(service, request) == counted, kind


def test_unseen_zero_looks_up_a_zero_row(trained, archives, tmp_path):
    """``unseen: zero`` on t_user (sum pooling): its default row is zero in the float model once
    a checkpoint trained without it is loaded, is zeroed by each forward, and is zero in the
    served table, so an item whose user_id bag holds unseen ids scores as with an empty bag (the
    default_row archive scores it otherwise)."""
    spec, _, model, checkpoint = trained
    tables = [t.model_dump(mode="json") for t in spec.tables]
    tables[0]["remap"]["unseen"] = "zero"
    zero = spec.replace(name="tiny_raw_zero", tables=tables)
    zero.to_yaml(tmp_path / "zero.yaml")
    factory = DLRMFactory(zero)
    float_zero = factory.float_model(seed=0)
    factory.load_checkpoint(float_zero, torch.load(checkpoint, weights_only=True))
    default_rows = {m: tbe_weight(m, "t_user")[-1] for m in (model, float_zero)}
    assert default_rows[float_zero].eq(0).all() and default_rows[model].ne(0).any()
    with torch.no_grad():  # as an optimizer step after the last forward could leave it
        tbe_weight(float_zero, "t_user")[-1].fill_(1.0)
    train(float_zero, zero, owned_ids(model)["t_user"], torch.Generator().manual_seed(3), steps=2)
    assert tbe_weight(float_zero, "t_user")[-1].eq(0).all()  # its forwards zeroed it (owned ids: no gradient)
    random_rows = factory.random_weights(seed=5).tables["t_user"]  # no float model: zeroed as served
    assert all(part[-1].eq(0).all() for part in random_rows if part is not None) and random_rows[0][0].ne(0).any()
    archive = build_archive(tmp_path / "zero.yaml", checkpoint=checkpoint, seed=0, name="tiny_raw_zero", version="1.0",
                            model_store=tmp_path, serving=ServingConfig(batch_size=8), artifact=Artifact.EAGER)
    unseen = torch.randint(-(2**63), MCH_FREE_SLOT, (3,), generator=torch.Generator().manual_seed(4)).tolist()
    assert not np.isin(unseen, owned_ids(model)["t_user"].numpy()).any()
    with_unseen, empty = raw_request(spec, model, 31, items=2), raw_request(spec, model, 31, items=2)
    with_unseen["items"][0]["sparse"]["user_id"], empty["items"][0]["sparse"]["user_id"] = unseen, []
    served_zero, served_default = archive_service(archive), archive_service(archives["eager"])
    assert _first_score(served_zero, with_unseen) == pytest.approx(_first_score(served_zero, empty), abs=1e-6)
    assert _first_score(served_default, with_unseen) != pytest.approx(_first_score(served_default, empty), abs=1e-4)
    factory.load_checkpoint(float_zero, torch.load(checkpoint, weights_only=True))  # the trained model, held at zero
    assert _first_score(served_zero, with_unseen) == pytest.approx(
        float(float_scores(float_zero, zero, with_unseen)[0]), abs=QUANTIZATION_TOLERANCE)


def test_zch_unseen_zero_leaves_unseen_ids_out_of_their_bags(trained, archives, tmp_path):
    """``unseen: zero`` on t_item (ZCH, sum pooling): an id it has not seen looks up no row, so an
    item whose item_id bag holds unseen ids beside owned ones scores as with the owned ones alone,
    served (slot -1, which FBGEMM's lookup skips) and in the float model (which leaves them out of
    their bags in eval); they are still counted unseen. The probe_slot archive scores it otherwise."""
    spec, _, model, checkpoint = trained
    tables = [t.model_dump(mode="json") for t in spec.tables]
    next(t for t in tables if t["name"] == "t_item")["remap"]["unseen"] = "zero"
    zero = spec.replace(name="tiny_raw_zch_zero", tables=tables)
    zero.to_yaml(tmp_path / "zero.yaml")
    factory = DLRMFactory(zero)
    float_zero = factory.float_model(seed=0)
    factory.load_checkpoint(float_zero, torch.load(checkpoint, weights_only=True))
    float_zero.eval()
    archive = build_archive(tmp_path / "zero.yaml", checkpoint=checkpoint, seed=0, name="tiny_raw_zch_zero",
                            version="1.0", model_store=tmp_path, serving=ServingConfig(batch_size=8),
                            artifact=Artifact.EAGER)
    owned = owned_ids(model)["t_item"][:2].tolist()
    unseen = torch.randint(-(2**63), MCH_FREE_SLOT, (3,), generator=torch.Generator().manual_seed(6)).tolist()
    assert not np.isin(unseen, owned_ids(model)["t_item"].numpy()).any()
    with_unseen, owned_only = raw_request(spec, model, 41, items=2), raw_request(spec, model, 41, items=2)
    with_unseen["items"][0]["sparse"]["item_id"], owned_only["items"][0]["sparse"]["item_id"] = owned + unseen, owned

    served_zero, served_probe = archive_service(archive), archive_service(archives["eager"])
    assert _first_score(served_zero, with_unseen) == pytest.approx(_first_score(served_zero, owned_only), abs=1e-6)
    assert _first_score(served_probe, with_unseen) != pytest.approx(_first_score(served_probe, owned_only), abs=1e-4)
    reference = float(float_scores(float_zero, zero, with_unseen)[0])
    assert reference == pytest.approx(float(float_scores(float_zero, zero, owned_only)[0]), abs=1e-6)
    assert _first_score(served_zero, with_unseen) == pytest.approx(reference, abs=QUANTIZATION_TOLERANCE)
    counts = [_unseen_after(s, [orjson.dumps(with_unseen)])["t_item"] for s in (served_zero, served_probe)]
    assert counts[0] == counts[1] >= len(unseen)


def _unseen_after(service, payloads: list[bytes]) -> dict[str, int]:
    """Per raw-id table, the unseen ids of one batch of ``payloads``."""
    service.unseen_ids.since_last()
    service.handle(payloads)
    return service.unseen_ids.since_last()[0]


def _first_score(service, request: dict) -> float:
    return orjson.loads(service.handle([orjson.dumps(request)]).responses[0].body)["scores"][0]


def test_raw_ids_arrive_exactly_and_the_free_slot_marker_is_refused(trained):
    spec, _, model, _ = trained
    decoder = RequestDecoder(input_schema(spec))
    request = raw_request(spec, model, 9, items=1)
    ids = decoder.decode(orjson.dumps(request)).inputs.tensors["sparse_features"]
    user_ids = dict(zip(spec.feature_names, ids.per_feature()))["user_id"]
    assert user_ids.tolist() == EXTREMES  # no float round trip: 2^63-2 and 2^53+1 kept
    request["items"][0]["sparse"] = {"user_id": [ZCH_EMPTY_SLOT], "item_id": [MCH_FREE_SLOT]}  # each the other kind's marker
    assert decoder.decode(orjson.dumps(request)).inputs.tensors["sparse_features"].values.tolist() == [
        ZCH_EMPTY_SLOT, MCH_FREE_SLOT]
    for feature, bad, problem in (("user_id", MCH_FREE_SLOT, f"raw id {MCH_FREE_SLOT} is reserved"),
                                  ("item_id", ZCH_EMPTY_SLOT, "raw id -1 is reserved"),
                                  ("user_id", 2**63, "out of int64 range"), ("item_id", -(2**63) - 1, "within int64's range")):
        request["items"][0]["sparse"] = {feature: [5, bad]}
        with pytest.raises(Rejected) as refused:
            decoder.decode(json.dumps(request).encode())  # orjson writes no integer past 64 bits
        error = refused.value.error
        assert isinstance(error, BadRequest) and error.field == f"items[0].sparse.{feature}[1]", error.message
        assert problem in error.message


@pytest.fixture(scope="module")
def server(archives):
    """One TorchServe over the archives' model store, for the tests that serve through it."""
    with LocalTorchServe(model_store=archives["aoti"].parent) as server:
        yield server


def test_served_by_torchserve_counting_unseen_ids_exactly_and_refusing_a_reserved_id(trained, archives, server):
    """The AOTI archive through TorchServe: the extremes scored as in process; each table's unseen
    ids (owning no slot) and looked-up ids published as HandlerUnseenIds / HandlerRawIds, the
    metrics the dashboard's raw-id panel divides."""
    spec, _, model, _ = trained
    reference = archive_service(archives["eager"])
    owned, table_of = owned_ids(model), {f: t.name for t in spec.tables for f in t.features}
    unseen, looked_up = dict.fromkeys(owned, 0), dict.fromkeys(owned, 0)
    assert server.register(archives["aoti"].name, initial_workers=1).status_code == 200
    for seed in (11, 12):
        request = raw_request(spec, model, seed)
        response = server.predict("tiny_raw_aoti", request)
        assert response.status_code == 200, response.text
        expected = orjson.loads(reference.handle([orjson.dumps(request)]).responses[0].body)["scores"]
        assert response.json()["scores"] == pytest.approx(expected, abs=1e-6)
        for item in request["items"]:
            for feature, ids in item["sparse"].items():
                table = table_of[feature]
                unseen[table] += int((~np.isin(ids, owned[table].numpy())).sum())
                looked_up[table] += len(ids)
    request["items"][1]["sparse"]["item_id"] = [3, ZCH_EMPTY_SLOT]  # a ZCH table's empty-slot marker
    response = server.predict("tiny_raw_aoti", request)
    assert response.status_code == 400 and response.json()["field"] == "items[1].sparse.item_id[1]"
    published = _published(server.scrape("tiny_raw_aoti"), "tiny_raw_aoti")
    assert {t: published[("HandlerUnseenIds", t)] for t in owned} == unseen and all(unseen.values())
    assert {t: published[("HandlerRawIds", t)] for t in owned} == looked_up


def _published(text: str, model: str) -> dict[tuple[str, str], float]:
    """{(counter, Table label): value} of ``model``'s samples in a Prometheus scrape."""
    return {
        (family.name, sample.labels["Table"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("ModelName") == model and "Table" in sample.labels
    }


def test_what_raw_id_tables_do_not_do_yet_is_refused_naming_why(trained, tiny_spec, archives, tmp_path):
    """A collection mixing raw and index tables, a rows file for a raw-id table, a delta of an
    archive built before raw-id deltas, planning a raw-id spec; and a slot map of the wrong size, or none, for a served table."""
    spec, spec_path, model, checkpoint = trained
    mixed = spec.replace(tables=[spec.tables[0], *tiny_spec.tables[1:]])
    with pytest.raises(SpecError, match=r"\['t_user'\] \(ids raw\) and .* \(ids index\)"):
        DLRMFactory(mixed).float_model(seed=0)
    torch.save({"t_user": {"ids": torch.tensor([4]), "rows": torch.zeros(1, spec.tables[0].dim)}}, tmp_path / "rows.pt")
    with pytest.raises(InputError, match="table t_user takes raw ids: its rows move between ids"):
        make_delta(archives["eager"], DeltaSource(rows=tmp_path / "rows.pt"), tmp_path / "unused.delta", sequence=1)
    old = tmp_path / "built_before"  # an archive whose tables.json predates raw-id deltas
    with zipfile.ZipFile(archives["eager"]) as packed:
        packed.extractall(old)
    layout = json.loads((old / "tables.json").read_text())
    for table in layout["tables"]:
        del table["raw_ids"]
    (old / "tables.json").write_text(json.dumps(layout))
    with pytest.raises(InputError, match=r"does not mark raw-id tables \['t_category', 't_hour', 't_item', 't_user'\]"):
        make_delta(old, DeltaSource(checkpoint=checkpoint), tmp_path / "unused.delta", sequence=1)
    (old / LOG_POINTER).write_text("{}")  # registered through the plugin: a server refuses its deltas too
    assert "predates raw-id deltas" in WorkerFreshness.open(old, Archive(old).options)  # type: ignore[operator]
    with pytest.raises(SpecError, match=r"take raw ids \(ids: raw\): the planner"):
        plan_tables(spec_path, tmp_path / "unread.jsonl", Budget(0.001, 0.002), tmp_path / "plan")
    served = DLRMFactory(spec).inference_model(DLRMFactory(spec).quantize(model)).sparse_arch.embedding_bag_collection
    maps = slot_maps(model)
    with pytest.raises(ValueError, match=r"the slot maps of tables \[.*'t_hour'.*\] do not lie end to end"):
        served.load_slot_maps(maps)  # each table's own tensors: the remap would not see a delta's writes
    short = fused_in(served, {**maps, "t_hour": tuple(part[:5] for part in maps["t_hour"])})
    with pytest.raises(ValueError, match=r"table t_hour's slot map must be int64 \[6\] a part, got \[\[5\], \[5\]\]"):
        served.load_slot_maps(short)
    with pytest.raises(ValueError, match=r"tables \['t_item'\]: their slot maps must be identities, got 2 part"):
        served.load_slot_maps(fused_in(served, {**maps, "t_item": maps["t_hour"]}))
    with pytest.raises(ValueError, match=r"raw-id tables \['t_item', 't_user'\] come without their slot maps"):
        served.load_slot_maps({"t_hour": maps["t_hour"], "t_category": maps["t_category"]})


def test_generated_requests_draw_owned_ids_mostly_and_unseen_ones_across_int64(trained):
    """What the build verifies on when no validation file is given."""
    spec, _, model, _ = trained
    owned = owned_ids(model)["t_user"].numpy()
    requests = [items_request(spec, 8, seed=s, owned_ids=slot_owners(model)) for s in range(20)]
    ids = np.array([i for r in requests for item in r["items"] for i in item["sparse"]["user_id"]])
    seen = np.isin(ids, owned)
    assert 0.6 < seen.mean() < 0.9, seen.mean()
    assert (ids[~seen] < -(2**40)).any() and (ids[~seen] > 2**40).any()


def test_binary_int64_tensors_carry_raw_ids_exactly(trained):
    """KServe v2 binary tensors: the same ids as in JSON, bit for bit; the marker refused by name."""
    spec, _, _, _ = trained
    decoder = RequestDecoder(input_schema(spec))
    features = len(spec.feature_names)
    lengths = np.array([[len(EXTREMES)]] + [[0]] * (features - 1), dtype=np.int64)  # [F, 1]: user_id's bag

    def body(values: list[int]) -> BinaryBody:
        arrays = {"dense_features": np.zeros((1, spec.dense_features), np.float32),
                  "sparse_features.lengths": lengths, "sparse_features.values": np.array(values, np.int64)}
        return BinaryBody(*encode_request(arrays))

    ids = decoder.decode(body(EXTREMES)).inputs.tensors["sparse_features"]
    assert ids.values.tolist() == EXTREMES
    with pytest.raises(Rejected) as refused:
        decoder.decode(body([*EXTREMES[:-1], MCH_FREE_SLOT]))
    assert "reserved" in refused.value.error.message and "user_id" in refused.value.error.field


def test_the_benchmarks_raw_traffic_looks_up_the_rows_of_its_row_traffic(trained, archives):
    """benchmarks.raw_ids: its raw requests (row ids replaced by the raw ids that own those rows
    in a compiled archive's slot maps) look up the same rows, but for the ids it counts unseen,
    which own no slot."""
    spec, _, _, _ = trained
    with Archive.open(archives["aoti"]) as archive:
        weights = torch.load(weights_file(archive.unpacked()), weights_only=True)
        maps = slot_maps_in(weights)
    assert set(maps) == set(ROWS)
    rows = TrafficModel(items_per_request=3).generate(spec, 40, seed=4)
    raw, unseen = raw_traffic(rows, spec, maps, unseen_share=0.2, seed=5)
    table_of = {f: t.name for t in spec.tables for f in t.features}
    found_unseen = 0
    for row_body, raw_body in zip(rows.bodies, raw.bodies):
        for row_item, raw_item in zip(orjson.loads(row_body)["items"], orjson.loads(raw_body)["items"]):
            for feature, ids in raw_item["sparse"].items():
                table = table_of[feature]
                remap = served_remap(next(t for t in spec.tables if t.name == table))
                remap.load({table: maps[table]})
                ids, owners = torch.tensor(ids, dtype=torch.int64), owners_of(maps[table])
                owned = torch.isin(ids, owners[owners != MCH_FREE_SLOT])
                slots = remap.first_feature(ids)
                assert torch.equal(slots[owned], torch.tensor(row_item["sparse"][feature])[owned])
                if REMAPS[table]["kind"] == "zch":  # an unseen id: where its probing starts
                    assert torch.equal(slots[~owned], first_probe_slots(ids[~owned], ROWS[table], REMAPS[table]["buckets"]))
                else:  # the default row
                    assert (slots[~owned] == ROWS[table] - 1).all()
                found_unseen += int((~owned).sum())
    assert sum(unseen) == found_unseen > 0


def test_a_model_trained_with_torchrecs_adapter_has_the_state_names_the_float_model_loads(tiny_spec):
    """TorchRec's McEmbeddingBagCollectionAdapter (sort ZCH: MCH with DistanceLFU) keeps its state
    under the names, shapes and dtypes ManagedBags does, so its checkpoints load strictly."""
    spec = tiny_spec.replace(tables=[
        {**t.model_dump(mode="json"), "ids": "raw", "remap": {"kind": "mch", "eviction": "distance_lfu"}}
        for t in tiny_spec.tables
    ])
    ours = DLRMFactory(spec).float_model(seed=0).sparse_arch.embedding_bag_collection
    adapter = McEmbeddingBagCollectionAdapter(
        tables=ours.embedding_bag_configs(), input_hash_size=2**62, device=torch.device("cpu"), world_size=1,
        zch_method="sort_zch",
    )
    theirs = adapter.state_dict()  # its tables on meta (the adapter's own choice): names, shapes and dtypes
    assert {k: (v.shape, v.dtype) for k, v in theirs.items()} == {k: (v.shape, v.dtype) for k, v in ours.state_dict().items()}


def _publish(server: LocalTorchServe, model: str, dense_sequence: int, **params) -> dict:
    """Publishes (or rolls back), then waits until the tables are applied and every worker
    serves the dense weights of delta ``dense_sequence``."""
    response = server.management("POST", f"/freshness/{model}", params=params)
    assert response.status_code == 200, response.text

    def served(state: dict) -> bool:
        applied = state.get("rolling_back_to") is None and state["applied_sequence"] == state["log_head"]  # null: left out
        return applied and {w.get("dense_sequence") for w in state["workers"]} == {dense_sequence}

    return server.freshness_when(model, served, timeout_s=60)


def test_a_slot_delta_serves_what_a_fresh_build_of_the_later_checkpoint_serves(
    trained, trained_on, archives, server, tmp_path, capsys
):
    """Training on evicts ids and gives their slots to new ones: the delta carries those slots
    with their new owners and rows (and the new dense weights). Published to the AOTI archive
    (two workers) and the eager one through TorchServe, each serves the later checkpoint's fresh
    build exactly; a rollback serves the base again."""
    spec, spec_path, model, _ = trained
    later, checkpoint = trained_on
    store = archives["aoti"].parent
    (store / "deltas").mkdir(exist_ok=True)  # where the plugin reads published deltas from
    fresh = build_archive(spec_path, checkpoint=checkpoint, seed=0, name="tiny_raw_fresh", version="1.0",
                          model_store=tmp_path, serving=ServingConfig(batch_size=8), artifact=Artifact.EAGER)
    moved = {t: int((slot_owners(later)[t] != slot_owners(model)[t]).sum()) for t in ROWS}
    assert all(moved[t] > 0 for t in ("t_user", "t_item", "t_category")), moved  # evictions and insertions
    for kind in ("aoti", "eager"):  # through the command line: its per-table lines, and --verify
        path = store / "deltas" / f"slots-{kind}.delta"
        assert cli_main(["delta", str(archives[kind]), "--checkpoint", str(checkpoint), "--dense", str(checkpoint),
                         "--out", str(path), "--sequence", "1", "--verify"]) == 0
        lines = re.findall(r"^  (\w+) +([\d,]+) rows(?:, ([\d,]+) of their slots to new owners)?$",
                           capsys.readouterr().err, re.M)
        rows = {t: int(n.replace(",", "")) for t, n, _ in lines}
        said_moved = {t: int(m.replace(",", "")) for t, _, m in lines if m}
        assert {t: n for t, n in said_moved.items() if n} == {t: n for t, n in moved.items() if n}, (kind, lines)
        assert all(rows[t] >= moved[t] for t in moved), (rows, moved)
    requests = [raw_request(spec, later, seed) for seed in (21, 22)] + [raw_request(spec, model, 23)]
    base, expected = archive_service(archives["eager"]), archive_service(fresh)

    def scores(service) -> list[float]:
        return [x for r in requests for x in orjson.loads(service.handle([orjson.dumps(r)]).responses[0].body)["scores"]]

    assert scores(base) != pytest.approx(scores(expected), abs=1e-4)
    for kind, workers in (("aoti", 2), ("eager", 1)):
        model_name = f"tiny_raw_{kind}_fresh"  # a registration of its own on the module's server
        assert server.register(archives[kind].name, model_name=model_name, initial_workers=workers).status_code == 200
        served = lambda: [x for r in requests for x in server.predict(model_name, r).json()["scores"]]  # noqa: E731
        assert served() == pytest.approx(scores(base), abs=1e-6), kind
        _publish(server, model_name, 1, delta=f"slots-{kind}.delta")
        assert served() == pytest.approx(scores(expected), abs=1e-6), kind
        _publish(server, model_name, 0, rollback_to=0)
        assert served() == pytest.approx(scores(base), abs=1e-6), kind
