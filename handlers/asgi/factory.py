"""uvicorn's factory, run in each server process: the process lowers its CPU priority
(``start_priority.py``) before it imports the app, since torch's import and the models' load are
the CPU its start takes from serving siblings, and raises it back once its models are loaded.
The collector is paused for that start too, as a TorchServe worker's is
(``handlers.torchserve_handler``): the full collections that the imports' new objects trigger walk
everything imported before them again (0.4 of the 3.8 CPU-seconds of the app's and TorchRec's
imports here); the lifespan collects and freezes what the start made (``registry.freeze_loaded``)
before the collector resumes.

    uvicorn.run("handlers.asgi.factory:app_from_environment", factory=True, workers=4)
"""

from __future__ import annotations

import gc

from handlers.asgi.start_priority import start_low


def app_from_environment():  # -> KeyCheck, imported below
    """The app of this process, from the settings the launching process put in its environment."""
    restore = start_low()
    gc.disable()
    from handlers.asgi.app import create_app  # after lowering: torch's import is seconds of CPU
    from handlers.asgi.settings import EngineSettings

    def started() -> None:
        gc.enable()
        restore()

    return create_app(EngineSettings.from_env(), loaded=started)
