"""A TorchServe worker starts with the garbage collector paused (the handler module's imports, then
the model's load) and has it on again once ``initialize`` returns or fails. A loaded worker's
collector is checked under the real TorchServe (``tests/integration/test_torchserve.py``)."""

from __future__ import annotations

import gc
import importlib

import pytest

import handlers.torchserve_handler as handler


class _Context:
    """What TorchServe hands ``initialize``, for a model folder that holds nothing."""

    def __init__(self, folder: str) -> None:
        self.system_properties = {"model_dir": folder, "gpu_id": None}
        self.model_yaml_config: dict = {}
        self.model_name = "empty"
        self.manifest: dict = {}


def test_the_collector_paused_by_the_import_is_on_again_after_a_failed_load(tmp_path):
    enabled = gc.isenabled()
    try:
        importlib.reload(handler)  # as a worker's first import runs it
        assert not gc.isenabled()
        with pytest.raises(FileNotFoundError, match="inputs.json"):
            handler.DLRMHandler().initialize(_Context(str(tmp_path)))
        assert gc.isenabled()
    finally:
        (gc.enable if enabled else gc.disable)()
