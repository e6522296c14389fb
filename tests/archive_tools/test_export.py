"""The captured graphs: exported program and AOTInductor package score exactly as the eager model,
at any batch size (1 included), and run in a process that never imports torchrec."""

import contextlib
import subprocess
import sys
import textwrap

import pytest
import torch

from archive_tools import compile_cache
from archive_tools.compile_cache import CACHE_ENV, compiled_in, package_key
from archive_tools.export import AOTI_SETTINGS, MAX_BATCH, compile_aoti, export_model
from handlers.modeling.eager import eager_service
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.spec import DensePrecision, ShardingType, WeightDtype
from handlers.runtime.artifacts import Artifact, GraphModel, aoti_weights_file
from handlers.runtime.batching import coalesce, plain_arguments
from handlers.runtime.service import ScoringService
from handlers.runtime.torch_internals import load_package
from tests.helpers import is_file_mapped, items_request, sharded, with_tables


def _batch(spec, service, sizes, seed):
    return coalesce(
        [service.decoder.decode(items_request(spec, n, seed=seed + n)).inputs for n in sizes],
        service.tags,
    )


@pytest.fixture(scope="module", params=["tiny", "ranker"])
def exported(request, tmp_path_factory, tiny_spec, tiny_weights, ranker_spec, ranker_weights):
    """(eager service, exported program path) for DLRM and the context ranker."""
    spec, weights = (tiny_spec, tiny_weights) if request.param == "tiny" else (ranker_spec, ranker_weights)
    eager = eager_service(spec, DLRMFactory(spec).inference_model(weights))
    # export from a model of its own: capture prepares the model it is given in place
    example = _batch(spec, eager, (3, 5), 0)
    program = export_model(DLRMFactory(spec).inference_model(weights), eager.tags, example)
    path = tmp_path_factory.mktemp("export") / "model.pt2"
    torch.export.save(program, str(path))
    return spec, eager, program, path


@pytest.fixture(scope="module")
def compiled(exported, tmp_path_factory):
    """The exported program compiled once by AOTInductor; each test loads its own copy of it."""
    _, _, program, _ = exported
    return compile_aoti(program, tmp_path_factory.mktemp("aoti") / "model_aoti.pt2")


@pytest.mark.parametrize("sizes", [(1,), (2, 7), (200, 1, 30)])
def test_exported_program_equals_eager(exported, sizes):
    spec, eager, _, path = exported
    graph = GraphModel(path, Artifact.EXPORTED, eager.tags)
    batch = _batch(spec, eager, sizes, seed=11)
    with torch.inference_mode():
        torch.testing.assert_close(graph(batch), eager.model(batch), atol=0, rtol=0)


def test_aoti_package_equals_eager(exported, compiled):
    spec, eager, _, _ = exported
    graph = GraphModel(compiled, Artifact.AOTI, eager.tags)
    for sizes in ((1,), (64, 3)):
        batch = _batch(spec, eager, sizes, seed=5)
        with torch.inference_mode():
            torch.testing.assert_close(graph(batch), eager.model(batch), atol=1e-6, rtol=1e-5)


def _no_compile(*args, **kwargs):
    raise AssertionError("compiled again: the compile cache missed")


def test_the_same_graph_with_other_weights_comes_from_the_compile_cache_and_serves_them(
    exported, compiled, tmp_path, monkeypatch
):
    """A build of the model with other weights is not compiled again: the package of ``compiled``
    (kept under its program's key) is copied, and scores with the new weights file."""
    spec, eager, program, _ = exported
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    state = {**program.state_dict, **program.constants}
    values = compiled_in(state, set(load_package(compiled).get_constant_fqns()))
    compile_cache.keep(package_key(program, AOTI_SETTINGS), compiled, values)
    factory = DLRMFactory(spec)
    other = factory.quantize(factory.float_model(seed=1))
    other_eager = eager_service(spec, factory.inference_model(other))
    other_program = export_model(factory.inference_model(other), eager.tags, _batch(spec, other_eager, (3, 5), 0))
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", _no_compile)
    graph = GraphModel(compile_aoti(other_program, tmp_path / "model_aoti.pt2"), Artifact.AOTI, eager.tags)
    batch = _batch(spec, eager, (64, 3), seed=5)
    with torch.inference_mode():
        torch.testing.assert_close(graph(batch), other_eager.model(batch), atol=1e-6, rtol=1e-5)
        assert not torch.allclose(graph(batch), eager.model(batch), atol=1e-3)


