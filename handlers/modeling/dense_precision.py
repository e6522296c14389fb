"""Dense submodules of the served model in lower precision, as module swaps before serving.

``dense_precision: {over_arch: bf16, dense_arch: int8_dynamic}`` in the spec:

* ``bf16`` / ``fp16``: the submodule's weights in that dtype, wrapped in ``CastTo`` so it still
  takes and returns float32 (its neighbours, the embeddings and the interaction, stay float32);
* ``int8_weight_only`` / ``int8_dynamic``: TorchAO's ``quantize_`` on the submodule's Linear layers
  (int8 weights; activations float, or quantized to int8 per call).
"""

from __future__ import annotations

import torch
from torch import nn
from handlers.modeling.spec import DensePrecision, ModelSpec
from handlers.runtime.quiet import quieter

_FLOAT_DTYPES = {DensePrecision.BF16: torch.bfloat16, DensePrecision.FP16: torch.float16}


class CastTo(nn.Module):
    """Runs ``module`` in ``dtype``: [*, D] float32 in -> [*, D'] float32 out."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module.to(dtype)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.to(self.dtype)).float()


def apply_dense_precision(model: nn.Module, spec: ModelSpec) -> nn.Module:
    """Swaps the spec's dense submodules in place (after their float weights are loaded)."""
    for name, precision in spec.dense_precision.items():
        submodule = getattr(model, name)
        if precision in _FLOAT_DTYPES:
            setattr(model, name, CastTo(submodule, _FLOAT_DTYPES[precision]))
        elif precision in (DensePrecision.INT8_WEIGHT_ONLY, DensePrecision.INT8_DYNAMIC):
            _quantize_int8(submodule, dynamic=precision == DensePrecision.INT8_DYNAMIC)
    return model


def _quantize_int8(submodule: nn.Module, dynamic: bool) -> None:
    """TorchAO's ``quantize_`` on ``submodule``'s Linear layers. TorchAO is imported here, by the
    models that use it only (0.4 s of every worker's start otherwise); importing it logs that its
    CUDA-only kernels (mxfp8, cutlass) and Triton are missing, which a CPU build does not use, and
    torch deprecates how it registers an enum with torch.compile."""
    with quieter("torchao", "torch.utils._pytree"):
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    quantize_(submodule, Int8DynamicActivationInt8WeightConfig() if dynamic else Int8WeightOnlyConfig())


def float_name(name: str, spec: ModelSpec) -> str:
    """A served model's state name as the float model has it: ``CastTo`` puts a wrapped
    submodule's own under ``.module`` (``dense_arch.module.model.0.weight`` -> ``dense_arch.model.0.weight``)."""
    top, _, rest = name.partition(".")
    if spec.dense_precision.get(top) in _FLOAT_DTYPES and rest.startswith("module."):
        return f"{top}.{rest.removeprefix('module.')}"
    return name

