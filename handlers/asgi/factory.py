"""uvicorn's factory, run in each server process: the process lowers its CPU priority
(``start_priority.py``) before it imports the app, since torch's import and the models' load are
the CPU its start takes from serving siblings, and raises it back once its models are loaded.

    uvicorn.run("handlers.asgi.factory:app_from_environment", factory=True, workers=4)
"""

from __future__ import annotations

from handlers.asgi.start_priority import start_low


def app_from_environment():  # -> KeyCheck, imported below
    """The app of this process, from the settings the launching process put in its environment."""
    restore = start_low()
    from handlers.asgi.app import create_app  # after lowering: torch's import is seconds of CPU
    from handlers.asgi.settings import EngineSettings

    return create_app(EngineSettings.from_env(), loaded=restore)
