"""A process of the ASGI engine builds its app (uvicorn's factory) with the garbage collector
paused, and has it on again once its models are loaded, the app's ``loaded`` call (a process of its
own; the app stands in for the engine's, whose loads the integration tests run)."""

import os
import subprocess
import sys
from pathlib import Path

from handlers.asgi.settings import ENGINE_ENV, EngineSettings

PROGRAM = """
import gc, sys, types

app = types.ModuleType("handlers.asgi.app")  # the engine's app, without its imports and loads

def create_app(settings, loaded):
    app.loaded, app.collecting = loaded, gc.isenabled()
    return "the app"

app.create_app = create_app
sys.modules[app.__name__] = app
from handlers.asgi.factory import app_from_environment

built = app_from_environment()
paused = not gc.isenabled()
app.loaded()
print(built, app.collecting, paused, gc.isenabled())
"""


def test_the_collector_is_paused_while_the_app_is_built_and_on_once_loaded(tmp_path):
    settings = EngineSettings((tmp_path / "tiny",), tmp_path / "keys.json")
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, ENGINE_ENV: settings.to_env()}, cwd=Path(__file__).resolve().parents[3],
    )
    assert done.stdout.split("\n")[0] == "the app False True True", done.stderr
