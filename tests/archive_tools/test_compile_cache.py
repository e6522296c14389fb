"""The compile cache's key and folder (``archive_tools.compile_cache``). That a package from the
cache serves its own build's weights is test_export's (a real compile)."""

import os

import torch

from archive_tools import compile_cache
from archive_tools.compile_cache import CACHE_ENV, compiled_in, package_key

SETTINGS = {"aot_inductor.package_constants_in_so": False}


class Scaled(torch.nn.Module):
    def __init__(self, rows: int = 4, offset: float = 0.0) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(rows, 1)
        self.register_buffer("offset", torch.full((1,), offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.offset


def _program(seed: int, rows: int = 4, offset: float = 0.0, batch: int = 3) -> torch.export.ExportedProgram:
    torch.manual_seed(seed)
    return torch.export.export(Scaled(rows, offset).eval(), (torch.randn(batch, rows),))


def test_the_key_follows_the_graph_shapes_and_settings_not_the_values():
    key = package_key(_program(seed=0), SETTINGS)
    assert package_key(_program(seed=1), SETTINGS) == key  # other weights: the same code
    assert package_key(_program(seed=0, offset=1.0), SETTINGS) == key  # the values compiled in: compiled_in's
    assert package_key(_program(seed=0, rows=5), SETTINGS) != key  # shapes
    assert package_key(_program(seed=0), {**SETTINGS, "joint_graph_constant_folding": False}) != key


def test_the_values_compiled_in_are_those_of_the_tensors_the_package_does_not_take_as_constants():
    state = dict(_program(seed=0).state_dict)
    constants = {"linear.weight", "linear.bias"}  # offset compiled in
    digest = compiled_in(state, constants)
    assert compiled_in({**state, "linear.weight": torch.zeros(1, 4)}, constants) == digest
    assert compiled_in({**state, "offset": torch.ones(1)}, constants) != digest
    assert compiled_in({**state, "offset": torch.ones(1)}, constants | {"offset"}) == compiled_in(state, constants | {"offset"})


def test_a_kept_package_is_fetched_if_it_compiled_in_the_same_values_the_oldest_forgotten(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(compile_cache, "MAX_ENTRIES", 2)
    for n in range(3):
        package = tmp_path / f"built-{n}.pt2"
        package.write_bytes(bytes([n]) * 10)
        compile_cache.keep(f"key{n}", package, values=f"values{n}")
        os.utime(tmp_path / "cache" / f"key{n}.pt2", (n, n))  # kept in this order

    def values_of(package):
        return f"values{package.read_bytes()[0]}"

    out = tmp_path / "out.pt2"
    assert not compile_cache.fetch("key0", out, values_of) and not out.exists()  # forgotten
    assert compile_cache.fetch("key2", out, values_of) and out.read_bytes() == bytes([2]) * 10
    assert not compile_cache.fetch("key2", tmp_path / "other.pt2", lambda package: "values9")
    assert not (tmp_path / "other.pt2").exists()

    def damaged(package):
        raise RuntimeError("not a zip archive")

    assert not compile_cache.fetch("key2", tmp_path / "other.pt2", damaged) and not (tmp_path / "other.pt2").exists()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        "key1.pt2", "key1.values", "key2.pt2", "key2.values"]


def test_off_keeps_and_fetches_nothing_and_the_default_folder_is_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "off")
    assert compile_cache.cache_folder() is None
    (tmp_path / "built.pt2").write_bytes(b"package")
    compile_cache.keep("key", tmp_path / "built.pt2", values="v")
    assert not compile_cache.fetch("key", tmp_path / "out.pt2", lambda package: "v")
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.cache_folder() == tmp_path / "torchrec-serve" / "aoti"
