"""The artifacts an archive serves, and the runner for its captured graphs.

An archive serves one ``Artifact``, named in its ``model-config.yaml``: ``aoti`` (an AOTInductor
package, fastest), ``exported`` (a ``torch.export`` program, run by PyTorch's interpreter),
``eager`` (TorchRec modules on the memory-mapped ``weights.pt``; built by
``handlers.modeling``, for debugging) or ``split`` (a sparse and a dense part, each one of the
kinds above; ``handlers.runtime.split``). A distributed layout (``handlers.runtime.remote``) serves
``lookups`` on its embedding shards (a group of tables, eager on their mapped ``weights.pt``: ids
in, pooled embeddings out) and ``remote`` on its dense hosts (the dense part, calling the shards).

A graph takes plain tensors in the order of the model's input tags (``batching.plain_arguments``):
``ROWS`` / ``CONTEXT`` ``[N or K, D]``, a ``JAGGED`` input as ``values [V]``, ``lengths [F, N]``
(and ``weights [V]``), ``ITEM_COUNTS`` ``[K]``. Running one needs torch and the FBGEMM operators
it calls, nothing of the code that built it.
"""

from __future__ import annotations

import enum
import threading
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.export.passes import move_to_device_pass

from handlers.runtime import archive_files
from handlers.runtime import fbgemm_ops  # noqa: F401  the TBE operators the graphs call
from handlers.runtime.archive_files import aoti_weights_file
from handlers.runtime.batching import Batch, plain_arguments
from handlers.runtime.freshness.delta_file import DenseShapes, dense_shapes
from handlers.runtime.freshness.dense import is_table_constant
from handlers.runtime.id_buckets import derived_constants, is_index
from handlers.runtime.inputs import RAW_ID_COUNTER, InputTag
from handlers.runtime.quiet import quieter
from handlers.runtime.torch_internals import load_package, run_package

# A loaded model, whatever its artifact: the coalesced batch -> logits [N, 1].
Runner = Callable[[Batch], torch.Tensor]


class Artifact(str, enum.Enum):
    AOTI = "aoti"
    EXPORTED = "exported"
    EAGER = "eager"
    SPLIT = "split"
    LOOKUPS = "lookups"
    REMOTE = "remote"

    def file_name(self, part: str = "model") -> str:
        """The file that holds ``part`` (``model``, ``sparse`` or ``dense``) as this artifact."""
        if self in (Artifact.EAGER, Artifact.LOOKUPS):
            return archive_files.WEIGHTS
        if self in (Artifact.SPLIT, Artifact.REMOTE):
            raise ValueError(f"a {self.value} archive holds one file per part")
        return archive_files.aoti_file(part) if self == Artifact.AOTI else archive_files.exported_file(part)

    def files(self, part: str = "model") -> list[str]:
        """Every file that holds ``part`` as this artifact (a compiled package has its weights
        beside it)."""
        main = self.file_name(part)
        return [main, aoti_weights_file(Path(main)).name] if self == Artifact.AOTI else [main]


