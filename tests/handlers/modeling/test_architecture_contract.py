"""The architecture contract from the user's side: an architecture named by import path from a
folder that is no installed package, its embedding collections found wherever it put them, and
every way of breaking the contract refused in one line naming what is wrong."""

from __future__ import annotations

import itertools
import sys
import textwrap

import pytest
import torch

from handlers.modeling.architecture import CONTRACT_VERSION
from handlers.modeling.eager import eager_service
from handlers.modeling.embedding_modules import find_collections
from handlers.modeling.errors import SpecError
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.registry import input_schema, parse_spec, synthetic_request
from tests.handlers.modeling.user_architecture import USER_MODULE, USER_SPEC
from tests.helpers import QUANTIZATION_TOLERANCE

_NAMES = itertools.count()


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes a module into a fresh folder on sys.path; returns a function of its source -> its name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        name = f"users_models_{next(_NAMES)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    yield write
    for name in [m for m in sys.modules if m.startswith("users_models_")]:
        del sys.modules[name]


def _spec(architecture: str, **changes):
    return parse_spec({**USER_SPEC, "architecture": architecture, **changes})


def _scores(service, requests):
    return torch.tensor([s for r in requests for s in _json(service.handle([_body(r)]).responses[0].body)["scores"]])


def _body(request):
    import orjson

    return orjson.dumps(request)


def _json(body):
    import orjson

    return orjson.loads(body)


def test_a_users_architecture_by_import_path_is_found_quantized_and_served(user_module):
    module = user_module(USER_MODULE)
    spec = _spec(f"{module}:TwoTowerArchitecture")
    factory = DLRMFactory(spec)
    float_model = factory.float_model(seed=0)
    assert [(c.path, c.tables) for c in find_collections(float_model)] == [
        ("user_side.embeddings", ("t_user",)),
        ("item_bags", ("t_item", "t_cat")),
    ]
    weights = factory.quantize(float_model)
    served = factory.inference_model(weights)
    assert {c.path for c in find_collections(served)} == {"user_side.embeddings", "item_bags"}
    requests = [synthetic_request(spec, n, seed=n) for n in (1, 4, 9)]
    float_scores = _scores(eager_service(spec, float_model), requests)
    served_scores = _scores(eager_service(spec, served), requests)
    torch.testing.assert_close(served_scores, float_scores, atol=QUANTIZATION_TOLERANCE, rtol=0)
    assert not torch.equal(served_scores, float_scores)  # int4/int8 tables: quantized, not float


def test_every_table_of_every_collection_lies_in_the_weights_file(user_module, tmp_path):
    spec = _spec(f"{user_module(USER_MODULE)}:TwoTowerArchitecture")
    factory = DLRMFactory(spec)
    weights = factory.quantize(factory.float_model(seed=0))
    factory.save_weights(weights, tmp_path / "weights.pt")
    layout = factory.tables_layout(tmp_path / "weights.pt")
    assert {(t.name, t.rows, t.dtype) for t in layout.tables} == {
        ("t_user", 300, "int8"), ("t_item", 500, "fp16"), ("t_cat", 40, "int4"),
    }
    loaded = factory.load_weights(tmp_path / "weights.pt")
    for name, (rows, _) in weights.tables.items():
        assert torch.equal(loaded.tables[name][0], rows), name


BROKEN = [
    ("no_such_arch", None, "architecture: 'no_such_arch' is neither a registered architecture"),
    ("{m}:Missing", "", "has no attribute 'Missing'"),
    ("{m}:NOT_ONE", "NOT_ONE = 3\n", "is a int, not a handlers.modeling.architecture.Architecture"),
    ("{m}:A", "raise ImportError('torch_geometric is not installed')\n",
     "cannot import {m}: ImportError: torch_geometric is not installed"),
    ("{m}:NoBuild", USER_MODULE + "\nclass NoBuild(TwoTowerArchitecture):\n    build = Architecture.build\n",
     "Can't instantiate abstract class NoBuild"),
    ("{m}:Old", USER_MODULE + "\nclass Old(TwoTowerArchitecture):\n    contract_version = 0\n",
     f"written for contract version 0, this torchrec-serve implements {CONTRACT_VERSION}"),
]


@pytest.mark.parametrize("architecture, source, message", BROKEN, ids=lambda v: str(v)[:20])
def test_a_broken_architecture_is_refused_naming_it(user_module, architecture, source, message):
    module = user_module(source) if source is not None else "unused"
    with pytest.raises(SpecError, match=message.format(m=module).replace("(", r"\(").replace(")", r"\)")):
        _spec(architecture.format(m=module))


