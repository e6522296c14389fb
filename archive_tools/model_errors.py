"""Errors the model itself raises while the build runs it, told apart from the build's own.

The build runs the model on requests it makes or reads: the float model scoring validation
requests, the served model's forward and its trace by ``torch.export`` at capture, the artifact at
verification. An exception whose traceback passes through code outside this project, torch and
its libraries and Python's own (the model's code, wherever it is installed) is the model's:
``ModelRaised`` names the innermost such frame and the batch the model ran on, e.g.

    the model raised during capture: IndexError: one id per bag at din_ranker/model.py:88 in
    forward, on a batch of 10 items (ids per bag: user_id 0-3, item_id 0-3; dense_features [10, 13])

An error of torch's own (``torch.export`` meeting what it cannot capture) in the model's code is
said as such. Anything else (no frame of the model's) stays what it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import traceback
from pathlib import Path
from typing import Callable, Iterator, Sequence

from handlers.runtime.batching import Batch
from handlers.runtime.errors import InputError
from handlers.runtime.inputs import BatchKind, InputTag, JaggedIds

# the top-level packages whose frames are not the model's: this project, torch and its libraries
# (Python's own modules are not the model's either: sys.stdlib_module_names)
NOT_THE_MODEL = frozenset(
    {"archive_tools", "handlers", "torch", "torchrec", "fbgemm_gpu", "torchao", "functorch", "sympy", "numpy", "triton"}
)
FEATURES_SHOWN = 8  # features whose bag sizes a batch's description gives


@dataclasses.dataclass(frozen=True)
class ModelFrame:
    """Where in the model's code: ``din_ranker/model.py:88 in forward``."""

    path: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} in {self.function}"


class ModelRaised(Exception):
    """The model raised (or torch could not capture it) on the batch ``shape`` describes, at
    ``frame``, during ``stage``."""

    def __init__(self, stage: str, error: BaseException, frame: ModelFrame, shape: str) -> None:
        self.stage, self.error, self.frame, self.shape = stage, error, frame, shape
        message = (str(error).strip().splitlines() or [""])[0]
        by_torch = type(error).__module__.split(".")[0] == "torch"
        lead = "torch.export cannot capture the model" if by_torch and stage == "capture" else (
            f"the model raised during {stage}")
        advice = " (build --artifact eager serves it uncaptured)" if by_torch and stage == "capture" else ""
        super().__init__(f"{lead}: {type(error).__name__}: {message} at {frame}, on {shape}{advice}")


@contextlib.contextmanager
def raised_by_model(stage: str, shape: Callable[[], str]) -> Iterator[None]:
    """Turns an exception from the model's own code into ``ModelRaised``; ``shape``: the batch it
    ran on, described (``describe_batch``)."""
    try:
        yield
    except (ModelRaised, InputError):  # already said, or the project's own typed error
        raise
    except Exception as error:
        frame = model_frame(error)
        if frame is None:
            raise
        raise ModelRaised(stage, error, frame, shape()) from error


def model_frame(error: BaseException) -> ModelFrame | None:
    """The innermost frame of the model's code in ``error``'s traceback (or in that of the error it
    came from), or None."""
    seen = error
    while seen is not None:
        found = None
        for frame, line in traceback.walk_tb(seen.__traceback__):
            module = frame.f_globals.get("__name__", "")
            if _is_the_models(module):
                found = ModelFrame(_shown_path(frame.f_code.co_filename, module), line, frame.f_code.co_name)
        if found is not None:
            return found
        seen = seen.__cause__ or seen.__context__
    return None


def describe_batch(batch: Batch, tags: Sequence[InputTag], requests: int | None = None) -> str:
    """``a batch of 16 items in 2 requests (ids per bag: user_id 0-3, item_id 1; dense [16, 13])``."""
    items, parts = 0, []
    for tag in tags:
        value = batch.get(tag.name)
        if isinstance(value, JaggedIds):
            lengths = value.lengths.reshape(len(tag.keys), -1)
            items = items or (lengths.shape[1] if tag.kind == BatchKind.JAGGED else 0)
            sizes = [_span(row) for row in lengths]
            shown = [f"{k} {s}" for k, s in zip(tag.keys, sizes)][:FEATURES_SHOWN]
            more = f" and {len(sizes) - FEATURES_SHOWN} more features" if len(sizes) > FEATURES_SHOWN else ""
            parts.append(f"ids per bag: {', '.join(shown)}{more}")
        elif value is not None and tag.kind in (BatchKind.ROWS, BatchKind.CONTEXT):
            items = items or (value.shape[0] if tag.kind == BatchKind.ROWS else 0)
            parts.append(f"{tag.name} {list(value.shape)}")
    in_requests = f" in {requests} requests" if requests and requests > 1 else ""
    return f"a batch of {items} items{in_requests} ({'; '.join(parts)})"


def _span(lengths) -> str:
    low, high = (int(lengths.min()), int(lengths.max())) if lengths.numel() else (0, 0)
    return str(low) if low == high else f"{low}-{high}"


def _is_the_models(module: str) -> bool:
    top = module.split(".")[0]
    return bool(top) and top not in NOT_THE_MODEL and top not in sys.stdlib_module_names and top != "__main__"


def _shown_path(filename: str, module: str) -> str:
    """The file as its package lays it out (``din_ranker/model.py``), else as it is."""
    parts = Path(filename).parts
    depth = module.count(".") + 1 + (Path(filename).name == "__init__.py")
    shown = Path(*parts[-depth:]) if len(parts) >= depth else Path(filename)
    expected = Path(*module.split(".")).with_suffix(".py") if depth == module.count(".") + 1 else None
    return str(shown) if expected is None or shown == expected else filename
