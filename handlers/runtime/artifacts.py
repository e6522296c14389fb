"""The artifacts an archive serves, and the runner for its captured graphs.

An archive serves one ``Artifact``, named in its ``model-config.yaml``: ``aoti`` (an AOTInductor
package, fastest), ``exported`` (a ``torch.export`` program, run by PyTorch's interpreter),
``eager`` (TorchRec modules on the memory-mapped ``weights.pt``; built by
``handlers.modeling``, for debugging) or ``split`` (a sparse and a dense part, each one of the
kinds above; ``handlers.runtime.split``).

A graph takes plain tensors in the order of the model's input tags (``batching.plain_arguments``):
``ROWS`` / ``CONTEXT`` ``[N or K, D]``, a ``JAGGED`` input as ``values [V]``, ``lengths [F, N]``
(and ``weights [V]``), ``ITEM_COUNTS`` ``[K]``. Running one needs torch and the FBGEMM operators
it calls, nothing of the code that built it.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.export.passes import move_to_device_pass

from handlers.runtime import fbgemm_ops  # noqa: F401  the TBE operators the graphs call
from handlers.runtime.batching import Batch, plain_arguments
from handlers.runtime.inputs import InputTag
from handlers.runtime.quiet import quieter

# A loaded model, whatever its artifact: the coalesced batch -> logits [N, 1].
Runner = Callable[[Batch], torch.Tensor]


class Artifact(str, enum.Enum):
    AOTI = "aoti"
    EXPORTED = "exported"
    EAGER = "eager"
    SPLIT = "split"

    def file_name(self, part: str = "model") -> str:
        """The file that holds ``part`` (``model``, ``sparse`` or ``dense``) as this artifact."""
        if self == Artifact.EAGER:
            return "weights.pt"
        if self == Artifact.SPLIT:
            raise ValueError("a split archive holds one file per part")
        return f"{part}_aoti.pt2" if self == Artifact.AOTI else f"{part}.pt2"

    def files(self, part: str = "model") -> list[str]:
        """Every file that holds ``part`` as this artifact (a compiled package has its weights
        beside it)."""
        main = self.file_name(part)
        return [main, aoti_weights_file(Path(main)).name] if self == Artifact.AOTI else [main]


def aoti_weights_file(package: Path) -> Path:
    """``model_aoti.pt2`` -> ``model_aoti_weights.pt``."""
    return package.with_name(f"{package.stem}_weights.pt")


class GraphModel:
    """A loaded exported program or AOTInductor package, called with the coalescer's batch; its
    inputs go to ``device`` (an exported program captured on the cpu is moved there at load)."""

    def __init__(
        self,
        path: str | Path,
        artifact: Artifact,
        tags: Sequence[InputTag],
        device: torch.device = torch.device("cpu"),
    ) -> None:
        if artifact == Artifact.AOTI:
            if device.type != "cpu":
                raise ValueError(f"{path}: compiled for cpu; an exported program can move to {device}")
            self.run = torch._inductor.aoti_load_package(str(path))
            # Mapped, not read: the tables cost page cache shared by every worker, and the package
            # uses these tensors in place (user-managed), so they must live as long as it does.
            self.weights = torch.load(aoti_weights_file(Path(path)), mmap=True, weights_only=True)
            self.run.load_constants(self.weights, check_full_update=True, user_managed=True)
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