_ITEM_BAGS = 'tables.bags("t_item", "t_cat")'
_FORWARD = "def forward(self, dense_features, sparse_features):"
_SHORT_ITEM_BAGS = (
    '__import__("torchrec").EmbeddingBagCollection(tables=[__import__("torchrec").EmbeddingBagConfig('
    'name="t_item", num_embeddings=499, embedding_dim=8, feature_names=["item"])], device=tables.device)'
)
_PROCESSED_ITEM_BAGS = (  # TorchRec's feature processors take weighted collections: weighted_ids below
    '__import__("torchrec").modules.fp_embedding_modules.FeatureProcessedEmbeddingBagCollection('
    + _ITEM_BAGS + ', __import__("torchrec").modules.feature_processor_.PositionWeightedModuleCollection('
    '{"item": 4, "cat": 4}))'
)
_MEAN_ITEM_BAGS = """__import__("torchrec").EmbeddingBagCollection(
            tables=[
                __import__("torchrec").EmbeddingBagConfig(name="t_item", num_embeddings=500, embedding_dim=8,
                    feature_names=["item"], pooling=__import__("torchrec").PoolingType.MEAN),
                __import__("torchrec").EmbeddingBagConfig(name="t_cat", num_embeddings=40, embedding_dim=4,
                    feature_names=["cat"]),
            ],
            device=tables.device,
        )"""
_UNWEIGHTED_USER_BAGS = (
    '__import__("torchrec").EmbeddingBagCollection(tables=tables.bags("t_user").embedding_bag_configs(), '
    "is_weighted=False, device=tables.device)"
)


_MANAGED_ITEM_BAGS = """(lambda bags, mc: __import__("torchrec").modules.mc_embedding_modules.
            ManagedCollisionEmbeddingBagCollection(bags, mc.ManagedCollisionCollection(
                managed_collision_modules={
                    c.name: mc.MCHManagedCollisionModule(
                        zch_size=c.num_embeddings, device=tables.device,
                        eviction_policy=mc.DistanceLFU_EvictionPolicy(), eviction_interval=1)
                    for c in bags.embedding_bag_configs()
                },
                embedding_configs=bags.embedding_bag_configs()), return_remapped_features=False)
        )(tables.bags("t_item", "t_cat"), __import__("torchrec").modules.mc_modules)"""  # raw ids: MCH before the bags

# (what the user's model does wrong: the source it replaces, with what, the spec's weighted_ids,
# and the one line the build fails with)
MODEL_FAULTS = [
    ("forward", _FORWARD, "def forward(self, dense, ids):", False,
     r"TwoTower.forward takes \(dense, ids\), its input_tags declare \(dense_features, sparse_features\)"),
    ("processor", _ITEM_BAGS, _PROCESSED_ITEM_BAGS, True,
     "item_bags: FeatureProcessedEmbeddingBagCollection: feature processors are not served"),
    ("missing table", 'nn.ModuleDict({"embeddings": tables.bags("t_user")})', "nn.ModuleDict()", False,
     r"tables: \['t_user'\] are in the spec but in none of the model's embedding collections"),
    ("managed collisions", _ITEM_BAGS, _MANAGED_ITEM_BAGS, False,
     "item_bags: ManagedCollisionEmbeddingBagCollection: managed collisions are served for tables with ids: raw, "
     "in the collection EmbeddingTables.bags makes of them"),
    ("unknown table", 'tables.bags("t_user")', 'tables.bags("t_users")', False,
     r"tables: the architecture asks for \['t_users'\], the spec has"),
    ("pooled as a sequence", 'tables.bags("t_user")', 'tables.sequences("t_user")', False,
     r"tables: \['t_user'\] asked for as unpooled \(sequences, pooling: none\) tables"),
    ("shape", _ITEM_BAGS, _SHORT_ITEM_BAGS, False, r"item_bags: table t_item: 499 rows x dim 8, the spec says 500 x 8"),
    ("pooling", _ITEM_BAGS, _MEAN_ITEM_BAGS, False, "item_bags: table t_item: pooling mean, the spec says sum"),
    ("weighting", 'tables.bags("t_user")', _UNWEIGHTED_USER_BAGS, True,
     "user_side.embeddings: is_weighted=False, the spec's weighted_ids is True"),
]


