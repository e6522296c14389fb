"""Compiled packages kept by what they were compiled from, so that a model built again with other
weights (a new checkpoint, the next version, a dense delta's fresh build) is not compiled again.

An AOTInductor package that ``export.compile_aoti`` makes holds code, not weights: the tensors it
takes as constants (every parameter, and the tables) are read from the weights file beside it. So
the package is a function of the program's graph, its inputs' and tensors' shapes, dtypes and
layouts, the compile's settings, torch and this machine's processor: the key (``package_key``);
and of the values of the few tensors it compiled in as literals (a slot map of a few rows), whose
digest is kept beside it (``compiled_in``) and must match for the package to be reused. A compile
here takes 10-30 s; a copy, none. A package is kept once ``compile_aoti`` has checked it; one from
the cache is checked again, with the rest of its build (the accuracy check against the float
model included).

The folder: ``$TORCHREC_SERVE_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/torchrec-serve/aoti`` (by
default ``~/.cache/...``); ``TORCHREC_SERVE_COMPILE_CACHE=off`` compiles every time. It keeps the
``MAX_ENTRIES`` packages used last. An entry is written under a temporary name and renamed, so
that builds running side by side never read half a package.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from tqdm import tqdm

CACHE_ENV = "TORCHREC_SERVE_COMPILE_CACHE"
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
MAX_ENTRIES = 64


def cache_folder() -> Path | None:
    """Where packages are kept, or None when the cache is off."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen == "off":
        return None
    if chosen:
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchrec-serve" / "aoti"


def package_key(program: torch.export.ExportedProgram, settings: Mapping[str, Any]) -> str:
    """What an AOTInductor package of ``program`` compiled with ``settings`` depends on, hashed."""
    digest = hashlib.sha256()

    def add(*parts: object) -> None:
        for part in parts:
            digest.update(_ADDRESS.sub("", str(part)).encode())  # a repr's object address: not the object
            digest.update(b"\0")

    add(torch.__version__, platform.machine(), _cpu_flags(), os.environ.get("CXX", ""), sorted(settings.items()))
    for name, module in program.graph_module.named_modules():
        if isinstance(module, torch.fx.GraphModule):
            add(name, module.code)
    add(program.graph_signature, program.range_constraints, program.call_spec)
    add(*(node.meta.get("val") for node in program.graph.nodes if node.op == "placeholder"))
    for name, tensor in sorted({**program.state_dict, **program.constants}.items()):
        add(name, *_layout(tensor))
    return digest.hexdigest()


def compiled_in(state: Mapping[str, torch.Tensor], constants: set[str]) -> str:
    """A digest of the values of ``state``'s plain tensors that a package with ``constants``
    compiled into its code (a tensor subclass's inner tensors are constants of their own)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        if name not in constants and type(tensor) in (torch.Tensor, torch.nn.Parameter):
            digest.update(name.encode() + b"\0" + _values(tensor).encode())
    return digest.hexdigest()


def fetch(key: str, path: Path, compiled_in_of: Callable[[Path], str]) -> bool:
    """Copies the package kept for ``key`` to ``path`` if it compiled in the values this build
    has (``compiled_in_of(package)``, against the digest kept with it); False if there is none."""
    folder = cache_folder()
    entry = folder / f"{key}.pt2" if folder else None
    if entry is None or not entry.is_file() or not entry.with_suffix(".values").is_file():
        return False
    shutil.copyfile(entry, path)
    try:
        reusable = compiled_in_of(path) == entry.with_suffix(".values").read_text()
    except (RuntimeError, OSError):  # a damaged entry: compiled again, and replaced
        reusable = False
    if not reusable:
        path.unlink()
        return False
    entry.touch()  # used last: kept longest
    tqdm.write(f"compiled package from the compile cache ({entry}; {CACHE_ENV}=off compiles it)", file=sys.stderr)
    return True


def keep(key: str, package: Path, values: str) -> None:
    """Keeps ``package`` (compiled and checked) for ``key``, with the digest of the values it
    compiled in (``compiled_in``)."""
    folder = cache_folder()
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{key}.{os.getpid()}.partial"
    partial.write_text(values)
    os.replace(partial, folder / f"{key}.values")
    shutil.copyfile(package, partial)
    os.replace(partial, folder / f"{key}.pt2")
    _forget_oldest(folder)


def _cpu_flags() -> str:
    """The processor's instruction sets (Inductor compiles for the vector ones it finds)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _forget_oldest(folder: Path) -> None:
    entries = sorted(folder.glob("*.pt2"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[MAX_ENTRIES:]:
        old.unlink(missing_ok=True)
        old.with_suffix(".values").unlink(missing_ok=True)


def _inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """A tensor subclass's inner tensors (TorchAO's quantized weights), or the tensor itself."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [getattr(tensor, name) for name in names]


def _layout(tensor: torch.Tensor | torch.ScriptObject) -> list[object]:
    if not isinstance(tensor, torch.Tensor):  # an FBGEMM object the program holds (its class: the signature's)
        return [type(tensor).__name__]
    described: list[object] = [type(tensor).__name__, tuple(tensor.shape), tensor.dtype]
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        described.append(tensor.__tensor_flatten__()[1])
    return described + [(t.dtype, tuple(t.shape), t.stride(), t.device) for t in _inner_tensors(tensor)]


def _values(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().flatten().view(torch.uint8)
    return hashlib.sha256(data.numpy()).hexdigest()
