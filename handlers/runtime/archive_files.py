"""Every file an archive holds, by name: the one place the build, the worker, the delta tool, the
benchmarks and (checked by a test) the Java plugin take them from.

    MAR-INF/MANIFEST.json    torch-model-archiver's manifest (name, version, handler)
    model-config.yaml        TorchServe's settings and ours: handler, guard, freshness sections
    spec.yaml                the model spec (parsed by ``handlers.modeling``, never by the runtime)
    architecture.json        the architecture, the contract version it was built against, and
                             the user's package an eager archive carries (``code/``)
    inputs.json              the input schema (``handlers.runtime.inputs.InputSchema``)
    tables.json              where each table's rows lie (``freshness.layout``): only in an
                             archive that holds tables (not the dense archive of a layout)
    verification.json        the build's verification report
    weights.pt               the tables and dense weights that TorchRec modules run on
    <part>.pt2               a ``torch.export`` program; ``<part>``: model, sparse or dense
    <part>_aoti.pt2          an AOTInductor package, its weights in ``<part>_aoti_weights.pt``
    handlers/                this package; ``torchserve_handler.py`` is TorchServe's entry point
    freshness-log.json       put in a registered model's folder by the plugin: its delta log
    freshness-calls/         the plugin's freshness calls to the model's workers, and their
                             replies (``handlers.runtime.freshness.protocol``)
"""

from __future__ import annotations

from pathlib import Path

MANIFEST = "MAR-INF/MANIFEST.json"
MODEL_CONFIG = "model-config.yaml"
SPEC = "spec.yaml"
ARCHITECTURE = "architecture.json"
CODE = "code"
INPUTS = "inputs.json"
TABLES = "tables.json"
VERIFICATION = "verification.json"
WEIGHTS = "weights.pt"
PRUNING = "pruning.pt"  # a pruned model's kept ids per table (handlers.modeling.pruning)
HANDLERS = "handlers"
HANDLER = "torchserve_handler.py"
LOG_POINTER = "freshness-log.json"
MAILBOX = "freshness-calls"
REFUSED = "refused.json"  # in the mailbox: why the model's archive takes no deltas

# The parts a captured graph may hold: the whole model, or a split's two halves.
PARTS = ("model", "sparse", "dense")


def exported_file(part: str) -> str:
    """A ``torch.export`` program of ``part``: ``model.pt2``."""
    return f"{_part(part)}.pt2"


def aoti_file(part: str) -> str:
    """An AOTInductor package of ``part``: ``model_aoti.pt2``."""
    return f"{_part(part)}_aoti.pt2"


def aoti_weights_file(package: Path) -> Path:
    """The weights beside a compiled package: ``model_aoti.pt2`` -> ``model_aoti_weights.pt``."""
    return package.with_name(f"{package.stem}_weights.pt")


def _part(part: str) -> str:
    if part not in PARTS:
        raise ValueError(f"part: one of {PARTS}, got {part!r}")
    return part