@pytest.mark.parametrize("fault, old, new, weighted, message", MODEL_FAULTS, ids=[f[0] for f in MODEL_FAULTS])
def test_a_model_that_breaks_the_contract_fails_the_build_naming_it(user_module, fault, old, new, weighted, message):
    assert old in USER_MODULE
    spec = _spec(f"{user_module(USER_MODULE.replace(old, new))}:TwoTowerArchitecture", weighted_ids=weighted)
    with pytest.raises(SpecError, match=message):
        DLRMFactory(spec).float_model(seed=0)


def test_the_sequence_table_is_served_quantized_not_left_in_float():
    """TorchRec's quantize_embeddings leaves an EmbeddingCollection in float unless told; the
    factory quantizes every collection, the unpooled one to its int8 rows too."""
    from din_ranker.train import SPEC

    from handlers.modeling import tbe
    from handlers.modeling.registry import load_spec

    spec = load_spec(SPEC)
    factory = DLRMFactory(spec)
    served = factory.inference_model(factory.quantize(factory.float_model(seed=0)))
    kinds = {c.path: type(c.module).__module__ for c in find_collections(served)}
    assert kinds == {"item_embeddings": "torchrec.quant.embedding_modules", "candidate_side.bags": "torchrec.quant.embedding_modules"}
    dtypes = {name: sparse_type.value for module in tbe.tbes(served) for name, _, _, sparse_type, *_ in module.embedding_specs}
    assert dtypes == {"t_item": "int8", "t_category": "int8"}


def test_an_eager_archives_worker_finds_the_architecture_without_its_package_or_entry_point(tmp_path, monkeypatch):
    """What an eager archive carries is enough: a worker whose Python has neither the user's
    package nor its entry point resolves the spec's registered name through architecture.json."""
    from handlers.modeling import registry
    from handlers.modeling.archive_code import ArchitectureRecord, use_archive_code

    source = tmp_path / "src"
    (source / "towers_pkg").mkdir(parents=True)
    (source / "towers_pkg" / "__init__.py").write_text("")
    (source / "towers_pkg" / "model.py").write_text(USER_MODULE)
    path = "towers_pkg.model:TwoTowerArchitecture"
    monkeypatch.setattr(registry, "entry_points", lambda group: [_EntryPoint("towers", path)])
    monkeypatch.syspath_prepend(str(source))
    spec = _spec("towers")
    archive = tmp_path / "archive"
    archive.mkdir()
    assert "carries towers_pkg" in ArchitectureRecord.of(spec).stage(archive, carry=True)
    spec.to_yaml(archive / "spec.yaml")

    # the worker's process: no package on its path, no entry point
    sys.path.remove(str(source))
    for name in [m for m in sys.modules if m.startswith("towers_pkg")]:
        del sys.modules[name]
    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    monkeypatch.setattr(registry, "_REMEMBERED", {})
    registry.resolve.cache_clear()
    with pytest.raises(SpecError, match="'towers' is neither a registered architecture"):
        registry.load_spec(archive / "spec.yaml")
    use_archive_code(archive)
    loaded = registry.load_spec(archive / "spec.yaml")
    assert loaded.to_dict() == spec.to_dict() and type(loaded).__module__ == "towers_pkg.model"
    assert sys.modules["towers_pkg.model"].__file__ == str(archive / "code" / "towers_pkg" / "model.py")
    sys.path.remove(str(archive / "code"))
    del sys.modules["towers_pkg.model"], sys.modules["towers_pkg"]
    registry.resolve.cache_clear()


class _EntryPoint:
    def __init__(self, name: str, value: str) -> None:
        self.name, self.value = name, value


def test_inputs_the_runtime_cannot_batch_are_a_spec_error_naming_the_architecture(user_module):
    source = USER_MODULE.replace(
        "return per_item_tags(spec)",
        "from handlers.runtime.inputs import BatchKind, InputTag\n"
        "        return per_item_tags(spec) + (InputTag('history', BatchKind.CONTEXT_JAGGED, keys=()),)",
    )
    spec = _spec(f"{user_module(source)}:TwoTowerArchitecture")
    with pytest.raises(SpecError, match=r"TwoTowerArchitecture: inputs: a context_jagged input needs an item_counts"):
        input_schema(spec)  # what the build asks first (the inputs.json it stages)


def test_a_worker_refuses_an_archive_built_against_another_contract(tmp_path):
    from handlers.modeling.archive_code import use_archive_code

    (tmp_path / "architecture.json").write_text(
        '{"architecture": "dlrm", "contract_version": 0, "path": "handlers.modeling.architectures.dlrm:ARCHITECTURE"}'
    )
    with pytest.raises(SpecError, match=f"built against architecture contract 0, this worker implements {CONTRACT_VERSION}"):
        use_archive_code(tmp_path)
