"""Every use of torch beyond its public API, in one place; ``tests/test_torch_contracts.py`` fails
by name when a torch release changes what these rely on.

* ``run_package``: a compiled package's forward through its loader's ``run``. The public
  ``AOTICompiledModel.__call__`` reads the package's call spec back and flattens the arguments as
  pytrees on every call: 61 us against 40 us for a one-item forward of the tiny model here, half
  again the forward's own cost; the runtime's arguments are a flat list of tensors already.
* ``kept_as_constants`` (at build time): Inductor compiles a tensor attribute of at most 8
  elements (the last layer's bias) into the code as a literal, out of reach of a dense swap. Its
  switch against that (``always_keep_tensor_constants``) also keeps small anonymous constants whose
  values the package does not give back (the build then fails: it lacks ``_tensor_constant0``),
  and ``aot_inductor.use_runtime_constant_folding`` adds folded constants the package lacks too; no
  setting keys on names. So for the time of one compile, ``GraphLowering.get_attr`` keeps the
  named parameters as constants (``add_tensor_constant``, as it does for large tensors).

* ``load_package``: the public ``aoti_load_package``, where its extraction goes. The loader
  unpacks a package into a new folder under ``TMPDIR`` (``aotinductor_XXXXXX``, 1.9 MB for the
  Criteo-shaped model), keeps it for its life (TorchRec's TBE objects are read from it) and removes
  it when it is freed, which a killed process never does: every TorchServe stop kills its workers,
  and each start left a folder in /tmp. Each process now extracts under a folder of its own
  (``AOTI_FOLDERS/PID``), and a load removes the folders of processes that are gone. The loader
  also names the CPU's vector ISA to warn where it differs from the compiling machine's, and to
  name it, compiles a probe for each candidate ISA and loads each in a child Python: a load took
  1.8 s here with Inductor's cache warm, 11-12 s where the cache is new (as under each fresh
  ``TMPDIR``: a local server's workers), 1.1 s without the probes. For the load it takes the
  CPU's flags at their word (``cpp.vec_isa_ok``); a process that had not checked its ISAs before
  forgets the answer, so that a compile checks them.

Handing a package its constants goes through the public loader's ``load_constants``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

AOTI_FOLDERS = Path(tempfile.gettempdir()) / "torchrec-serve-aoti"  # one folder a process, by pid


def load_package(path: Path) -> Any:
    """``aoti_load_package(path)``, extracted under this process's folder of ``AOTI_FOLDERS``;
    the folders of processes no longer running are removed first."""
    from torch._inductor import aoti_load_package, config  # 0.7 s to import: by processes that load one only
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    AOTI_FOLDERS.mkdir(exist_ok=True)
    for folder in AOTI_FOLDERS.iterdir():
        if folder.name.isdigit() and not _running(int(folder.name)):
            shutil.rmtree(folder, ignore_errors=True)
    mine = AOTI_FOLDERS / str(os.getpid())
    mine.mkdir(exist_ok=True)
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(mine)  # read by the loader as it extracts
    isas_checked = valid_vec_isa_list.cache_info().currsize > 0
    try:
        with config.patch({"cpp.vec_isa_ok": True}):  # the ISA named from the CPU's flags, no probe built
            return aoti_load_package(str(path))
    finally:
        if not isas_checked:
            valid_vec_isa_list.cache_clear()
        if previous is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = previous


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def run_package(package: Any, arguments: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs of ``package`` (what ``aoti_load_package`` returns) on flat tensor arguments."""
    return package.loader.run(list(arguments))


@contextlib.contextmanager
def kept_as_constants(names: set[str]) -> Iterator[None]:
    """Within this block, Inductor keeps the graph attributes ``names`` as constants."""
    from torch._inductor.graph import GraphLowering as lowering  # imported by a compile anyway

    get_attr = lowering.get_attr

    def keeping(self, target, args, kwargs):  # type: ignore[no-untyped-def]
        if target in names:
            return self.add_tensor_constant(torch.fx.graph_module._get_attr(self.module, target), target)
        return get_attr(self, target, args, kwargs)

    lowering.get_attr = keeping
    try:
        yield
    finally:
        lowering.get_attr = get_attr
