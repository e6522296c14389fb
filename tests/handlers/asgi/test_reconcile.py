"""A model that a server process loads through its reconciler (every model ``serve`` names: they
come from the engine's state folder) is out of the collector's walks once loaded, as a model
loaded at start is: a full collection that walked it took 40-55 ms every half second under load."""

import asyncio
import gc
from concurrent.futures import ThreadPoolExecutor

from archive_tools.build import build_archive
from archive_tools.model_config import ServingConfig
from handlers.asgi.engine_state import EngineState
from handlers.asgi.reconcile import Reconciler
from handlers.asgi.registry import ModelRegistry
from tests.conftest import TINY_SPEC


def test_a_model_the_reconciler_loads_is_frozen_out_of_the_collectors_walks(tmp_path):
    folder = build_archive(TINY_SPEC, checkpoint=None, seed=0, name="tiny", version="1.0",
                           model_store=tmp_path / "store", serving=ServingConfig(), archive_format="no-archive")
    forwards = ThreadPoolExecutor(max_workers=1)
    reconciler = Reconciler(EngineState(tmp_path / "state"), ModelRegistry([]), forwards)
    frozen = gc.get_freeze_count()
    try:
        model = asyncio.run(reconciler.load(folder))
        assert gc.is_tracked(model) and gc.get_freeze_count() > frozen  # the model's objects among them
        assert not any(o is model for o in gc.get_objects())  # frozen: in no generation the collector walks
    finally:  # (left frozen: unfrozen, everything the test process froze would be walked again)
        forwards.shutdown()
