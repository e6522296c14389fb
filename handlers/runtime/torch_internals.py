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

Loading a package and handing it its constants go through the public ``aoti_load_package``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch


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
