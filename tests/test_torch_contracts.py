"""What the project relies on in torch beyond its documented API (``handlers.runtime.torch_internals``)
and in torch's AOTInductor loader (``handlers.runtime.artifacts.CompiledPackage``). Each test names
the assumption it checks, so a torch upgrade that breaks one fails here by name."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import torch

from archive_tools.export import compile_aoti
from handlers.runtime.archive_files import aoti_weights_file
from handlers.runtime.artifacts import CompiledPackage
from handlers.runtime.torch_internals import AOTI_FOLDERS, kept_as_constants, load_package, run_package


class _SmallBias(torch.nn.Module):
    """A layer whose 1-element bias Inductor would inline as a literal."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_inductor_lowers_attributes_through_get_attr_and_add_tensor_constant():
    """kept_as_constants replaces GraphLowering.get_attr(self, target, args, kwargs) and calls
    add_tensor_constant(tensor, name) and torch.fx.graph_module._get_attr(module, target)."""
    from torch._inductor.graph import GraphLowering

    assert list(inspect.signature(GraphLowering.get_attr).parameters) == ["self", "target", "args", "kwargs"]
    assert list(inspect.signature(GraphLowering.add_tensor_constant).parameters)[:3] == ["self", "data", "name"]
    assert callable(torch.fx.graph_module._get_attr)
    original = GraphLowering.get_attr
    with kept_as_constants({"x"}):
        assert GraphLowering.get_attr is not original
    assert GraphLowering.get_attr is original, "the patch must be undone"


def test_a_small_bias_stays_a_swappable_constant_of_the_package(tmp_path):
    """The whole reason for the patch: without it this compile fails (the bias becomes a literal);
    with it the package takes the bias from its weights file, and a swap reaches it."""
    model = _SmallBias().eval()
    x = torch.randn(3, 4)
    program = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("n", min=2, max=64)},))
    package = compile_aoti(program, tmp_path / "model_aoti.pt2")
    loaded = CompiledPackage(package)
    assert "linear.bias" in loaded.active and aoti_weights_file(package).is_file()
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=1e-6)
    loaded.swap({"linear.bias": loaded.active["linear.bias"] + 1.0})
    torch.testing.assert_close(loaded(x), model(x) + 1.0, rtol=0, atol=1e-6)


def test_the_aoti_loader_takes_user_managed_constants_and_runs_flat_tensors(tmp_path):
    """CompiledPackage uses aoti_load_package(path)'s public get_constant_fqns() and
    load_constants(constants, check_full_update=, user_managed=), and (run_package) its loader's
    private run(list of tensors); with user_managed the package reads our tensors in place (a
    change to one shows in the next run)."""
    model = _SmallBias().eval()
    x = torch.randn(2, 4)
    program = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("n", min=2, max=64)},))
    loaded = CompiledPackage(compile_aoti(program, tmp_path / "model_aoti.pt2"))
    assert set(loaded.model.get_constant_fqns()) == {"linear.weight", "linear.bias"}
    assert list(inspect.signature(loaded.model.load_constants).parameters)[:3] == [
        "constants_map", "check_full_update", "user_managed"]
    (direct,) = run_package(loaded.model, [x])
    torch.testing.assert_close(direct, model(x), rtol=0, atol=1e-6)
    before = loaded(x)
    with torch.no_grad():
        loaded.active["linear.bias"].add_(2.0)  # in place: not copied into the container
    torch.testing.assert_close(loaded(x), before + 2.0, rtol=0, atol=1e-6)


def test_a_load_removes_the_extractions_of_processes_that_are_gone(tmp_path):
    """The loader unpacks a package that holds TorchRec's TBE objects under TMPDIR (load_package
    points it at AOTI_FOLDERS/PID) and removes it only when freed, which a killed process (a
    TorchServe worker at every stop) never does; a package without such objects leaves nothing.
    A load removes the folders of processes that are gone, keeps its own and restores TMPDIR."""
    model = _SmallBias().eval()
    x = torch.randn(2, 4)
    program = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("n", min=2, max=64)},))
    package = compile_aoti(program, tmp_path / "model_aoti.pt2")
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    left = AOTI_FOLDERS / str(gone) / "aotinductor_killed"
    left.mkdir(parents=True)
    (left / "model.so").write_bytes(b"\0" * 1024)
    tmpdir = os.environ.get("TMPDIR")
    loaded = load_package(package)
    assert set(loaded.get_constant_fqns()) == {"linear.weight", "linear.bias"}
    assert not left.parent.exists() and (AOTI_FOLDERS / str(os.getpid())).is_dir()
    assert os.environ.get("TMPDIR") == tmpdir


_LOAD_IN_A_NEW_PROCESS = """
import json, sys
from pathlib import Path
from torch._inductor import cpu_vec_isa
from handlers.runtime.torch_internals import load_package

probed = []
check_build = cpu_vec_isa.VecISA.check_build
def spied(isa, code):
    probed.append(type(isa).__name__)
    return check_build(isa, code)
cpu_vec_isa.VecISA.check_build = spied
load_package(Path(sys.argv[1]))
probed_in_load = list(probed)
unchecked_after_load = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 0
plain = [type(i).__name__ for i in cpu_vec_isa.supported_vec_isa_list
         if type(i).__bool__ is cpu_vec_isa.VecISA.__bool__]
cpu_vec_isa.pick_vec_isa()  # as a compile does: the ISAs checked by building probes
load_package(Path(sys.argv[1]))
print(json.dumps({"probed": probed_in_load, "plain": plain, "unchecked_after_load": unchecked_after_load,
                  "checked_after_compile_and_load": cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1}))
"""


def test_a_load_names_the_cpus_isa_from_its_flags_and_leaves_the_check_to_a_compile(tmp_path):
    """The loader names the CPU's ISA (get_device_information -> cpu_vec_isa.pick_vec_isa), which
    compiles and loads a probe for each candidate ISA unless config.cpp.vec_isa_ok says yes:
    load_package says yes for the load (10 s more a load in a new Inductor cache here), so no ISA
    whose check honours it (cpu_vec_isa.VecISA.__bool__) is probed; and a process that had not
    checked its ISAs leaves valid_vec_isa_list (functools.cache) empty for a compile to check."""
    model = _SmallBias().eval()
    x = torch.randn(2, 4)
    program = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("n", min=2, max=64)},))
    package = compile_aoti(program, tmp_path / "model_aoti.pt2")
    fresh = tmp_path / "tmp"  # a new Inductor cache (its folder is under TMPDIR), as a new server's worker has
    fresh.mkdir()
    done = subprocess.run([sys.executable, "-c", _LOAD_IN_A_NEW_PROCESS, str(package)], capture_output=True,
                          text=True, env={**os.environ, "TMPDIR": str(fresh)}, check=True)
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["plain"], "the ISAs whose check a setting can answer"
    assert not set(seen["probed"]) & set(seen["plain"]), seen
    assert seen["unchecked_after_load"] and seen["checked_after_compile_and_load"], seen
