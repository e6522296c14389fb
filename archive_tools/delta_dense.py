"""A delta's dense part: the dense weights a checkpoint gives, in the form the archive serves them,
and which dense modules differ from what the archive (or a delta) serves, compared as the served
model holds them (the spec's dense precision applied: a float change a bf16 layer rounds away is none).

    served_dense(archive, spec, checkpoint)       # what --dense carries: {name: tensor}
    dense_changes(archive, spec, checkpoint)      # {module: max |diff|}: what a delta without it drops
    verify_dense(archive, spec, carried, checkpoint)  # modules the archive plus a delta serves otherwise

The archive's own dense weights, by kind: an eager archive's float ones in ``weights.pt`` (the
dense precision applied as a worker loads them), a compiled package's constants, an exported
dense part's program state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from archive_tools.export import package_constant
from handlers.modeling.dense_precision import float_name
from handlers.modeling.embedding_modules import table_prefixes
from handlers.modeling.factory import DLRMFactory
from handlers.modeling.spec import ModelSpec
from handlers.runtime.archive import Archive
from handlers.runtime.archive_files import WEIGHTS, aoti_weights_file
from handlers.runtime.artifacts import Artifact
from handlers.runtime.errors import InputError
from handlers.runtime.freshness.delta_file import dense_shapes
from handlers.runtime.freshness.dense import is_table_constant
from handlers.runtime.quiet import quieter


def served_dense(archive: Archive, spec: ModelSpec, checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's dense weights as the archive serves them, by the names it serves them
    under: an eager archive's float dense state, or the dense constants of its compiled package
    (in the spec's dense precision, TorchAO's int8 weights as their inner tensors)."""
    factory = DLRMFactory(spec)
    dense = factory.dense_weights(checkpoint)
    kind = _swapped_kind(archive)
    if kind == Artifact.EAGER:
        served, current = dense, _archive_dense(factory, archive)
    elif kind == Artifact.AOTI:
        served, current = _package_constants(factory, archive, dense)
    else:
        raise InputError(f"a {archive.options.describe()} archive cannot swap dense weights: build it as aoti or "
                         "eager (or a split with an aoti dense part)")
    missing = sorted(n for n, t in served.items() if t is None)
    if missing or set(served) != set(current):
        raise InputError(f"the served dense weights {sorted(current)} and the checkpoint's {sorted(served)} differ "
                         f"(missing {missing})")
    wrong = [n for n in current if dense_shapes({n: served[n]}) != dense_shapes({n: current[n]})]
    if wrong:
        raise InputError(f"dense weights {wrong}: dtype or shape differ from the archive's")
    return {n: served[n].detach().contiguous() for n in current}


def dense_changes(archive: Archive, spec: ModelSpec, checkpoint: dict[str, torch.Tensor]) -> dict[str, float]:
    """The dense modules whose served weights differ between the archive and ``checkpoint`` (after
    the spec's checkpoint mapping), each with the largest |difference| of its served values:
    ``{"over_arch.model.0": 0.03}``; empty when the checkpoint serves the archive's dense weights."""
    factory = DLRMFactory(spec)
    dense = factory.dense_weights(checkpoint)
    kind = _swapped_kind(archive)
    if kind == Artifact.EAGER:  # the float weights, given the dense precision as a worker loads them
        current = _state(factory.dense_model(_archive_dense(factory, archive)))
        new = _state(factory.dense_model(dense))
    elif kind == Artifact.AOTI:
        new, current = _package_constants(factory, archive, dense)
    else:  # an exported dense part: its program's weights
        with quieter("torch._export.serde.serialize"):
            current = torch.export.load(str(archive.file(kind.file_name("dense")))).state_dict
        new = {f"model.{n}": t for n, t in _state(factory.architecture.split(factory.dense_model(dense))[1]).items()}
    return _differing(current, new, _namer(archive, spec))