def test_a_batch_with_every_bag_empty_scores_as_eager(exported, compiled):
    """A captured graph asserts that its jagged input holds some id; the service pads such a
    batch with a request that holds one (its output dropped)."""
    spec, eager, _, path = exported
    graphs = [GraphModel(path, Artifact.EXPORTED, eager.tags), GraphModel(compiled, Artifact.AOTI, eager.tags)]
    body = items_request(spec, 3, seed=4)
    for item in body["items"]:
        item["sparse"] = {}
    requests = [eager.decoder.decode(body).inputs]
    expected = eager.logits(requests)
    for graph in graphs:
        scores = ScoringService(eager.schema, graph).logits(requests)
        torch.testing.assert_close(scores, expected, atol=1e-6, rtol=1e-5)


def test_aoti_package_maps_its_tables_and_uses_them_in_place(exported, compiled):
    """The package holds code only: its weights file is memory-mapped at load, and the compiled
    model reads the mapped tables themselves (zeroing them changes its scores)."""
    spec, eager, _, _ = exported
    graph = GraphModel(compiled, Artifact.AOTI, eager.tags)
    tables = [t for name, t in graph.run.original.items() if name.endswith("weights_host")]
    assert tables and all(is_file_mapped(t, aoti_weights_file(compiled)) for t in tables)
    batch = _batch(spec, eager, (4, 2), seed=8)
    with torch.inference_mode():
        before = graph(batch)
        for table in tables:
            table.zero_()  # copy-on-write pages of a private mapping: the file is untouched
        after = graph(batch)
    assert not torch.equal(before, after)


def test_exported_program_runs_without_torchrec(exported, tmp_path):
    """A fresh process with torch and fbgemm_gpu only: no torchrec, no model class."""
    spec, eager, _, path = exported
    batch = _batch(spec, eager, (4, 1), seed=3)
    torch.save(list(plain_arguments(batch, eager.tags)), tmp_path / "inputs.pt")
    with torch.inference_mode():
        torch.save(eager.model(batch), tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        import fbgemm_gpu  # the TBE operators
        program = torch.export.load({str(path)!r}).module()
        inputs = torch.load({str(tmp_path / "inputs.pt")!r})
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        torch.testing.assert_close(program(*inputs), expected, atol=0, rtol=0)
        assert "torchrec" not in sys.modules, "torchrec was imported"
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_int8_dynamic_graph_pads_batch_one(tiny_spec, ranker_spec, tmp_path):
    """TorchAO's int8 dynamic activation quantization guards against batch 1, so its graph is
    captured for 2+ requests and the service pads a single request; scores still equal eager."""
    for spec in (tiny_spec, ranker_spec):
        spec = spec.replace(
            dense_precision={m: DensePrecision.INT8_DYNAMIC for m in spec.DENSE_SUBMODULES}
        )
        assert spec.min_requests == 2
        factory = DLRMFactory(spec)
        weights = factory.quantize(factory.float_model(seed=0))
        eager = eager_service(spec, factory.inference_model(weights))
        program = export_model(
            factory.inference_model(weights), eager.tags, _batch(spec, eager, (3, 5, 2), 0), spec.min_requests
        )
        # captured for 2+ items (and requests): a batch of 1 is outside what the graph was made for
        assert {r.lower for r in program.range_constraints.values() if r.upper == MAX_BATCH} == {2}
        path = tmp_path / f"{spec.name}.pt2"
        torch.export.save(program, str(path))
        graph = GraphModel(path, Artifact.EXPORTED, eager.tags)
        batch_sizes = []

        def recording(batch):
            batch_sizes.append(len(batch["dense_features"]))
            return graph(batch)

        served = ScoringService(eager.schema, recording)
        for sizes in ((1,), (7,), (2, 7)):
            requests = [eager.decoder.decode(items_request(spec, n, seed=n)).inputs for n in sizes]
            for got, want in zip(served.logits(requests), eager.logits(requests)):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert batch_sizes == [2, 8, 9]  # one padding item where there was one request


def test_graph_model_refuses_what_it_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="compiled for cpu; an exported program can move to cuda"):
        GraphModel(tmp_path / "model_aoti.pt2", Artifact.AOTI, (), device=torch.device("cuda"))
    with pytest.raises(ValueError, match="eager is not a graph artifact"):
        GraphModel(tmp_path / "weights.pt", Artifact.EAGER, ())