class CompiledPackage:
    """An AOTInductor package, loaded through torch's public loader (``aoti_load_package``), its
    constants (the weights) mapped from the file beside it and used in place (user-managed): the
    tables cost page cache shared by every worker, so they must live as long as the package does.

    ``swap`` is how dense weights change while it serves: the active constants, some replaced,
    are loaded whole (pointers, no copy) between two runs. torch 2.13's loader offers no swap of
    an inactive buffer (the container's ``swap_constant_buffer`` is reachable only through its
    private runner), and it rewrites the active buffer without the container's run lock; so runs
    and swaps hold a lock of ours, and a run sees either set whole, never a mix.

        package = CompiledPackage(Path("model_aoti.pt2"))     # weights: model_aoti_weights.pt
        logits = package(dense, values, lengths)
        package.swap({"model.over_arch.model.1.weight": new_weight, ...})
    """

    def __init__(self, path: Path, weights: Path | None = None) -> None:
        # The loader unpacks the package (TorchRec's TBE objects beside its library) for its life.
        self.model = load_package(path)
        self._lock = threading.Lock()
        names = set(self.model.get_constant_fqns())
        self.original = torch.load(weights or aoti_weights_file(path), mmap=True, weights_only=True)
        missing = sorted(n for n in names - set(self.original) if not is_index(n))
        if missing:
            raise ValueError(f"{path}: its weights file lacks constants {missing}")
        # The graph adds to its raw-id counters each run: this worker's own copies. A run that
        # wrote into the mapped file would copy the page privately, and the tables or slot maps
        # that share it would stop seeing the deltas written into the file.
        self.active = {name: self.original[name].clone() if RAW_ID_COUNTER.search(name) else self.original[name]
                       for name in names if not is_index(name)}
        self.active.update(derived_constants(self.active, names))  # this worker's own too
        self._load(self.active)

    def __call__(self, *arguments: torch.Tensor) -> torch.Tensor:
        with self._lock:
            (output,) = run_package(self.model, arguments)
        return output

    def swap(self, changed: Mapping[str, torch.Tensor]) -> None:
        """Makes the active constants, with ``changed`` replaced, the ones the next run uses; the
        tensors are used in place (``self.active`` keeps them alive)."""
        unknown = sorted(set(changed) - set(self.active))
        if unknown:
            raise KeyError(f"no such constants in the package: {unknown}")
        constants = {**self.active, **changed}
        with self._lock:
            self._load(constants)
            self.active = constants

    def _load(self, constants: Mapping[str, torch.Tensor]) -> None:
        """Every constant, into the active buffer, user-managed (kept, not copied)."""
        self.model.load_constants(dict(constants), check_full_update=True, user_managed=True)


class GraphModel:
    """A loaded exported program or AOTInductor package, called with the coalescer's batch; its
    inputs go to ``device`` (an exported program captured on the cpu is moved there at load)."""

    def __init__(
        self,
        path: str | Path,
        artifact: Artifact,
        tags: Sequence[InputTag],
        device: torch.device = torch.device("cpu"),
        weights: Path | None = None,
    ) -> None:
        """``weights``: where a compiled package's weights file is, if not beside it."""
        if artifact == Artifact.AOTI:
            if device.type != "cpu":
                raise ValueError(f"{path}: compiled for cpu; an exported program can move to {device}")
            self.run = CompiledPackage(Path(path), weights)
        elif artifact == Artifact.EXPORTED:
            # Unbacked sizes of the jagged inputs (u0, u1, ...) that the saved graph no longer
            # names are logged as warnings when it is read back; they are not used.
            with quieter("torch._export.serde.serialize"):
                program = torch.export.load(str(path))
            if device.type != "cpu":  # captured on cpu: its weights and device arguments move
                program = move_to_device_pass(program, device)
            self.run = program.module()
        else:
            raise ValueError(f"{artifact.value} is not a graph artifact")
        self.tags = tuple(tags)
        self.device = device

    def __call__(self, batch: Batch) -> torch.Tensor:
        arguments = plain_arguments(batch, self.tags)
        if self.device.type != "cpu":
            arguments = tuple(a.to(self.device) for a in arguments)
        return self.run(*arguments)

    # A ``freshness.dense.DenseSlot``: a compiled package swaps its dense constants.

    def dense_shapes(self) -> DenseShapes | str:
        if not isinstance(self.run, CompiledPackage):
            return "an exported program keeps its weights inside its graph module; build aoti to swap dense weights"
        return dense_shapes({n: t for n, t in self.run.original.items() if not is_table_constant(n)})

    def swap_dense(self, tensors: Mapping[str, torch.Tensor] | None) -> None:
        assert isinstance(self.run, CompiledPackage), "dense_shapes() said this runner cannot swap"
        if tensors is None:
            tensors = {n: t for n, t in self.run.original.items() if not is_table_constant(n)}
        self.run.swap(tensors)


def served_tensors(runner: Runner) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a loaded model serves from, by name: a split model's lookups', a graph's
    constants, or an eager model's buffers (a raw-id remap's counts and bucket index among them)."""
    part = getattr(runner, "sparse", runner)
    run = getattr(part, "run", None)
    if isinstance(run, CompiledPackage):
        yield from run.active.items()
    module = run if isinstance(run, nn.Module) else getattr(part, "module", None)
    if isinstance(module, nn.Module):
        yield from module.named_buffers()