def verify_dense(
    archive: Archive, spec: ModelSpec, carried: dict[str, torch.Tensor] | None, checkpoint: dict[str, torch.Tensor]
) -> list[str]:
    """The dense modules whose weights, served with a delta's dense section ``carried`` swapped in
    (None: the archive's own), differ from those a fresh build of ``checkpoint`` serves."""
    if carried is None:
        return list(dense_changes(archive, spec, checkpoint))
    fresh = served_dense(archive, spec, checkpoint)
    if _swapped_kind(archive) == Artifact.EAGER:  # float weights, given the dense precision as they load
        factory = DLRMFactory(spec)
        carried, fresh = _state(factory.dense_model(carried)), _state(factory.dense_model(fresh))
    return list(_differing(carried, fresh, _namer(archive, spec)))


def refusal(changes: dict[str, float], checkpoint: Path) -> str:
    """The one line that refuses a delta that would drop ``changes``."""
    return (f"{', '.join(changes)}: dense weights differ from the archive's (max |diff| {max(changes.values()):.3g}): "
            f"add --dense {checkpoint} to swap them, or --rows-only to publish the rows alone")


def _differing(
    old: dict[str, torch.Tensor | None], new: dict[str, torch.Tensor | None], named: Callable[[str], str]
) -> dict[str, float]:
    """{module: max |diff| of its values} over the tensors whose served bytes differ, the module
    named as ``named`` names its tensor's."""
    changes: dict[str, float] = {}
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name), new.get(name)
        if a is not None and b is not None and _same(a, b):
            continue
        module = _module(named(name))
        diff = float("inf") if a is None or b is None or a.shape != b.shape else _max_diff(a, b)
        changes[module] = max(changes.get(module, 0.0), diff)
    return changes


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    parts_a, parts_b = _parts(a), _parts(b)
    return len(parts_a) == len(parts_b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(parts_a, parts_b)
    )


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    """A tensor subclass (TorchAO's int8 weights) as its inner tensors; a plain tensor alone."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [getattr(t, n) for n in names]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |difference| of the values the two tensors stand for (int8 weights dequantized)."""
    values = [t if type(t) in (torch.Tensor, torch.nn.Parameter) else t.dequantize() for t in (a, b)]
    return float((values[0].float() - values[1].float()).abs().max()) if values[0].numel() else 0.0


def _module(name: str) -> str:
    """``over_arch.model.0.weight`` -> ``over_arch.model.0``; a package constant's TorchAO inner
    tensor (``<owner>.parametrizations.weight.original0``) -> its owner."""
    owner = name.rsplit(".", 1)[0]
    return owner.split(".parametrizations.")[0]


def _package_constants(
    factory: DLRMFactory, archive: Archive, dense: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor]]:
    """(``dense`` as the archive's compiled package holds it, the package's own dense constants),
    by constant name (None: a constant ``dense`` does not give)."""
    options = archive.options
    model = factory.dense_model(dense)
    if options.split is not None:
        model = factory.architecture.split(model)[1]
    state = {**dict(model.named_parameters(prefix="model")), **dict(model.named_buffers(prefix="model"))}
    package = _swapped_kind(archive).file_name("dense" if options.split is not None else "model")
    current = torch.load(archive.file(aoti_weights_file(Path(package)).name), mmap=True, weights_only=True)
    current = {n: t for n, t in current.items() if not is_table_constant(n)}
    return {n: package_constant(state, n) for n in current}, current


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A served model's (or dense part's) dense state, as it holds it (the spec's dense precision
    applied: bf16 tensors, TorchAO int8 weights): its tables and slot maps left out."""
    tables = table_prefixes(model)
    return {n: t.detach() for n, t in model.state_dict().items()
            if not n.startswith(tables) and not is_table_constant(n)}


def _namer(archive: Archive, spec: ModelSpec) -> Callable[[str], str]:
    """A served dense tensor's name -> the float model's (a captured graph's weights are those of
    its wrapper, ``export.PlainInputs``: the model's or dense part's under ``model.``)."""
    prefix = "" if _swapped_kind(archive) == Artifact.EAGER else "model."
    return lambda name: float_name(name.removeprefix(prefix), spec)


def _archive_dense(factory: DLRMFactory, archive: Archive) -> dict[str, torch.Tensor]:
    """The float dense weights an eager archive was built with (in its weights.pt)."""
    return factory.load_weights(archive.file(WEIGHTS)).dense


def _swapped_kind(archive: Archive) -> Artifact:
    """The artifact whose dense weights a delta swaps: the model's, or a split's dense part's."""
    options = archive.options
    return options.split.dense if options.split is not None else options.artifact