def test_table_wise_sharded_model_exports_and_equals_eager(tiny_spec, tmp_path):
    spec = sharded(with_tables(tiny_spec, weight_dtype=WeightDtype.INT8), 2, ShardingType.TABLE_WISE)
    factory = DLRMFactory(spec)
    weights = factory.quantize(factory.float_model(seed=0))
    eager = eager_service(spec, factory.inference_model(weights))
    program = export_model(factory.inference_model(weights), eager.tags, _batch(spec, eager, (3, 5, 2), 0))
    torch.export.save(program, str(tmp_path / "model.pt2"))
    graph = GraphModel(tmp_path / "model.pt2", Artifact.EXPORTED, eager.tags)
    for sizes in ((1,), (2, 7)):
        batch = _batch(spec, eager, sizes, seed=21)
        with torch.inference_mode():
            torch.testing.assert_close(graph(batch), eager.model(batch), atol=0, rtol=0)


def test_torchao_int8_weights_compile_into_a_package(tiny_spec, tmp_path):
    """AOTInductor keeps TorchAO's int8 weight tensors as their inner tensors; the package's
    weights file holds them under the names the package asks for."""
    spec = tiny_spec.replace(dense_precision={m: DensePrecision.INT8_WEIGHT_ONLY for m in tiny_spec.DENSE_SUBMODULES})
    factory = DLRMFactory(spec)
    weights = factory.quantize(factory.float_model(seed=0))
    eager = eager_service(spec, factory.inference_model(weights))
    program = export_model(factory.inference_model(weights), eager.tags, _batch(spec, eager, (3, 5), 0))
    graph = GraphModel(compile_aoti(program, tmp_path / "model_aoti.pt2"), Artifact.AOTI, eager.tags)
    assert any(".parametrizations." in name for name in graph.run.original)
    batch = _batch(spec, eager, (4, 9), seed=2)
    with torch.inference_mode():
        torch.testing.assert_close(graph(batch), eager.model(batch), atol=1e-5, rtol=1e-4)


def test_a_slot_map_that_is_no_view_of_the_programs_constants_is_refused_before_compiling(tmp_path):
    """The weights file stores each raw-id table's slot map as a view of the remap's constants
    (the storage once, what the graph reads); a map of its own would be saved apart from it."""
    program = torch.export.export(torch.nn.Linear(4, 1).eval(), (torch.randn(3, 4),))
    with pytest.raises(ValueError, match=r"slot maps of tables \['t_user'\] are not views"):
        compile_aoti(program, tmp_path / "model_aoti.pt2", {"t_user": (torch.arange(4),)})
    assert not (tmp_path / "model_aoti.pt2").exists()


def test_a_parameter_compiled_in_as_a_literal_is_refused_naming_it(tmp_path, monkeypatch):
    """A compile that folds a parameter into the code (what Inductor does to a one-dimensional
    tensor of at most 8 elements without ``kept_as_constants``, as a torch upgrade could again)
    leaves it out of reach of a dense swap: ``compile_aoti`` raises, naming the parameter, and
    writes no weights file, so the build stops."""
    monkeypatch.setattr("archive_tools.export.kept_as_constants", lambda names: contextlib.nullcontext())
    monkeypatch.setenv(CACHE_ENV, "off")  # this compile, not one the cache kept
    program = torch.export.export(torch.nn.Linear(4, 1).eval(), (torch.randn(3, 4),))
    with pytest.raises(RuntimeError, match=r"parameters compiled in as literals.*\['bias'\]"):
        compile_aoti(program, tmp_path / "model_aoti.pt2")
    assert not aoti_weights_file(tmp_path / "model_aoti.pt2").exists()
